"""A tiny training problem shared by the trainers' tests: a sharpened random target and
repeating token patterns (20 training rows, 4 held out)."""

from __future__ import annotations

import jax
import numpy as np

from specjax.models import llama
from specjax.models.config import ModelConfig
from train import data

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
TRAIN_CONFIG = dict(  # the TrainConfig fields every tiny run shares
    seq_len=16, draft_vocab_size=24, batch_size=4, num_steps=6, grad_accum_steps=2, learning_rate=1e-2, warmup_steps=1,
    checkpoint_every=3, log_every=1, eval_samples=4,
)


def target_params() -> llama.Params:
    """Random weights, sharpened: a peaked, context-dependent target distribution."""
    params = llama.init_params(TARGET, jax.random.key(7))
    return {**params, "layers": jax.tree.map(lambda w: 5 * w, params["layers"]), "lm_head": 50 * params["lm_head"]}


def pattern_rows() -> tuple[data.TokenRows, data.TokenRows]:
    """(train, held out): 24 rows repeating a random 3-token pattern, responses from position 4."""
    patterns = np.random.default_rng(0).integers(0, 24, (24, 3))
    tokens = np.stack([np.resize(p, 16) for p in patterns]).astype(np.int32)
    mask = np.zeros_like(tokens, bool)
    mask[:, 4:] = True
    rows = data.TokenRows(tokens, mask)
    return rows.subset(slice(0, 20)), rows.subset(slice(20, None))
