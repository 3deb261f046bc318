"""Grouped-query attention of a new block over a committed KV prefix plus the block itself.

Cost scales with the live rows, not with the cache buffer: the committed prefix is read in
fixed-size chunks by `fori_loop`s whose trip counts come from the traced lengths (they lower to
while loops), merged with an online softmax. In a batch of rows of different lengths (continuous
batching) a chunk is read only for the longest rows that reach it, rounded up to a quarter of the
batch (of 8 rows or more): one loop per quarter, over the range of chunks that many rows reach,
so a short row does not pay for the longest one's prefix. The new block's own keys never touch
the cache, so the cache is read-only here and prefill is simply `lengths = 0` with a causal block mask.
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


def dividing_chunk(chunk_size: int, cache_length: int) -> int:
    """The widest chunk of at most `chunk_size` slots that divides `cache_length` (a drafter's cache is
    as long as the engine's, which need only be a multiple of the engine's own chunk)."""
    return next(width for width in range(min(chunk_size, cache_length), 0, -1) if cache_length % width == 0)


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

    stats_shape = (batch, num_kv_heads, num_queries, num_groups)
    carry = (
        jnp.full(stats_shape, _MASKED, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (head_dim,), jnp.float32),
    )
    if k_cache is not None:
        carry = _attend_prefix(q, k_cache, v_cache, layer, lengths, chunk_size, scale, carry)

    k_new, v_new = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_new, v_new))  # [B, Hkv, T, D]
    block_scores = jnp.einsum("bktgd,bkud->bktgu", q, k_new, preferred_element_type=jnp.float32) * scale
    block_mask = jnp.broadcast_to(block_mask, (batch, num_queries, num_queries))
    _, running_sum, acc = _online_update(carry, block_scores, block_mask[:, None, :, None, :], v_new)
    out = acc / jnp.where(running_sum > 0, running_sum, 1.0)[..., None]  # [B, Hkv, T, G, D]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)


def row_counts(batch: int) -> tuple[int, ...]:
    """The static numbers of rows a chunk of the prefix is read for: quarters of a batch of 8 or
    more, the whole of a smaller one (where the prefix weighs little beside the weights and
    reading rows one by one cost more than it saved)."""
    if batch < 8:
        return (batch,)
    return tuple(sorted({-(-batch * quarter // 4) for quarter in (1, 2, 3, 4)}))


def _attend_prefix(q, k_cache, v_cache, layer, lengths, chunk_size, scale, carry):
    """Fold the committed prefix, chunk by chunk, into the online-softmax carry.

    q: [B, Hkv, T, G, D] queries; carry: per row (max, sum, accumulator). With the rows taken
    longest first, the chunks only the n longest reach (n one of `row_counts(B)`) are a range:
    one loop per n reads its range for those rows (gathered, then scattered back; skipped under
    a conditional when the range is empty), the whole batch's as one slice. Every row still folds
    its chunks in order, as a single loop over the whole batch would.
    """
    batch, num_kv_heads, _, _, head_dim = q.shape

    def fold(rows, row_q, row_lengths):
        """One chunk for rows [R] (None: the whole batch), their queries and lengths."""
        size = (1, batch if rows is None else 1, num_kv_heads, chunk_size, head_dim)
        if rows is None:  # [B, Hkv, C, D], one slice
            read = lambda cache, start: lax.dynamic_slice(cache, (layer, 0, 0, start, 0), size)[0]
        else:  # [R, Hkv, C, D], a slice per row
            read = lambda cache, start: jax.vmap(lambda r: lax.dynamic_slice(cache, (layer, r, 0, start, 0), size)[0, 0])(rows)

        def step(chunk, carry):
            start = chunk * chunk_size
            scores = jnp.einsum("bktgd,bksd->bktgs", row_q, read(k_cache, start), preferred_element_type=jnp.float32) * scale
            live = start + jnp.arange(chunk_size) < row_lengths[:, None]  # [R, C]
            return _online_update(carry, scores, live[:, None, None, None, :], read(v_cache, start))
        return step

    chunks = lambda length: (length + chunk_size - 1) // chunk_size
    counts = row_counts(batch)
    longest_first = jnp.argsort(-lengths)  # [B]
    # Chunks some row past the `count` longest reaches (0: every live chunk): they need more rows.
    reached_beyond = lambda count: chunks(lengths[longest_first[count]]) if count < batch else 0
    for count, fewer in zip(counts[::-1], (*counts[-2::-1], 0)):  # the whole batch first: chunks in order
        first, end = reached_beyond(count), reached_beyond(fewer)
        if count == batch:
            carry = lax.fori_loop(first, end, fold(None, q, lengths), carry)
            continue

        def fold_rows(carry, rows=longest_first[:count], first=first, end=end):
            folded = lax.fori_loop(first, end, fold(rows, q[rows], lengths[rows]), tuple(c[rows] for c in carry))
            return tuple(c.at[rows].set(f) for c, f in zip(carry, folded))

        carry = lax.cond(first < end, fold_rows, lambda carry: carry, carry)
    return carry
