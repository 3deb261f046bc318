"""Medusa-1 heads (Cai et al. 2024) as pure functions over a params pytree.

Head k (k = 0 .. K-1) reads the target's final-normed hidden state h_t at position t and
predicts the token at t + k + 2 (the target's own LM head predicts t + 1):

    x = h_t;  x = x + SiLU(x @ W_kl + b_kl)  for each of its L residual layers
    logits_k = x @ lm_head_k          over a truncated vocabulary of Vt target tokens

Params (matrices [in, out]), one entry per head: heads[k] = {"layers": [L x {"weight" [H, H],
"bias" [H]}], "lm_head" [H, Vt]}; per head, not stacked, so a chain using the first heads reads
only theirs. `token_map` [Vt] holds the target id of each truncated-vocabulary entry (vLLM's name).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    num_heads: int  # K: heads, i.e. tokens drafted beyond the target's own next token
    hidden_size: int  # H, the target's
    vocab_size: int  # the target's vocabulary
    truncated_vocab_size: int  # Vt: tokens a head can predict (token_map)
    num_layers: int = 1  # L: residual SiLU layers per head

    def __post_init__(self):
        if min(self.num_heads, self.hidden_size, self.truncated_vocab_size, self.num_layers) < 1:
            raise ValueError(f"Medusa sizes must be >= 1: {self}")
        if self.truncated_vocab_size > self.vocab_size:
            raise ValueError(f"truncated_vocab_size {self.truncated_vocab_size} exceeds the vocabulary ({self.vocab_size})")

    def param_shapes(self) -> Params:
        H = self.hidden_size
        layer = {"weight": (H, H), "bias": (H,)}
        head = lambda: {"layers": [dict(layer) for _ in range(self.num_layers)], "lm_head": (H, self.truncated_vocab_size)}
        return {"heads": [head() for _ in range(self.num_heads)]}


def init_params(config: MedusaConfig, target_head: jax.Array, token_map: jax.Array) -> Params:
    """Medusa's initialisation: residual layers at zero (each head starts as the target's LM
    head, restricted to the truncated vocabulary). target_head: [H, V] the target's output
    projection; token_map: [Vt] target ids."""
    H = config.hidden_size
    lm_head = jnp.asarray(target_head, jnp.float32)[:, token_map]  # [H, Vt]
    layer = lambda: {"weight": jnp.zeros((H, H)), "bias": jnp.zeros((H,))}
    return {"heads": [{"layers": [layer() for _ in range(config.num_layers)], "lm_head": lm_head} for _ in range(config.num_heads)]}


def forward(params: Params, hidden: jax.Array, num_heads: int | None = None) -> jax.Array:
    """hidden [..., H] -> float32 logits [..., K, Vt] of the first `num_heads` heads (all by default)."""
    logits = []
    for head in params["heads"][:num_heads]:
        x = hidden.astype(head["lm_head"].dtype)
        for layer in head["layers"]:
            x = x + jax.nn.silu(x @ layer["weight"] + layer["bias"])
        logits.append(jnp.einsum("...h,hv->...v", x, head["lm_head"], preferred_element_type=jnp.float32))
    return jnp.stack(logits, -2)
