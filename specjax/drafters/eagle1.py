"""EAGLE-1 drafting: a chain, an EAGLE-2 dynamic tree, or EAGLE-1's static tree, from the feature draft.

The draft layer (models/eagle1.py) reads the target's top-layer feature (after the final norm,
`Taps(final_hidden=True)`: no cost when no drafter asks for it) and predicts the next one; the
target's own LM head turns predicted features into logits over the full vocabulary. Drafting,
reading the committed path and the EAGLE-2 tree grower are shared with EAGLE-3
(drafters/feature_draft.py).

EAGLE-1's static tree (`eagle1-static:D,K,T`) is a fixed set of rank paths, like Medusa's
choices: node (r1, .., rd) is the rd-th most likely draft token below node (r1, .., rd-1). The
head runs once per level over every node of that level; the paths are the T most likely of depth
<= D and ranks < K (`drafters/medusa.tree_paths`) when the child of rank r is taken to be right
with probability STATIC_RANK_PRIOR * STATIC_RANK_DECAY ** r at any depth (a stated prior: unlike
Medusa's heads, one draft predicts every level).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoints.eagle1 import load_eagle1
from specjax.drafters.base import TREE, Method, Priors, Proposal, StepContext
from specjax.drafters.feature_draft import FeatureDraftState, FeatureDrafter, HeadShape, fed_mask
from specjax.drafters.medusa import tree_paths
from specjax.models import eagle1
from specjax.models.config import ModelConfig
from specjax.models.llama import Taps
from specjax.tree import from_paths

STATIC_RANK_PRIOR, STATIC_RANK_DECAY = 0.75, 0.2


def static_paths(depth: int, top_k: int, nodes: int) -> list[tuple[int, ...]]:
    """EAGLE-1's static tree: the `nodes` likeliest rank paths under the stated prior (module doc)."""
    rates = [STATIC_RANK_PRIOR * STATIC_RANK_DECAY**rank for rank in range(top_k)]
    return tree_paths(depth, top_k, nodes, [rates] * depth)


def default_draft_path() -> Path:
    """The shipped SmolLM2-135M-Instruct EAGLE-1 draft (package data of specjax.drafts)."""
    path = Path(importlib.resources.files("specjax.drafts")) / "smollm2-135m-eagle1"
    if not (path / "config.json").exists():
        raise ValueError(f"no default EAGLE-1 draft at {path}; pass --draft PATH")
    return path


