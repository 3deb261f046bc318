"""KV cache bookkeeping: per-row lengths, write / compact / commit, and what attention may see.

Cache entries here encode what they hold (a token id, or a node index), so a test can read
back which entry landed in which slot.
"""

from __future__ import annotations

from functools import partial

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from specjax import kv_cache, verify
from specjax.kv_cache import KVCache
from specjax.models.attention import attention
from specjax.sampling import SamplingParams
from specjax.tree import Tree
from specjax.tree import causal_mask

LAYERS, HEADS, HEAD_DIM = 2, 1, 2

# The engine runs these under jit; so do the tests (one compilation per shape, not per op).
write = jax.jit(kv_cache.write)
compact = jax.jit(kv_cache.compact)
commit = jax.jit(kv_cache.commit)


@partial(jax.jit, static_argnums=2)
def visible(lengths: jax.Array, block_mask: jax.Array, max_len: int) -> jax.Array:
    """[B, T, max_len + T] bool: which cache slots, then which block entries, each query of a new
    block attends, read off the model's attention: zero queries weigh every visible value alike,
    and every slot, stale or not, holds a value of its own (the one-hot of its index)."""
    batch, num_queries = lengths.shape[0], block_mask.shape[-1]
    values = jnp.eye(max_len + num_queries)  # [S + T, S + T]
    v_cache = jnp.broadcast_to(values[:max_len], (1, batch, 1, max_len, max_len + num_queries))  # [L, B, Hkv, S, D]
    v_new = jnp.broadcast_to(values[max_len:, None], (batch, num_queries, 1, max_len + num_queries))
    q = jnp.zeros((batch, num_queries, 1, 1, max_len + num_queries))
    out = attention(q, jnp.zeros_like(v_new), v_new, jnp.zeros_like(v_cache), v_cache, 0, lengths, block_mask, 2)
    return out[:, :, 0, 0] > 0


