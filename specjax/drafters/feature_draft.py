"""Drafting from a one-layer head that reads the target's features: EAGLE-1 and EAGLE-3.

Both drafts are autoregressive over features. The head's cache entry at position t reads (a
feature of position t, the token at t + 1) and its output, fed back as the next entry's feature,
predicts the token at t + 2; so the head holds one entry per committed target token. After every
verification (`update`) it reads the accepted path with the target's true features, the last
entry reading the new pending token; `propose` only drafts, and may be skipped. Before adaptive
steps that draft nothing (`NAME:auto` at depth 0) a postponing drafter only queues those entries,
keeping the newest W, and reads the queue in one block before it drafts again: a depth-0 step then
costs what plain decoding does. Entries dropped from a full queue are never read: the head's cache
then lacks those positions (its entries keep their own target positions, so attention simply does
not see them). A row's next prompt keeps the head's entries of the positions it shares with what
the row held (`keep_prefix`), up to the first gap a dropped entry left. The two differ only in
the head (`FeatureDrafter._head`, `_project`, `_to_target`): EAGLE-3 fuses three target layers
and predicts a draft vocabulary, EAGLE-1 reads the top layer and regresses the next one.

Chain (top-k 1): each draft is sampled from the head's distribution, processed like the target's
(temperature, top-k, top-p; the argmax for greedy rows), and verified by the rejection rule.
EAGLE-2 tree (depth D, top-k K, T nodes): level 1 takes the K most likely tokens; each level
expands the K best nodes of the level above (by cumulative draft log-probability) into K
children each, so the candidate pool has K + (D - 1) K^2 nodes; the best T of the pool are
kept, in pool order (parents before children, siblings by score), and verified with the
point-mass tree rule at temperature 0 and multi-draft rejection above it.
"""

from __future__ import annotations

import abc
import copy
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import kv_cache as kv
from specjax import sampling as sampling_lib
from specjax.drafters.base import Commit, Drafter, PrefillChunk, Proposal, StepContext, trace_once, zeros_like
from specjax.models.config import ModelConfig
from specjax.models.llama import Taps
from specjax.tree import Tree, ancestor_mask, causal_mask, chain, pool_size


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """The sizes the shared drafting code needs of a head."""

    name: str  # for error messages, e.g. "EAGLE-3 draft"
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int  # Vd: the tokens the head's logits cover
    target_vocab_size: int


@struct.dataclass
class Backlog:
    """Committed entries the head has not read yet (`FeatureDrafter.postponing`): a ring, the
    entry of target position p in slot p mod W, so queueing one writes it and moves nothing."""

    features: jax.Array  # [B, W, F] target taps
    tokens: jax.Array  # [B, W] the token after each
    count: jax.Array  # [B] entries held: a row's newest, up to the position before its pending token
    aligned: jax.Array  # [B] the head's leading cache entries that sit at their own target positions (before any gap)


@struct.dataclass
class FeatureDraftState:
    cache: kv.KVCache  # the head's 1-layer cache: one entry per committed target token read so far
    hidden: jax.Array  # [B, H] head output at the newest entry (it predicts the token after the pending one)
    backlog: Backlog | None = None  # the newest entries left unread while no step drafts (postponing drafters only)


