"""The EAGLE-1 draft (Li et al. 2024): one decoder layer that regresses the target's next feature.

The feature f_t is the target's top-layer hidden state after its final norm (what its LM head
reads). One draft step, for queries at positions `positions`:

    x      = concat(embed(token), f) @ fc (+ fc_bias)                  # [B, T, 2H] -> [B, T, H]
    h      = x + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))    # no input norm (EAGLE's layer 0)
    f_next = h + mlp(post_attention_layernorm(h))                      # the predicted next feature
    logits = f_next @ target lm_head                                   # the target's head, frozen, no norm

The draft feeds f_next back as the next step's f. Params are a flat dict in [in, out] layout
(the checkpoint module converts to and from torch's [out, in] names); `fc_bias` is optional
(the EAGLE reference trains one; vLLM's EagleLlamaForCausalLM has none, so specjax trains none).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.kv_cache import KVCache
from specjax.models.attention import attention, dividing_chunk
from specjax.models.config import Llama3RopeScaling, ModelConfig, layer_shape
from specjax.models.dense import dense
from specjax.models.llama import apply_rope, rms_norm, rope_frequencies

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Eagle1Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's: the draft predicts through its LM head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    fc_bias: bool = False

    @classmethod
    def from_target(cls, target: ModelConfig) -> Eagle1Config:
        """A draft layer shaped like one of `target`'s."""
        return cls(**layer_shape(target), vocab_size=target.vocab_size)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter, [in, out] for matrices."""
        hidden, q_width, kv_width = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "fc": (2 * hidden, hidden),
            "q_proj": (hidden, q_width),
            "k_proj": (hidden, kv_width),
            "v_proj": (hidden, kv_width),
            "o_proj": (q_width, hidden),
            "post_attention_layernorm": (hidden,),
            "gate_proj": (hidden, self.intermediate_size),
            "up_proj": (hidden, self.intermediate_size),
            "down_proj": (self.intermediate_size, hidden),
        }
        return shapes | ({"fc_bias": (hidden,)} if self.fc_bias else {})


class Eagle1Output(NamedTuple):
    hidden: jax.Array  # [B, T, H] the predicted next features
    k: jax.Array  # [1, B, T, Hkv, D]
    v: jax.Array  # [1, B, T, Hkv, D]


def init_params(config: Eagle1Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Normal(0, 0.02) matrices, unit norm scale, zero bias; `fc` adds the identity on the feature
    half, so an untrained draft predicts "the next feature is this one plus the layer's update"."""
    shapes = config.param_shapes()
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    params = {name: 0.02 * jax.random.normal(keys[name], shape, dtype) for name, shape in shapes.items() if len(shape) == 2}
    hidden = config.hidden_size
    params["fc"] = params["fc"].at[hidden:].add(jnp.eye(hidden, dtype=dtype))
    params["post_attention_layernorm"] = jnp.ones((hidden,), dtype)
    if config.fc_bias:
        params["fc_bias"] = jnp.zeros((hidden,), dtype)
    return params


def fuse(params: Params, token_embeddings: jax.Array, features: jax.Array) -> jax.Array:
    """fc over concat(embedding, feature): [B, T, H] twice -> x [B, T, H]."""
    dtype = params["fc"].dtype
    x = dense(jnp.concatenate([token_embeddings.astype(dtype), features.astype(dtype)], -1), params["fc"])
    return x + params["fc_bias"] if "fc_bias" in params else x


def layer_qkv(params: Params, config: Eagle1Config, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B, T, Hq, D], keys and values [B, T, Hkv, D] of the layer input x [B, T, H]."""
    batch, length, _ = x.shape
    heads = lambda w, n: dense(x, w).reshape(batch, length, n, config.head_dim)
    inv_freq = rope_frequencies(config)
    q = apply_rope(heads(params["q_proj"], config.num_heads), positions, inv_freq)
    k = apply_rope(heads(params["k_proj"], config.num_kv_heads), positions, inv_freq)
    return q, k, heads(params["v_proj"], config.num_kv_heads)


def layer_output(params: Params, config: Eagle1Config, x: jax.Array, attention_out: jax.Array) -> jax.Array:
    """From the layer input x [B, T, H] and attention output [B, T, Hq, D]: the predicted features [B, T, H]."""
    batch, length, _ = x.shape
    h = x + dense(attention_out.reshape(batch, length, -1).astype(x.dtype), params["o_proj"])
    normed = rms_norm(h, params["post_attention_layernorm"], config.rms_norm_eps)
    return h + dense(jax.nn.silu(dense(normed, params["gate_proj"])) * dense(normed, params["up_proj"]), params["down_proj"])


def forward(
    params: Params,
    config: Eagle1Config,
    token_embeddings: jax.Array,
    features: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    block_mask: jax.Array,
    *,
    chunk_size: int = 256,
) -> Eagle1Output:
    """One draft step over a block of T queries.

    token_embeddings: [B, T, H] target embeddings of the input tokens (the token after each feature).
    features:         [B, T, H] target features, or the draft's own earlier predictions.
    positions:        [B, T] RoPE positions.
    cache:            the draft's 1-layer KVCache; queries attend to slots < cache.lengths[b]
                      plus the block entries block_mask allows ([B, T, T] or [T, T]). The cache is
                      not modified: the caller writes the returned k, v.
    """
    batch, length, _ = features.shape
    x = fuse(params, token_embeddings, features)
    q, k, v = layer_qkv(params, config, x, positions)
    grouped = q.reshape(batch, length, config.num_kv_heads, -1, config.head_dim)  # [B, T, Hkv, G, D]
    chunk_size = dividing_chunk(chunk_size, cache.max_len)
    out = attention(grouped, k, v, cache.k, cache.v, jnp.int32(0), cache.lengths, block_mask, chunk_size)
    return Eagle1Output(hidden=layer_output(params, config, x, out.reshape(q.shape)), k=k[None], v=v[None])
