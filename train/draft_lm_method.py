"""A vanilla draft model as a training method for train.core: the target's first layers, fine-tuned.

The draft is a Llama model of the target's shape with `draft_num_layers` layers, initialised from
the target's first layers and final norm; its embedding and output head are the target's, frozen
(and written into the export, which is a plain Hugging Face checkpoint). The layers and the final
norm train on the cross-entropy of the next response token. On a self-distilled corpus those tokens
are the target's own greedy choices (sequence-level distillation), so the draft's top-1 accuracy on
them is the rate at which the target accepts its first greedy draft. No target forward runs while
training: there is nothing to precompute, and `features` must be `online`.
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

from specjax.checkpoints.draft_files import save_model
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.models import llama
from specjax.models.config import ModelConfig
from train import core, data, tau_eval
from train.config import TrainConfig

FROZEN_KEYS = ("embed_tokens", "lm_head")  # the target's, shared by the draft and never trained


@dataclasses.dataclass(frozen=True)
class DraftLMLoss:
    """Next-token cross-entropy over response tokens (static under jit)."""

    draft_config: ModelConfig
    compute_dtype: str

    def __call__(self, params: dict, frozen: dict, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
        dtype = core.DTYPES[self.compute_dtype]
        model = jax.tree.map(lambda p: p.astype(dtype), {**frozen, **params})
        tokens = batch["tokens"]  # [B, T]
        batch_size, length = tokens.shape
        positions, causal = jnp.broadcast_to(jnp.arange(length), (batch_size, length)), jnp.tril(jnp.ones((length, length), bool))
        logits = llama.forward(model, self.draft_config, tokens, positions, None, causal).logits[:, :-1]  # [B, T-1, V] float32
        labels, mask = tokens[:, 1:], batch["loss_mask"][:, 1:].astype(jnp.float32)  # the token each position predicts
        picked = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        loss_sum = jnp.sum((jax.nn.logsumexp(logits, -1) - picked) * mask)
        weight = jnp.sum(mask)
        correct = jnp.sum((jnp.argmax(logits, -1) == labels) * mask)
        stats = {"loss_sum": loss_sum[None], "weight": weight[None], "correct": correct[None]}
        return loss_sum / jnp.maximum(weight, 1.0), stats


@dataclasses.dataclass(frozen=True, eq=False)
class DraftLMMethod:
    """A draft model cut from the target's first layers and fine-tuned (a core.Method)."""

    config: TrainConfig
    target_config: ModelConfig
    target_params: llama.Params  # in the target dtype (config.target_compute_dtype)
    name = "draft-lm"

    @property
    def draft_config(self) -> ModelConfig:
        return dataclasses.replace(self.target_config, num_layers=self.config.draft_num_layers)

    @property
    def loss(self) -> DraftLMLoss:
        return DraftLMLoss(self.draft_config, self.config.compute_dtype)

    @functools.cached_property
    def identity(self) -> str:
        return core.fingerprint(self.draft_config)

    def frozen(self, offline: bool) -> dict[str, jax.Array]:
        return {key: self.target_params[key] for key in FROZEN_KEYS if key in self.target_params}

    def init_params(self, key: jax.Array) -> dict:
        """The target's first draft_num_layers layers and its final norm, float32."""
        trained = {"layers": self.target_params["layers"][: self.config.draft_num_layers], "norm": self.target_params["norm"]}
        return jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), trained)

    def target_outputs(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        raise ValueError("a draft model trains on the corpus tokens alone: there are no target outputs to precompute")

    def summarize(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Loss and top-1 accuracy per response token (a list of one, as the multi-token drafts')."""
        weight = np.maximum(stats["weight"], 1)
        return {"loss": [round(float(x), 5) for x in stats["loss_sum"] / weight], "acc": [round(float(x), 5) for x in stats["correct"] / weight]}

    def model_params(self, trained: dict) -> dict:
        """The whole draft model: trained layers and norm beside the frozen embedding (and head)."""
        return {**self.frozen(False), **trained}

    def tau_evaluator(self, eval_rows: data.TokenRows) -> tau_eval.TauEvaluator:
        """Greedy chains of tau_eval_num_spec drafts on held-out prompts (compiled once)."""
        c, prompts = self.config, tau_eval.held_out_prompts(eval_rows, self.config.tau_eval_prompts)
        dtype = jax.tree.leaves(self.target_params)[0].dtype
        placeholder = jax.tree.map(lambda p: p.astype(dtype), self.model_params(self.init_params(jax.random.key(0))))
        drafter = DraftModelDrafter(self.draft_config, placeholder, num_draft=c.tau_eval_num_spec, chunk_size=64)
        return tau_eval.TauEvaluator(
            drafter, self.model_params, self.target_config, self.target_params, prompts, max_new_tokens=c.tau_eval_max_new_tokens
        )

    def export(self, params: dict, path: Path, *, overwrite: bool, evaluation: dict | None = None) -> None:
        """A Hugging Face checkpoint (config.json, model.safetensors) that `--method draft --draft PATH` loads."""
        dtype = ml_dtypes.bfloat16 if self.config.export_dtype == "bfloat16" else np.dtype(self.config.export_dtype)
        model = jax.tree.map(lambda p: np.asarray(jax.device_get(p), np.float32), self.model_params(params))
        save_model(path, self.draft_config, model, dtype, overwrite=overwrite)

    @classmethod
    def build(cls, config: TrainConfig, target: core.Target, train_rows: data.TokenRows) -> DraftLMMethod:
        if config.draft_num_layers >= target.config.num_layers:
            raise ValueError(
                f"draft_num_layers {config.draft_num_layers} must be below the target's {target.config.num_layers} layers"
            )
        if config.features != "online":
            raise ValueError("a draft model trains on the corpus tokens alone: set features: online (nothing to precompute)")
        return cls(config, target.config, target.params)


def prepare(config: TrainConfig) -> core.Setup:
    """Target, rows and draft-model method of a run (core.prepare)."""
    return core.prepare(config, DraftLMMethod.build)
