"""EAGLE-3 drafting: a chain, or an EAGLE-2 dynamic tree, from the trained draft head.

The head's cache entry at position t reads (target features f_t, the token at t + 1) and its
output predicts the token at t + 2, so the head holds one entry per committed target token.
After every verification (`update`) it reads the accepted path with the target's true features,
the last entry reading the new pending token; `propose` only drafts, and may be skipped.

Chain (top-k 1): each draft is sampled from the head's distribution, processed like the target's
(temperature, top-k, top-p; the argmax for greedy rows), and verified by the rejection rule.
EAGLE-2 tree (depth D, top-k K, T nodes): level 1 takes the K most likely tokens; each level
expands the K best nodes of the level above (by cumulative draft log-probability) into K
children each, so the candidate pool has K + (D - 1) K^2 nodes; the best T of the pool are
kept, in pool order (parents before children, siblings by score), and verified with the
point-mass tree rule.
"""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import struct

from specjax import kv_cache as kv
from specjax import sampling as sampling_lib
from specjax.checkpoints.eagle3 import load_eagle3
from specjax.drafters.base import TREE, Commit, Drafter, Method, PrefillChunk, Priors, Proposal, StepContext
from specjax.models import eagle3
from specjax.models.config import ModelConfig
from specjax.models.llama import Taps
from specjax.tree import Tree, ancestor_mask, causal_mask, chain, pool_size


def default_draft_path() -> Path:
    """The shipped SmolLM2-135M-Instruct EAGLE-3 draft (package data of specjax.drafts)."""
    path = Path(importlib.resources.files("specjax.drafts")) / "smollm2-135m-eagle3"
    if not (path / "config.json").exists():
        raise ValueError(f"no default EAGLE-3 draft at {path}; pass --draft PATH")
    return path


@struct.dataclass
class Eagle3State:
    cache: kv.KVCache  # the head's 1-layer cache: one entry per committed target token
    hidden: jax.Array  # [B, H] head output at the newest entry (it predicts the token after the pending one)
    logits: jax.Array  # [B, Vd] draft-vocabulary logits of that output


