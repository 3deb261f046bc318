"""Medusa-1 heads as a training method for train.core: the per-head loss, its target inputs, export.

Head k at position t predicts the token at t + k + 2, whose distribution under the target is
the target's softmax at position t + k + 1. The loss is the cross-entropy of head k against that
distribution restricted to the truncated vocabulary (the most frequent response tokens of the
training rows, as the EAGLE-3 draft vocabulary), over response tokens, weighted ttt_decay**k
(Medusa's lambda_k = 0.8**k). The frozen target supplies its final hidden states and logits.
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

from specjax.checkpoints.medusa import save_medusa
from specjax.drafters.medusa import MedusaDrafter, chain_paths
from specjax.models import llama, medusa
from specjax.models.config import ModelConfig
from train import core, data, tau_eval
from train.config import TrainConfig

#: Ranks whose held-out hit rates are recorded per head (they size static trees, drafters/medusa.py).
RANKS = 4


def target_outputs(target_params: llama.Params, target_config: ModelConfig, tokens: jax.Array, token_map: jax.Array) -> dict:
    """Frozen target forward over [B, T] tokens: final hidden states [B, T, H], logits over the
    truncated vocabulary [B, T, Vt], and the rank-0 choice: the truncated index of the target's
    argmax, -1 outside it [B, T]."""
    batch, length = tokens.shape
    positions, causal = jnp.broadcast_to(jnp.arange(length), (batch, length)), jnp.tril(jnp.ones((length, length), bool))
    out = llama.forward(target_params, target_config, tokens, positions, None, causal, taps=llama.Taps(final_hidden=True))
    index_of = jnp.full((target_config.vocab_size,), -1, jnp.int32).at[token_map].set(jnp.arange(token_map.shape[0]))
    return {
        "hidden": out.features,
        "target_logits": out.logits[..., token_map],
        "target_choice": index_of[jnp.argmax(out.logits, -1)],
    }


_target_outputs = jax.jit(target_outputs, static_argnums=1)


@dataclasses.dataclass(frozen=True)
class MedusaLoss:
    """Per-head soft cross-entropy of a batch (static under jit)."""

    target_config: ModelConfig
    num_heads: int
    decay: float
    compute_dtype: str

    def __call__(self, params: medusa.Params, frozen: dict, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
        outputs = batch if "hidden" in batch else target_outputs(frozen["target"], self.target_config, batch["tokens"], frozen["token_map"])
        dtype = core.DTYPES[self.compute_dtype]
        logits = medusa.forward(jax.tree.map(lambda p: p.astype(dtype), params), outputs["hidden"].astype(dtype))  # [B, T, K, Vt]
        length, total, stats = batch["tokens"].shape[1], 0.0, {k: [] for k in ("loss_sum", "weight", "correct", "rank_hits")}
        for k in range(self.num_heads):
            shift = k + 1  # head k at t is scored against the target at t + shift, predicting t + shift + 1
            log_p = jax.nn.log_softmax(logits[:, : length - shift - 1, k], -1)  # [B, T', Vt]
            q = jax.nn.softmax(outputs["target_logits"][:, shift : length - 1].astype(jnp.float32), -1)
            mask = batch["loss_mask"][:, shift + 1 :].astype(jnp.float32)  # [B, T'] the predicted token is a response token
            choice = outputs["target_choice"][:, shift : length - 1]
            loss_sum = jnp.sum(-jnp.sum(q * log_p, -1) * mask)
            weight = jnp.sum(mask)
            total = total + self.decay**k * loss_sum / jnp.maximum(weight, 1.0)
            chosen_logit = jnp.take_along_axis(log_p, jnp.maximum(choice, 0)[..., None], -1)[..., 0]
            rank = jnp.sum(log_p > chosen_logit[..., None], -1)  # [B, T'] the target token's rank under head k
            hit = (choice >= 0)[..., None] & (rank[..., None] == jnp.arange(RANKS))  # [B, T', R]
            stats["loss_sum"].append(loss_sum)
            stats["weight"].append(weight)
            stats["correct"].append(jnp.sum(hit[..., 0] * mask))
            stats["rank_hits"].append(jnp.sum(hit * mask[..., None], (0, 1)))
        return total, {name: jnp.stack(values) for name, values in stats.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class MedusaMethod:
    """Medusa-1 heads trained on a frozen target's hidden states (a core.Method)."""

    config: TrainConfig
    target_config: ModelConfig
    target_params: llama.Params  # in the target dtype (config.target_compute_dtype)
    token_map: jax.Array  # [Vt] target ids of the truncated vocabulary
    name = "medusa"

    @property
    def draft_config(self) -> medusa.MedusaConfig:
        return medusa.MedusaConfig(
            num_heads=self.config.medusa_num_heads, hidden_size=self.target_config.hidden_size,
            vocab_size=self.target_config.vocab_size, truncated_vocab_size=int(self.token_map.shape[0]),
        )

    @property
    def loss(self) -> MedusaLoss:
        c = self.config
        return MedusaLoss(self.target_config, c.medusa_num_heads, c.ttt_decay, c.compute_dtype)

    @functools.cached_property
    def identity(self) -> str:
        return core.fingerprint(np.asarray(self.token_map), self.draft_config)

    def frozen(self, offline: bool) -> dict[str, Any]:
        return {"target": None if offline else self.target_params, "token_map": self.token_map}

    def init_params(self, key: jax.Array) -> medusa.Params:
        return medusa.init_params(self.draft_config, llama.output_head(self.target_params, self.target_config), self.token_map)

    def target_outputs(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Offline: float16 hidden states [B, T, H] and truncated logits [B, T, Vt], int32 choices [B, T]."""
        out = jax.device_get(_target_outputs(self.target_params, self.target_config, jnp.asarray(tokens), self.token_map))
        return {name: value.astype(np.float16) if value.dtype.kind == "f" else value for name, value in out.items()}

    def summarize(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Per-head loss and top-1 accuracy, and per head the rate of each rank holding the target's token."""
        rounded = lambda values: [round(float(x), 5) for x in values]
        weight = np.maximum(stats["weight"], 1)  # response tokens each head predicted
        return {
            "loss": rounded(stats["loss_sum"] / weight),
            "acc": rounded(stats["correct"] / weight),
            "rank_acc": [rounded(row) for row in stats["rank_hits"] / weight[:, None]],
        }

    def tau_evaluator(self, eval_rows: data.TokenRows) -> tau_eval.TauEvaluator:
        """Greedy chains of min(heads, tau_eval_num_spec) heads on held-out prompts (compiled once)."""
        c, prompts = self.config, tau_eval.held_out_prompts(eval_rows, self.config.tau_eval_prompts)
        dtype = jax.tree.leaves(self.target_params)[0].dtype
        placeholder = jax.tree.map(lambda p: p.astype(dtype), self.init_params(jax.random.key(0)))
        drafter = MedusaDrafter(self.draft_config, placeholder, self.token_map, chain_paths(min(c.medusa_num_heads, c.tau_eval_num_spec)))
        with_params = lambda params: {**params, "token_map": self.token_map}
        return tau_eval.TauEvaluator(
            drafter, with_params, self.target_config, self.target_params, prompts, max_new_tokens=c.tau_eval_max_new_tokens
        )

    def export(self, params: medusa.Params, path: Path, *, overwrite: bool, evaluation: dict | None = None) -> None:
        """vLLM's Medusa layout (specjax.checkpoints.medusa), with the held-out rank rates."""
        dtype = ml_dtypes.bfloat16 if self.config.export_dtype == "bfloat16" else np.dtype(self.config.export_dtype)
        accuracy = (evaluation or {}).get("rank_acc")
        save_medusa(path, self.draft_config, params, self.token_map, dtype=dtype, topk_accuracy=accuracy, overwrite=overwrite)

    @classmethod
    def build(cls, config: TrainConfig, target: core.Target, train_rows: data.TokenRows) -> MedusaMethod:
        """The truncated vocabulary: the draft_vocab_size most frequent response tokens."""
        ids = core.frequent_response_tokens(config, target.config.vocab_size, train_rows)
        return cls(config, target.config, target.params, jnp.asarray(ids, jnp.int32))

def prepare(config: TrainConfig) -> core.Setup:
    """Target, rows, Medusa method and features of a run (core.prepare)."""
    return core.prepare(config, MedusaMethod.build)
