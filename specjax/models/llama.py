"""The Llama-family target decoder as pure functions over a params pytree.

Params are nested dicts of arrays; matrices are stored [in, out]; `layers` is a list of L
per-layer dicts, and the layer loop is unrolled (each layer a call of one nested jit, traced
once for all of them: docs/architecture.md, "Startup"):

    embed_tokens [V, H]      norm [H]      lm_head [H, V] (absent when tie_word_embeddings)
    layers[i]/input_layernorm [H]            layers[i]/post_attention_layernorm [H]
    layers[i]/q_proj [H, Hq*D]   layers[i]/k_proj, v_proj [H, Hkv*D]   layers[i]/o_proj [Hq*D, H]
    layers[i]/gate_proj, up_proj [H, F]      layers[i]/down_proj [F, H]
    layers[i]/q_bias [Hq*D], k_bias, v_bias [Hkv*D]     (attention_bias, Qwen2)
    layers[i]/q_norm, k_norm [D]                         (qk_norm, Qwen3)

Why not weights stacked on an L axis and a `lax.scan`: on XLA:CPU every step of the scan copies
its layer's weights out of the stacked arrays before the matmuls read them, so a decode step
moved every weight twice (docs/architecture.md, "Two XLA:CPU pitfalls").

`forward` never writes the KV cache: it returns the new block's keys and values, and the caller
decides what to `kv_cache.write` and `commit` (the decode-step contract in docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from specjax.kv_cache import KVCache
from specjax.models import block_matmul
from specjax.models.attention import attention, dividing_chunk
from specjax.models.config import ModelConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Taps:
    """Hidden states a drafter reads from the target's forward, concatenated in this order.

    layer_inputs: the hidden states entering these layers (Hugging Face `hidden_states[i]`).
    final_hidden: the last layer's output after the final norm (`last_hidden_state`).
    Static under jit; no taps cost nothing.
    """

    layer_inputs: tuple[int, ...] = ()
    final_hidden: bool = False

    def width(self, hidden_size: int) -> int:
        """F: the features' last dimension."""
        return (len(self.layer_inputs) + self.final_hidden) * hidden_size


@struct.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, T, V] float32
    k: jax.Array  # [L, B, T, Hkv, D] keys of the new block, RoPE applied
    v: jax.Array  # [L, B, T, Hkv, D] values of the new block
    features: jax.Array | None  # [B, T, F] the requested taps (Taps.width), or None


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree with a shape tuple at every leaf (what loaders validate against)."""
    c = config
    L, H, F, D = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_heads * D, c.num_kv_heads * D
    layer = {
        "input_layernorm": (H,),
        "q_proj": (H, q_dim),
        "k_proj": (H, kv_dim),
        "v_proj": (H, kv_dim),
        "o_proj": (q_dim, H),
        "post_attention_layernorm": (H,),
        "gate_proj": (H, F),
        "up_proj": (H, F),
        "down_proj": (F, H),
    }
    if c.attention_bias:
        layer |= {"q_bias": (q_dim,), "k_bias": (kv_dim,), "v_bias": (kv_dim,)}
    if c.qk_norm:
        layer |= {"q_norm": (D,), "k_norm": (D,)}
    shapes = {"embed_tokens": (c.vocab_size, H), "layers": [dict(layer) for _ in range(L)], "norm": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (H, c.vocab_size)
    return shapes


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params: norm weights at 1, everything else N(0, 0.02)."""
    shapes = param_shapes(config)
    is_shape = lambda leaf: isinstance(leaf, tuple)
    keys = iter(jax.random.split(key, len(jax.tree.leaves(shapes, is_leaf=is_shape))))

    def init(path, shape):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)

    return jax.tree_util.tree_map_with_path(init, shapes, is_leaf=is_shape)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, result in x's dtype (as Hugging Face)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with Llama-3.1 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None:
        low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout). x: [B, T, N, D]; positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]  # [B, T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """[B, T] int32 -> [B, T, H] in the params' dtype."""
    return params["embed_tokens"][tokens]