class Eagle3Drafter(Drafter):
    def __init__(
        self,
        head_config: eagle3.Eagle3Config,
        head_params,
        vocab: eagle3.DraftVocab,
        embed_tokens: jax.Array,
        *,
        depth: int = 5,
        top_k: int = 1,
        tree_nodes: int | None = None,
        feature_layers: tuple[int, ...],
        chunk_size: int = 256,
    ):
        tree_nodes = depth if tree_nodes is None else tree_nodes
        if min(depth, top_k, tree_nodes) < 1 or tree_nodes > pool_size(depth, top_k):
            raise ValueError(
                f"tree needs depth, top_k, nodes >= 1 and nodes <= pool size {pool_size(depth, top_k)}; "
                f"got {depth}, {top_k}, {tree_nodes}"
            )
        self.head_config = head_config
        self.depth, self.top_k, self.tree_nodes, self.chunk_size = depth, top_k, tree_nodes, chunk_size
        self.taps = Taps(layer_inputs=tuple(feature_layers))
        self.params = {"head": head_params, "d2t": vocab.d2t, "embed_tokens": embed_tokens}

    def at_depth(self, depth: int) -> Eagle3Drafter:
        if self.top_k != 1:
            raise ValueError("an EAGLE-2 tree has no adaptive depth; use a chain (eagle3:auto)")
        variant = copy.copy(self)
        variant.depth = variant.tree_nodes = depth
        return variant

    def params_with_head(self, head_params: eagle3.Params):
        """This drafter's params pytree with other head weights (e.g. a draft being trained)."""
        return {**self.params, "head": head_params}

    @property
    def num_nodes(self) -> int:
        return self.tree_nodes + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    def check_target(self, target_config: ModelConfig) -> None:
        head = self.head_config
        if head.target_vocab_size != target_config.vocab_size:
            raise ValueError(
                f"EAGLE-3 draft was trained for a vocabulary of {head.target_vocab_size} tokens, "
                f"the target has {target_config.vocab_size}"
            )
        if head.hidden_size != target_config.hidden_size:
            raise ValueError(
                f"EAGLE-3 draft hidden size {head.hidden_size} does not match the target's {target_config.hidden_size}"
            )
        if max(self.taps.layer_inputs) >= target_config.num_layers:
            raise ValueError(f"EAGLE-3 feature layers {self.taps.layer_inputs} beyond the target's {target_config.num_layers} layers")

    def init_state(self, batch_size: int, max_len: int) -> Eagle3State:
        c = self.head_config
        dtype = self.params["head"]["fc"].dtype
        return Eagle3State(
            cache=kv.KVCache.init(1, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype),
            hidden=jnp.zeros((batch_size, c.hidden_size), dtype),
            logits=jnp.zeros((batch_size, c.draft_vocab_size), jnp.float32),
        )

    def _head(self, params, cache, tokens, hidden, positions, block_mask):
        """One head forward over a block; tokens are target ids, hidden is h ([B, T, H])."""
        embeddings = params["embed_tokens"][tokens]  # [B, T, H]
        return eagle3.forward(
            params["head"], self.head_config, embeddings, hidden, positions, cache, block_mask, chunk_size=self.chunk_size
        )

    def _in_target_vocab(self, params, probs: jax.Array) -> jax.Array:
        """[B, T, Vd] draft-vocabulary distributions -> [B, T, V] over the target's (0 off the draft vocabulary)."""
        targets = eagle3.draft_to_target(jnp.arange(probs.shape[-1]), params["d2t"])  # [Vd] target ids
        zeros = jnp.zeros(probs.shape[:-1] + (self.head_config.target_vocab_size,), jnp.float32)
        return zeros.at[:, :, targets].set(probs)

    def _read(self, params, state: Eagle3State, features, next_tokens, count) -> Eagle3State:
        """Append `count[b]` entries (features [B, W, F], the token after each [B, W]) to the head's cache.

        Rows that read something keep the head output at their last entry for the next draft.
        """
        width = features.shape[1]
        cache = state.cache
        positions = cache.lengths[:, None] + jnp.arange(width)[None, :]
        hidden = eagle3.project_features(params["head"], features.astype(params["head"]["fc"].dtype))
        out = self._head(params, cache, next_tokens, hidden, positions, causal_mask(width))
        last = jnp.maximum(count - 1, 0)[:, None, None]
        read = (count > 0)[:, None]
        return Eagle3State(
            cache=kv.append(cache, out.k, out.v, count),
            hidden=jnp.where(read, jnp.take_along_axis(out.hidden, last, 1)[:, 0], state.hidden),
            logits=jnp.where(read, jnp.take_along_axis(out.logits, last, 1)[:, 0], state.logits),
        )

    def prefill(self, params, state: Eagle3State, chunk: PrefillChunk) -> Eagle3State:
        # Entry t reads the token at t + 1; the prefill stops before the pending token, so it is known.
        rows = jnp.arange(chunk.tokens.shape[0])[:, None]
        next_tokens = chunk.history[rows, jnp.minimum(chunk.positions + 1, chunk.history.shape[1] - 1)]  # [B, C]
        return self._read(params, state, chunk.features, next_tokens, chunk.num_valid)

    def update(self, params, state: Eagle3State, ctx, proposal, commit: Commit, features) -> Eagle3State:
        # The accepted path's entries, with the target's true features; the last one reads the new pending token.
        path_features = jnp.take_along_axis(features, commit.path[:, :, None], 1)  # [B, D + 1, F]
        return self._read(params, state, path_features, jnp.maximum(commit.emitted, 0), commit.num_committed)

    def propose(self, params, state: Eagle3State, key, ctx: StepContext, sampling):
        if self.depth == 0:  # an adaptive step that drafts nothing
            return state, Proposal(tree=chain(ctx.pending.shape[0], 0), tokens=ctx.pending[:, None])
        if self.top_k == 1:
            return state, self.sample_chain(params, state, key, ctx, sampling)
        return state, self.grow_tree(params, state, key, ctx, sampling)

    def sample_chain(self, params, state: Eagle3State, key, ctx: StepContext, sampling) -> Proposal:
        """A chain of `depth` drafts, each sampled from the head's distribution processed as the
        target's is (`sampling.probs`; greedy rows take the argmax), verified by the rejection rule.

        At temperature > 0 this accepts a draft with probability sum(min(p, q)) rather than q(top-1).
        """
        cache, hidden, logits = state.cache, state.hidden, state.logits  # [B, H], [B, Vd]
        batch, depth = ctx.pending.shape[0], self.depth
        keys = jax.vmap(lambda k: jax.random.split(k, depth))(key)  # [B, D]
        targets = eagle3.draft_to_target(jnp.arange(logits.shape[-1]), params["d2t"])  # [Vd] target ids
        drafts, probs, fed_tokens, fed_hidden = [], [], [], []
        for level in range(depth):
            p = sampling_lib.probs(logits, sampling)  # [B, Vd]
            drafts.append(targets[sampling_lib.sample(keys[:, level], p)])  # [B]
            probs.append(p)
            if level + 1 < depth:  # the head reads the chain so far; its last output drafts the next
                fed_tokens.append(drafts[-1])
                fed_hidden.append(hidden)
                fed = level + 1
                positions = cache.lengths[:, None] + jnp.arange(fed)
                out = self._head(params, cache, jnp.stack(fed_tokens, 1), jnp.stack(fed_hidden, 1), positions, causal_mask(fed))
                logits, hidden = out.logits[:, -1], out.hidden[:, -1]
        draft_probs = self._in_target_vocab(params, jnp.stack(probs, 1))  # [B, D, V]
        tokens = jnp.concatenate([ctx.pending[:, None], jnp.stack(drafts, 1)], 1)  # [B, D + 1]
        return Proposal(tree=chain(batch, depth), tokens=tokens, draft_probs=draft_probs, rule="rejection")

    def grow_tree(self, params, state: Eagle3State, key, ctx: StepContext, sampling) -> Proposal:
        """The EAGLE-2 dynamic tree grown from the newest entry's output (module doc).

        Each expanded node's K children: for greedy rows its K most likely tokens, for sampled
        rows K tokens drawn one after another without replacement from the head's distribution
        processed as the target's (Gumbel top-k). Level by level the K pool nodes of best
        cumulative draft log-probability are expanded. Greedy rows keep the best T of the pool;
        sampled rows keep its first T entries (level by level, siblings in draw order), because
        keeping a node for its own drawn score would bias which tokens are tried. Verified by
        `verify.sampled_tree` (greedy rows: the argmax walk).
        """
        cache, hidden, logits = state.cache, state.hidden, state.logits  # [B, H], [B, Vd]
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
        d2t = params["d2t"]
        for level in range(1, self.depth):
            all_ids = jnp.concatenate(pool_ids, 1)
            all_scores = jnp.concatenate(pool_scores, 1)
            frontier_ids = jnp.take_along_axis(all_ids, frontier, 1)  # [B, K]
            offset = fed_tokens.shape[1]
            fed_tokens = jnp.concatenate([fed_tokens, eagle3.draft_to_target(frontier_ids, d2t)], 1)
            fed_hidden = jnp.concatenate([fed_hidden, frontier_hidden], 1)
            fed_parents = jnp.concatenate([fed_parents, frontier_fed_parent], 1)
            fed_depths = jnp.concatenate([fed_depths, jnp.full((batch, k), level, jnp.int32)], 1)
            # Each fed node sees the committed prefix, its fed ancestors and itself.
            mask = _fed_mask(fed_parents, level)
            positions = cache.lengths[:, None] + fed_depths - 1
            out = self._head(params, cache, fed_tokens, fed_hidden, positions, mask)
            child_ids, child_scores, p = children(out.logits[:, offset:], level)  # [B, K, K], [B, K, Vd]
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
        tokens = eagle3.draft_to_target(jnp.take_along_axis(ids, kept, 1), d2t)
        kept_probs = lambda: jnp.take_along_axis(jnp.concatenate(pool_probs, 1), kept[:, :, None], 1)  # [B, T, Vd]
        draft_probs = jax.lax.cond(  # [B, T, V] what each kept node was drawn from; greedy rows never read it
            jnp.all(sampling.greedy),
            lambda: jnp.zeros((batch, self.tree_nodes, self.head_config.target_vocab_size), jnp.float32),
            lambda: self._in_target_vocab(params, kept_probs()),
        )
        return Proposal(
            tree=tree, tokens=jnp.concatenate([ctx.pending[:, None], tokens], 1), draft_probs=draft_probs, rule="rejection"
        )


