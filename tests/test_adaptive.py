"""Adaptive draft length (`NAME:auto`): the depth choice, its statistics, and the engine backing off."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import test_engine as engine_tests
from engine_helpers import ADAPTIVE_COSTS, eagle3_drafter
from specjax import tree as tree_lib
from specjax.drafters import adaptive
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import ChainDrafter, Commit, Proposal
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.models import llama
from specjax.sampling import SamplingParams
from specjax.tree import causal_mask

CONFIG, PARAMS, PROMPTS, MAX_LEN = engine_tests.CONFIG, engine_tests.PARAMS, engine_tests.PROMPTS, engine_tests.MAX_LEN


def stats_for(alphas, weight=50.0):
    """[B, 2] counts that estimate the given acceptance rates with `weight` tried positions each."""
    alphas = np.asarray(alphas, np.float32)
    return jnp.stack([alphas * weight, np.full_like(alphas, weight)], -1)


def test_choose_depth_prices_expected_tokens_against_cost():
    costs = jnp.asarray([1.0, 1.1, 1.2, 1.3, 1.4])
    active = jnp.ones(2, bool)
    assert int(adaptive.choose_depth(stats_for([0.9, 0.9]), active, costs)) == 4  # good drafts: the longest chain
    assert int(adaptive.choose_depth(stats_for([0.02, 0.02]), active, costs)) == 0  # useless drafts: plain decoding
    # 0.5 acceptance: one draft emits 1.5 tokens for 1.1, more drafts add less than they cost.
    assert int(adaptive.choose_depth(stats_for([0.5, 0.5]), active, jnp.asarray([1.0, 1.1, 1.5, 2.0, 2.5]))) == 1
    # Only live rows count: a finished row with perfect drafts does not make the others draft.
    assert int(adaptive.choose_depth(stats_for([0.02, 0.99]), jnp.array([True, False]), costs)) == 0
    # Free verification (flat costs): any acceptance above zero pays for the whole chain.
    assert int(adaptive.choose_depth(stats_for([0.1, 0.1]), active, jnp.ones(5))) == 4


def test_observe_counts_tried_positions_and_decays():
    stats = jnp.zeros((3, 2))
    # Accepted 2 of a 3-chain (3 tried: two accepted, the third rejected); all 3 accepted; inactive.
    stats = adaptive.observe(stats, jnp.array([2, 3, 3]), 3, jnp.array([True, True, False]))
    np.testing.assert_allclose(stats, [[2, 3], [3, 3], [0, 0]])
    again = adaptive.observe(stats, jnp.array([0, 0, 0]), 3, jnp.array([True, True, False]))
    np.testing.assert_allclose(again, np.asarray(stats) * adaptive.DECAY + [[0, 1], [0, 1], [0, 0]])
    idle = adaptive.observe(stats, jnp.array([0, 0, 0]), 0, jnp.ones(3, bool))  # a step without drafts
    np.testing.assert_allclose(idle, np.asarray(stats) * adaptive.IDLE_DECAY)
    assert float(adaptive.acceptance(jnp.zeros((1, 2)))[0]) == pytest.approx(0.5)  # the prior


def test_drafting_must_beat_plain_decoding_by_the_margin():
    costs, active = jnp.asarray([1.0, 1.2]), jnp.ones(1, bool)
    assert 1.23 / 1.2 < adaptive.MARGIN < 1.3 / 1.2  # 0.23 would gain 2.5%, 0.3 gains 8%
    assert int(adaptive.choose_depth(stats_for([0.23]), active, costs)) == 0
    assert int(adaptive.choose_depth(stats_for([0.3]), active, costs)) == 1


def test_a_depth_zero_step_counts_a_checked_guess_as_one_try():
    stats = stats_for([0.2, 0.2, 0.2], weight=10.0)
    active, guessed = jnp.array([True, True, False]), jnp.array([True, False, True])
    new = adaptive.observe(stats, jnp.zeros(3, jnp.int32), 0, active, guessed, jnp.array([True, True, True]))
    expected = np.asarray(stats) * [[adaptive.DECAY], [adaptive.IDLE_DECAY], [adaptive.DECAY]] + [[1, 1], [0, 0], [0, 0]]
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    # Drafting steps ignore guesses.
    drafted = adaptive.observe(stats, jnp.array([1, 1, 1]), 2, active, guessed, jnp.array([False] * 3))
    np.testing.assert_allclose(drafted, adaptive.observe(stats, jnp.array([1, 1, 1]), 2, active))


def test_right_guesses_bring_a_row_back_to_drafting_within_a_few_steps():
    costs, active = jnp.asarray([1.0, 1.3, 1.6]), jnp.ones(1, bool)
    def steps_to_resume(guessed):
        stats = stats_for([0.05], weight=20.0)  # a row that stopped drafting
        for step in range(1, 200):
            stats = adaptive.observe(stats, jnp.zeros(1, jnp.int32), 0, active, jnp.array([guessed]), jnp.array([True]))
            if int(adaptive.choose_depth(stats, active, costs)) > 0:
                return step
    assert steps_to_resume(True) <= 10 < 30 < steps_to_resume(False)


def test_an_infinite_cost_rules_a_depth_out():
    stats, active = stats_for([0.9, 0.9]), jnp.ones(2, bool)
    for depth in range(4):
        forced = jnp.full(4, jnp.inf).at[depth].set(1.0)
        assert int(adaptive.choose_depth(stats, active, forced)) == depth


@pytest.fixture(scope="module")
def autoregressive():
    reference = engine_tests.engine_for(None)
    return [reference.generate([p], max_new_tokens=engine_tests.NEW_TOKENS).tokens[0] for p in PROMPTS]


class OracleChain(ChainDrafter):
    """The target's own greedy continuation as a chain (re-runs the target; test only)."""

    def propose(self, params, state, key, ctx, sampling):
        batch, max_len = ctx.history.shape
        rows, lengths, history, truth = jnp.arange(batch), ctx.lengths + 1, ctx.history, []
        positions = jnp.broadcast_to(jnp.arange(max_len), (batch, max_len))
        for _ in range(self.num_draft):
            logits = llama.forward(PARAMS, CONFIG, history, positions, None, causal_mask(max_len)).logits
            token = jnp.argmax(logits[rows, lengths - 1], -1).astype(jnp.int32)
            truth.append(token)
            history, lengths = history.at[rows, lengths].set(token, mode="drop"), lengths + 1
        tokens = jnp.stack([ctx.pending] + truth, 1)  # [B, D + 1]
        return state, Proposal(tree=tree_lib.chain(batch, self.num_draft), tokens=tokens)