def entries(values: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """k, v blocks [L, B, T, H, D] whose every element encodes values[b, t] (v negated)."""
    values = np.asarray(values, np.float32)
    block = np.broadcast_to(values[None, :, :, None, None], (LAYERS,) + values.shape + (HEADS, HEAD_DIM))
    return jnp.asarray(block), jnp.asarray(-block)


def slot_values(cache: KVCache) -> np.ndarray:
    """[B, S] the value encoded in each slot (checking k, v and every layer agree)."""
    k, v = np.asarray(cache.k), np.asarray(cache.v)
    np.testing.assert_array_equal(k, -v)
    np.testing.assert_array_equal(k, np.broadcast_to(k[:1, :, :1, :, :1], k.shape))  # [L, B, Hkv, S, D]
    return k[0, :, 0, :, 0]


def prefilled(lengths: list[int], max_len: int) -> KVCache:
    """A cache whose row b holds 100 * b + slot in every slot, committed up to lengths[b]."""
    cache = KVCache.init(LAYERS, len(lengths), max_len, HEADS, HEAD_DIM)
    values = 100 * np.arange(len(lengths))[:, None] + np.arange(max_len)[None, :]  # one shape per buffer
    cache = write(cache, *entries(values))
    return commit(cache, jnp.asarray(lengths))


def test_two_sequences_accept_all_and_reject_at_position_two():
    """Row A accepts all three drafts, row B rejects its third: lengths advance by 4 and 3."""
    cache = prefilled([5, 3], max_len=16)
    vocab = 8
    # Greedy targets: the argmax continuation is 1, 2, 3, 4 for both rows.
    target_probs = jax.nn.one_hot(jnp.asarray([[1, 2, 3, 4]] * 2), vocab)  # [B, N + 1, V]
    drafts = jnp.asarray([[1, 2, 3], [1, 2, 7]])  # row B's third draft is wrong
    draft_probs = jax.nn.one_hot(drafts, vocab)
    verdict = verify.chain(jax.random.key(0), drafts, draft_probs, target_probs, SamplingParams.make(2))
    np.testing.assert_array_equal(verdict.accepted, [3, 2])
    np.testing.assert_array_equal(verdict.next_token, [4, 3])

    block_tokens = np.asarray([[5, 1, 2, 3], [5, 1, 2, 7]])  # [pending, drafts]
    cache = write(cache, *entries(1000 + block_tokens))
    cache = commit(compact(cache, verdict.path), verdict.accepted + 1)
    np.testing.assert_array_equal(cache.lengths, [9, 6])
    values = slot_values(cache)
    np.testing.assert_array_equal(values[0, :9], [0, 1, 2, 3, 4, 1005, 1001, 1002, 1003])
    np.testing.assert_array_equal(values[1, :6], [100, 101, 102, 1005, 1001, 1002])
    # Row B's rejected slot (6) is stale: still in the buffer, never visible.
    seen = visible(cache.lengths, jnp.ones((1, 1), bool), cache.max_len)  # [B, 1, S + 1]
    np.testing.assert_array_equal(seen[:, 0, :16], np.arange(16)[None, :] < np.asarray([[9], [6]]))


def test_tree_path_compaction_moves_the_right_entries():
    lengths = [4, 2]
    cache = prefilled(lengths, max_len=16)
    node_values = 1000 + 10 * np.arange(2)[:, None] + np.arange(7)[None, :]  # [B, N]: row, node
    cache = write(cache, *entries(node_values))
    path = jnp.asarray([[0, 2, 5, 5], [0, 1, 4, 6]])  # row 0 accepted 2 nodes (then padding), row 1 three
    accepted = jnp.asarray([2, 3])
    cache = commit(compact(cache, path), accepted + 1)
    values = slot_values(cache)
    np.testing.assert_array_equal(cache.lengths, [7, 6])
    np.testing.assert_array_equal(values[0, :7], [0, 1, 2, 3, 1000, 1002, 1005])
    np.testing.assert_array_equal(values[1, :6], [100, 101, 1010, 1011, 1014, 1016])


def test_stale_entries_are_never_visible():
    lengths = jnp.asarray([0, 3, 9])
    max_len, block = 12, 3
    causal = causal_mask(block)
    seen = np.asarray(visible(lengths, causal, max_len))  # [B, T, S + T]
    for row, length in enumerate(np.asarray(lengths)):
        np.testing.assert_array_equal(seen[row, :, :length], True)  # the committed prefix
        np.testing.assert_array_equal(seen[row, :, length:max_len], False)  # stale slots
        np.testing.assert_array_equal(seen[row, :, max_len:], causal)  # the block, by its mask


def test_per_row_block_masks():
    """A [B, T, T] tree mask is placed at each row's own offset."""
    parents = jnp.asarray([[-1, 0, 0], [-1, 0, 1]])
    block_mask = Tree(parents=parents, depths=jnp.asarray([[0, 1, 1], [0, 1, 2]]), max_depth=2).ancestor_mask()
    seen = np.asarray(visible(jnp.asarray([1, 2]), block_mask, 6))
    np.testing.assert_array_equal(seen[0, :, 6:], block_mask[0])
    np.testing.assert_array_equal(seen[1, :, 6:], block_mask[1])
    prefix = np.arange(6)[None, :] < np.asarray([1, 2])[:, None]  # [B, S]
    np.testing.assert_array_equal(seen[:, :, :6], np.broadcast_to(prefix[:, None], (2, 3, 6)))
    assert not seen[0, 2, 7] and seen[1, 2, 7]  # siblings hidden, chain visible


def test_write_drops_out_of_range_slots():
    max_len = 8
    cache = prefilled([6, 1], max_len=max_len)
    cache = write(cache, *entries(1000 + np.arange(4)[None, :].repeat(2, 0)))
    values = slot_values(cache)
    np.testing.assert_array_equal(values[0], [0, 1, 2, 3, 4, 5, 1000, 1001])  # nothing wrapped around
    np.testing.assert_array_equal(values[1, :5], [100, 1000, 1001, 1002, 1003])
    np.testing.assert_array_equal(cache.lengths, [6, 1])  # write never commits


# ----------------------------------------------------------------------------- property

NODES, VOCAB, MAX_LEN = 7, 5, 16


@st.composite
def verified_trees(draw):
    """Random per-row topologies and prefix lengths; the path comes from verify.tree."""
    batch = draw(st.sampled_from([1, 4]))
    parents = [[-1] + [draw(st.integers(0, node - 1)) for node in range(1, NODES)] for _ in range(batch)]
    lengths = [draw(st.integers(0, MAX_LEN - NODES)) for _ in range(batch)]
    return parents, lengths, draw(st.integers(0, 2**31 - 1))


@given(verified_trees())
@settings(max_examples=20, deadline=None, derandomize=True, database=None)
def test_compact_and_commit_equal_writing_the_path_token_by_token(example):
    parents, lengths, seed = example
    rng = np.random.default_rng(seed)
    batch = len(parents)
    depths = []
    for row in parents:
        depths.append([0])
        for parent in row[1:]:
            depths[-1].append(depths[-1][parent] + 1)
    topology = Tree(parents=jnp.asarray(parents), depths=jnp.asarray(depths), max_depth=NODES - 1)
    # Tokens drawn from q at the parent, so paths of every length occur.
    q = rng.dirichlet(np.full(VOCAB, 0.3), size=(batch, NODES)).astype(np.float32)  # [B, N, V]
    tokens = np.asarray([[rng.choice(VOCAB, p=q[b, max(parent, 0)] / q[b, max(parent, 0)].sum()) for parent in row]
                         for b, row in enumerate(parents)])
    verdict = verify.tree(
        jax.random.key(seed), topology, jnp.asarray(tokens), jnp.asarray(q), SamplingParams.make(batch, temperature=1.0)
    )
    cache = prefilled(lengths, MAX_LEN)
    node_values = 1000 + 10 * np.arange(batch)[:, None] + np.arange(NODES)[None, :]  # [B, N]

    verified = write(cache, *entries(node_values))
    verified = commit(compact(verified, verdict.path), verdict.accepted + 1)

    sequential = cache  # one token at a time along the path; rows past their path write stale slots
    path, accepted = np.asarray(verdict.path), np.asarray(verdict.accepted)
    for depth in range(NODES):
        step_values = node_values[np.arange(batch), path[:, min(depth, path.shape[1] - 1)]][:, None]  # [B, 1]
        sequential = write(sequential, *entries(step_values))
        sequential = commit(sequential, jnp.asarray(depth <= accepted, jnp.int32))

    np.testing.assert_array_equal(verified.lengths, sequential.lengths)
    np.testing.assert_array_equal(verified.lengths, np.asarray(lengths) + accepted + 1)
    verified_values, sequential_values = slot_values(verified), slot_values(sequential)
    for row, length in enumerate(np.asarray(verified.lengths)):
        np.testing.assert_array_equal(verified_values[row, :length], sequential_values[row, :length])
