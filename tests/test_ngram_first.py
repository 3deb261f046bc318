"""N-gram-first drafting: per-row choice between prompt lookup and a fallback chain drafter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_engine_sampling as sampling
from engine_helpers import eagle3_drafter, tiny_config, tiny_params
from goodness_of_fit import chi_square_pvalue
from specjax.drafters.base import StepContext
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter, lookup
from specjax.drafters.ngram_first import NgramFirst
from specjax.engine import Engine
from specjax.sampling import SamplingParams

CONFIG = tiny_config(num_layers=2)
PARAMS = tiny_params(CONFIG, seed=0, scale=30.0)
KEYS = jax.random.split(jax.random.key(0), 2)  # one per row


def test_lookup_reports_the_matched_suffix_size():
    history = jnp.array([1, 2, 3, 4, 9, 2, 3, 0, 0], jnp.int32)  # sequence 1 2 3 4 9 2 3 (pending 3 at 6)
    drafts, size = lookup(history, jnp.int32(6), 3, 4, 1)
    assert int(size) == 2 and list(np.asarray(drafts)) == [4, 9, 2]  # "2 3" matched, followed by 4 9 2
    _, none = lookup(jnp.array([1, 2, 3, 4, 5, 0], jnp.int32), jnp.int32(4), 3, 4, 1)
    assert int(none) == 0


def test_rows_with_a_long_enough_match_take_the_lookup_chain():
    drafter = NgramFirst(eagle3_drafter(CONFIG, PARAMS, depth=3), min_ngram=3, max_ngram=4)
    history = jnp.array(
        [
            [10, 11, 12, 13, 14, 10, 11, 12, 0, 0],  # "10 11 12" occurred before: lookup proposes 13 14 10
            [10, 11, 12, 13, 14, 20, 11, 12, 0, 0],  # only "11 12" repeats: below min_ngram, EAGLE-3 chain
        ],
        jnp.int32,
    )
    lengths = jnp.array([7, 7], jnp.int32)
    ctx = StepContext(pending=history[:, 7], lengths=lengths, history=history, active=jnp.array([True, True]))
    state = drafter.init_state(2, 16)
    propose, head_propose = jax.jit(drafter.propose), jax.jit(drafter.inner.propose)  # eager would dispatch op by op
    _, proposal = propose(drafter.params, state, KEYS, ctx, SamplingParams.make(2))
    _, head_proposal = head_propose(drafter.params, state, KEYS, ctx, SamplingParams.make(2))
    tokens = np.asarray(proposal.tokens)
    assert list(tokens[0]) == [12, 13, 14, 10]
    np.testing.assert_array_equal(tokens[1], np.asarray(head_proposal.tokens)[1])
    np.testing.assert_array_equal(proposal.tree.parents, head_proposal.tree.parents)
    np.testing.assert_array_equal(proposal.tree.depths, head_proposal.tree.depths)

    # The first guess at a depth-0 step: the lookup's first draft, classed by the matched suffix's
    # length where it is long enough (0: no guess).
    guess, guess_class = drafter.first_guess(ctx)
    assert list(np.asarray(guess_class)) == [3, 0] and int(guess[0]) == 13 and drafter.guess_classes == 5
    plain = NgramDrafter(3, max_ngram=4)  # any match of 1 .. 4 tokens
    plain_guess, plain_class = plain.first_guess(ctx)
    assert list(np.asarray(plain_class)) == [3, 2] and list(np.asarray(plain_guess)) == [13, 13]
    assert not plain.drafts_without_guess and drafter.drafts_without_guess  # the EAGLE-3 chain drafts anyway

    # Every live row matches (row 1 has finished): the lookup chain alone, the head's drafting skipped.
    ctx = ctx.replace(history=history.at[1].set(history[0]), active=jnp.array([True, False]))
    _, proposal = propose(drafter.params, state, KEYS, ctx, SamplingParams.make(2))
    assert [list(row) for row in np.asarray(proposal.tokens)] == [[12, 13, 14, 10]] * 2


def test_needs_a_chain_drafter():
    with pytest.raises(ValueError, match="needs a chain drafter"):
        NgramFirst(eagle3_drafter(CONFIG, PARAMS, depth=3, top_k=2, nodes=4))
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramFirst(eagle3_drafter(CONFIG, PARAMS, depth=3), min_ngram=4, max_ngram=2)


def sampling_engine(fallback: str) -> Engine:
    """min_ngram 1 on a 12-token vocabulary: rows switch between lookup and the fallback every step.

    Over the EAGLE-3 chain the point-mass rule verifies; over the sampled draft model the
    rejection rule, with one-hot draft distributions on looked-up rows."""
    drafter = {
        "eagle3": lambda: eagle3_drafter(sampling.CONFIG, sampling.PARAMS, depth=2),
        "draft": lambda: DraftModelDrafter(sampling.DRAFT_CONFIG, sampling.DRAFT_PARAMS, num_draft=2),
    }[fallback]()
    return Engine(sampling.CONFIG, sampling.PARAMS, NgramFirst(drafter, min_ngram=1), max_len=sampling.MAX_LEN, eos_ids=())


@pytest.mark.parametrize("fallback", ["eagle3", "draft"])
def test_first_three_tokens_follow_the_target(fallback):
    """The engine-level chi-square check of test_engine_sampling.py, for n-gram-first drafting at
    temperature 1 (truncated target distributions meet the same rules there, over each fallback)."""
    samples = sampling.sample_joint(sampling_engine(fallback), sampling.SETTINGS["t1"], seed=11)
    assert chi_square_pvalue(samples, sampling.exact_joint(sampling.SETTINGS["t1"])) > 1e-4