class Eagle1Drafter(FeatureDrafter):
    """The EAGLE-1 draft layer over the target's embedding and (frozen) LM head.

    paths: EAGLE-1's static tree as rank paths (then depth/top_k/tree_nodes are unused); None
    drafts a chain (top_k 1) or an EAGLE-2 dynamic tree.
    """

    def __init__(
        self,
        config: eagle1.Eagle1Config,
        layer_params,
        target_config: ModelConfig,
        target_params,
        *,
        depth: int = 5,
        top_k: int = 1,
        tree_nodes: int | None = None,
        paths: list[tuple[int, ...]] | None = None,
        chunk_size: int = 256,
    ):
        c = config
        shape = HeadShape("EAGLE-1 draft", c.hidden_size, c.num_kv_heads, c.head_dim, c.vocab_size, c.vocab_size)
        super().__init__(shape, Taps(final_hidden=True), depth=depth, top_k=top_k, tree_nodes=tree_nodes, chunk_size=chunk_size)
        self.config, self.tied = config, target_config.tie_word_embeddings
        self.paths = None if paths is None else [tuple(p) for p in paths]
        if self.paths is not None:
            from_paths(1, self.paths)  # ValueError for a path before its parent
            self.depth, self.tree_nodes = max(map(len, self.paths)), len(self.paths)
        output = {} if self.tied else {"lm_head": target_params["lm_head"]}  # tied: the embedding is the head
        self.params = {"head": layer_params, "embed_tokens": target_params["embed_tokens"], **output}

    def params_with_head(self, layer_params: eagle1.Params):
        """This drafter's params pytree with other layer weights (e.g. a draft being trained)."""
        return {**self.params, "head": layer_params}

    @property
    def dtype(self):
        return self.params["head"]["fc"].dtype

    def at_depth(self, depth: int) -> Eagle1Drafter:
        if self.paths is not None:
            raise ValueError("a static EAGLE-1 tree has no adaptive depth; use a chain (eagle1:auto)")
        return super().at_depth(depth)

    def _head(self, params, cache, tokens, hidden, positions, block_mask) -> eagle1.Eagle1Output:
        embeddings = params["embed_tokens"][tokens]  # [B, T, H]
        return eagle1.forward(params["head"], self.config, embeddings, hidden, positions, cache, block_mask, chunk_size=self.chunk_size)

    def _logits(self, params, hidden):
        head = params["embed_tokens"].T if self.tied else params["lm_head"]  # [H, V]
        return jnp.einsum("...h,hv->...v", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)

    def _project(self, params, features):
        return features.astype(self.dtype)  # the draft reads the target's feature as it is

    def _to_target(self, params, draft_ids):
        return draft_ids  # the draft vocabulary is the target's

    def propose(self, params, state: FeatureDraftState, key, ctx: StepContext, sampling):
        if self.paths is None:
            return super().propose(params, state, key, ctx, sampling)
        return state, self.static_tree(params, state, ctx)

    def static_tree(self, params, state: FeatureDraftState, ctx: StepContext) -> Proposal:
        """EAGLE-1's static tree: each node's token is the draft's rank-r token below its parent.

        Level by level, every node of the level is fed to the head (seeing the committed prefix
        and its ancestors) and its children take their ranks of its distribution. Deterministic
        candidates: verified by the point-mass tree rule, exact at any temperature.
        """
        batch, paths = ctx.pending.shape[0], self.paths
        index = {path: i for i, path in enumerate(paths)}  # path -> node index - 1
        width = max(max(p) for p in paths) + 1
        tokens = jnp.zeros((batch, len(paths)), jnp.int32)
        ranked = jax.lax.top_k(self._logits(params, state.hidden), width)[1]  # [B, R] the root's children by rank
        level_paths = [p for p in paths if len(p) == 1]
        tokens = tokens.at[:, [index[p] for p in level_paths]].set(ranked[:, [p[0] for p in level_paths]])
        fed: list[tuple[int, ...]] = []  # nodes fed to the head so far, level by level
        fed_inputs = jnp.zeros((batch, 0, self.shape.hidden_size), self.dtype)  # [B, M, H] their feature inputs
        outputs = None  # [B, M, H] their head outputs
        for level in range(1, self.depth):
            parents = [p for p in paths if len(p) == level and any(q[:-1] == p for q in paths)]
            # A node's feature input is its parent's head output (the newest entry's at level 1).
            inputs = [state.hidden[:, None] if level == 1 else outputs[:, fed.index(p[:-1])][:, None] for p in parents]
            offset = len(fed)
            fed += parents
            fed_inputs = jnp.concatenate([fed_inputs] + inputs, 1)
            parent_of = np.asarray([-1 if len(p) == 1 else fed.index(p[:-1]) for p in fed], np.int32)
            mask = fed_mask(jnp.broadcast_to(parent_of, (batch, len(fed))), level)  # ancestors and self
            positions = ctx.lengths[:, None] + np.asarray([len(p) for p in fed], np.int32) - 1
            out = self._head(params, state.cache, tokens[:, [index[p] for p in fed]], fed_inputs, positions, mask)
            outputs = out.hidden
            ranked = jax.lax.top_k(self._logits(params, outputs[:, offset:]), width)[1]  # [B, P, R]
            children = [q for q in paths if len(q) == level + 1]
            rows = [parents.index(q[:-1]) for q in children]
            tokens = tokens.at[:, [index[q] for q in children]].set(ranked[:, rows, [q[-1] for q in children]])
        return Proposal(tree=from_paths(batch, paths), tokens=jnp.concatenate([ctx.pending[:, None], tokens], 1))


def _build(spec, context) -> Eagle1Drafter:
    config, layer_params = load_eagle1(
        context.draft_path or default_draft_path(), target_config=context.target_config, dtype=context.dtype
    )
    if spec.method == "eagle1-static":
        return Eagle1Drafter(config, layer_params, context.target_config, context.target_params, paths=static_paths(*spec.shape))
    depth, top_k, nodes = spec.shape or (spec.num_spec, 1, spec.num_spec)
    return Eagle1Drafter(
        config, layer_params, context.target_config, context.target_params, depth=depth, top_k=top_k, tree_nodes=nodes
    )


_DRAFT = "an EAGLE-1 draft directory in vLLM's layout (default: the shipped SmolLM2-135M-Instruct draft)"
_PRIORS = Priors(
    alpha={"chat": 0.6, "code": 0.7, "structured": 0.7, "long-form": 0.6, "creative": 0.5},
    temperature_decay=0.35,
    draft_cost=0.08,
)

METHOD = Method(
    "eagle1",
    "the EAGLE-1 feature draft: a chain, or an EAGLE-2 dynamic tree DEPTH,TOPK,NODES",
    build=_build,
    num_spec=3,
    shape=(TREE, None),
    draft=_DRAFT,
    priors=_PRIORS,
)

STATIC_METHOD = Method(
    "eagle1-static",
    "the EAGLE-1 feature draft proposing EAGLE-1's static tree DEPTH,TOPK,NODES (rank paths)",
    build=_build,
    shape=(TREE, (4, 3, 12)),
    draft=_DRAFT,
    adaptive=False,
)