def test_the_engine_drafts_long_where_drafts_are_right_and_backs_off_where_wrong(autoregressive):
    right = Engine(CONFIG, PARAMS, AdaptiveDepth(OracleChain(3), costs=ADAPTIVE_COSTS), max_len=MAX_LEN)
    stats = right.generate(PROMPTS, max_new_tokens=engine_tests.NEW_TOKENS)
    assert stats.tokens == autoregressive
    assert stats.drafting_share == 1.0 and stats.tau > 3.5  # every step at the full depth (the last ones cut short)
    # A random EAGLE-3 head is never right: the rows stop drafting, only probing now and then.
    wrong = engine_tests.engine_for("eagle3-auto").generate(PROMPTS, max_new_tokens=engine_tests.NEW_TOKENS)
    assert wrong.tokens == autoregressive and wrong.tau == 1.0
    assert 0 < wrong.drafting_share < 0.15
    np.testing.assert_array_equal(wrong.acceptance_by_position, 0.0)


class GuessingOracle(OracleChain):
    """An oracle whose first guess is its first draft, or a token it is not (`wrong`)."""

    def __init__(self, num_draft, wrong=False):
        super().__init__(num_draft)
        self.wrong = wrong

    def first_guess(self, params, state, ctx):
        token = OracleChain(1).propose(params, state, None, ctx, None)[1].tokens[:, 1]
        return (token + self.wrong) % CONFIG.vocab_size, ctx.active


@pytest.mark.parametrize("drafter, low, high", [(GuessingOracle(3), 0.9, 1.0), (GuessingOracle(3, wrong=True), 0.0, 0.1),
                                                (OracleChain(3), 0.5, 0.5)])
def test_the_engine_checks_the_first_guess_at_depth_zero_steps(drafter, low, high):
    plain = [1.0] + [np.inf] * 3  # every step at depth 0
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(drafter, costs=plain), max_len=MAX_LEN)
    state = engine.admit(engine.init_state(1), [0], PROMPTS[:1], 40)
    state = engine.decode(state, SamplingParams.make(1), 30)
    assert int(state.step) == 30
    assert low <= float(adaptive.acceptance(state.accept_stats)[0]) <= high  # no guess: the prior alone


