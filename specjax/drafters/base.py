"""The one interface every proposal strategy implements (docs/architecture.md, "The decode step").

The engine owns the target model, its KV cache and the token history; a drafter owns only its
own state (a pytree: its KV cache, head outputs, ...). All methods are pure and are traced
inside the engine's jitted prefill and decode loop, so static sizes (number of tree nodes,
depth) are Python attributes of the drafter and never depend on data.

Per decode step the engine calls `propose`, runs the target over the proposed tree, verifies
by the proposal's rule, commits, and then calls `update` with the `Commit` it computed.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.llama import Taps
from specjax.sampling import SamplingParams
from specjax.tree import Tree

DrafterState = Any  # a pytree

#: How a proposal is verified: "point_mass" (deterministic candidates, `verify.tree`) or
#: "rejection" (drafts sampled from `draft_probs`, siblings without replacement: `verify.chain`
#: for a chain, else `verify.sampled_tree`).
Rule = Literal["point_mass", "rejection"]

#: The shape of an EAGLE-2 dynamic tree (`Method.shape`): depth, children per expanded node, nodes kept.
TREE = "DEPTH,TOPK,NODES"


@struct.dataclass
class Proposal:
    """A draft tree below the pending token.

    tree:        topology with N = num_nodes nodes; node 0 is the pending token.
    tokens:      [B, N] target-vocabulary ids; tokens[:, 0] is the pending token.
    draft_probs: [B, N - 1, V] the distribution node i + 1 was sampled from (its parent's; rule
                 "rejection" only; zeros in an all-greedy batch, where no rule reads them).
    rule:        static; which verification rule is exact for these drafts.
    aux_tokens:  [B, A] auxiliary nodes run in the same forward, never verified or committed
                 (Lookahead's Jacobi window); their logits go to `update` as aux_logits.
    aux_offsets: [B, A] their positions relative to the pending token's.
    aux_mask:    [B, A, N + A] which tree nodes and auxiliary nodes each one attends to (beside
                 the committed prefix); tree nodes never see auxiliary ones.
    """

    tree: Tree
    tokens: jax.Array
    draft_probs: jax.Array | None = None
    rule: Rule = struct.field(pytree_node=False, default="point_mass")
    aux_tokens: jax.Array | None = None
    aux_offsets: jax.Array | None = None
    aux_mask: jax.Array | None = None


@struct.dataclass
class Commit:
    """What one decode step committed, per row; the engine computes it once, drafters read it.

    accepted:      [B] drafted tokens accepted (0 for rows that were not active).
    num_committed: [B] target cache entries committed: the old pending token and the accepted
                   drafts (accepted + 1), 0 for rows that were not active.
    path:          [B, D + 1] accepted node indices from the root; past `accepted` the last
                   accepted node repeats.
    next_token:    [B] the new pending token (residual or bonus sample).
    emitted:       [B, D + 1] tokens emitted in order: the accepted drafts, then next_token;
                   -1 past the end and for rows that were not active.
    drafts_next:   [] bool, whether the next step drafts. False only before an adaptive step at
                   depth 0, which proposes the pending token alone without reading the drafter's
                   state: `update` may then postpone its work (`Drafter.postponing`).
    """

    accepted: jax.Array
    num_committed: jax.Array
    path: jax.Array
    next_token: jax.Array
    emitted: jax.Array
    drafts_next: jax.Array


@struct.dataclass
class StepContext:
    """What the engine knows about each row when it asks for a draft or reports a commit.

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
    """One fixed-size chunk of the prompts, as the target just processed it.

    The prefill commits every prompt token but the last, which becomes the pending token, so
    the token after each prefilled position is known: history[b, positions[b, t] + 1].
    tokens:    [B, C] prompt tokens of this chunk (padding past each row's prefill).
    positions: [B, C] absolute positions.
    num_valid: [B] tokens of the row inside this chunk (0 .. C); rows with 0 are untouched.
    history:   [B, S] every row's tokens (the whole prompt of the rows being prefilled).
    features:  [B, C, F] the target taps the drafter asked for, else None.
    """

    tokens: jax.Array
    positions: jax.Array
    num_valid: jax.Array
    history: jax.Array
    features: jax.Array | None = None


def trace_once(fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
    """(replay, shapes): `fn` traced once, `replay()` emitting its computation again from that
    trace (without running `fn`'s Python), `shapes` its result's ShapeDtypeStructs. For code that
    needs a function's result shapes before placing it in a conditional: tracing it again for
    them doubled the Python of a decode step's compilation (SmolLM2's EAGLE-1 step: a 2.7 s trace,
    where replaying it takes 0.6 s). The program XLA compiles is the same."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)()
    treedef = jax.tree.structure(shapes)
    return lambda: jax.tree.unflatten(treedef, jax.core.eval_jaxpr(closed.jaxpr, closed.consts)), shapes


def zeros_like(shapes: Any) -> Any:
    """Zeros for a pytree of ShapeDtypeStructs: the other branch of a conditional whose outputs
    must match a traced function's."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def run_or_zeros(pred: jax.Array, fn: Callable[[], Any]) -> Any:
    """`fn()` where `pred` holds, else zeros shaped like its result; `fn` traced once."""
    replay, shapes = trace_once(fn)
    return jax.lax.cond(pred, replay, lambda: zeros_like(shapes))


class Drafter(abc.ABC):
    """A proposal strategy: a plain Python object holding static config and a `params` pytree.

    The engine passes `params` back into every method as a jit argument (never a closure, so
    weights are not baked into the compiled program as constants).
    """

    params: Any = ()

    #: What the drafter reads of the target's forward (features in prefill and update).
    taps: Taps = Taps()

    #: A: auxiliary nodes per proposal (run in the forward, never verified), e.g. Lookahead's window.
    num_aux: int = 0

    #: True when `propose` writes state that `update` relies on; a combinator may skip a
    #: `propose` call only when this is False (then `update` alone keeps the state right).
    propose_changes_state: bool = False

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

    def init_state(self, batch_size: int, max_len: int) -> DrafterState:
        """Fresh state for a batch whose target cache has max_len slots. Default: stateless.

        Every leaf is per row, with the batch on one axis: `Engine.admit` prefills new rows as a
        batch of their own and copies them into their slots along it."""
        return ()

    def prefill(self, params, state: DrafterState, chunk: PrefillChunk) -> DrafterState:
        """Read one chunk of the prompts. Default: nothing to read."""
        return state

    #: Whether a row's state can keep a cached prompt prefix (`keep_prefix`); a drafter without
    #: state always can. `Engine.admit(reuse_prefix=True)` refuses the others.
    keeps_prefixes: bool = False

    def reusable(self, held: DrafterState) -> jax.Array | None:
        """[R] how many leading target positions the state of R rows (`held`) holds exactly, as a
        fresh prefill of those positions would have left it; None: no limit. Default: None."""
        return None

    def keep_prefix(self, fresh: DrafterState, held: DrafterState, kept: jax.Array) -> DrafterState:
        """The state of R new rows whose target caches keep the first kept [R] entries of rows whose
        state was `held` (those R rows); `fresh` is the new rows' initial state. The engine keeps no
        more than `reusable(held)` entries, and at least the last prompt position is prefilled
        after this, so state of the newest position (a head's output) is rewritten there.
        Default: `fresh` (a drafter whose prefill reads nothing)."""
        return fresh

    @abc.abstractmethod
    def propose(
        self, params, state: DrafterState, key: jax.Array, ctx: StepContext, sampling: SamplingParams
    ) -> tuple[DrafterState, Proposal]:
        """Draft a tree below ctx.pending; key holds [B] per-row keys (a row samples with its own)."""

    def update(
        self,
        params,
        state: DrafterState,
        ctx: StepContext,
        proposal: Proposal,
        commit: Commit,
        features: jax.Array | None,
    ) -> DrafterState:
        """Learn what was committed. ctx is the context *before* the commit; features [B, N, F]
        are the target's taps at the proposed nodes (None without taps). A drafter that proposes
        auxiliary nodes also receives their logits as the keyword `aux_logits` [B, A, V].
        Default: nothing."""
        return state

    #: For an adaptive drafter (`drafters.adaptive`): its variants at depth 0 .. D, one per step size.
    variants: tuple[Drafter, ...] | None = None

    def at_depth(self, depth: int) -> Drafter:
        """This drafter proposing a chain of `depth` drafts (0: the pending token alone) with the
        same params and state layout, for `NAME:auto`. Default: not possible."""
        raise ValueError(f"{type(self).__name__} cannot change its draft length per step (no :auto)")

    #: Classes of `first_guess`: 0 is "no guess", 1 .. guess_classes - 1 say how the guess was
    #: found (an n-gram match's length). An adaptive engine keeps acceptance statistics per class.
    #: 1: the drafter never guesses.
    guess_classes: int = 1

    #: False where the drafter has nothing worth verifying without a guess (n-gram lookup without a
    #: match proposes the last token repeated): an adaptive engine never drafts for such a row.
    drafts_without_guess: bool = True

    def first_guess(self, ctx: StepContext) -> tuple[jax.Array, jax.Array]:
        """The first token this drafter would propose below ctx.pending, found without running a
        model: ([B] token, [B] int32 class, 0 where the row has no guess). Default: no guess.
        An adaptive engine checks a depth-0 step's guess against the token it samples, so a row's
        acceptance estimate keeps learning while the row does not draft, and prices the next
        step with the statistics of its guess's class."""
        return jnp.zeros_like(ctx.pending), jnp.zeros_like(ctx.pending)

    def postponing(self, steps: int) -> Drafter:
        """This drafter, allowed to leave what was committed unread while no step drafts
        (`Commit.drafts_next` False), and to read only the newest `steps` of those entries, in one
        block, before it drafts again. Default: itself (its update has nothing worth postponing)."""
        return self

    def with_matmuls(self, mode: str) -> Drafter:
        """This drafter with its own weight matmuls in the engine's `block_matmul` mode (its params
        may change with it: read `params` again). Default: itself (XLA serves its matmuls as well)."""
        return self


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

    def at_depth(self, depth: int) -> ChainDrafter:
        variant = copy.copy(self)
        variant.num_draft = depth
        return variant


class Wrapper(Drafter):
    """A drafter built around another (`inner`), changing only how it proposes: sizes, state,
    prefill and update are the inner drafter's."""

    def __init__(self, inner: Drafter):
        self.inner, self.params, self.taps = inner, inner.params, inner.taps
        self.propose_changes_state = inner.propose_changes_state

    @property
    def num_nodes(self) -> int:
        return self.inner.num_nodes

    @property
    def max_depth(self) -> int:
        return self.inner.max_depth

    def check_target(self, target_config) -> None:
        self.inner.check_target(target_config)

    def init_state(self, batch_size: int, max_len: int) -> DrafterState:
        return self.inner.init_state(batch_size, max_len)

    def prefill(self, params, state, chunk):
        return self.inner.prefill(params, state, chunk)

    @property
    def keeps_prefixes(self) -> bool:
        return self.inner.keeps_prefixes

    def reusable(self, held):
        return self.inner.reusable(held)

    def keep_prefix(self, fresh, held, kept):
        return self.inner.keep_prefix(fresh, held, kept)

    def update(self, params, state, ctx, proposal, commit, features, **aux):
        return self.inner.update(params, state, ctx, proposal, commit, features, **aux)

    @property
    def guess_classes(self) -> int:
        return self.inner.guess_classes

    @property
    def drafts_without_guess(self) -> bool:
        return self.inner.drafts_without_guess

    def first_guess(self, ctx):
        return self.inner.first_guess(ctx)

    def postponing(self, steps: int) -> Wrapper:
        postponing = copy.copy(self)
        postponing.inner = self.inner.postponing(steps)
        return postponing

    def with_matmuls(self, mode: str) -> Wrapper:
        variant = copy.copy(self)
        variant.inner = self.inner.with_matmuls(mode)
        variant.params = variant.inner.params
        return variant


@dataclasses.dataclass(frozen=True)
class Priors:
    """Stated guesses `infer.tune` ranks a method by before anything is measured."""

    alpha: dict[str, float]  # acceptance per drafted position at temperature 0, per task
    temperature_decay: float  # alpha(T) = alpha(0) * exp(-temperature_decay * T)
    draft_cost: float  # decode steps per drafted token


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a method's builder may use: the loaded target, the --draft path, the weights' dtype."""

    target_config: Any  # ModelConfig
    target_params: Any
    draft_path: str | None
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method as the command lines know it (see `registry` for the spec syntax).

    build:     (spec, context) -> the drafter, its parameters loaded.
    num_spec:  default drafted tokens per step; None for a method that drafts no chain.
    shape:     the name of the three numbers it takes instead of a chain length, if any
               (TREE for an EAGLE-2 tree, "WINDOW,NGRAM,GUESSES" for Lookahead), and their default.
    draft:     what --draft names for it (None: it takes no --draft).
    min_ngram: default shortest suffix match for prompt lookup (None: no lookup).
    priors:    tune's priors; None keeps it out of tune's candidates.
    adaptive:  whether its chain may take `:auto` (False where drafting writes state).
    """

    name: str
    help: str
    build: Callable[[Any, BuildContext], Drafter]
    num_spec: int | None = None
    shape: tuple[str, tuple[int, int, int] | None] | None = None
    draft: str | None = None
    min_ngram: int | None = None
    priors: Priors | None = None
    adaptive: bool = True
