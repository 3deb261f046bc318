"""Adaptive draft length (`NAME:auto`): the depth choice, its statistics, and the engine backing off."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import test_engine as engine_tests
from engine_helpers import ADAPTIVE_COSTS, eagle3_drafter
from specjax import tree as tree_lib
from specjax.drafters import adaptive
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import ChainDrafter, Commit, Proposal, StepContext
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine, Stats
from specjax.models import llama
from specjax.sampling import SamplingParams
from specjax.tree import causal_mask

CONFIG, PARAMS, PROMPTS, MAX_LEN = engine_tests.CONFIG, engine_tests.PARAMS, engine_tests.PROMPTS, engine_tests.MAX_LEN


def stats_for(alphas, weight=50.0, depth=4, classes=1):
    """[B, C, D, 2] counts that estimate the given acceptance rate at every position and class,
    with `weight` tries each."""
    alphas = np.asarray(alphas, np.float32)[:, None, None]
    counts = np.stack(np.broadcast_arrays(alphas * weight, np.float32(weight)), -1)  # [B, 1, 1, 2]
    return jnp.asarray(np.broadcast_to(counts, (len(alphas), classes, depth, 2)))


def choose(stats, costs, active=None, guess_class=None, drafts_without_guess=True, remaining=None, refills=True):
    """The depth chosen for a refilled batch (default) or a static one; rows have 1000 tokens to go."""
    batch = stats.shape[0]
    active = jnp.ones(batch, bool) if active is None else active
    guess_class = jnp.zeros(batch, jnp.int32) if guess_class is None else jnp.asarray(guess_class, jnp.int32)
    remaining = jnp.full(batch, 1000) if remaining is None else jnp.asarray(remaining, jnp.int32)
    return int(adaptive.choose_depth(
        stats, guess_class, active, remaining, jnp.asarray(costs), jnp.asarray(refills), drafts_without_guess
    ))


def test_choose_depth_prices_expected_tokens_against_cost():
    costs = [1.0, 1.1, 1.2, 1.3, 1.4]
    assert choose(stats_for([0.9, 0.9]), costs) == 4  # good drafts: the longest chain
    assert choose(stats_for([0.02, 0.02]), costs) == 0  # useless drafts: plain decoding
    # 0.5 acceptance: one draft emits 1.5 tokens for 1.1, more drafts add less than they cost.
    assert choose(stats_for([0.5, 0.5]), [1.0, 1.1, 1.5, 2.0, 2.5]) == 1
    # Only live rows count: a finished row with perfect drafts does not make the others draft.
    assert choose(stats_for([0.02, 0.99]), costs, active=jnp.array([True, False])) == 0
    # Free verification (flat costs): an acceptance worth the margin pays for the whole chain.
    assert choose(stats_for([0.2, 0.2]), np.ones(5)) == 4


def test_a_static_batch_drafts_only_where_its_slowest_row_gains():
    """Row 0's drafts are right, row 1's wrong. Refilled, every token row 0 gains is work done; in a
    static batch row 0 would only wait for row 1, unless row 0 is the one with most to go."""
    stats, costs = stats_for([0.9, 0.02]), [1.0, 1.1, 1.2, 1.3, 1.4]
    assert choose(stats, costs, remaining=[50, 50]) == 4
    assert choose(stats, costs, remaining=[50, 50], refills=False) == 0
    assert choose(stats, costs, remaining=[50, 10], refills=False) == 4
    # Finished rows do not count, however much they had to go.
    assert choose(stats, costs, remaining=[50, 90], refills=False, active=jnp.array([True, False])) == 4


def test_one_row_is_priced_alike_static_or_refilled():
    rng = np.random.default_rng(0)
    for _ in range(50):
        stats = stats_for(rng.uniform(0, 1, 1), depth=4)
        costs = np.concatenate([[1.0], np.sort(rng.uniform(1.0, 2.5, 4))])
        remaining = [int(rng.integers(1, 8))]
        assert choose(stats, costs, remaining=remaining) == choose(stats, costs, remaining=remaining, refills=False)


def test_a_row_is_never_priced_beyond_its_remaining_budget():
    good, costs = stats_for([0.99]), [1.0, 1.1, 1.2, 1.3, 1.4]  # near-certain drafts
    for refills in (True, False):
        assert choose(good, costs, remaining=[1], refills=refills) == 0  # one token left: nothing to draft
        assert choose(good, costs, remaining=[2], refills=refills) == 1  # a longer chain emits no more
        assert choose(good, costs, remaining=[9], refills=refills) == 4


def test_expected_tokens_follow_acceptance_by_position():
    """An n-gram chain: its first token is often wrong, but once right the rest follow. A
    geometric model with the pooled rate would misprice every depth."""
    counts = np.zeros((1, 1, 4, 2), np.float32)
    counts[0, 0, :, 1] = [100, 30, 25, 22]  # tried per position
    counts[0, 0, :, 0] = [30, 25, 22, 20]  # accepted
    alpha, prior = [], adaptive.PRIOR[0]
    for accepted, tried in counts[0, 0]:  # each position's pseudo-try is at the estimate before it
        alpha.append((accepted + prior) / (tried + 1))
        prior = alpha[-1]
    expected = adaptive.expected_tokens(jnp.asarray(counts), jnp.zeros(1, jnp.int32), True)[0]
    np.testing.assert_allclose(expected, 1 + np.concatenate([[0], np.cumsum(np.cumprod(alpha))]), rtol=1e-6)
    # One draft pays 1.3 for 1.4 (no); four pay about 2.0 for 1.7 (yes).
    assert choose(jnp.asarray(counts), [1.0, 1.4, 1.5, 1.6, 1.7]) == 4


def test_rows_are_priced_by_the_class_of_their_coming_guess():
    counts = np.array(stats_for([0.1], depth=3, classes=3))
    counts[0, 2] = np.asarray(stats_for([0.9], depth=3))[0, 0]  # long matches are right, the rest not
    stats, costs = jnp.asarray(counts), [1.0, 1.3, 1.4, 1.5]
    assert choose(stats, costs, guess_class=[2]) == 3
    assert choose(stats, costs, guess_class=[1]) == 0 and choose(stats, costs, guess_class=[0]) == 0
    # A drafter with nothing to draft without a guess never drafts for a row that has none.
    good = stats_for([0.9], depth=3, classes=3)
    assert choose(good, costs, guess_class=[0]) == 3
    assert choose(good, costs, guess_class=[0], drafts_without_guess=False) == 0


def test_observe_counts_tried_positions_and_decays():
    stats, active, none = jnp.zeros((3, 1, 3, 2)), jnp.array([True, True, False]), jnp.zeros(3, jnp.int32)
    observe = lambda stats, accepted, depth: adaptive.observe(stats, none, jnp.asarray(accepted), depth, active, jnp.zeros(3, bool))
    # Accepted 1 of a 3-chain (positions 1, 2 tried, the first accepted); all 3 accepted; inactive.
    stats = observe(stats, [1, 3, 3], 3)
    np.testing.assert_allclose(stats[:, 0], [[[1, 1], [0, 1], [0, 0]], [[1, 1], [1, 1], [1, 1]], [[0, 0]] * 3])
    again = observe(stats, [0, 0, 0], 3)  # only position 1 tried: it decays and counts; the rest stay
    expected = np.array(stats)
    expected[:2, 0, 0] = expected[:2, 0, 0] * adaptive.DECAY + [0, 1]
    np.testing.assert_allclose(again, expected)
    short = observe(stats, [2, 2, 0], 2)  # a 2-chain never tries position 3
    np.testing.assert_allclose(short[:, 0, 2], stats[:, 0, 2])
    idle = observe(stats, [0, 0, 0], 0)  # a step without drafts or guesses: back towards the prior
    np.testing.assert_allclose(idle, np.asarray(stats) * [[[[adaptive.IDLE_DECAY]]], [[[adaptive.IDLE_DECAY]]], [[[1.0]]]])
    # Without evidence: the prior at position 1, nothing deeper while no first draft was right.
    np.testing.assert_allclose(adaptive.acceptance(jnp.zeros((1, 3, 2))), [[adaptive.PRIOR[0], 0.0, 0.0]])
    # A position never reached is priced like the one before it: a right chain stays long.
    right = jnp.asarray([[[20.0, 20.0], [20.0, 20.0], [0.0, 0.0]]])
    assert float(adaptive.acceptance(right)[0, 2]) > 0.97
    # Right once but long ago (decayed to half a count): deeper positions at half the estimate.
    half = adaptive.acceptance(jnp.asarray([[[0.5, 1.0], [0.0, 0.0]]]))[0]
    np.testing.assert_allclose(half[1], half[0] * 0.5, rtol=1e-6)


def test_a_row_without_evidence_tries_one_draft_then_goes_deeper_once_right():
    """On the prior a fresh row tries a single draft, not a chain; a right one makes the chain long,
    a wrong one stops the drafting."""
    costs, none, one = [1.0, 1.3, 1.5, 1.7], jnp.zeros(1, jnp.int32), jnp.ones(1, bool)
    fresh = jnp.zeros((1, 1, 3, 2))
    assert choose(fresh, costs) == 1
    tried = lambda accepted: adaptive.observe(fresh, none, jnp.array([accepted]), 1, one, jnp.zeros(1, bool))
    assert choose(tried(1), costs) == 3
    assert choose(tried(0), costs) == 0


def test_drafting_must_beat_plain_decoding_by_the_margin():
    costs = [1.0, 1.2]
    assert 1.3 / 1.2 < adaptive.MARGIN < 1.4 / 1.2  # 0.3 would gain 8%, 0.4 gains 17%
    assert choose(stats_for([0.3], depth=1), costs) == 0
    assert choose(stats_for([0.4], depth=1), costs) == 1


def test_a_depth_zero_step_counts_a_checked_guess_in_its_class():
    stats = stats_for([0.2, 0.2, 0.2], weight=10.0, depth=2, classes=3)
    active, guess_class, right = jnp.array([True, True, False]), jnp.array([2, 0, 1]), jnp.array([True, True, True])
    new = adaptive.observe(stats, guess_class, jnp.zeros(3, jnp.int32), 0, active, right)
    expected = np.array(stats)
    expected[0, 2, 0] = expected[0, 2, 0] * adaptive.DECAY + [1, 1]  # row 0: position 1 of class 2
    expected[1, 0] *= adaptive.IDLE_DECAY  # row 1 has no guess: its class drifts to the prior
    np.testing.assert_allclose(new, expected, rtol=1e-6)  # row 2 is finished
    # Drafting steps count the chain, whatever the guess said.
    drafted = adaptive.observe(stats, guess_class, jnp.array([1, 1, 1]), 2, active, jnp.zeros(3, bool))
    np.testing.assert_allclose(drafted, adaptive.observe(stats, guess_class, jnp.array([1, 1, 1]), 2, active, right))


def test_a_fresh_row_with_a_guess_checks_it_before_drafting():
    """Without a guess a fresh row tries a chain on the optimistic prior; with one it first checks
    the guess at a step that does not draft, which costs nothing, and drafts once it was right."""
    fresh, costs, one = jnp.zeros((1, 2, 3, 2)), [1.0, 1.4, 1.55, 1.7], jnp.ones(1, bool)
    assert choose(fresh, costs, guess_class=[0]) > 0
    assert choose(fresh, costs, guess_class=[1]) == 0
    checked = lambda right: adaptive.observe(fresh, jnp.array([1]), jnp.zeros(1, jnp.int32), 0, one, jnp.array([right]))
    assert choose(checked(True), costs, guess_class=[1]) > 0
    assert choose(checked(False), costs, guess_class=[1]) == 0


def test_right_guesses_bring_a_row_back_to_drafting_within_a_few_steps():
    costs, active = [1.0, 1.3, 1.6], jnp.ones(1, bool)
    def steps_to_resume(guess_class):
        stats = stats_for([0.05], weight=20.0, depth=2, classes=2)  # a row that stopped drafting
        for step in range(1, 200):
            stats = adaptive.observe(stats, jnp.array([guess_class]), jnp.zeros(1, jnp.int32), 0, active, jnp.array([True]))
            if choose(stats, costs, guess_class=[guess_class]) > 0:
                return step
    assert steps_to_resume(1) <= 15 < 60 < steps_to_resume(0)


def test_an_infinite_cost_rules_a_depth_out():
    for stats in (stats_for([0.9, 0.9], depth=3), stats_for([0.0, 0.0], depth=3)):
        for depth in range(4):
            assert choose(stats, adaptive.forcing_costs(depth, 3)) == depth


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
    # Every step drafts, but a last one with one token to go: the first a single draft (the prior),
    # a last one no more than its tokens left, the rest the whole chain.
    assert np.all(stats.reached[:, 0] >= stats.calls - 1)
    assert stats.steps_by_depth[1] >= 1 and stats.steps_by_depth[1:3].sum() <= 2
    assert stats.tau > 3.5
    # A random EAGLE-3 head is never right: the rows stop drafting, only probing now and then.
    wrong = engine_tests.engine_for("eagle3-auto").generate(PROMPTS, max_new_tokens=engine_tests.NEW_TOKENS)
    assert wrong.tokens == autoregressive and wrong.tau == 1.0
    assert 0 < wrong.drafting_share < 0.15
    np.testing.assert_array_equal(wrong.acceptance_by_position, 0.0)


class HalfOracle(OracleChain):
    """The oracle for row 0; every other row's drafts are wrong."""

    def propose(self, params, state, key, ctx, sampling):
        state, proposal = super().propose(params, state, key, ctx, sampling)
        wrong = (proposal.tokens + 1) % CONFIG.vocab_size
        keep = (jnp.arange(proposal.tokens.shape[0]) == 0)[:, None] | (jnp.arange(proposal.tokens.shape[1]) == 0)[None, :]
        return state, proposal.replace(tokens=jnp.where(keep, proposal.tokens, wrong))


