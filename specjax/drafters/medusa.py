"""Medusa-1 drafting: K heads on the target's last hidden state propose a static tree of top-k tokens.

The state is the target's final-normed hidden state at the last committed position, the one
whose LM head sampled the pending token (`update` reads it at the accepted path's end; `prefill`
at the prompt's). Head k's top-ranked tokens fill depth k + 1. The tree is Medusa's "choices":
fixed paths of ranks, e.g. (0, 1) = head 0's best token, then head 1's second best. The drafts
are deterministic candidates, verified by the point-mass tree rule, which is exact at any
temperature; Medusa's "typical acceptance" is not offered, because it changes the output
distribution (docs/architecture.md).

`medusa:N` drafts the chain (0,), (0, 0), ... of N heads' top-1 tokens; `medusa:D,K,T` keeps the
T most likely paths of depth <= D and ranks < K, scored by the product of the heads' held-out
top-k accuracy the draft records (`specjax_topk_accuracy`), or by a stated prior without it.
"""

from __future__ import annotations

import copy
import importlib.resources
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.checkpoints.medusa import load_medusa
from specjax.drafters.base import TREE, Commit, Drafter, Method, PrefillChunk, Priors, Proposal, StepContext
from specjax.models import medusa
from specjax.models.config import ModelConfig
from specjax.models.llama import Taps
from specjax.tree import from_paths

#: Without measured accuracies, rank r of head k is taken to hold the target's token with
#: probability PRIOR_HEAD ** (k + 1) * PRIOR_RANK ** r.
PRIOR_HEAD, PRIOR_RANK = 0.6, 0.4


def default_draft_path() -> Path:
    """The shipped SmolLM2-135M-Instruct Medusa heads (package data of specjax.drafts)."""
    path = Path(importlib.resources.files("specjax.drafts")) / "smollm2-135m-medusa"
    if not (path / "config.json").exists():
        raise ValueError(f"no default Medusa draft at {path}; pass --draft PATH")
    return path


def chain_paths(depth: int) -> list[tuple[int, ...]]:
    """The chain of every head's top-1 token, `depth` heads deep."""
    return [(0,) * d for d in range(1, depth + 1)]


def tree_paths(depth: int, top_k: int, nodes: int, accuracy: list[list[float]] | None = None) -> list[tuple[int, ...]]:
    """The `nodes` most likely paths of depth <= `depth` and ranks < `top_k`, parents first.

    accuracy[k][r]: how often rank r of head k is the target's token (held out); missing ranks or
    heads fall back to the prior. A path's score is the product over its depths, so a parent
    never scores below its child and the kept set is a tree.
    """
    def rate(head: int, rank: int) -> float:
        if accuracy is not None and head < len(accuracy) and rank < len(accuracy[head]):
            return max(float(accuracy[head][rank]), 1e-9)
        return PRIOR_HEAD ** (head + 1) * PRIOR_RANK**rank

    candidates = [path for d in range(1, depth + 1) for path in itertools.product(range(top_k), repeat=d)]
    if nodes > len(candidates):
        raise ValueError(f"a Medusa tree of depth {depth} and top-k {top_k} has {len(candidates)} paths, fewer than {nodes}")
    score = lambda path: float(np.prod([rate(head, rank) for head, rank in enumerate(path)]))
    kept = sorted(candidates, key=lambda path: (-score(path), len(path), path))[:nodes]
    return sorted(kept, key=lambda path: (len(path), path))


@struct.dataclass
class MedusaState:
    hidden: jax.Array  # [B, H] the target's final hidden state whose LM head sampled the pending token


