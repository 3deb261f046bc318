"""Grouped-query attention of a new block over a committed KV prefix plus the block itself.

Cost scales with the longest live row, not with the cache buffer: the committed prefix is read
in fixed-size chunks by a `fori_loop` whose trip count comes from the traced lengths (it lowers
to a while loop), merged with an online softmax. The new block's own keys never touch the cache,
so the cache is read-only here and prefill is simply `lengths = 0` with a causal block mask.
Inside, everything runs head-major ([B, Hkv, T, G, ...]), the layout of the cache's chunks, so that
no chunk is transposed before its matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_MASKED = -1e30  # finite "minus infinity": a fully masked chunk must not produce inf - inf


def _online_update(carry, scores, visible, values):
    """Fold one set of keys into the running (max, sum, accumulator).

    scores:  [B, Hkv, T, G, K] float32 logits of the queries against K keys
    visible: broadcastable to scores, bool
    values:  [B, Hkv, K, D]
    """
    running_max, running_sum, acc = carry  # [B, Hkv, T, G], [B, Hkv, T, G], [B, Hkv, T, G, D]
    scores = jnp.where(visible, scores, _MASKED)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
    probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)  # [B, Hkv, T, G, K]
    rescale = jnp.exp(running_max - new_max)
    running_sum = running_sum * rescale + jnp.sum(probs, axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum(
        "bktgs,bksd->bktgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    return new_max, running_sum, acc


def attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array | None,
    v_cache: jax.Array | None,
    layer: int,
    lengths: jax.Array | None,
    block_mask: jax.Array,
    chunk_size: int,
) -> jax.Array:
    """Softmax attention of T queries over the committed prefix and the new block.

    q:        [B, T, Hkv, G, D] queries (RoPE applied), query head h = kv_head * G + g
    k_new:    [B, T, Hkv, D] keys of the new block (RoPE applied); v_new likewise
    k_cache:  [L, B, Hkv, S, D] the whole cache; only chunks of layer `layer` are read; v_cache likewise;
              None for an empty prefix
    layer:    the layer's index in the cache
    lengths:  [B] committed slots per row: query (b, t) sees cache slots s < lengths[b]
    block_mask: [B, T, T] or [T, T] bool: query t sees block entry u iff block_mask[..., t, u]
    chunk_size: cache slots per chunk; must divide S

    Returns [B, T, Hkv, G, D] in q's dtype. A query that sees nothing gets zeros.
    """
    batch, num_queries, num_kv_heads, num_groups, head_dim = q.shape
    if k_cache is not None and k_cache.shape[3] % chunk_size:
        raise ValueError(f"cache length {k_cache.shape[3]} is not a multiple of chunk_size {chunk_size}")
    scale = head_dim**-0.5
    q = jnp.transpose(q, (0, 2, 1, 3, 4))  # [B, Hkv, T, G, D]

    def chunk_step(chunk, carry):
        start = chunk * chunk_size
        slice_at = (layer, 0, 0, start, 0)
        size = (1, batch, num_kv_heads, chunk_size, head_dim)
        k_chunk = lax.dynamic_slice(k_cache, slice_at, size)[0]  # [B, Hkv, C, D]
        v_chunk = lax.dynamic_slice(v_cache, slice_at, size)[0]  # [B, Hkv, C, D]
        scores = jnp.einsum("bktgd,bksd->bktgs", q, k_chunk, preferred_element_type=jnp.float32) * scale
        live = start + jnp.arange(chunk_size) < lengths[:, None]  # [B, C]
        return _online_update(carry, scores, live[:, None, None, None, :], v_chunk)

    stats_shape = (batch, num_kv_heads, num_queries, num_groups)
    carry = (
        jnp.full(stats_shape, _MASKED, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (head_dim,), jnp.float32),
    )
    if k_cache is not None:
        num_chunks = (jnp.max(lengths) + chunk_size - 1) // chunk_size
        carry = lax.fori_loop(0, num_chunks, chunk_step, carry)

    k_new, v_new = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_new, v_new))  # [B, Hkv, T, D]
    block_scores = jnp.einsum("bktgd,bkud->bktgu", q, k_new, preferred_element_type=jnp.float32) * scale
    block_mask = jnp.broadcast_to(block_mask, (batch, num_queries, num_queries))
    _, running_sum, acc = _online_update(carry, block_scores, block_mask[:, None, :, None, :], v_new)
    out = acc / jnp.where(running_sum > 0, running_sum, 1.0)[..., None]  # [B, Hkv, T, G, D]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)
