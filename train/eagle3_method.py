"""EAGLE-3 as a training method for train.core: the TTT loss and its target inputs, the draft vocabulary, export.

The draft predicts only a draft vocabulary (the most frequent response tokens of the training
rows, or the vocabulary of the draft it continues); the target's outputs the loss compares with
are its features at the EAGLE-3 taps and its logits restricted to that vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checkpoints.eagle3 import load_eagle3, save_eagle3
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.models import eagle3, llama
from specjax.models.config import ModelConfig
from train import core, data, tau_eval, ttt
from train.config import TrainConfig


def target_outputs(
    target_params: llama.Params, target_config: ModelConfig, tokens: jax.Array, vocab: eagle3.DraftVocab
) -> dict[str, jax.Array]:
    """Frozen target forward over [B, T] tokens: features, draft-vocab logits, in-vocab argmax."""
    batch, length = tokens.shape
    positions, causal = jnp.broadcast_to(jnp.arange(length), (batch, length)), jnp.tril(jnp.ones((length, length), bool))
    taps = llama.Taps(layer_inputs=eagle3.feature_layers(target_config.num_layers))
    out = llama.forward(target_params, target_config, tokens, positions, None, causal, taps=taps)
    return {
        "features": out.features,  # [B, T, 3H]
        "target_logits": out.logits[..., vocab.target_ids],  # [B, T, Vd]
        "in_vocab": vocab.t2d[jnp.argmax(out.logits, -1)],  # [B, T]
    }


_target_outputs = jax.jit(target_outputs, static_argnums=1)


@dataclasses.dataclass(frozen=True)
class TTTLoss:
    """The TTT loss of a batch (static under jit: only what the computation reads)."""

    target_config: ModelConfig
    draft_config: eagle3.Eagle3Config
    ttt_length: int
    ttt_decay: float
    compute_dtype: str

    def __call__(self, params: eagle3.Params, frozen: dict, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
        """frozen: {"target": target params (the embeddings when offline), "vocab"}; batch: tokens,
        loss_mask [B, T] and, offline, the target outputs (else computed here, constants for the gradient)."""
        target, tokens = frozen["target"], batch["tokens"]
        outputs = batch if "features" in batch else target_outputs(target, self.target_config, tokens, frozen["vocab"])
        dtype = core.DTYPES[self.compute_dtype]
        params, embeddings = jax.tree.map(lambda p: p.astype(dtype), params), llama.embed(target, tokens).astype(dtype)
        return ttt.ttt_loss(
            params, self.draft_config, embeddings, outputs["features"].astype(dtype), outputs["target_logits"],
            outputs["in_vocab"], batch["loss_mask"], num_steps=self.ttt_length, decay=self.ttt_decay,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Method:
    """An EAGLE-3 head trained with training-time test on a frozen target (a core.Method)."""

    config: TrainConfig
    target_config: ModelConfig
    target_params: llama.Params  # in the target dtype (config.target_compute_dtype)
    vocab: eagle3.DraftVocab
    initial_params: eagle3.Params | None = None  # from config.init_from; None = random init
    name = "eagle3"

    @property
    def draft_config(self) -> eagle3.Eagle3Config:
        return eagle3.Eagle3Config.from_target(self.target_config, self.config.draft_vocab_size)

    @property
    def loss(self) -> TTTLoss:
        c = self.config
        return TTTLoss(self.target_config, self.draft_config, c.ttt_length, c.ttt_decay, c.compute_dtype)

    @functools.cached_property
    def identity(self) -> str:
        return core.fingerprint(np.asarray(self.vocab.target_ids), self.draft_config)

    def frozen(self, offline: bool) -> dict[str, Any]:
        target = {"embed_tokens": self.target_params["embed_tokens"]} if offline else self.target_params
        return {"target": target, "vocab": self.vocab}

    def init_params(self, key: jax.Array) -> eagle3.Params:
        return eagle3.init_params(self.draft_config, key) if self.initial_params is None else self.initial_params

    def target_outputs(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Offline: float16 features [B, T, 3H] and draft-vocab logits [B, T, Vd], bool in_vocab [B, T]."""
        out = jax.device_get(_target_outputs(self.target_params, self.target_config, jnp.asarray(tokens), self.vocab))
        return {name: value.astype(np.float16) if value.dtype.kind == "f" else value for name, value in out.items()}

    def summarize(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Per-step loss_k and acc_k and the simulated acceptance length from summed stats [K]."""
        loss = stats["loss_sum"] / np.maximum(stats["weight"], 1)
        acc = stats["correct"] / np.maximum(stats["response"], 1)
        acceptance_length = round(float(ttt.acceptance_length(jnp.asarray(acc))), 4)
        rounded = lambda values: [round(float(x), 5) for x in values]
        return {"loss": rounded(loss), "acc": rounded(acc), "acceptance_length": acceptance_length}

    def tau_evaluator(self, eval_rows: data.TokenRows) -> tau_eval.TauEvaluator:
        """The engine evaluation on the first tau_eval_prompts held-out rows (compiled once)."""
        c, prompts = self.config, tau_eval.held_out_prompts(eval_rows, self.config.tau_eval_prompts)
        dtype = jax.tree.leaves(self.target_params)[0].dtype
        placeholder = jax.tree.map(lambda p: p.astype(dtype), eagle3.init_params(self.draft_config, jax.random.key(0)))
        drafter = Eagle3Drafter(
            self.draft_config, placeholder, self.vocab, self.target_params["embed_tokens"], depth=c.tau_eval_num_spec,
            feature_layers=eagle3.feature_layers(self.target_config.num_layers),
        )
        return tau_eval.TauEvaluator(
            drafter, drafter.params_with_head, self.target_config, self.target_params, prompts,
            max_new_tokens=c.tau_eval_max_new_tokens,
        )

    def export(self, params: eagle3.Params, path: Path, *, overwrite: bool, evaluation: dict | None = None) -> None:
        """The EAGLE-3 Hugging Face layout (specjax.checkpoints.eagle3.save_eagle3)."""
        dtype = ml_dtypes.bfloat16 if self.config.export_dtype == "bfloat16" else np.dtype(self.config.export_dtype)
        save_eagle3(path, self.draft_config, params, self.vocab, dtype=dtype, overwrite=overwrite)

    @classmethod
    def build(cls, config: TrainConfig, target: core.Target, train_rows: data.TokenRows) -> Eagle3Method:
        """The draft vocabulary (cached in output_dir/draft_vocab.npz under a key of its inputs) and init_from."""
        draft_config = eagle3.Eagle3Config.from_target(target.config, config.draft_vocab_size)
        rebuild = config.init_vocab == "rebuild" or not config.init_from
        initial_params = None
        if config.init_from:
            initial_params, vocab = load_initial_draft(config.init_from, draft_config, target.config, any_vocab_size=rebuild)
            ids = np.asarray(vocab.target_ids)
        if rebuild:
            new_ids = core.frequent_response_tokens(config, target.config.vocab_size, train_rows)
            if initial_params is not None:
                initial_params = remap_draft_head(initial_params, ids, new_ids, target.params, target.config)
            ids = new_ids
        vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(ids), target.config.vocab_size)
        return cls(config, target.config, target.params, vocab, initial_params)


def prepare(config: TrainConfig) -> core.Setup:
    """Target, rows, EAGLE-3 method and features of a run (core.prepare)."""
    return core.prepare(config, Eagle3Method.build)


def load_initial_draft(
    path: str, draft_config: eagle3.Eagle3Config, target_config: ModelConfig, *, any_vocab_size: bool = False
) -> tuple[eagle3.Params, eagle3.DraftVocab]:
    """Float32 params and vocabulary of an EAGLE-3 draft to continue training; it must fit this run.

    any_vocab_size: accept a different draft_vocab_size (the head is then remapped, see remap_draft_head).
    """
    config, params, vocab = load_eagle3(path, target_vocab_size=target_config.vocab_size)
    # A draft that records no taps reads the EAGLE-3 default ones; a draft's own embedding is not trained here.
    config = dataclasses.replace(config, tap_layers=config.target_taps(target_config.num_layers))
    params = {name: value for name, value in params.items() if name != "embed_tokens"}
    if any_vocab_size:
        config = dataclasses.replace(config, draft_vocab_size=draft_config.draft_vocab_size)
    if config != draft_config:
        differences = {
            field.name: (getattr(config, field.name), getattr(draft_config, field.name))
            for field in dataclasses.fields(config)
            if getattr(config, field.name) != getattr(draft_config, field.name)
        }
        raise ValueError(f"init_from {path}: the draft differs from this run's (draft, run): {differences}")
    return params, vocab


def remap_draft_head(
    params: eagle3.Params, old_ids: np.ndarray, new_ids: np.ndarray, target_params: llama.Params, target_config: ModelConfig
) -> eagle3.Params:
    """The draft moved to a new vocabulary (sorted target ids old_ids [Vo] -> new_ids [Vn]).

    Tokens in both keep their trained lm_head column. A new token starts from the target's output
    embedding of it, scaled by the median norm ratio of trained to target columns over the shared tokens.
    """
    head = np.asarray(params["lm_head"], np.float32)  # [H, Vo]
    target_head = np.asarray(llama.output_head(target_params, target_config), np.float32)  # [H, V]
    shared, old_index, new_index = np.intersect1d(old_ids, new_ids, return_indices=True)
    if len(shared) == 0:
        raise ValueError("the new draft vocabulary shares no token with init_from's: nothing to carry over")
    target_norms = np.linalg.norm(target_head[:, shared], axis=0)  # [S]
    trained_norms = np.linalg.norm(head[:, old_index], axis=0)  # [S]
    scale = np.median(trained_norms[target_norms > 0] / target_norms[target_norms > 0])
    new_head = scale * target_head[:, new_ids]  # [H, Vn]
    new_head[:, new_index] = head[:, old_index]
    return {**params, "lm_head": jnp.asarray(new_head)}
