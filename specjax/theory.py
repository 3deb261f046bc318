"""The cost model of speculative decoding: expected tokens per verifier call, speedup, and
the optimal draft length (Leviathan et al. 2023, section 3), for chains and trees.

Notation: alpha is the per-token acceptance rate (the chance the verifier accepts a draft
token given it accepted every earlier one; for one position, sum_x min(p(x), q(x))); n is the
number of drafted tokens per step; c is the cost of one draft step relative to one target
decode step. Token counts always include the token the verifier itself samples (residual or
bonus), so "tokens per call" is the acceptance length tau (docs/architecture.md).
"""

from __future__ import annotations

import numpy as np


def expected_accepted(alpha: float, n: int) -> float:
    """Expected tokens per verifier call for n i.i.d. drafts: (1 - a^(n+1)) / (1 - a).

    The sum of the series 1 + a + ... + a^n: draft k is emitted with probability a^k, and the
    verifier's own token always is. At a = 1 it is n + 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if alpha == 1.0:
        return float(n + 1)
    return (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


def speedup(alpha: float, n: int, c: float) -> float:
    """Expected speedup over plain decoding: (1 - a^(n+1)) / ((1 - a)(n c + 1)).

    One step costs n draft calls (c each) plus one verifier call (1, the cost of a decode step,
    assuming verifying n + 1 tokens costs as much as decoding one).
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    return expected_accepted(alpha, n) / (n * c + 1.0)


def optimal_draft_length(alpha: float, c: float, n_max: int = 64) -> tuple[int, float]:
    """(n, speedup) maximising speedup(alpha, n, c) over n = 0 .. n_max (an exact scan).

    n = 0 (speedup 1) means speculation does not pay. Ties go to the shorter draft.
    """
    speedups = [speedup(alpha, n, c) for n in range(n_max + 1)]
    best = int(np.argmax(speedups))
    return best, speedups[best]


def tree_expected_accepted(parents, accept_prob) -> float | np.ndarray:
    """Expected tokens per verifier call of a draft tree: 1 + sum_i reach(i).

    parents:     [..., N] int, parents[..., 0] = -1 (the root), topological order.
    accept_prob: [..., N] the probability that the walk moves from parent(i) to i given it
                 reached parent(i) (for the point-mass rule with distinct sibling tokens,
                 q_parent(token i)); siblings' probabilities sum to at most 1; root ignored.
    reach(i) is the product of accept_prob along the root-to-i path. At most one node per
    depth is accepted, so the expected accepted length is the sum of the reach probabilities.
    """
    parents = np.asarray(parents)
    accept_prob = np.asarray(accept_prob, np.float64)
    reach = np.ones(np.broadcast_shapes(parents.shape, accept_prob.shape))  # [..., N]
    parents = np.broadcast_to(parents, reach.shape)
    accept_prob = np.broadcast_to(accept_prob, reach.shape)
    for node in range(1, reach.shape[-1]):
        parent_reach = np.take_along_axis(reach, parents[..., node : node + 1], axis=-1)[..., 0]
        reach[..., node] = parent_reach * accept_prob[..., node]
    expected = 1.0 + reach[..., 1:].sum(-1)
    return float(expected) if expected.ndim == 0 else expected


def expected_accepted_from_curve(per_position_acceptance) -> float | np.ndarray:
    """Expected tokens per call from a measured per-position acceptance curve: 1 + sum_k prod_{i<=k} a_i.

    per_position_acceptance: [..., n], a_i = P(position i accepted | positions < i accepted).
    Exact for any process (nothing i.i.d. assumed); with a constant curve it is expected_accepted.
    """
    curve = np.asarray(per_position_acceptance, np.float64)
    expected = 1.0 + np.cumprod(curve, axis=-1).sum(-1)
    return float(expected) if expected.ndim == 0 else expected


def acceptance_rate(p, q) -> float | np.ndarray:
    """Chance that speculative sampling accepts a draft from p when the target is q: sum min(p, q).

    p, q: [..., V] probabilities. It is 1 - TV(p, q).
    """
    rate = np.minimum(np.asarray(p, np.float64), np.asarray(q, np.float64)).sum(-1)
    return float(rate) if rate.ndim == 0 else rate


def cost_model_bound(tau: float, t_decode: float, t_verify: float, t_draft_total: float) -> float:
    """Speedup an engine with no overhead reaches: tau * T_decode / (T_verify + T_draft_total).

    tau: measured tokens per verifier call; t_decode: one plain decode step; t_verify: one
    verifier call over the whole draft (T + 1 tokens); t_draft_total: all drafting per step.
    """
    return tau * t_decode / (t_verify + t_draft_total)