def test_a_static_batch_stops_drafting_for_one_row_a_refilled_one_does_not(autoregressive):
    """Rows 0 and 1 share a budget; only row 0's drafts are right. `generate` (static) soon stops
    drafting, since row 1 sets the batch's finish; decoding for a caller that refills slots keeps
    drafting for row 0. Both emit plain decoding's tokens."""
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(HalfOracle(3), costs=ADAPTIVE_COSTS), max_len=MAX_LEN)
    static = engine.generate(PROMPTS[:2], max_new_tokens=engine_tests.NEW_TOKENS)
    state = engine.admit(engine.init_state(2), [0, 1], PROMPTS[:2], engine_tests.NEW_TOKENS)
    state = engine.decode(state, SamplingParams.make(2), 2 * engine_tests.NEW_TOKENS, refills=True)
    assert static.tokens == engine.outputs(state) == autoregressive[:2]
    steps = int(state.step)
    assert int(state.steps_by_depth.sum()) == steps and static.steps_by_depth.sum() == static.calls.max()
    assert static.steps_by_depth[1:].sum() <= 3  # the prior's first tries
    assert int(state.steps_by_depth[1:].sum()) >= int(state.accepted_hist[0].sum()) - 1 > 3  # all of row 0's life


def test_ngram_auto_drafts_where_the_text_repeats(autoregressive):
    """The tiny model's greedy outputs repeat themselves: the lookup's guesses come right, the
    rows draft long chains, and the output is plain decoding's. (Refilled, so that each row's
    gains count; a static batch drafts only where its slowest row gains.)"""
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(NgramDrafter(3), costs=ADAPTIVE_COSTS), max_len=MAX_LEN)
    state = engine.admit(engine.init_state(len(PROMPTS)), range(len(PROMPTS)), PROMPTS, engine_tests.NEW_TOKENS)
    state = engine.decode(state, SamplingParams.make(len(PROMPTS)), 2 * engine_tests.NEW_TOKENS, refills=True)
    assert engine.outputs(state) == autoregressive
    stats = Stats(np.asarray(state.accepted_hist), np.asarray(state.reached), np.asarray(state.steps_by_depth), 0.0, 0.0, [])
    assert stats.drafting_share > 0.3 and stats.tau > 1.5  # rows that never drafted would leave tau at 1