class MedusaDrafter(Drafter):
    """Medusa heads proposing a static tree (`paths`) of their top-ranked tokens."""

    taps = Taps(final_hidden=True)

    def __init__(self, config: medusa.MedusaConfig, head_params, token_map: jax.Array, paths: list[tuple[int, ...]]):
        self.config, self.paths = config, [tuple(p) for p in paths]
        if self.paths:
            from_paths(1, self.paths)  # ValueError for a path before its parent
            if max(map(len, self.paths)) > config.num_heads:
                raise ValueError(f"a path of depth {max(map(len, self.paths))} needs more than the draft's {config.num_heads} heads")
        self.params = {**head_params, "token_map": token_map}  # {"heads": [...], "token_map" [Vt]}

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(map(len, self.paths), default=0)

    def at_depth(self, depth: int) -> MedusaDrafter:
        if self.paths != chain_paths(self.max_depth):
            raise ValueError("a Medusa tree has no adaptive depth; use a chain (medusa:auto)")
        variant = copy.copy(self)
        variant.paths = chain_paths(depth)
        return variant

    def check_target(self, target_config: ModelConfig) -> None:
        if self.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"Medusa heads were trained for a vocabulary of {self.config.vocab_size} tokens, the target has {target_config.vocab_size}"
            )
        if self.config.hidden_size != target_config.hidden_size:
            raise ValueError(f"Medusa hidden size {self.config.hidden_size} does not match the target's {target_config.hidden_size}")

    def init_state(self, batch_size: int, max_len: int) -> MedusaState:
        return MedusaState(hidden=jnp.zeros((batch_size, self.config.hidden_size), self.params["heads"][0]["lm_head"].dtype))

    def _keep_last(self, state: MedusaState, features: jax.Array, index: jax.Array, has: jax.Array) -> MedusaState:
        """hidden[b] = features[b, index[b]] where has[b] (features [B, W, H], index and has [B])."""
        last = jnp.take_along_axis(features, index[:, None, None], 1)[:, 0].astype(state.hidden.dtype)
        return MedusaState(hidden=jnp.where(has[:, None], last, state.hidden))

    keeps_prefixes = True  # the prefill rewrites `hidden` at the last prompt position (`Drafter.keep_prefix`)

    def prefill(self, params, state: MedusaState, chunk: PrefillChunk) -> MedusaState:
        return self._keep_last(state, chunk.features, jnp.maximum(chunk.num_valid - 1, 0), chunk.num_valid > 0)

    def propose(self, params, state: MedusaState, key, ctx: StepContext, sampling) -> tuple[MedusaState, Proposal]:
        batch = ctx.pending.shape[0]
        tree = from_paths(batch, self.paths)
        if not self.paths:
            return state, Proposal(tree=tree, tokens=ctx.pending[:, None])
        depth, width = self.max_depth, max(max(p) for p in self.paths) + 1
        logits = medusa.forward(params, state.hidden, num_heads=depth)  # [B, D, Vt]
        _, ranked = jax.lax.top_k(logits, width)  # [B, D, R] truncated-vocabulary ids by rank
        heads = np.asarray([len(p) - 1 for p in self.paths])  # static: each node's head and rank
        ranks = np.asarray([p[-1] for p in self.paths])
        tokens = params["token_map"][ranked[:, heads, ranks]]  # [B, N - 1] target ids
        return state, Proposal(tree=tree, tokens=jnp.concatenate([ctx.pending[:, None], tokens], 1))

    def update(self, params, state: MedusaState, ctx, proposal, commit: Commit, features) -> MedusaState:
        last_node = jnp.take_along_axis(commit.path, commit.accepted[:, None], 1)[:, 0]  # [B]
        return self._keep_last(state, features, last_node, commit.num_committed > 0)


def _build(spec, context) -> MedusaDrafter:
    config, params, token_map, accuracy = load_medusa(
        context.draft_path or default_draft_path(), target_vocab_size=context.target_config.vocab_size, dtype=context.dtype
    )
    paths = tree_paths(*spec.shape, accuracy) if spec.shape else chain_paths(spec.num_spec)
    return MedusaDrafter(config, params, token_map, paths)


METHOD = Method(
    "medusa",
    "Medusa-1 heads on the target's last hidden state: a chain of top-1 tokens, or a static tree DEPTH,TOPK,NODES",
    build=_build,
    num_spec=3,
    shape=(TREE, None),
    draft="a Medusa draft directory in vLLM's layout (default: the shipped SmolLM2-135M-Instruct heads)",
    priors=Priors(
        alpha={"chat": 0.5, "code": 0.6, "structured": 0.6, "long-form": 0.5, "creative": 0.4},
        temperature_decay=0.35,
        draft_cost=0.02,
    ),
)
