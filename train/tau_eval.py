"""The real test of a draft in training: tau measured by the specjax engine on held-out prompts.

Simulated acceptance (train.ttt, per-head accuracy) assumes every drafted token is the target's;
the engine runs the actual decode loop (the method's drafter, greedy verification) and counts what
the target accepts. One engine is compiled once per run; each evaluation only swaps weights in.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter
from specjax.engine import Engine
from specjax.models import llama
from specjax.models.config import ModelConfig
from train.data import TokenRows


def held_out_prompts(rows: TokenRows, count: int) -> list[list[int]]:
    """The prompt of each row's first assistant turn (tokens before its first response token)."""
    prompts = []
    for tokens, mask in zip(rows.tokens, rows.loss_mask):
        first_response = int(np.argmax(mask))
        if mask.any() and first_response > 0:
            prompts.append([int(t) for t in tokens[:first_response]])
        if len(prompts) == count:
            break
    return prompts


class TauEvaluator:
    """Greedy decoding of held-out prompts with a drafter; tau and acceptance by position.

    with_params(trained params) -> the drafter's params pytree (same structure as drafter.params).
    """

    def __init__(
        self, drafter: Drafter, with_params: Callable[[Any], Any], target_config: ModelConfig,
        target_params: llama.Params, prompts: list[list[int]], *, max_new_tokens: int,
    ):
        if not prompts:
            raise ValueError("no held-out prompts for the engine evaluation (set eval_samples > 0)")
        self.dtype = jax.tree.leaves(target_params)[0].dtype
        self.drafter, self.with_params = drafter, with_params
        max_len = -(-(max(map(len, prompts)) + max_new_tokens + drafter.num_nodes) // 64) * 64
        self.engine = Engine(target_config, target_params, drafter, max_len=max_len, attention_chunk=64)
        self.prompts, self.max_new_tokens = prompts, max_new_tokens

    def cast(self, params):
        """To the target's dtype, on the default device (training params may live on a mesh)."""
        return jax.tree.map(lambda p: jnp.asarray(np.asarray(jax.device_get(p)), self.dtype), params)

    def __call__(self, trained_params) -> dict[str, Any]:
        drafter_params = self.with_params(self.cast(trained_params))
        stats = self.engine.generate(self.prompts, max_new_tokens=self.max_new_tokens, drafter_params=drafter_params)
        return {
            "tau": round(stats.tau, 4),
            "acceptance_by_position": [round(float(a), 4) for a in stats.acceptance_by_position],
            "prompts": len(self.prompts),
            "tokens": stats.num_generated,
        }