def lm_head(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and output projection: pre-norm residual [B, T, H] -> float32 logits [B, T, V]."""
    return project_logits(params, config, rms_norm(hidden, params["norm"], config.rms_norm_eps))


def output_head(params: Params, config: ModelConfig) -> jax.Array:
    """[H, V] the output projection as a matrix (the embedding, transposed, when tied)."""
    return params["embed_tokens"].T if config.tie_word_embeddings else params["lm_head"]


def with_untied_head(config: ModelConfig, params: Params) -> tuple[ModelConfig, Params]:
    """The same model with its output head as its own [H, V] matrix: a tied embedding is copied,
    transposed, into `lm_head` (the embedding's size again in memory). An [H, V] head streams in
    memory order where the embedding's [V, H] rows are read across: on XLA:CPU a row's logits take
    1/1.16 of the time, and through the streamed kernel a 4-token block's 1/1.30 of what the
    kernel that read the embedding's rows took (docs/architecture.md, "Streamed block matmuls")."""
    if not config.tie_word_embeddings:
        return config, params
    head = output_head(params, config)  # [H, V], a new buffer in that layout (jax arrays have no strides)
    return dataclasses.replace(config, tie_word_embeddings=False), {**params, "lm_head": head}


def streamed(config: ModelConfig, params: Params) -> tuple[ModelConfig, Params]:
    """The model as `matmuls="streamed"` runs it: the head untied (`with_untied_head`) and every
    matrix of the layers and the head packed for the kernel (`block_matmul.pack`: the same bytes,
    in panels); the embedding stays a lookup table. Packed params come back as they are."""
    config, params = with_untied_head(config, params)
    packed = {name: block_matmul.pack_matrices(params[name]) for name in ("layers", "lm_head")}
    return config, {**params, **packed}


def project_logits(params: Params, config: ModelConfig, normed: jax.Array, matmuls: str = "xla") -> jax.Array:
    """Output projection alone: final-normed hidden [B, T, H] -> float32 logits [B, T, V].
    matmuls: a `block_matmul` mode."""
    if config.tie_word_embeddings:  # XLA's; a streamed engine unties the head (`streamed`)
        return jnp.einsum("...h,vh->...v", normed, params["embed_tokens"], preferred_element_type=jnp.float32)
    return block_matmul.head(normed, params["lm_head"], matmuls)


def _attention_block(config, w, x, layer, positions, inv_freq, cache, block_mask, chunk_size, matmuls):
    """Pre-norm self-attention of one layer. x: [B, T, H] -> ([B, T, H], k [B, T, Hkv, D], v)."""
    c = config
    batch, num_new, _ = x.shape
    h = rms_norm(x, w["input_layernorm"], c.rms_norm_eps)
    q = block_matmul.dense(h, w["q_proj"], matmuls)  # [B, T, Hq*D]
    k = block_matmul.dense(h, w["k_proj"], matmuls)  # [B, T, Hkv*D]
    v = block_matmul.dense(h, w["v_proj"], matmuls)  # [B, T, Hkv*D]
    if c.attention_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q = q.reshape(batch, num_new, c.num_heads, c.head_dim)
    k = k.reshape(batch, num_new, c.num_kv_heads, c.head_dim)
    v = v.reshape(batch, num_new, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    q = q.reshape(batch, num_new, c.num_kv_heads, c.num_groups, c.head_dim)  # [B, T, Hkv, G, D]
    k_cache, v_cache, lengths = (None, None, None) if cache is None else (cache.k, cache.v, cache.lengths)
    out = attention(q, k, v, k_cache, v_cache, layer, lengths, block_mask, chunk_size)  # [B, T, Hkv, G, D]
    out = block_matmul.dense(out.reshape(batch, num_new, c.num_heads * c.head_dim), w["o_proj"], matmuls)  # [B, T, H]
    return out, k, v


def _mlp_block(config, w, x, matmuls):
    """Pre-norm SwiGLU MLP of one layer. x: [B, T, H] -> [B, T, H]."""
    h = rms_norm(x, w["post_attention_layernorm"], config.rms_norm_eps)
    gated = jax.nn.silu(block_matmul.dense(h, w["gate_proj"], matmuls)) * block_matmul.dense(h, w["up_proj"], matmuls)
    return block_matmul.dense(gated, w["down_proj"], matmuls)


@functools.partial(jax.jit, static_argnames=("config", "chunk_size", "matmuls"))
def _decoder_layer(w, hidden, layer, positions, cache, block_mask, *, config, chunk_size, matmuls):
    """One decoder layer: hidden [B, T, H] -> (hidden, k, v). layer: its int32 index in the cache.
    A nested jit, so every layer's call reuses one trace (and one lowering); XLA inlines the calls,
    so the compiled step is the unrolled loop's."""
    inv_freq = rope_frequencies(config)
    attn_out, k, v = _attention_block(config, w, hidden, layer, positions, inv_freq, cache, block_mask, chunk_size, matmuls)
    hidden = hidden + attn_out
    return hidden + _mlp_block(config, w, hidden, matmuls), k, v


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    block_mask: jax.Array,
    *,
    taps: Taps = Taps(),
    chunk_size: int = 256,
    matmuls: str = "xla",
) -> ForwardOutput:
    """Run T new tokens per row against the committed cache; the cache is not modified.

    tokens, positions: [B, T] int32. block_mask: [B, T, T] or [T, T] bool.
    Query t of row b attends to cache slots s < cache.lengths[b] and to block entry u iff
    block_mask[..., t, u]. `cache=None` means an empty prefix (training, no-cache scoring).
    taps: the hidden states returned as `features` (see Taps). chunk_size: the most cache slots
    attended per step of the prefix loop (the widest chunk up to it that divides the buffer). matmuls: a
    `block_matmul` mode ("streamed": every matmul through its kernel, the params as `streamed` packs them).
    Under jit, config, taps, chunk_size and matmuls are static.
    """
    feature_layers = taps.layer_inputs
    for layer in feature_layers:
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"feature layer {layer} out of range for {config.num_layers} layers")
    if cache is not None:
        chunk_size = dividing_chunk(chunk_size, cache.max_len)
    hidden = embed(params, tokens)  # [B, T, H]

    captured, k_new, v_new = {}, [], []
    for layer, w in enumerate(params["layers"]):
        if layer in feature_layers:
            captured[layer] = hidden
        hidden, k, v = _decoder_layer(w, hidden, jnp.int32(layer), positions, cache, block_mask,
                                      config=config, chunk_size=chunk_size, matmuls=matmuls)
        k_new.append(k)
        v_new.append(v)
    features = jnp.concatenate([captured[layer] for layer in feature_layers], -1) if feature_layers else None  # [B, T, F*H]
    normed = rms_norm(hidden, params["norm"], config.rms_norm_eps)  # [B, T, H]
    if taps.final_hidden:
        features = normed if features is None else jnp.concatenate([features, normed], -1)
    k_new, v_new = jnp.stack(k_new), jnp.stack(v_new)  # [L, B, T, Hkv, D]
    return ForwardOutput(logits=project_logits(params, config, normed, matmuls), k=k_new, v=v_new, features=features)