class GuessingOracle(OracleChain):
    """An oracle whose first guess is its first draft, or a token it is not (`wrong`)."""

    def __init__(self, num_draft, wrong=False):
        super().__init__(num_draft)
        self.wrong = wrong

    guess_classes = 2

    def first_guess(self, ctx):
        token = OracleChain(1).propose((), (), None, ctx, None)[1].tokens[:, 1]
        return (token + self.wrong) % CONFIG.vocab_size, ctx.active.astype(jnp.int32)


@pytest.mark.parametrize("drafter, low, high", [(GuessingOracle(3), 0.9, 1.0), (GuessingOracle(3, wrong=True), 0.0, 0.1),
                                                (OracleChain(3), adaptive.PRIOR[0] - 1e-6, adaptive.PRIOR[0] + 1e-6)])
def test_the_engine_checks_the_first_guess_at_depth_zero_steps(drafter, low, high):
    plain = [1.0] + [np.inf] * 3  # every step at depth 0
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(drafter, costs=plain), max_len=MAX_LEN)
    state = engine.admit(engine.init_state(1), [0], PROMPTS[:1], 40)
    state = engine.decode(state, SamplingParams.make(1), 30)
    assert int(state.step) == 30
    first = adaptive.acceptance(state.accept_stats)[0, -1, 0]  # position 1 of the guessing class
    assert low <= float(first) <= high  # no guess: the prior alone


