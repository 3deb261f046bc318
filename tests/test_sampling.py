"""sampling.probs against a plain numpy reference, row by row; greedy rows; argmax; row independence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.sampling import SamplingParams

VOCAB = 12
probs = jax.jit(sampling.probs)

# One row per setting: (temperature, top_k, top_p, min_p).
ROWS = [
    (1.0, 0, 1.0, 0.0),  # plain softmax
    (0.5, 0, 1.0, 0.0),  # sharper
    (2.0, 0, 1.0, 0.0),  # flatter
    (1.0, 3, 1.0, 0.0),  # top-k
    (0.7, 0, 0.6, 0.0),  # top-p
    (1.3, 0, 1.0, 0.2),  # min-p
    (0.8, 5, 0.7, 0.05),  # all three
    (0.0, 3, 0.5, 0.1),  # greedy ignores the filters
    (1.0, VOCAB + 5, 1.0, 0.0),  # top-k larger than the vocabulary
]


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Temperature, top-k, top-p (smallest sorted prefix with mass >= top_p), min-p; greedy one-hot."""
    if temperature == 0:
        return np.eye(len(logits))[logits.argmax()]
    scaled = logits / temperature
    keep = np.ones(len(logits), bool)
    order = np.argsort(-scaled)
    if 0 < top_k < len(logits):
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= top_p]] = False
        p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def params_for(rows) -> SamplingParams:
    temperature, top_k, top_p, min_p = map(np.asarray, zip(*rows))
    return SamplingParams(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
    )


def random_logits(seed: int, shape) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * 2.0).astype(np.float32)


def test_each_row_matches_the_reference():
    logits = random_logits(0, (len(ROWS), VOCAB))
    result = np.asarray(probs(jnp.asarray(logits), params_for(ROWS)))
    for row, setting in enumerate(ROWS):
        np.testing.assert_allclose(result[row], reference_probs(logits[row], *setting), atol=1e-6, err_msg=str(setting))
        assert abs(result[row].sum() - 1) < 1e-5


def test_filters_actually_truncate():
    logits = random_logits(1, (len(ROWS), VOCAB))
    support = (np.asarray(probs(jnp.asarray(logits), params_for(ROWS))) > 0).sum(-1)
    assert support[0] == VOCAB and support[3] == 3 and support[7] == 1
    assert 1 <= support[4] < VOCAB and 1 <= support[5] < VOCAB and support[6] <= 5


def test_greedy_rows_are_one_hot_argmax():
    logits = random_logits(2, (4, VOCAB))
    rows = [(0.0, 0, 1.0, 0.0), (0.0, 2, 0.3, 0.5), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]
    result = np.asarray(probs(jnp.asarray(logits), params_for(rows)))
    for row in (0, 1, 3):
        np.testing.assert_array_equal(result[row], np.eye(VOCAB)[logits[row].argmax()])
    assert (result[2] > 0).all()


def test_argmax_is_numpys_first_maximum_with_ties_nans_and_infinities():
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 4, size=(6, 5, 300)).astype(np.float32)  # many ties
    logits[0, 0] = -np.inf  # a row of -inf: index 0
    logits[1, 2, [7, 50]] = np.nan  # the first NaN wins, as in numpy and jnp.argmax
    logits[2, 3, 299] = np.inf
    logits[3, 1, [0, 299]] = 9.0  # the maximum at both ends
    for rows in (logits, logits.reshape(30, 300), logits[1, 2]):
        got = jax.jit(sampling.argmax)(jnp.asarray(rows))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))


def test_rows_are_independent():
    """A row's q depends only on its own logits and parameters, not on its batch neighbours."""
    logits = random_logits(3, (len(ROWS), VOCAB))
    together = np.asarray(probs(jnp.asarray(logits), params_for(ROWS)))
    shuffled = np.random.default_rng(0).permutation(len(ROWS))
    permuted = np.asarray(probs(jnp.asarray(logits[shuffled]), params_for([ROWS[i] for i in shuffled])))
    np.testing.assert_allclose(permuted, together[shuffled], atol=1e-7)
    # Only sampled rows without filters: the sort branch is skipped, results unchanged.
    plain = [0, 1, 2]
    alone = np.asarray(probs(jnp.asarray(logits[plain]), params_for([ROWS[i] for i in plain])))
    np.testing.assert_allclose(alone, together[plain], atol=1e-7)


def test_parameters_broadcast_over_positions():
    """[B, T, V] logits: every position of row b uses row b's parameters."""
    logits = random_logits(4, (len(ROWS), 3, VOCAB))
    result = np.asarray(probs(jnp.asarray(logits), params_for(ROWS)))
    for row, setting in enumerate(ROWS):
        for position in range(3):
            expected = reference_probs(logits[row, position], *setting)
            np.testing.assert_allclose(result[row, position], expected, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(min_p=1.0)])
def test_make_validates(bad):
    with pytest.raises(ValueError):
        SamplingParams.make(2, **bad)


def test_sample_never_draws_zero_probability_tokens():
    q = jnp.asarray([[0.0, 0.5, 0.0, 0.5]] * 4000)
    tokens = np.asarray(jax.jit(sampling.sample)(jax.random.key(0), q))
    assert set(np.unique(tokens)) == {1, 3}


def test_pick_samples_the_processed_distribution_and_skips_it_for_an_all_greedy_batch():
    """`pick` gives `probs` and what `sample` draws from it with the same keys as soon as one row
    samples (its greedy rows included); an all-greedy batch gets the argmax and zeros (as from
    `unless_greedy`)."""
    logits = jnp.asarray(random_logits(5, (4, VOCAB)))
    keys = jax.random.split(jax.random.key(7), 4)
    pick = jax.jit(sampling.pick)
    mixed = params_for([(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 3, 0.9, 0.0), (0.0, 0, 1.0, 0.0)])
    tokens, q = pick(keys, logits, mixed)
    np.testing.assert_array_equal(q, probs(logits, mixed))
    np.testing.assert_array_equal(tokens, sampling.sample(keys, q))
    tokens, q = pick(keys, logits, params_for([(0.0, 0, 1.0, 0.0)] * 4))
    np.testing.assert_array_equal(tokens, np.asarray(logits).argmax(-1))
    assert not np.asarray(q).any()
    unless_greedy = jax.jit(lambda params: sampling.unless_greedy(params, lambda: probs(logits, params)))
    np.testing.assert_array_equal(unless_greedy(mixed), probs(logits, mixed))
    assert not np.asarray(unless_greedy(params_for([(0.0, 0, 1.0, 0.0)] * 4))).any()