def test_a_postponing_head_reads_what_it_queued_as_if_it_had_read_every_step():
    """Entries queued while no step drafts, read in one block (when drafting resumes or the queue
    is full), leave the head's cache and output where reading them step by step does."""
    plain = eagle3_drafter(CONFIG, PARAMS, depth=3)
    queueing = plain.postponing(6)
    batch, width, rng = 2, 4, np.random.default_rng(0)
    states = {d: d.init_state(batch, 64) for d in (plain, queueing)}
    # (accepted drafts per row, committed per row, does the next step draft, entries left queued):
    # a drafting step read at once; queued steps; a queue that fills (row 1 reaches 6) and is read
    # although no step drafts; queued again beside a finished row; read when drafting resumes.
    steps = [([2, 0], [3, 1], True, [0, 0]), ([1, 3], [2, 4], False, [2, 4]), ([0, 0], [1, 1], False, [3, 5]),
             ([0, 0], [1, 1], False, [0, 0]), ([0, 0], [1, 0], False, [1, 0]), ([0, 0], [1, 0], True, [0, 0])]
    for accepted, committed, drafts_next, left in steps:
        accepted = jnp.asarray(accepted, jnp.int32)
        offsets = jnp.arange(width)
        tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (batch, width)), jnp.int32)
        num_committed = jnp.asarray(committed, jnp.int32)
        commit = Commit(
            accepted=accepted, num_committed=num_committed, path=jnp.minimum(offsets[None], accepted[:, None]),
            next_token=tokens[:, -1], emitted=jnp.where(offsets[None] < num_committed[:, None], tokens, -1),
            drafts_next=jnp.asarray(drafts_next),
        )
        features = jnp.asarray(rng.normal(size=(batch, width, plain.taps.width(CONFIG.hidden_size))), jnp.float32)
        states = {d: d.update(d.params, s, None, None, commit, features) for d, s in states.items()}
        read, queued = states[plain], states[queueing]
        np.testing.assert_array_equal(queued.backlog.count, left)
        np.testing.assert_array_equal(queued.cache.lengths + queued.backlog.count, read.cache.lengths)
        if not any(left):  # all read: the same cache and output
            for row, length in enumerate(np.asarray(read.cache.lengths)):
                for name in ("k", "v"):
                    np.testing.assert_allclose(getattr(queued.cache, name)[:, row, :length], getattr(read.cache, name)[:, row, :length], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(queued.hidden, read.hidden, rtol=1e-5, atol=1e-5)
    assert plain.postponing(6).init_state(1, 8).backlog.tokens.shape == (1, 6) and plain.init_state(1, 8).backlog is None


def test_costs_are_measured_once_per_batch_size():
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2)), max_len=MAX_LEN)
    engine.measure_depth_costs = functools.partial(engine.measure_depth_costs, steps=2, repeats=1)  # quick
    costs = np.asarray(engine.depth_costs(2))  # whole steps timed at each forced depth
    assert costs.shape == (3,) and costs[0] == 1.0 and np.all(np.isfinite(costs)) and np.all(np.diff(costs) >= 0)
    assert engine.depth_costs(2) is engine.depth_costs(2)
    with pytest.raises(ValueError, match="one entry per depth 0 .. 2"):
        AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2), costs=[1.0, 1.5])


def test_specs():
    spec = MethodSpec.parse("eagle3:auto6")
    assert spec.adaptive and spec.num_spec == 6 and spec.label == "eagle3:auto6"
    assert MethodSpec.parse("ngram:auto") == MethodSpec("ngram", num_spec=5, adaptive=True)
    for text, error in [("ar:auto", "only chain methods"), ("lookahead:auto", "only chain methods"), ("draft:auto", "without writing state"),
                        ("eagle3:autox", "METHOD:auto"), ("eagle3:auto0", ">= 1")]:
        with pytest.raises(ValueError, match=error):
            MethodSpec.parse(text)
    with pytest.raises(ValueError, match="EAGLE-2 tree has no adaptive depth"):
        AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2, top_k=2, nodes=4))
    with pytest.raises(ValueError, match="writes its state while drafting"):  # a draft model's cache
        AdaptiveDepth(DraftModelDrafter(CONFIG, PARAMS, num_draft=2))
