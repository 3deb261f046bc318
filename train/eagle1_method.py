"""EAGLE-1 as a training method for train.core: feature regression plus cross-entropy, export.

The draft layer reads (f_t, embed(x_{t+1})) and predicts f_{t+1}, the target's top-layer feature
(after the final norm). As in the paper, the loss is smooth-L1 between predicted and true
features plus `eagle1_cls_weight` (0.1) times the cross-entropy between the distributions the
frozen LM head gives them: softmax(lm_head(f_{t+1})) is the target's own next-token distribution.
The cross-entropy is taken over the `draft_vocab_size` most frequent response tokens of the
training rows (the full vocabulary at inference), which makes it cheap on a CPU.

The paper fights exposure bias with noise on the input features; this trainer unrolls the draft
on its own predictions instead (`ttt_length` steps, weighted `ttt_decay**k`, the attention of
train.ttt): step k reads its own step k - 1 output and is scored against f_{t+1+k}. ttt_length 1
is the paper's teacher forcing. Offline, only the target's features are stored (H per token).
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

from specjax.checkpoints.eagle1 import save_eagle1
from specjax.drafters.eagle1 import Eagle1Drafter
from specjax.models import eagle1, llama
from specjax.models.config import ModelConfig
from train import core, data, tau_eval, ttt
from train.config import TrainConfig


def target_outputs(target_params: llama.Params, target_config: ModelConfig, tokens: jax.Array, vocab_ids: jax.Array) -> dict:
    """Frozen target forward over [B, T] tokens: top-layer features [B, T, H] (after the final
    norm) and whether its argmax is in the loss vocabulary [B, T]."""
    batch, length = tokens.shape
    positions, causal = jnp.broadcast_to(jnp.arange(length), (batch, length)), jnp.tril(jnp.ones((length, length), bool))
    out = llama.forward(target_params, target_config, tokens, positions, None, causal, taps=llama.Taps(final_hidden=True))
    in_vocab = jnp.zeros((target_config.vocab_size,), bool).at[vocab_ids].set(True)
    return {"features": out.features, "in_vocab": in_vocab[jnp.argmax(out.logits, -1)]}


_target_outputs = jax.jit(target_outputs, static_argnums=1)


def smooth_l1(x: jax.Array) -> jax.Array:
    """Huber with beta 1 (torch's SmoothL1Loss), elementwise."""
    return jnp.where(jnp.abs(x) < 1.0, 0.5 * x * x, jnp.abs(x) - 0.5)


def unrolled_features(params: eagle1.Params, config: eagle1.Eagle1Config, embeddings: jax.Array, features: jax.Array, num_steps: int) -> list[jax.Array]:
    """The draft's predicted features at every unrolled step: num_steps arrays [B, T, H].

    Index t of step k reads embed(x_{t+1+k}) and step k - 1's output (f_t at step 0) at position
    t + k, attending causally to the step-0 entries and to its own index's later entries (the
    cache a chain drafter holds, train.ttt.ttt_attention), and predicts f_{t+1+k}.
    """
    batch, length, _ = embeddings.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    hidden, k_diag, v_diag, predicted = features, [], [], []
    for step in range(num_steps):
        x = eagle1.fuse(params, ttt.shift_left(embeddings, 1 + step), hidden)
        q, k, v = eagle1.layer_qkv(params, config, x, positions + step)
        if step == 0:
            k0, v0 = k, v
        else:
            k_diag.append(k)
            v_diag.append(v)
        hidden = eagle1.layer_output(params, config, x, ttt.ttt_attention(q, k0, v0, k_diag, v_diag))
        predicted.append(hidden)
    return predicted


@dataclasses.dataclass(frozen=True)
class Eagle1Loss:
    """Regression plus weighted cross-entropy, per unrolled step (static under jit)."""

    target_config: ModelConfig
    draft_config: eagle1.Eagle1Config
    num_steps: int
    decay: float
    cls_weight: float
    compute_dtype: str

    def __call__(self, params: eagle1.Params, frozen: dict, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
        """frozen: the target ("embed_tokens" and the loss vocabulary's LM-head columns "head" [H, Vd]
        when offline), "vocab_ids"; batch: tokens, loss_mask [B, T] and, offline, the target outputs."""
        target, tokens = frozen["target"], batch["tokens"]
        outputs = batch if "features" in batch else target_outputs(target, self.target_config, tokens, frozen["vocab_ids"])
        dtype = core.DTYPES[self.compute_dtype]
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        features = outputs["features"].astype(dtype)  # [B, T, H]
        head = frozen["head"].astype(dtype)  # [H, Vd]
        embeddings = llama.embed(target, tokens).astype(dtype)
        stats = {name: [] for name in ("loss_sum", "regression_sum", "correct", "weight", "response")}
        total = 0.0
        for step, predicted in enumerate(unrolled_features(params, self.draft_config, embeddings, features, self.num_steps)):
            true = ttt.shift_left(features, 1 + step)  # [B, T, H] f_{t+1+k}
            response = ttt.shift_left(batch["loss_mask"], 2 + step)  # the token f_{t+1+k} predicts is a response token
            weight = response & ttt.shift_left(outputs["in_vocab"], 1 + step)
            regression = jnp.mean(smooth_l1(predicted.astype(jnp.float32) - true.astype(jnp.float32)), -1)  # [B, T]
            logits = jnp.einsum("bth,hv->btv", predicted, head, preferred_element_type=jnp.float32)
            target_logits = jnp.einsum("bth,hv->btv", true, head, preferred_element_type=jnp.float32)
            cross_entropy = -jnp.sum(jax.nn.softmax(target_logits) * jax.nn.log_softmax(logits), -1)  # [B, T]
            count = jnp.sum(weight)
            regression_sum = jnp.sum(jnp.where(response, regression, 0.0))
            loss_sum = regression_sum + self.cls_weight * jnp.sum(jnp.where(weight, cross_entropy, 0.0))
            total = total + self.decay**step * loss_sum / jnp.maximum(jnp.sum(response), 1)
            correct = weight & (jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1))
            for name, value in [("loss_sum", loss_sum), ("regression_sum", regression_sum), ("correct", jnp.sum(correct)),
                                ("weight", count), ("response", jnp.sum(response))]:
                stats[name].append(value.astype(jnp.float32))
        return total, {name: jnp.stack(values) for name, values in stats.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle1Method:
    """The EAGLE-1 feature draft trained on a frozen target (a core.Method)."""

    config: TrainConfig
    target_config: ModelConfig
    target_params: llama.Params  # in the target dtype (config.target_compute_dtype)
    vocab_ids: jax.Array  # [Vd] target ids of the cross-entropy's vocabulary
    name = "eagle1"

    @property
    def draft_config(self) -> eagle1.Eagle1Config:
        return eagle1.Eagle1Config.from_target(self.target_config)

    @property
    def loss(self) -> Eagle1Loss:
        c = self.config
        return Eagle1Loss(self.target_config, self.draft_config, c.ttt_length, c.ttt_decay, c.eagle1_cls_weight, c.compute_dtype)

    @functools.cached_property
    def identity(self) -> str:
        return core.fingerprint(np.asarray(self.vocab_ids), self.draft_config)

    def frozen(self, offline: bool) -> dict[str, Any]:
        target = {"embed_tokens": self.target_params["embed_tokens"]} if offline else self.target_params
        head = llama.output_head(self.target_params, self.target_config)[:, self.vocab_ids]  # [H, Vd]
        return {"target": target, "head": head, "vocab_ids": self.vocab_ids}

    def init_params(self, key: jax.Array) -> eagle1.Params:
        return eagle1.init_params(self.draft_config, key)

    def target_outputs(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Offline: float16 features [B, T, H] and bool in_vocab [B, T]."""
        out = jax.device_get(_target_outputs(self.target_params, self.target_config, jnp.asarray(tokens), self.vocab_ids))
        return {name: value.astype(np.float16) if value.dtype.kind == "f" else value for name, value in out.items()}

    def summarize(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Per-step loss, feature regression and top-1 agreement, and the simulated acceptance length."""
        response = np.maximum(stats["response"], 1)
        acc = stats["correct"] / response
        rounded = lambda values: [round(float(x), 5) for x in values]
        return {
            "loss": rounded(stats["loss_sum"] / response),
            "regression": rounded(stats["regression_sum"] / response),
            "acc": rounded(acc),
            "acceptance_length": round(float(ttt.acceptance_length(jnp.asarray(acc))), 4),
        }

    def tau_evaluator(self, eval_rows: data.TokenRows) -> tau_eval.TauEvaluator:
        """Greedy chains of tau_eval_num_spec drafts on held-out prompts (compiled once)."""
        c, prompts = self.config, tau_eval.held_out_prompts(eval_rows, self.config.tau_eval_prompts)
        dtype = jax.tree.leaves(self.target_params)[0].dtype
        placeholder = jax.tree.map(lambda p: p.astype(dtype), self.init_params(jax.random.key(0)))
        drafter = Eagle1Drafter(self.draft_config, placeholder, self.target_config, self.target_params, depth=c.tau_eval_num_spec)
        return tau_eval.TauEvaluator(
            drafter, drafter.params_with_head, self.target_config, self.target_params, prompts, max_new_tokens=c.tau_eval_max_new_tokens
        )

    def export(self, params: eagle1.Params, path: Path, *, overwrite: bool, evaluation: dict | None = None) -> None:
        """vLLM's EagleLlamaForCausalLM layout (specjax.checkpoints.eagle1)."""
        dtype = ml_dtypes.bfloat16 if self.config.export_dtype == "bfloat16" else np.dtype(self.config.export_dtype)
        save_eagle1(path, self.draft_config, params, dtype=dtype, overwrite=overwrite)

    @classmethod
    def build(cls, config: TrainConfig, target: core.Target, train_rows: data.TokenRows) -> Eagle1Method:
        """The cross-entropy's vocabulary: the draft_vocab_size most frequent response tokens."""
        ids = core.frequent_response_tokens(config, target.config.vocab_size, train_rows)
        return cls(config, target.config, target.params, jnp.asarray(ids, jnp.int32))

def prepare(config: TrainConfig) -> core.Setup:
    """Target, rows, EAGLE-1 method and features of a run (core.prepare)."""
    return core.prepare(config, Eagle1Method.build)
