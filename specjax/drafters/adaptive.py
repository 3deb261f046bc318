"""Adaptive draft length (`NAME:auto`, `NAME:autoD`): each step verifies as many drafted tokens as pay.

A chain drafter is built at every depth 0 .. D (`Drafter.at_depth`; depth 0 proposes the pending
token alone, i.e. plain decoding, while the drafter's state keeps reading what is committed).
Before each step the engine picks one depth for the batch (`choose_depth`) and runs that
variant of the step (`lax.switch` over the D + 1 compiled variants), so shapes stay static.

The choice prices what each depth would emit against what it costs. Row b's acceptance rate
alpha_b is a running estimate from its own verifier calls (decayed counts of accepted and tried
draft positions). While a row does not draft, a drafter that can guess its first draft without a
model (n-gram lookup: `Drafter.first_guess`) has the guess checked against the token sampled, so
the estimate keeps following the text; without a guess a prior slowly pulls the row back to
trying. A chain of d drafts then emits E_b(d) = 1 + alpha_b + ... + alpha_b^d tokens. The cost of a step
at depth d, relative to a step at depth 0, is measured on this engine at this batch size: whole
steps of the compiled loop, each depth forced in turn (`Engine.measure_depth_costs`), so every
overhead of drafting, verifying and committing is priced. The batch takes
argmax_d sum_b E_b(d) / cost(d), where drafting must beat depth 0 by a margin: verifying costs
per block, not per row, so one depth serves every row. The choice depends only on the past, so every step stays exact.

Each step's depth is chosen at the end of the step before, so a drafter learns, as it reads what
was committed, whether the next step drafts; when it does not, a drafter may postpone that
reading (`Drafter.postponing`: an EAGLE head queues the entries and reads them in one block when
drafting resumes), so a depth-0 step costs what plain decoding does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter, Wrapper

#: Decay of a row's counts per drafting step: its estimate follows about its last twenty drafts.
DECAY = 0.95
#: Decay per step without drafts: with no new evidence a row's estimate drifts back to the prior
#: (over some 50 steps), so a row that stopped drafting tries again now and then.
IDLE_DECAY = 0.98
#: Pseudo-counts (accepted, tried) added to every estimate: alpha starts at 0.5. One pseudo-try
#: only: a heavier prior inflates the estimate of a row that drafts badly (with 2 pseudo-tries
#: beside ten real ones, an acceptance of 0.09 reads as 0.16), which makes it keep drafting where
#: a block costs more than that (batch 4: a one-draft step costs about 1.16 decode steps).
PRIOR = (0.5, 1.0)
#: Drafting must promise this much more than plain decoding per unit of time: the costs are
#: measured on synthetic rows and the estimate is noisy, and a step that drafts at break-even
#: gains nothing while one that misjudges loses.
MARGIN = 1.05
#: Steps at depth 0 in a row for which a drafter may leave what was committed unread
#: (`Drafter.postponing`): it catches up in one read of this width, not one per step.
POSTPONE_STEPS = 16


def acceptance(stats: jax.Array) -> jax.Array:
    """stats [B, 2] decayed (accepted, tried) draft positions -> [B] estimated acceptance rate."""
    return (stats[:, 0] + PRIOR[0]) / (stats[:, 1] + PRIOR[1])


def observe(
    stats: jax.Array, accepted: jax.Array, depth: int, active: jax.Array, guessed=None, guess_right=None
) -> jax.Array:
    """Decay every row's counts, then add this step's: accepted drafts [B], and the positions
    tried (the accepted ones and the first rejected one) of a depth-`depth` chain.

    At depth 0 a row whose drafter guessed its first draft (guessed [B], `Drafter.first_guess`)
    counts one try, accepted where the guess is the token sampled (guess_right [B]: for a sampled
    row this happens with probability q(guess), the point-mass rule's acceptance); a row without
    a guess has no new evidence and drifts back to the prior (IDLE_DECAY)."""
    tried = jnp.minimum(accepted + 1, depth)
    new = jnp.stack([accepted, tried], -1).astype(stats.dtype) * active[:, None]
    idle = stats * IDLE_DECAY
    if guessed is not None:
        guess = jnp.stack([guess_right, jnp.ones_like(guess_right)], -1).astype(stats.dtype)
        idle = jnp.where(guessed[:, None], stats * DECAY + guess * active[:, None], idle)
    return jnp.where(depth > 0, stats * DECAY + new, idle)


def choose_depth(stats: jax.Array, active: jax.Array, costs: jax.Array) -> jax.Array:
    """The depth d in 0 .. D maximising the batch's expected tokens per unit of time.

    stats [B, 2] per-row counts (`observe`), active [B], costs [D + 1] step time at each depth
    relative to depth 0 (inf: never). Returns an int32 scalar.
    """
    alpha = jnp.clip(acceptance(stats), 0.0, 0.999)[:, None]  # [B, 1]
    depths = jnp.arange(costs.shape[0])  # [D + 1]
    expected = (1 - alpha ** (depths + 1)) / (1 - alpha)  # [B, D + 1] tokens per call
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), axis=0)
    return jnp.argmax(tokens / (costs * jnp.where(depths > 0, MARGIN, 1.0))).astype(jnp.int32)


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

    def propose(self, params, state, key, ctx, sampling):
        return self.inner.propose(params, state, key, ctx, sampling)

    def first_guess(self, params, state, ctx):
        return self.inner.first_guess(params, state, ctx)
