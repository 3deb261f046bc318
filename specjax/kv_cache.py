"""The KV cache: a static buffer plus a logical length per row.

Row b holds its committed tokens in slots `0 .. lengths[b]-1`. Everything past `lengths[b]`
is stale: never cleared, never attended. Rolling back a rejected draft is therefore nothing but
not advancing `lengths` over it; `write` puts a verified block at each row's own offset,
`compact` gathers an accepted tree path into contiguous slots, and `commit` advances the length.

The buffers are laid out [L, B, Hkv, S, D]: a chunk of one head's slots is contiguous, the
operand attention's matmuls take as is (with slots before heads, XLA:CPU transposes every chunk it
reads; docs/architecture.md, "Cache layout"). Blocks come and go in the model's [L, B, T, Hkv, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    lengths: jax.Array  # [B] int32, committed tokens per row

    @classmethod
    def init(
        cls,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
    ) -> KVCache:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def _scatter_rows(buffer: jax.Array, entries: jax.Array, offsets: jax.Array) -> jax.Array:
    """buffer [L, B, Hkv, S, D] <- entries [B, T, L, Hkv, D] at slots offsets[b] + t (out of range: dropped).

    Indexing axes 1 and 3 (a slice between them) puts the indexed axes first: [B, T, L, Hkv, D]."""
    num_new = entries.shape[1]
    slots = offsets[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
    rows = jnp.arange(buffer.shape[1])[:, None]  # [B, 1]
    return buffer.at[:, rows, :, slots].set(entries, mode="drop")


def write(cache: KVCache, k_block: jax.Array, v_block: jax.Array) -> KVCache:
    """Store a block of new entries at each row's own offset `lengths[b]`; lengths unchanged.

    k_block, v_block: [L, B, T, Hkv, D]. Slots past the buffer are dropped; callers keep
    `lengths + T <= max_len` (the engine checks it before decoding starts).
    """
    return cache.replace(
        k=_scatter_rows(cache.k, jnp.transpose(k_block, (1, 2, 0, 3, 4)).astype(cache.k.dtype), cache.lengths),
        v=_scatter_rows(cache.v, jnp.transpose(v_block, (1, 2, 0, 3, 4)).astype(cache.v.dtype), cache.lengths),
    )


def compact(cache: KVCache, path: jax.Array) -> KVCache:
    """Gather an accepted tree path into contiguous slots.

    path: [B, P] node indices of the block written at `lengths[b]` (path[b, 0] = 0, the root).
    Slot `lengths[b] + path[b, i]` moves to slot `lengths[b] + i`. Entries of the path past the
    accepted length land past the new length and are stale, so any valid index may pad it.
    """
    src = cache.lengths[:, None] + path  # [B, P]
    rows = jnp.arange(cache.batch_size)[:, None]  # [B, 1]
    gather = lambda buf: buf[:, rows, :, jnp.minimum(src, cache.max_len - 1)]  # [B, P, L, Hkv, D]
    return cache.replace(
        k=_scatter_rows(cache.k, gather(cache.k), cache.lengths),
        v=_scatter_rows(cache.v, gather(cache.v), cache.lengths),
    )


def commit(cache: KVCache, num_new: jax.Array) -> KVCache:
    """Advance each row's logical length by num_new [B]: the whole of accept and rollback."""
    return cache.replace(lengths=cache.lengths + num_new.astype(jnp.int32))


def append(cache: KVCache, k_block: jax.Array, v_block: jax.Array, num_new: jax.Array) -> KVCache:
    """Write a block at each row's offset and commit its first num_new[b] entries (a causal block)."""
    return commit(write(cache, k_block, v_block), num_new)