def test_a_postponing_head_reads_its_newest_queued_entries_when_drafting_resumes():
    """Entries queued while no step drafts are read in one block when drafting resumes: as long
    as no more than W were queued, the head's cache and output are where reading them step by
    step leaves them; beyond W a row keeps its newest W, read at their own target positions (its
    cache then lacks the older ones), and a depth-0 step never reads."""
    plain = eagle3_drafter(CONFIG, PARAMS, depth=3)
    size, batch, width, rng = 6, 2, 4, np.random.default_rng(0)
    queueing = plain.postponing(size)
    states = {d: d.init_state(batch, 64) for d in (plain, queueing)}
    lengths = jnp.zeros((batch,), jnp.int32)  # the target's
    queued_since = {}  # row -> [(features, token)] committed after the last read, in order

    def step(accepted, committed, drafts_next):
        nonlocal states, lengths
        accepted, num_committed, offsets = jnp.asarray(accepted, jnp.int32), jnp.asarray(committed, jnp.int32), jnp.arange(width)
        tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (batch, width)), jnp.int32)
        path = jnp.minimum(offsets[None], accepted[:, None])
        commit = Commit(
            accepted=accepted, num_committed=num_committed, path=path, next_token=tokens[:, -1],
            emitted=jnp.where(offsets[None] < num_committed[:, None], tokens, -1), drafts_next=jnp.asarray(drafts_next),
        )
        features = jnp.asarray(rng.normal(size=(batch, width, plain.taps.width(CONFIG.hidden_size))), jnp.float32)
        path_features = np.take_along_axis(np.asarray(features), np.asarray(path)[:, :, None], 1)
        for row in range(batch):
            queued_since.setdefault(row, []).extend((path_features[row, i], int(tokens[row, i])) for i in range(committed[row]))
        ctx = StepContext(pending=tokens[:, 0], lengths=lengths, history=None, active=jnp.ones((batch,), bool))
        states = {d: d.update(d.params, s, ctx, None, commit, features) for d, s in states.items()}
        lengths = lengths + num_committed

    # (accepted drafts per row, committed per row, does the next step draft, entries left queued):
    # a drafting step read at once; queued steps (row 1 reaches 5 of 6); read when drafting resumes.
    for accepted, committed, drafts_next, left in [([2, 0], [3, 1], True, [0, 0]), ([1, 3], [2, 4], False, [2, 4]),
                                                   ([0, 0], [1, 1], False, [3, 5]), ([0, 0], [1, 0], True, [0, 0])]:
        before = states[queueing]
        step(accepted, committed, drafts_next)
        read, queued = states[plain], states[queueing]
        np.testing.assert_array_equal(queued.backlog.count, left)
        np.testing.assert_array_equal(queued.cache.lengths + queued.backlog.count, read.cache.lengths)
        if not drafts_next:
            np.testing.assert_array_equal(queued.cache.lengths, before.cache.lengths)  # nothing read
            np.testing.assert_array_equal(queued.hidden, before.hidden)
    for row, length in enumerate(np.asarray(read.cache.lengths)):
        for name in ("k", "v"):
            np.testing.assert_allclose(getattr(queued.cache, name)[:, row, :, :length], getattr(read.cache, name)[:, row, :, :length], rtol=1e-5, atol=1e-5)  # [L, B, Hkv, S, D]
    np.testing.assert_allclose(queued.hidden, read.hidden, rtol=1e-5, atol=1e-5)

    # Beyond W: rows 0 / 1 queue 4 / 12 entries, then drafting resumes; each reads only its newest
    # min(queued, W), as a head that read them alone at their positions would.
    before, queued_since = states[queueing], {}
    for committed in ([1, 4], [1, 4], [1, 4], [1, 0]):
        step([0, 3], committed, False)
    step([0, 0], [0, 0], True)
    queued = states[queueing]
    np.testing.assert_array_equal(queued.backlog.count, [0, 0])
    np.testing.assert_array_equal(queued.cache.lengths, before.cache.lengths + np.array([4, size]))
    for row, entries in queued_since.items():
        newest = entries[-size:]
        start = lengths[row : row + 1] - len(newest)
        cache = before.cache  # the row's alone: [L, 1, Hkv, S, D]
        single = cache.replace(k=cache.k[:, row : row + 1], v=cache.v[:, row : row + 1], lengths=cache.lengths[row : row + 1])
        k, v, hidden = plain._read_block(
            plain.params, single, jnp.asarray(np.stack([f for f, _ in newest]))[None], jnp.asarray([[t for _, t in newest]]),
            jnp.asarray([len(newest)]), start,
        )
        at = int(before.cache.lengths[row])
        for name, block in (("k", k), ("v", v)):
            np.testing.assert_allclose(
                getattr(queued.cache, name)[:, row, :, at : at + len(newest)], np.moveaxis(np.asarray(block)[:, 0], 1, 2), rtol=1e-5, atol=1e-5
            )
        np.testing.assert_allclose(queued.hidden[row], hidden[0], rtol=1e-5, atol=1e-5)
    assert plain.postponing(6).init_state(1, 8).backlog.tokens.shape == (1, 6) and plain.init_state(1, 8).backlog is None


