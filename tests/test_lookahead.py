"""Lookahead decoding: the window's attention pattern, the n-gram pool, and drafts from it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import tiny_config, tiny_params
from specjax.drafters.base import StepContext
from specjax.drafters.lookahead import LookaheadDrafter, _lookahead_branch
from specjax.engine import Engine
from specjax.sampling import SamplingParams


def test_window_nodes_see_their_column_and_the_first_level_before_it():
    # W = 3, N = 4: auxiliary nodes are level 0 columns 1, 2, then levels 1, 2 columns 0, 1, 2.
    offsets, mask = _lookahead_branch(window=3, ngram=4, num_nodes=1)
    assert offsets.tolist() == [1, 2, 1, 2, 3, 2, 3, 4]
    level2_column1 = mask[6]  # sees the root, level 0 column 1, levels 1 and 2 of column 1
    assert np.flatnonzero(level2_column1).tolist() == [0, 1, 1 + 3, 1 + 6]
    level0_column2 = mask[1]
    assert np.flatnonzero(level0_column2).tolist() == [0, 1, 2]
    assert mask[np.arange(8), 1 + np.arange(8)].all()  # every node sees itself


def test_pool_stores_each_column_once_and_replaces_the_oldest():
    drafter = LookaheadDrafter(vocab_size=16, window=2, ngram=3, guesses=2)
    state = drafter.init_state(1, 32)
    active = jnp.array([True])

    def step(state, levels, iterate, pending):
        state = state.replace(levels=jnp.asarray([levels], jnp.int32))
        logits = jax.nn.one_hot(jnp.asarray([[0] * (drafter.num_aux - 2) + iterate]), 16)  # the top level's argmax
        ctx = StepContext(pending=jnp.array([pending]), lengths=jnp.array([4]), history=jnp.zeros((1, 32), jnp.int32), active=active)
        return drafter.update((), state, ctx, None, None, None, aux_logits=logits)

    state = step(state, [[0, 5], [6, 7]], [8, 9], pending=5)  # columns: (5, 6, 8) and (5, 7, 9)
    assert int(state.count[0, 5]) == 2 and state.pool[0, 5].tolist() == [[6, 8], [7, 9]]
    assert state.levels[0].tolist() == [[6, 7], [8, 9]]  # shifted down, the iterate on top
    state = step(state, [[0, 5], [6, 7]], [8, 3], pending=5)  # (5, 6, 8) is known; (5, 7, 3) replaces the oldest
    assert int(state.count[0, 5]) == 2 and state.pool[0, 5].tolist() == [[7, 3], [7, 9]]
    proposal = drafter.propose((), state, None, StepContext(jnp.array([5]), jnp.array([4]), jnp.zeros((1, 32), jnp.int32), active), None)[1]
    assert proposal.tokens[0].tolist() == [5, 7, 3, 7, 9]  # the pool's n-grams for the pending token 5
    assert proposal.aux_tokens.shape == (1, drafter.num_aux) and proposal.aux_mask.shape == (1, 3, 5 + 3)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="N >= 3"):
        LookaheadDrafter(16, window=4, ngram=2, guesses=4)
    config = tiny_config(num_layers=1)
    with pytest.raises(ValueError, match="lookahead pool built for 17 tokens"):
        Engine(config, tiny_params(config, 0), LookaheadDrafter(17), max_len=64)


def test_lookahead_accepts_on_a_repetitive_target():
    config = tiny_config(num_layers=2)
    params = tiny_params(config, seed=0, scale=30.0)  # sharp: greedy text falls into loops
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [11, 12, 13]]
    stats = Engine(config, params, LookaheadDrafter(config.vocab_size, 4, 4, 4), max_len=256).generate(prompts, max_new_tokens=96)
    assert stats.tau > 1.5
    plain = Engine(config, params, max_len=256).generate(prompts, SamplingParams.make(2), max_new_tokens=96)
    assert stats.tokens == plain.tokens