class FeatureDrafter(Drafter):
    """A chain or an EAGLE-2 dynamic tree from a feature-level draft head (module doc).

    Subclasses supply the head: `_head` (one forward over a block), `_project` (target taps to
    the head's feature input) and `_to_target` (draft ids to target ids), and set `params`.
    """

    def __init__(self, shape: HeadShape, taps: Taps, *, depth: int, top_k: int, tree_nodes: int | None, chunk_size: int):
        tree_nodes = depth if tree_nodes is None else tree_nodes
        if min(depth, top_k, tree_nodes) < 1 or tree_nodes > pool_size(depth, top_k):
            raise ValueError(
                f"tree needs depth, top_k, nodes >= 1 and nodes <= pool size {pool_size(depth, top_k)}; "
                f"got {depth}, {top_k}, {tree_nodes}"
            )
        self.shape, self.taps = shape, taps
        self.depth, self.top_k, self.tree_nodes, self.chunk_size = depth, top_k, tree_nodes, chunk_size
        self.backlog_size = 0  # W: the newest entries `update` keeps unread (`postponing`)

    @abc.abstractmethod
    def _head(self, params, cache: kv.KVCache, tokens, hidden, positions, block_mask):
        """One head forward over a block: tokens [B, T] target ids, hidden [B, T, H] feature
        inputs -> an object with hidden [B, T, H] (the outputs, each the next step's feature
        input), k and v [1, B, T, Hkv, D] (not yet written to the cache)."""

    @abc.abstractmethod
    def _logits(self, params, hidden: jax.Array) -> jax.Array:
        """Head outputs [..., H] -> float32 draft-vocabulary logits [..., Vd] (only where needed:
        with EAGLE-1's full-vocabulary head they cost more than the layer)."""

    @abc.abstractmethod
    def _project(self, params, features: jax.Array) -> jax.Array:
        """The target's taps [B, T, F] -> the head's feature input [B, T, H]."""

    @abc.abstractmethod
    def _to_target(self, params, draft_ids: jax.Array) -> jax.Array:
        """Target ids of draft-vocabulary ids (any shape)."""

    @property
    @abc.abstractmethod
    def dtype(self):
        """The head's weight dtype (its cache and feature state are kept in it)."""

    def at_depth(self, depth: int) -> FeatureDrafter:
        if self.top_k != 1:
            raise ValueError(f"an EAGLE-2 tree has no adaptive depth; use a chain ({self.shape.name}, :auto)")
        variant = copy.copy(self)
        variant.depth = variant.tree_nodes = depth
        return variant

    def postponing(self, steps: int) -> FeatureDrafter:
        # A drafting step appends up to D + 1 entries to an empty backlog, a depth-0 step one.
        postponing = copy.copy(self)
        postponing.backlog_size = max(steps, self.depth + 1)
        return postponing

    @property
    def num_nodes(self) -> int:
        return self.tree_nodes + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    def check_target(self, target_config: ModelConfig) -> None:
        shape = self.shape
        if shape.target_vocab_size != target_config.vocab_size:
            raise ValueError(
                f"{shape.name} was trained for a vocabulary of {shape.target_vocab_size} tokens, "
                f"the target has {target_config.vocab_size}"
            )
        if shape.hidden_size != target_config.hidden_size:
            raise ValueError(f"{shape.name} hidden size {shape.hidden_size} does not match the target's {target_config.hidden_size}")
        if self.taps.layer_inputs and max(self.taps.layer_inputs) >= target_config.num_layers:
            raise ValueError(f"{shape.name} feature layers {self.taps.layer_inputs} beyond the target's {target_config.num_layers} layers")

    def init_state(self, batch_size: int, max_len: int) -> FeatureDraftState:
        s, size = self.shape, self.backlog_size
        backlog = None if not size else Backlog(
            features=jnp.zeros((batch_size, size, self.taps.width(s.hidden_size)), self.dtype),
            tokens=jnp.zeros((batch_size, size), jnp.int32),
            count=jnp.zeros((batch_size,), jnp.int32),
            aligned=jnp.zeros((batch_size,), jnp.int32),
        )
        return FeatureDraftState(
            cache=kv.KVCache.init(1, batch_size, max_len, s.num_kv_heads, s.head_dim, self.dtype),
            hidden=jnp.zeros((batch_size, s.hidden_size), self.dtype),
            backlog=backlog,
        )

    def _in_target_vocab(self, params, probs: jax.Array) -> jax.Array:
        """[B, T, Vd] draft-vocabulary distributions -> [B, T, V] over the target's (0 off the draft vocabulary)."""
        if probs.shape[-1] == self.shape.target_vocab_size:
            return probs  # the draft vocabulary is the target's
        targets = self._to_target(params, jnp.arange(probs.shape[-1]))  # [Vd] target ids
        zeros = jnp.zeros(probs.shape[:-1] + (self.shape.target_vocab_size,), jnp.float32)
        return zeros.at[:, :, targets].set(probs)

    def _read_block(self, params, cache: kv.KVCache, features, next_tokens, count, start):
        """The head over a block of entries (target taps [B, W, F], the token after each [B, W]) at
        target positions start[b] + i, placed after each row's cache: (k, v [1, B, W, Hkv, Dh], the
        output [B, H] at entry count[b] - 1). Nothing is written."""
        width = features.shape[1]
        positions = start[:, None] + jnp.arange(width)[None, :]
        out = self._head(params, cache, next_tokens, self._project(params, features), positions, causal_mask(width))
        hidden = jnp.take_along_axis(out.hidden, jnp.maximum(count - 1, 0)[:, None, None], 1)[:, 0]
        return out.k, out.v, hidden

    def _commit_read(self, state: FeatureDraftState, k, v, hidden, count, start) -> FeatureDraftState:
        """Append the first `count[b]` entries of a read block (target positions from start [B]) to
        the head's cache; rows that read something keep the output at their last entry for the next
        draft (its logits are computed only when a step drafts)."""
        backlog = state.backlog
        if backlog is not None:  # entries stay aligned while each block starts where the cache ends
            lengths = state.cache.lengths
            in_place = (backlog.aligned == lengths) & (start == lengths)
            backlog = backlog.replace(aligned=jnp.where(in_place, lengths + count, backlog.aligned))
        return state.replace(
            cache=kv.append(state.cache, k, v, count), hidden=jnp.where((count > 0)[:, None], hidden, state.hidden),
            backlog=backlog,
        )

    def _read(self, params, state: FeatureDraftState, features, next_tokens, count) -> FeatureDraftState:
        """Read `count[b]` entries (target taps [B, W, F], the token after each [B, W]) into the head's cache."""
        start = state.cache.lengths
        k, v, hidden = self._read_block(params, state.cache, features, next_tokens, count, start)
        return self._commit_read(state, k, v, hidden, count, start)

    keeps_prefixes = True

    def reusable(self, held: FeatureDraftState) -> jax.Array:
        # Entry t sits in slot t until a dropped queue entry leaves a gap.
        return held.cache.lengths if held.backlog is None else held.backlog.aligned

    def keep_prefix(self, fresh: FeatureDraftState, held: FeatureDraftState, kept: jax.Array) -> FeatureDraftState:
        # The head's output is rewritten by the prefill, which reads at least the last prompt position.
        backlog = None if fresh.backlog is None else fresh.backlog.replace(aligned=kept)
        return fresh.replace(cache=held.cache.replace(lengths=kept), backlog=backlog)

    def prefill(self, params, state: FeatureDraftState, chunk: PrefillChunk) -> FeatureDraftState:
        # Entry t reads the token at t + 1; the prefill stops before the pending token, so it is known.
        rows = jnp.arange(chunk.tokens.shape[0])[:, None]
        next_tokens = chunk.history[rows, jnp.minimum(chunk.positions + 1, chunk.history.shape[1] - 1)]  # [B, C]
        return self._read(params, state, chunk.features, next_tokens, chunk.num_valid)

    def update(self, params, state: FeatureDraftState, ctx, proposal, commit: Commit, features) -> FeatureDraftState:
        # The accepted path's entries, with the target's true features; the last one reads the new pending token.
        path_features = jnp.take_along_axis(features, commit.path[:, :, None], 1)  # [B, D + 1, F]
        next_tokens = jnp.maximum(commit.emitted, 0)  # [B, D + 1]
        if state.backlog is None:
            return self._read(params, state, path_features, next_tokens, commit.num_committed)
        return self._queue(params, state, path_features, next_tokens, commit, ctx.lengths)

    def _queue(self, params, state: FeatureDraftState, path_features, next_tokens, commit: Commit, lengths) -> FeatureDraftState:
        """Queue the path's entries (at target positions from lengths [B], the target's length
        before this step) in the backlog's ring, keeping a row's newest W (an older entry's slot is
        overwritten: the head never reads it), and read the backlog when the next step drafts: in a
        block of the path's width when it holds no more than the path, else of the whole backlog's
        width, oldest entry first, at the entries' own target positions. The reads run in a
        `lax.switch` and the cache is written after it (a cache carried through a conditional is
        copied on XLA:CPU)."""
        backlog, path_width = state.backlog, path_features.shape[1]
        size = backlog.tokens.shape[1]
        rows = jnp.arange(backlog.count.shape[0])[:, None]
        offsets = jnp.arange(path_width)  # [D + 1]
        positions = lengths[:, None] + offsets  # [B, D + 1]
        slots = jnp.where(offsets < commit.num_committed[:, None], positions % size, size)  # uncommitted: dropped
        backlog = backlog.replace(
            features=backlog.features.at[rows, slots].set(path_features.astype(backlog.features.dtype), mode="drop"),
            tokens=backlog.tokens.at[rows, slots].set(next_tokens, mode="drop"),
            count=jnp.minimum(backlog.count + commit.num_committed, size),
        )
        start = lengths + commit.num_committed - backlog.count  # [B] target position of each row's oldest queued entry

        def read(width):
            def run():
                oldest_first = (start[:, None] + jnp.arange(width)) % size  # [B, width] slots
                k, v, hidden = self._read_block(
                    params, state.cache, backlog.features[rows, oldest_first], backlog.tokens[rows, oldest_first], backlog.count, start
                )
                grow = lambda x: jnp.pad(x, [(0, size - width if axis == 2 else 0) for axis in range(x.ndim)])
                return grow(k), grow(v), hidden
            return run

        read_all, shapes = trace_once(read(size))
        which = jnp.where(commit.drafts_next, jnp.where(jnp.max(backlog.count) <= path_width, 1, 2), 0)
        k, v, hidden = jax.lax.switch(which, [lambda: zeros_like(shapes), read(min(path_width, size)), read_all])
        count = jnp.where(commit.drafts_next, backlog.count, 0)
        state = self._commit_read(state.replace(backlog=backlog), k, v, hidden, count, start)
        return state.replace(backlog=state.backlog.replace(count=backlog.count - count))

    def propose(self, params, state: FeatureDraftState, key, ctx: StepContext, sampling):
        if self.depth == 0:  # an adaptive step that drafts nothing
            return state, Proposal(tree=chain(ctx.pending.shape[0], 0), tokens=ctx.pending[:, None])
        if self.top_k == 1:
            return state, self.sample_chain(params, state, key, ctx, sampling)
        return state, self.grow_tree(params, state, key, ctx, sampling)

    def sample_chain(self, params, state: FeatureDraftState, key, ctx: StepContext, sampling) -> Proposal:
        """A chain of `depth` drafts, each sampled from the head's distribution processed as the
        target's is (`sampling.probs`; greedy rows take the argmax), verified by the rejection rule.

        At temperature > 0 this accepts a draft with probability sum(min(p, q)) rather than q(top-1).
        """
        cache, hidden = state.cache, state.hidden  # [B, H]
        logits = self._logits(params, hidden)  # [B, Vd]
        batch, depth = ctx.pending.shape[0], self.depth
        keys = jax.vmap(lambda k: jax.random.split(k, depth))(key)  # [B, D]
        targets = self._to_target(params, jnp.arange(logits.shape[-1]))  # [Vd] target ids
        drafts, probs, fed_tokens, fed_hidden = [], [], [], []
        for level in range(depth):
            draft_ids, p = sampling_lib.pick(keys[:, level], logits, sampling)  # [B], [B, Vd]
            drafts.append(targets[draft_ids])
            probs.append(p)
            if level + 1 < depth:  # the head reads the chain so far; its last output drafts the next
                fed_tokens.append(drafts[-1])
                fed_hidden.append(hidden)
                fed = level + 1
                positions = ctx.lengths[:, None] + jnp.arange(fed)  # fed entry i sits at the pending token's position + i
                out = self._head(params, cache, jnp.stack(fed_tokens, 1), jnp.stack(fed_hidden, 1), positions, causal_mask(fed))
                hidden = out.hidden[:, -1]
                logits = self._logits(params, hidden)
        draft_probs = sampling_lib.unless_greedy(sampling, lambda: self._in_target_vocab(params, jnp.stack(probs, 1)))  # [B, D, V]
        tokens = jnp.concatenate([ctx.pending[:, None], jnp.stack(drafts, 1)], 1)  # [B, D + 1]
        return Proposal(tree=chain(batch, depth), tokens=tokens, draft_probs=draft_probs, rule="rejection")

    def grow_tree(self, params, state: FeatureDraftState, key, ctx: StepContext, sampling) -> Proposal:
        """The EAGLE-2 dynamic tree grown from the newest entry's output (module doc).

        Each expanded node's K children: for greedy rows its K most likely tokens, for sampled
        rows K tokens drawn one after another without replacement from the head's distribution
        processed as the target's (Gumbel top-k). Level by level the K pool nodes of best
        cumulative draft log-probability are expanded. Greedy rows keep the best T of the pool;
        sampled rows keep its first T entries (level by level, siblings in draw order), because
        keeping a node for its own drawn score would bias which tokens are tried. Verified by
        `verify.sampled_tree` (greedy rows: the argmax walk).
        """
        cache, hidden = state.cache, state.hidden  # [B, H]
        logits = self._logits(params, hidden)  # [B, Vd]
        batch, k = ctx.pending.shape[0], self.top_k
        keys = jax.vmap(lambda row_key: jax.random.split(row_key, self.depth))(key)  # [B, D]
        greedy = sampling.greedy[:, None, None]  # [B, 1, 1]

        def children(level_logits, level):
            """[B, F, Vd] logits at F expanded nodes -> their K children's ids and log-probs
            [B, F, K], and the distribution p [B, F, Vd] they were drawn from (an all-greedy
            batch skips drawing: zeros)."""
            log_p = jax.nn.log_softmax(level_logits, -1)

            def drawn():
                p = sampling_lib.probs(level_logits, sampling)  # [B, F, Vd]
                gumbel = jax.vmap(lambda row_key: jax.random.gumbel(row_key, level_logits.shape[1:]))(keys[:, level])
                return jax.lax.top_k(jnp.where(greedy, log_p, jnp.log(p) + gumbel), k)[1], p

            ranked = lambda: (jax.lax.top_k(log_p, k)[1], jnp.zeros_like(log_p))
            ids, p = jax.lax.cond(jnp.all(sampling.greedy), ranked, drawn)  # [B, F, K], [B, F, Vd]
            return ids, jnp.take_along_axis(log_p, ids, -1), p

        # Pool of candidates, level by level: draft ids, parent pool index (-1: root), score, depth,
        # and the distribution each was drawn from.
        ids, scores, p = children(logits[:, None], 0)
        pool_ids, pool_scores, pool_probs = [ids[:, 0]], [scores[:, 0]], [jnp.repeat(p, k, 1)]
        pool_parents = [jnp.full((batch, k), -1, jnp.int32)]
        pool_depths = [jnp.ones((batch, k), jnp.int32)]
        frontier = jnp.broadcast_to(jnp.arange(k), (batch, k))  # pool indices of the level's best K
        # Nodes fed to the head so far (frontiers of levels 1 ..): target ids, h inputs, parents.
        fed_tokens = jnp.zeros((batch, 0), jnp.int32)
        fed_hidden = jnp.zeros((batch, 0, hidden.shape[-1]), hidden.dtype)
        fed_parents = jnp.zeros((batch, 0), jnp.int32)  # index into fed nodes, -1: the last read entry
        fed_depths = jnp.zeros((batch, 0), jnp.int32)
        frontier_fed_parent = jnp.full((batch, k), -1, jnp.int32)  # fed index of each frontier node's parent
        frontier_hidden = jnp.broadcast_to(hidden[:, None], (batch, k, hidden.shape[-1]))
        for level in range(1, self.depth):
            all_ids = jnp.concatenate(pool_ids, 1)
            all_scores = jnp.concatenate(pool_scores, 1)
            frontier_ids = jnp.take_along_axis(all_ids, frontier, 1)  # [B, K]
            offset = fed_tokens.shape[1]
            fed_tokens = jnp.concatenate([fed_tokens, self._to_target(params, frontier_ids)], 1)
            fed_hidden = jnp.concatenate([fed_hidden, frontier_hidden], 1)
            fed_parents = jnp.concatenate([fed_parents, frontier_fed_parent], 1)
            fed_depths = jnp.concatenate([fed_depths, jnp.full((batch, k), level, jnp.int32)], 1)
            # Each fed node sees the committed prefix, its fed ancestors and itself.
            mask = fed_mask(fed_parents, level)
            positions = ctx.lengths[:, None] + fed_depths - 1
            out = self._head(params, cache, fed_tokens, fed_hidden, positions, mask)
            child_ids, child_scores, p = children(self._logits(params, out.hidden[:, offset:]), level)  # [B, K, K], [B, K, Vd]
            parent_scores = jnp.take_along_axis(all_scores, frontier, 1)  # [B, K]
            child_scores = (parent_scores[:, :, None] + child_scores).reshape(batch, k * k)
            pool_ids.append(child_ids.reshape(batch, k * k))
            pool_scores.append(child_scores)
            pool_probs.append(jnp.repeat(p, k, 1))
            pool_parents.append(jnp.repeat(frontier, k, axis=1))
            pool_depths.append(jnp.full((batch, k * k), level + 1, jnp.int32))
            # Next frontier: the K best children; their h input is their parent's head output.
            _, best = jax.lax.top_k(child_scores, k)  # [B, K] index among this level's children
            level_start = sum(level_ids.shape[1] for level_ids in pool_ids[:-1])
            frontier = level_start + best
            frontier_fed_parent = offset + best // k
            frontier_hidden = jnp.take_along_axis(out.hidden[:, offset:], (best // k)[:, :, None], 1)

        ids = jnp.concatenate(pool_ids, 1)  # [B, P]
        scores = jnp.concatenate(pool_scores, 1)
        parents = jnp.concatenate(pool_parents, 1)
        depths = jnp.concatenate(pool_depths, 1)
        pool_size = ids.shape[1]
        # Greedy rows: best T, ties to the earlier (parent-first) pool entry so the kept set stays
        # a tree; sampled rows: the first T. Either way in pool order (topological, siblings in order).
        tie_break = jnp.arange(pool_size, dtype=jnp.float32) * 1e-6
        _, best = jax.lax.top_k(scores - tie_break, self.tree_nodes)
        kept = jnp.where(sampling.greedy[:, None], jnp.sort(best, axis=1), jnp.arange(self.tree_nodes))  # [B, T]
        node_of_pool = jnp.zeros((batch, pool_size), jnp.int32).at[jnp.arange(batch)[:, None], kept].set(
            jnp.arange(1, self.tree_nodes + 1)
        )
        kept_parents = jnp.take_along_axis(parents, kept, 1)
        node_parents = jnp.where(kept_parents < 0, 0, jnp.take_along_axis(node_of_pool, jnp.maximum(kept_parents, 0), 1))
        tree = Tree(
            parents=jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), node_parents], 1),
            depths=jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.take_along_axis(depths, kept, 1)], 1),
            max_depth=self.depth,
        )
        tokens = self._to_target(params, jnp.take_along_axis(ids, kept, 1))
        kept_probs = lambda: jnp.take_along_axis(jnp.concatenate(pool_probs, 1), kept[:, :, None], 1)  # [B, T, Vd]
        draft_probs = sampling_lib.unless_greedy(sampling, lambda: self._in_target_vocab(params, kept_probs()))  # [B, T, V]
        return Proposal(
            tree=tree, tokens=jnp.concatenate([ctx.pending[:, None], tokens], 1), draft_probs=draft_probs, rule="rejection"
        )


def fed_mask(fed_parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, M] parent index among fed nodes (-1: the entry they hang from) -> [B, M, M] mask.

    The fed nodes form a tree below a virtual root; a node sees itself and its fed ancestors.
    """
    batch = fed_parents.shape[0]
    with_root = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), fed_parents + 1], axis=1)
    return ancestor_mask(with_root, max_depth)[:, 1:, 1:]