def _fed_mask(fed_parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, M] parent index among fed nodes (-1: the entry they hang from) -> [B, M, M] mask.

    The fed nodes form a tree below a virtual root; a node sees itself and its fed ancestors.
    """
    batch = fed_parents.shape[0]
    with_root = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), fed_parents + 1], axis=1)
    return ancestor_mask(with_root, max_depth)[:, 1:, 1:]


def _build(spec, context) -> Eagle3Drafter:
    head_config, head_params, vocab = load_eagle3(
        context.draft_path or default_draft_path(), target_vocab_size=context.target_config.vocab_size, dtype=context.dtype
    )
    embed_tokens = head_params.pop("embed_tokens", context.target_params["embed_tokens"])  # the draft's own, as vLLM
    depth, top_k, nodes = spec.shape or (spec.num_spec, 1, spec.num_spec)
    return Eagle3Drafter(
        head_config, head_params, vocab, embed_tokens, depth=depth, top_k=top_k,
        tree_nodes=nodes, feature_layers=head_config.target_taps(context.target_config.num_layers),
    )


METHOD = Method(
    "eagle3",
    "the EAGLE-3 draft head: a chain, or an EAGLE-2 dynamic tree DEPTH,TOPK,NODES",
    build=_build,
    num_spec=3,
    shape=(TREE, None),
    draft="an EAGLE-3 draft directory (default: the shipped SmolLM2-135M-Instruct draft)",
    priors=Priors(
        alpha={"chat": 0.7, "code": 0.75, "structured": 0.75, "long-form": 0.65, "creative": 0.55},
        temperature_decay=0.35,
        draft_cost=0.05,
    ),
)
