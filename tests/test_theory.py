"""The cost-model formulas against brute force: series sums, scans, enumeration, Monte Carlo."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import theory, verify
from specjax.sampling import SamplingParams
from specjax.tree import from_branching


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.999, 1.0])
@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_expected_accepted_is_the_series_sum(alpha, n):
    series = sum(alpha**k for k in range(n + 1))
    assert theory.expected_accepted(alpha, n) == pytest.approx(series, rel=1e-12)


def test_expected_accepted_by_monte_carlo():
    """Simulate i.i.d. acceptance: tokens = 1 + the number of leading accepted drafts."""
    rng = np.random.default_rng(0)
    alpha, n, trials = 0.7, 6, 200_000
    accepted = np.cumprod(rng.random((trials, n)) < alpha, axis=1).sum(1)
    tokens = 1 + accepted
    standard_error = tokens.std() / np.sqrt(trials)
    assert abs(tokens.mean() - theory.expected_accepted(alpha, n)) < 5 * standard_error


def test_speedup_formula():
    alpha, n, c = 0.8, 4, 0.05
    assert theory.speedup(alpha, n, c) == pytest.approx((1 - alpha**5) / ((1 - alpha) * (n * c + 1)))
    assert theory.speedup(alpha, 0, c) == 1.0  # no drafts: plain decoding


@pytest.mark.parametrize("alpha, c", [(0.8, 0.05), (0.95, 0.02), (0.9, 0.04), (0.3, 0.5), (0.6, 0.0)])
def test_optimal_draft_length_matches_a_fine_scan(alpha, c):
    n, best = theory.optimal_draft_length(alpha, c, n_max=64)
    scanned = [(1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)) for k in range(65)]
    assert n == int(np.argmax(scanned)) and best == pytest.approx(max(scanned))
    assert all(theory.speedup(alpha, k, c) <= best + 1e-12 for k in range(65))


def test_optimal_draft_length_known_values():
    assert theory.optimal_draft_length(0.8, 0.05)[0] == 8
    assert theory.optimal_draft_length(0.95, 0.02)[0] == 31
    assert theory.optimal_draft_length(0.1, 0.9)[0] == 0  # speculation does not pay


def test_curve_with_constant_acceptance_is_the_closed_form():
    for alpha in (0.2, 0.75, 1.0):
        assert theory.expected_accepted_from_curve([alpha] * 7) == pytest.approx(theory.expected_accepted(alpha, 7))


def test_curve_by_exact_enumeration():
    """A non-i.i.d. curve: enumerate every accept/reject pattern and its probability."""
    curve = [0.9, 0.6, 0.8, 0.3]
    expected = 0.0
    for pattern in itertools.product([0, 1], repeat=len(curve)):
        probability = np.prod([a if accepted else 1 - a for a, accepted in zip(curve, pattern)])
        leading = next((i for i, accepted in enumerate(pattern) if not accepted), len(curve))
        expected += probability * (1 + leading)
    assert theory.expected_accepted_from_curve(curve) == pytest.approx(expected)


def test_tree_expectation_on_a_chain_is_the_closed_form():
    parents = np.arange(-1, 6)
    assert theory.tree_expected_accepted(parents, np.full(7, 0.6)) == pytest.approx(theory.expected_accepted(0.6, 6))


def test_tree_expectation_by_exact_enumeration():
    """Walk the tree over every outcome of 'which child (if any) is taken' at each node."""
    parents = [-1, 0, 0, 1, 1, 2, 3]
    accept_prob = [1.0, 0.5, 0.3, 0.4, 0.2, 0.7, 0.9]
    children = {node: [c for c in range(len(parents)) if parents[c] == node] for node in range(len(parents))}

    def expected_from(node: int) -> float:  # expected tokens emitted from `node` on
        stay = 1.0 - sum(accept_prob[c] for c in children[node])
        return stay * 1 + sum(accept_prob[c] * (1 + expected_from(c)) for c in children[node])

    assert theory.tree_expected_accepted(parents, accept_prob) == pytest.approx(expected_from(0))
    batched = theory.tree_expected_accepted(np.stack([parents] * 3), np.stack([accept_prob] * 3))
    np.testing.assert_allclose(batched, expected_from(0))


def test_tree_expectation_matches_verify_tree_by_monte_carlo():
    """Deterministic children, point-mass rule: the walk moves to child c with probability
    q_parent(c) (distinct sibling tokens), so theory predicts verify.tree's mean tokens."""
    rng = np.random.default_rng(1)
    vocab, batch = 8, 50_000
    topology = from_branching(batch, [2, 2, 2])
    parents = np.asarray(topology.parents[0])
    q = rng.dirichlet(np.full(vocab, 0.5), size=len(parents))  # [N, V] q at each node
    tokens = np.zeros(len(parents), int)
    for node in range(1, len(parents)):  # siblings: the parent's top tokens in order
        rank = np.sum(parents[1:node] == parents[node])
        tokens[node] = np.argsort(-q[parents[node]], kind="stable")[rank]
    accept_prob = np.r_[1.0, q[parents[1:], tokens[1:]]]
    verdict = verify.tree(
        jax.random.key(0),
        topology,
        jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (batch, len(parents))),
        jnp.broadcast_to(jnp.asarray(q, jnp.float32), (batch,) + q.shape),
        SamplingParams.make(batch, temperature=1.0),
    )
    tokens_per_call = np.asarray(verdict.accepted) + 1
    standard_error = tokens_per_call.std() / np.sqrt(batch)
    predicted = theory.tree_expected_accepted(parents, accept_prob)
    assert abs(tokens_per_call.mean() - predicted) < 5 * standard_error, (tokens_per_call.mean(), predicted)


def test_acceptance_rate_is_one_minus_total_variation():
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(10), size=(2, 5))
    np.testing.assert_allclose(theory.acceptance_rate(p, q), 1 - 0.5 * np.abs(p - q).sum(-1))
    assert theory.acceptance_rate(p[0], p[0]) == pytest.approx(1.0)
    assert theory.acceptance_rate([1.0, 0.0], [0.0, 1.0]) == 0.0


def test_cost_model_bound():
    # tau 3.5 tokens per call, decode 50 ms, verify 100 ms, drafting 40 ms per step.
    assert theory.cost_model_bound(3.5, 0.050, 0.100, 0.040) == pytest.approx(3.5 * 0.05 / 0.14)
    # Free drafting and verification as cheap as decoding: the bound is tau itself.
    assert theory.cost_model_bound(3.5, 1.0, 1.0, 0.0) == pytest.approx(3.5)


@pytest.mark.parametrize("bad", [dict(alpha=1.5, n=2), dict(alpha=0.5, n=-1)])
def test_expected_accepted_validates(bad):
    with pytest.raises(ValueError):
        theory.expected_accepted(**bad)
