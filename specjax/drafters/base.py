"""The one interface every proposal strategy implements.

The engine owns the target model, its KV cache and the token history; a drafter owns only its
own state (a pytree: its KV cache, features it still has to read, ...). All methods are pure
and are traced inside the engine's jitted prefill and decode loop, so static sizes (number of
tree nodes, depth) are Python attributes of the drafter and never depend on data.

Per decode step the engine calls `propose`, runs the target over the proposed tree, verifies,
commits, and then calls `update` with what was accepted.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
from flax import struct

from specjax.sampling import SamplingParams
from specjax.tree import Tree

DrafterState = Any  # a pytree


@struct.dataclass
class Proposal:
    """A draft tree below the pending token.

    tree:        topology with N = num_nodes nodes; node 0 is the pending token.
    tokens:      [B, N] target-vocabulary ids; tokens[:, 0] is the pending token.
    draft_probs: [B, N - 1, V] the distributions the drafted chain tokens were sampled from
                 (Leviathan rule), or None for deterministic candidates (tree point-mass rule).
    """

    tree: Tree
    tokens: jax.Array
    draft_probs: jax.Array | None = None


@struct.dataclass
class StepContext:
    """What the engine knows about each row when it asks for a draft or reports a verdict.

    pending: [B] the last sampled token, not yet in the target cache.
    lengths: [B] committed tokens in the target cache (the pending token sits at this position).
    history: [B, S] all tokens so far: history[b, :lengths[b]] committed, history[b, lengths[b]] pending.
    active:  [B] bool, rows still generating.
    """

    pending: jax.Array
    lengths: jax.Array
    history: jax.Array
    active: jax.Array


@struct.dataclass
class PrefillChunk:
    """One fixed-size chunk of the prompt, as the target just processed it.

    tokens:    [B, C] prompt tokens of this chunk (padding past each row's prompt).
    next_tokens: [B, C] the prompt token after each position (padding where unknown).
    positions: [B, C] absolute positions.
    start:     [B] committed tokens before this chunk.
    num_valid: [B] prompt tokens of the row inside this chunk (0 .. C).
    prompt_lengths: [B] total prompt length per row.
    features:  [B, C, F] target hidden states for drafters that read them, else None.
    """

    tokens: jax.Array
    next_tokens: jax.Array
    positions: jax.Array
    start: jax.Array
    num_valid: jax.Array
    prompt_lengths: jax.Array
    features: jax.Array | None = None


class Drafter(abc.ABC):
    """A proposal strategy: a plain Python object holding static config and a `params` pytree.

    The engine passes `params` back into every method as a jit argument (never a closure, so
    weights are not baked into the compiled program as constants).
    """

    params: Any = ()

    #: Target layers whose input hidden states the drafter reads (EAGLE-3); empty otherwise.
    feature_layers: tuple[int, ...] = ()

    @property
    @abc.abstractmethod
    def num_nodes(self) -> int:
        """N: nodes of every proposed tree, the root included."""

    @property
    @abc.abstractmethod
    def max_depth(self) -> int:
        """Depth of the deepest proposed node (drafted tokens on the longest path)."""

    def check_target(self, target_config) -> None:
        """Raise ValueError if the drafter cannot serve this target (e.g. vocabulary mismatch)."""

    @abc.abstractmethod
    def init_state(self, batch_size: int, max_len: int) -> DrafterState:
        """Fresh state for a batch whose target cache has max_len slots."""

    def prefill(self, params, state: DrafterState, chunk: PrefillChunk) -> DrafterState:
        """Read one chunk of the prompt. Default: nothing to read."""
        return state

    @abc.abstractmethod
    def propose(
        self, params, state: DrafterState, key: jax.Array, ctx: StepContext, sampling: SamplingParams
    ) -> tuple[DrafterState, Proposal]:
        """Draft a tree below ctx.pending."""

    def update(
        self,
        params,
        state: DrafterState,
        ctx: StepContext,
        proposal: Proposal,
        verdict: Any,
        features: jax.Array | None,
    ) -> DrafterState:
        """Learn what was accepted. ctx is the context *before* the commit; features [B, N, F]
        are the target's features at the proposed nodes (None unless feature_layers).
        Default: nothing to learn."""
        return state


class ChainDrafter(Drafter):
    """A drafter proposing a chain of `num_draft` tokens: N = num_draft + 1 nodes."""

    def __init__(self, num_draft: int):
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.num_draft = num_draft

    @property
    def num_nodes(self) -> int:
        return self.num_draft + 1

    @property
    def max_depth(self) -> int:
        return self.num_draft
