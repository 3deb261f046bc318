"""The EAGLE-3 draft head: `fc` over three target feature layers, one 2H-input decoder layer.

Params are a flat dict of arrays in [in, out] layout (the checkpoint module converts to and
from the torch [out, in] names). One draft step, for queries at positions `positions`:

    x     = concat(input_layernorm(embed(token)), hidden_norm(h))      # [B, T, 2H]
    r     = hidden_norm(h) if norm_before_residual else h               # the residual stream
    h'    = r + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
    h_out = h' + mlp(post_attention_layernorm(h'))                      # fed back as the next h
    logits = lm_head(norm(h_out))                                       # [B, T, Vd], draft vocab

Step 0 uses h = project_features(target features); later steps use the previous h_out.
Activations take the dtype of the norm scales; the matrices may be narrower (bfloat16 matrices with
float32 activations under `matmuls="streamed"`, `block_matmul`). `matmuls="xla"` uses `dense`,
whose gradient training needs.
`norm_before_residual` is vLLM's flag of that name (EAGLE and SpecForge drafts: False).
Draft token i is target token i + d2t[i]; t2d[v] says whether target token v is drafted.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.kv_cache import KVCache
from specjax.models import block_matmul
from specjax.models.attention import attention, dividing_chunk
from specjax.models.config import Llama3RopeScaling, ModelConfig, layer_shape
from specjax.models.dense import dense
from specjax.models.llama import apply_rope, rms_norm, rope_frequencies

Params = dict[str, jax.Array]


def feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target taps EAGLE-3 reads: hidden states entering layers 2, N//2 and N-3 (low, mid, high)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    tap_layers: tuple[int, ...] | None = None  # target layers whose inputs fc reads; None: feature_layers(N)
    norm_before_residual: bool = False  # the residual stream starts at hidden_norm(h) instead of h

    def __post_init__(self):
        if self.tap_layers is not None and len(self.tap_layers) != 3:
            raise ValueError(f"EAGLE-3 reads three target layers (fc takes 3H), got {self.tap_layers}")

    def target_taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs this draft reads: its own, else the EAGLE-3 default."""
        return self.tap_layers or feature_layers(num_target_layers)

    @classmethod
    def from_target(cls, target: ModelConfig, draft_vocab_size: int) -> Eagle3Config:
        """A draft shaped like one layer of `target`, drafting over `draft_vocab_size` tokens."""
        if not 0 < draft_vocab_size <= target.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} not in (0, {target.vocab_size}]")
        return cls(
            **layer_shape(target),
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=target.vocab_size,
            tap_layers=feature_layers(target.num_layers),
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter, [in, out] for matrices."""
        hidden, q_width = self.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return {
            "fc": (3 * hidden, hidden),
            "q_proj": (2 * hidden, q_width),
            "k_proj": (2 * hidden, kv_width),
            "v_proj": (2 * hidden, kv_width),
            "o_proj": (q_width, hidden),
            "gate_proj": (hidden, self.intermediate_size),
            "up_proj": (hidden, self.intermediate_size),
            "down_proj": (self.intermediate_size, hidden),
            "input_layernorm": (hidden,),
            "hidden_norm": (hidden,),
            "post_attention_layernorm": (hidden,),
            "norm": (hidden,),
            "lm_head": (hidden, self.draft_vocab_size),
        }


@struct.dataclass
class DraftVocab:
    """The draft vocabulary: draft id i is target id i + d2t[i]; t2d[v] marks drafted target ids."""

    d2t: jax.Array  # [Vd] int32
    t2d: jax.Array  # [V] bool

    @classmethod
    def from_target_ids(cls, target_ids: jax.Array, target_vocab_size: int) -> DraftVocab:
        """From the sorted, distinct target ids of the draft vocabulary."""
        target_ids = jnp.asarray(target_ids, jnp.int32)  # [Vd]
        return cls(
            d2t=target_ids - jnp.arange(target_ids.shape[0], dtype=jnp.int32),
            t2d=jnp.zeros((target_vocab_size,), bool).at[target_ids].set(True),
        )

    @property
    def target_ids(self) -> jax.Array:
        """[Vd] target id of each draft id."""
        return draft_to_target(jnp.arange(self.d2t.shape[0]), self.d2t)


class Eagle3Output(NamedTuple):
    logits: jax.Array  # [B, T, Vd] float32
    hidden: jax.Array  # [B, T, H] pre-norm output, the next step's h
    k: jax.Array  # [1, B, T, Hkv, D]
    v: jax.Array  # [1, B, T, Hkv, D]


def init_params(config: Eagle3Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Normal(0, 0.02) matrices, unit norm scales."""
    shapes = config.param_shapes()
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {
        name: (
            jnp.ones(shape, dtype)
            if len(shape) == 1
            else 0.02 * jax.random.normal(keys[name], shape, dtype)
        )
        for name, shape in shapes.items()
    }


def draft_to_target(draft_ids: jax.Array, d2t: jax.Array) -> jax.Array:
    """Target token ids of draft token ids (any shape)."""
    return draft_ids + d2t[draft_ids].astype(draft_ids.dtype)


def _matmul(x: jax.Array, w: jax.Array, matmuls: str) -> jax.Array:
    """x [..., K] @ w [K, N]: `dense` under "xla", else the `block_matmul` mode's."""
    return dense(x, w) if matmuls == "xla" else block_matmul.dense(x, w, matmuls)


def activation_dtype(params: Params):
    """The dtype the head computes in: its norm scales' (its matrices may be narrower)."""
    return params["norm"].dtype


def project_features(params: Params, features: jax.Array, matmuls: str = "xla") -> jax.Array:
    """fc: [B, T, 3H] concatenated target features (low, mid, high) -> [B, T, H]."""
    return _matmul(features.astype(activation_dtype(params)), params["fc"], matmuls)


def midlayer_qkv(
    params: Params,
    config: Eagle3Config,
    token_embeddings: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    matmuls: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B, T, Hq, D], keys and values [B, T, Hkv, D] of one draft step."""
    batch, length, _ = hidden.shape
    dtype = activation_dtype(params)
    x = jnp.concatenate(
        [
            rms_norm(token_embeddings.astype(dtype), params["input_layernorm"], config.rms_norm_eps),
            rms_norm(hidden.astype(dtype), params["hidden_norm"], config.rms_norm_eps),
        ],
        axis=-1,
    )  # [B, T, 2H]
    heads = lambda w, n: _matmul(x, w, matmuls).reshape(batch, length, n, config.head_dim)
    inv_freq = rope_frequencies(config)
    q = apply_rope(heads(params["q_proj"], config.num_heads), positions, inv_freq)
    k = apply_rope(heads(params["k_proj"], config.num_kv_heads), positions, inv_freq)
    v = heads(params["v_proj"], config.num_kv_heads)
    return q, k, v


def midlayer_output(
    params: Params, config: Eagle3Config, hidden: jax.Array, attention_out: jax.Array, matmuls: str = "xla"
) -> tuple[jax.Array, jax.Array]:
    """From h [B, T, H] and attention output [B, T, Hq, D]: (logits [B, T, Vd] f32, h_out [B, T, H])."""
    hidden = midlayer_hidden(params, config, hidden, attention_out, matmuls)
    return head_logits(params, config, hidden, matmuls), hidden


def midlayer_hidden(
    params: Params, config: Eagle3Config, hidden: jax.Array, attention_out: jax.Array, matmuls: str = "xla"
) -> jax.Array:
    """From h [B, T, H] and attention output [B, T, Hq, D]: h_out [B, T, H] (o_proj, residual, MLP)."""
    batch, length, _ = hidden.shape
    dtype = activation_dtype(params)
    mm = lambda x, name: _matmul(x, params[name], matmuls)
    residual = hidden.astype(dtype)
    if config.norm_before_residual:
        residual = rms_norm(residual, params["hidden_norm"], config.rms_norm_eps)
    hidden = residual + mm(attention_out.reshape(batch, length, -1).astype(dtype), "o_proj")
    x = rms_norm(hidden, params["post_attention_layernorm"], config.rms_norm_eps)
    return hidden + mm(jax.nn.silu(mm(x, "gate_proj")) * mm(x, "up_proj"), "down_proj")


def head_logits(params: Params, config: Eagle3Config, hidden: jax.Array, matmuls: str = "xla") -> jax.Array:
    """h_out [..., H] -> float32 draft-vocabulary logits [..., Vd] (final norm, lm_head)."""
    normed = rms_norm(hidden, params["norm"], config.rms_norm_eps)
    return _matmul(normed, params["lm_head"], matmuls).astype(jnp.float32)


def forward(
    params: Params,
    config: Eagle3Config,
    token_embeddings: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    block_mask: jax.Array,
    *,
    chunk_size: int = 256,
    matmuls: str = "xla",
) -> Eagle3Output:
    """One draft step over a block of T queries.

    token_embeddings: [B, T, H] target embeddings of the input tokens.
    hidden:           [B, T, H] h: project_features(target features) or a previous `hidden` output.
    positions:        [B, T] RoPE positions.
    cache:            the draft's 1-layer KVCache; queries attend to slots < cache.lengths[b]
                      plus the block entries allowed by block_mask ([B, T, T] or [T, T] bool,
                      each query must see itself). The cache is not modified: the caller writes
                      the returned k, v. chunk_size: the widest chunk up to it that divides the buffer.
    matmuls:          a `block_matmul` mode for the head's matrices.
    """
    batch, length, _ = hidden.shape
    q, k, v = midlayer_qkv(params, config, token_embeddings, hidden, positions, matmuls)
    grouped = q.reshape(batch, length, config.num_kv_heads, -1, config.head_dim)  # [B, T, Hkv, G, D]
    chunk_size = dividing_chunk(chunk_size, cache.max_len)
    out = attention(grouped, k, v, cache.k, cache.v, jnp.int32(0), cache.lengths, block_mask, chunk_size)
    logits, hidden_out = midlayer_output(params, config, hidden, out.reshape(q.shape), matmuls)
    return Eagle3Output(logits=logits, hidden=hidden_out, k=k[None], v=v[None])
