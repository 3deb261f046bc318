"""The real test of a draft in training: tau measured by the specjax engine on held-out prompts.

The simulated TTT acceptance (train.ttt) assumes every drafted token is the target's; the engine
runs the actual decode loop (EAGLE-3 chain, greedy verification) and counts what the target
accepts. One engine is compiled once per run; each evaluation only swaps the head's weights in.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.engine import Engine
from specjax.models import eagle3, llama
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
    """Greedy EAGLE-3 chain decoding of held-out prompts; tau and acceptance by position."""

    def __init__(
        self, draft_config: eagle3.Eagle3Config, vocab: eagle3.DraftVocab, target_config: ModelConfig,
        target_params: llama.Params, prompts: list[list[int]], *, num_spec: int, max_new_tokens: int,
    ):
        if not prompts:
            raise ValueError("no held-out prompts for the engine evaluation (set eval_samples > 0)")
        self.dtype = jax.tree.leaves(target_params)[0].dtype
        placeholder = eagle3.init_params(draft_config, jax.random.key(0))
        self.drafter = Eagle3Drafter(
            draft_config, self._cast(placeholder), vocab, target_params["embed_tokens"], depth=num_spec,
            feature_layers=eagle3.feature_layers(target_config.num_layers),
        )
        max_len = -(-(max(map(len, prompts)) + max_new_tokens + self.drafter.num_nodes) // 64) * 64
        self.engine = Engine(target_config, target_params, self.drafter, max_len=max_len, attention_chunk=64)
        self.prompts, self.max_new_tokens = prompts, max_new_tokens

    def _cast(self, params: eagle3.Params) -> eagle3.Params:
        """To the target's dtype, on the default device (training params may live on a mesh)."""
        return jax.tree.map(lambda p: jnp.asarray(np.asarray(jax.device_get(p)), self.dtype), params)

    def __call__(self, head_params: eagle3.Params) -> dict[str, Any]:
        drafter_params = self.drafter.params_with_head(self._cast(head_params))
        stats = self.engine.generate(self.prompts, max_new_tokens=self.max_new_tokens, drafter_params=drafter_params)
        return {
            "tau": round(stats.tau, 4),
            "acceptance_by_position": [round(float(a), 4) for a in stats.acceptance_by_position],
            "prompts": len(self.prompts),
            "tokens": stats.num_generated,
        }