def test_measured_costs_resist_drift_and_a_disturbed_round(monkeypatch):
    """Timed on a fake clock: steps at depth d cost true[d], the machine slows down steadily over
    the measurement, and two rounds' depth-0 timings run four times slower. The per-round ratios
    of forth-and-back timings cancel the drift and the median over rounds drops the bad rounds."""
    true = np.array([1.0, 1.3, 1.5])
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2)), max_len=MAX_LEN)
    clock, calls = [0.0], []

    def decode(params, drafter_params, state, sampling, stop_step, costs, refills):
        depth = int(np.argmin(np.asarray(costs)))
        assert int(state.depth) == depth  # the first step runs at the forced depth too
        calls.append(depth)
        slow = 4.0 if 6 <= len(calls) <= 12 and depth == 0 else 1.0  # rounds 1 and 2 (call 1 compiles)
        clock[0] += true[depth] * (int(stop_step) - int(state.step)) * (1.0 + 0.05 * len(calls)) * slow
        return state.replace(step=stop_step)

    monkeypatch.setattr(engine, "_decode_jit", decode)
    monkeypatch.setattr("specjax.engine.time.perf_counter", lambda: clock[0])
    state = engine.init_state(2).replace(active=jnp.array([True, False]))
    costs = engine.measure_depth_costs(state, SamplingParams.make(2), steps=3, rounds=5)
    np.testing.assert_allclose(costs, true, rtol=1e-9)
    assert len(calls) == 1 + 5 * 2 * 3


def test_costs_are_measured_on_the_first_batch_of_each_size_which_decodes_as_if_unmeasured(autoregressive):
    engine = Engine(CONFIG, PARAMS, AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2)), max_len=MAX_LEN)
    measured, measure = [], engine.measure_depth_costs

    def quick(state, sampling, drafter_params=None):
        measured.append(state.pending.shape[0])
        return measure(state, sampling, drafter_params, steps=2, rounds=1)

    engine.measure_depth_costs = quick
    with pytest.raises(ValueError, match="measured by its first decode"):
        engine.depth_costs(2)
    first = engine.generate(PROMPTS[:2], max_new_tokens=engine_tests.NEW_TOKENS)
    assert first.tokens == autoregressive[:2]  # the timed copies left the batch as it was
    engine.generate(PROMPTS[2:4], max_new_tokens=engine_tests.NEW_TOKENS)
    assert measured == [2]
    costs = np.asarray(engine.depth_costs(2))  # whole steps timed at each forced depth
    assert costs.shape == (3,) and costs[0] == 1.0 and np.all(np.isfinite(costs)) and np.all(np.diff(costs) >= 0)
    with pytest.raises(ValueError, match="needs an active row"):
        measure(engine.init_state(2), SamplingParams.make(2))
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
