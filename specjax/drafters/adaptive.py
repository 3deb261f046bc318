"""Adaptive draft length (`NAME:auto`, `NAME:autoD`): each step verifies as many drafted tokens as pay.

A chain drafter is built at every depth 0 .. D (`Drafter.at_depth`; depth 0 proposes the pending
token alone, i.e. plain decoding, while the drafter's state keeps reading what is committed).
Before each step the engine picks one depth for the batch (`choose_depth`) and runs that
variant of the step (`lax.switch` over the D + 1 compiled variants), so shapes stay static.

The choice prices what each depth would emit against what it costs. Each row keeps decayed
counts of accepted and tried drafts per chain position, so a_bk estimates P(draft k accepted |
drafts 1 .. k-1 accepted) for row b: acceptance is not geometric (an n-gram chain that gets its
first token right usually gets the rest; an EAGLE head's first draft is its best). The counts
are kept per class of the row's first guess (`Drafter.first_guess`: an n-gram match's length,
found without a model before the step), and a row is priced with the class of the guess it has
for the coming step, so a row drafts where its text repeats and not elsewhere. A chain of d
drafts then emits E_b(d) = 1 + a_b1 + a_b1 a_b2 + ... + a_b1 ... a_bd tokens. While a row does
not draft, its guess is checked against the token sampled (position 1 of its class); without a
guess its counts drift back to the prior, so it tries again now and then. The cost of a step at
depth d, relative to a step at depth 0, is measured on this engine at this batch size, on the
first batch it decodes: whole steps of the compiled loop over copies of that batch, each depth
forced in turn (`Engine.measure_depth_costs`), so every overhead of drafting, verifying and
committing is priced on the rows being served. A row never emits more than its remaining budget
r_b (max_new - generated), so E_b(d) is capped there. Verifying costs per block, not per row, so
one depth serves every row, and what the batch gains depends on how it is scheduled:
- refilled (a server's continuous batching, distillation): a finished row's slot takes the next
  request at once, so every token any row emits is work done; the batch takes
  argmax_d sum_b E_b(d) / cost(d).
- static (`Engine.generate`): the batch runs until its last row is done, so a row that gains
  tokens but finishes before the others saves no step, while every drafting step costs the whole
  batch. The batch takes the depth that would finish it soonest if held:
  argmin_d cost(d) max_b r_b / E_b(d), the projected finish of its slowest row. (With one row
  both rules agree.)
Drafting must beat depth 0 by a margin either way. The choice depends only on the past, so
every step stays exact.

Each step's depth is chosen at the end of the step before, so a drafter learns, as it reads what
was committed, whether the next step drafts; when it does not, a drafter may postpone that
reading (`Drafter.postponing`: an EAGLE head queues the entries, keeps the newest POSTPONE_STEPS
and reads them in one block when drafting resumes), so a depth-0 step costs what plain decoding does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter, Wrapper

#: Decay of a count each time its position is tried: an estimate follows about its last twenty tries.
DECAY = 0.95
#: Decay per step without a draft or a guess: with no new evidence a row's estimates drift back to
#: the prior, so a row that stopped drafting tries again now and then (at acceptance 0.3 and
#: batch 1, after some 150 steps).
IDLE_DECAY = 0.98
#: Pseudo-counts (accepted, tried) added to position 1's counts: a row without evidence is priced
#: at 0.7, optimistic on purpose, so that it tries drafting once (a fresh row, or one whose counts
#: have decayed while it did not draft) whatever the margin. One pseudo-try only: a heavier prior
#: inflates the estimate of a row that drafts badly (beside ten real tries at 0.09 it reads 0.15;
#: with 2 pseudo-tries 0.19). A deeper position k gets one pseudo-try at the estimate of position
#: k - 1 times min(1, accepted count of position 1): once a first draft has been right, a position
#: the chain has not reached yet is priced like the one before it (a right chain stays long);
#: before that at nothing, so a row without evidence tries one draft, not a whole chain (on chat,
#: where the shipped head is right one time in three and its second draft hardly ever, a first try
#: at depth 3 costs 1.7 plain steps for 1.3 tokens; at depth 1, 1.3), and as its counts decay
#: while it does not draft, its next try is a single draft again.
PRIOR = (0.7, 1.0)
#: Position 1's prior estimate for a row whose coming step has a guess (class > 0), in place of
#: PRIOR[0]: its guess is checked for free at every step that does not draft, so it learns without
#: trying a chain, and an optimistic start would only make every fresh row try one chain per class
#: (at batch 1 on chat, eagle3+ngram:auto3 spent 30 of its 37 drafting steps over 8 prompts so,
#: gaining 13 tokens for 20 steps' worth of time). A right first check reads 0.65 and a wrong one 0.15.
GUESSED_PRIOR = 0.3
#: Drafting must promise this much more than plain decoding per unit of time: the estimates are
#: noisy, a batch drafts when they read high (so its drafting steps realise less than they
#: promised), and a step that drafts at break-even gains nothing while one that misjudges loses.
MARGIN = 1.15
#: Committed entries a drafter keeps unread while no step drafts (`Drafter.postponing`): when
#: drafting resumes it reads the newest this many in one block and never reads older ones, so a
#: batch that stays at depth 0 runs no head at all (reading every 16th step cost an EAGLE-3 batch
#: of 4 about 1.7% of its time), while a head that resumes sees the last 32 tokens in full.
POSTPONE_STEPS = 32


def forcing_costs(depth: int, max_depth: int) -> np.ndarray:
    """[D + 1] costs under which `choose_depth` always picks `depth`: every other depth costs inf."""
    return np.where(np.arange(max_depth + 1) == depth, 1.0, np.inf).astype(np.float32)


def init_stats(batch_size: int, drafter: Drafter) -> jax.Array:
    """[B, C, D, 2] zero counts: (accepted, tried) per row, guess class and chain position."""
    return jnp.zeros((batch_size, drafter.guess_classes, drafter.max_depth, 2), jnp.float32)


def acceptance(stats: jax.Array, prior=PRIOR[0]) -> jax.Array:
    """stats [..., D, 2] decayed (accepted, tried) counts per chain position -> [..., D] estimated
    acceptance of each position given the ones before it were accepted; prior [...] (or a scalar):
    position 1's pseudo-try, deeper positions' from the one before (see PRIOR)."""
    rates, prior = [], jnp.broadcast_to(jnp.asarray(prior, stats.dtype), stats.shape[:-2])  # [...]
    first_right = jnp.minimum(stats[..., 0, 0], 1.0)  # [...]: deeper pseudo-tries only once a first draft was right
    for position in range(stats.shape[-2]):
        accepted, tried = stats[..., position, 0], stats[..., position, 1]
        rates.append((accepted + prior * PRIOR[1]) / (tried + PRIOR[1]))
        prior = rates[-1] * first_right
    return jnp.stack(rates, -1)


def observe(
    stats: jax.Array, guess_class: jax.Array, accepted: jax.Array, depth, active: jax.Array, guess_right: jax.Array
) -> jax.Array:
    """Add one step's evidence to each row's counts of the class of its guess (guess_class [B]).

    stats [B, C, D, 2]; accepted [B] drafts of a depth-`depth` chain. A drafting step tries the
    positions up to the first rejected one and accepts those before it. At depth 0 a row with a
    guess tries position 1, accepted where the guess is the token sampled (guess_right [B]: for a
    sampled row this happens with probability q(guess), the point-mass rule's acceptance); a row
    without a guess has no new evidence and its counts drift back to the prior (IDLE_DECAY).
    Every tried count decays by DECAY before it is added to; untried counts stay."""
    positions = jnp.arange(stats.shape[2])  # [D]
    checked = active & (guess_class > 0)
    tried = jnp.where(depth > 0, (positions < depth) & (positions <= accepted[:, None]), (positions == 0) & checked[:, None])
    hit = jnp.where(depth > 0, positions < accepted[:, None], (positions == 0) & (checked & guess_right)[:, None])
    in_class = jax.nn.one_hot(guess_class, stats.shape[1], dtype=bool) & active[:, None]  # [B, C]
    cells = (in_class[:, :, None] & tried[:, None, :])[..., None]  # [B, C, D, 1]
    evidence = jnp.stack([hit, jnp.ones_like(hit)], -1).astype(stats.dtype)[:, None]  # [B, 1, D, 2]
    stats = jnp.where(cells, stats * DECAY + evidence, stats)
    idle = (depth == 0) & active & (guess_class == 0)  # [B]
    return jnp.where((idle[:, None] & in_class)[:, :, None, None], stats * IDLE_DECAY, stats)


def expected_tokens(stats: jax.Array, guess_class: jax.Array, drafts_without_guess: bool) -> jax.Array:
    """[B, D + 1] tokens a depth-d step is expected to emit for each row, from the counts of the
    class of its guess; a row without a guess emits one where its drafter needs one."""
    prior = jnp.where(guess_class > 0, GUESSED_PRIOR, PRIOR[0])  # [B]
    alpha = acceptance(jnp.take_along_axis(stats, guess_class[:, None, None, None], 1)[:, 0], prior)  # [B, D]
    if not drafts_without_guess:
        alpha = jnp.where(guess_class[:, None] > 0, alpha, 0.0)
    reach = jnp.cumprod(alpha, axis=-1)  # [B, D]: P(drafts 1 .. k all accepted)
    return 1.0 + jnp.concatenate([jnp.zeros_like(reach[:, :1]), jnp.cumsum(reach, axis=-1)], -1)


def choose_depth(
    stats: jax.Array,
    guess_class: jax.Array,
    active: jax.Array,
    remaining: jax.Array,
    costs: jax.Array,
    refills: jax.Array,
    drafts_without_guess: bool = True,
) -> jax.Array:
    """The depth d in 0 .. D at which the batch gets its work done soonest (see the module doc).

    stats [B, C, D, 2] per-row counts (`observe`), guess_class [B] of the coming step's guesses,
    active [B], remaining [B] tokens each row may still emit, costs [D + 1] step time at each
    depth relative to depth 0 (inf: never), refills [] whether finished rows are replaced at once
    (tokens per unit of time count) or the batch is static (its slowest row's finish counts).
    Returns an int32 scalar.
    """
    remaining = jnp.maximum(remaining, 1).astype(jnp.float32)[:, None]  # [B, 1]
    expected = jnp.minimum(expected_tokens(stats, guess_class, drafts_without_guess), remaining)  # [B, D + 1]
    depths = jnp.arange(costs.shape[0])
    priced = costs * jnp.where(depths > 0, MARGIN, 1.0)  # [D + 1]
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), axis=0)
    slowest = jnp.max(jnp.where(active[:, None], remaining / expected, 1.0), axis=0)  # [D + 1] steps to finish
    return jnp.where(refills, jnp.argmax(tokens / priced), jnp.argmin(priced * slowest)).astype(jnp.int32)


class AdaptiveDepth(Wrapper):
    """A chain drafter whose draft length the engine chooses every step (see the module doc).

    As a plain drafter it behaves as its deepest variant (`inner`). costs: a fixed [D + 1] cost
    vector (e.g. from a stored profile, which also makes seeded sampling reproducible across
    processes); None has the engine measure it once per batch size.
    """

    def __init__(self, drafter: Drafter, costs=None):
        depth = drafter.max_depth
        if drafter.propose_changes_state:
            raise ValueError(f"{type(drafter).__name__} writes its state while drafting: its draft length cannot vary per step")
        drafter = drafter.postponing(POSTPONE_STEPS)
        self.variants = tuple(drafter.at_depth(d) for d in range(depth + 1))
        super().__init__(self.variants[-1])
        if costs is not None and np.shape(costs) != (depth + 1,):
            raise ValueError(f"costs must have one entry per depth 0 .. {depth}, got shape {np.shape(costs)}")
        self.costs = None if costs is None else np.asarray(costs, np.float32)

    def with_matmuls(self, mode: str) -> AdaptiveDepth:
        return AdaptiveDepth(self.inner.with_matmuls(mode), self.costs)  # every variant from the one converted drafter (postponing twice is once)

    def propose(self, params, state, key, ctx, sampling):
        return self.inner.propose(params, state, key, ctx, sampling)
