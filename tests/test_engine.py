"""The engine: greedy losslessness for every method, batching, limits, errors, compilation."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import OracleTreeDrafter, all_drafters, eagle3_drafter, tiny_config, tiny_params
from specjax import kv_cache as kv
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import run_or_zeros, trace_once
from specjax.drafters.draft_model import DraftModelDrafter
from specjax import engine as engine_module
from specjax.engine import Engine, memory_maps
from specjax.sampling import SamplingParams

CONFIG = tiny_config(num_layers=4)
PARAMS = tiny_params(CONFIG, seed=0, scale=30.0)
MAX_LEN = 128
NEW_TOKENS = 64
# Repetitive prompts give n-gram lookup something to find.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 12, 13],
    [20, 21, 22, 23, 24, 25, 20, 21, 22],
    [40, 41, 42, 40, 41],
]
DRAFTERS = all_drafters(CONFIG, PARAMS)


@functools.cache
def engine_for(method: str | None) -> Engine:
    """One engine (one compilation) per method, shared by the tests."""
    return Engine(CONFIG, PARAMS, DRAFTERS[method] if method else None, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def autoregressive():
    """Greedy reference tokens: each prompt alone, plain autoregressive decoding."""
    return [engine_for(None).generate([p], max_new_tokens=NEW_TOKENS).tokens[0] for p in PROMPTS]


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_greedy_speculative_equals_autoregressive(method, autoregressive):
    """Each row of a batch of four equals its prompt decoded alone, autoregressively."""
    batch = engine_for(method).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert batch.tokens == autoregressive
    assert all(len(t) == NEW_TOKENS for t in batch.tokens)
    assert batch.calls.sum() > 0


@pytest.mark.parametrize("method", ["draft-random", "eagle3-chain", "eagle1-chain"])
def test_a_drafter_cache_of_any_engine_length(method, autoregressive):
    """A drafter's own cache is as long as the engine's, which need only be a multiple of the
    engine's attention chunk (320 of 64 here), not of the drafter's (256)."""
    engine = Engine(CONFIG, PARAMS, DRAFTERS[method], max_len=320, attention_chunk=64)
    assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS).tokens == autoregressive


def test_agreeing_drafts_are_fully_accepted():
    for method in ("draft-self", "oracle-tree"):
        drafter = DRAFTERS[method]
        stats = engine_for(method).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        # Every verifier call accepts the whole path (the final, truncated one aside).
        assert stats.tau > drafter.max_depth + 0.5, method
        np.testing.assert_allclose(stats.acceptance_by_position, 1.0)


def test_random_draft_is_mostly_rejected():
    stats = engine_for("draft-random").generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert stats.tau < 2.0


def test_rows_finish_at_different_times():
    eos = 3
    config = tiny_config(num_layers=4, eos=(eos,))
    engine = Engine(config, PARAMS, DRAFTERS["ngram"], max_len=MAX_LEN)
    reference = Engine(config, PARAMS, max_len=MAX_LEN)
    stats = engine.generate(PROMPTS, max_new_tokens=[7, 30, 64, 1])
    assert [len(t) for t in stats.tokens] <= [7, 30, 64, 1]
    for prompt, limit, tokens in zip(PROMPTS, [7, 30, 64, 1], stats.tokens):
        assert tokens == reference.generate([prompt], max_new_tokens=limit).tokens[0]
        assert len(tokens) == limit or tokens[-1] == eos
    # Forcing an EOS early: a row whose every token is EOS stops after one.
    forced = Engine(config, PARAMS, DRAFTERS["ngram"], max_len=MAX_LEN, eos_ids=tuple(range(config.vocab_size)))
    assert [len(t) for t in forced.generate(PROMPTS, max_new_tokens=20).tokens] == [1, 1, 1, 1]


def test_prompt_at_the_cache_limit():
    drafter = DRAFTERS["ngram"]
    engine = engine_for("ngram")
    new_tokens = 16
    fits = MAX_LEN - new_tokens - drafter.num_nodes
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, CONFIG.vocab_size, fits)]
    stats = engine.generate([prompt], max_new_tokens=new_tokens)
    assert stats.tokens[0] == engine_for(None).generate([prompt], max_new_tokens=new_tokens).tokens[0]
    with pytest.raises(ValueError, match="cache slots"):
        engine.generate([prompt + [1]], max_new_tokens=new_tokens)


def test_bad_inputs_are_named():
    engine = engine_for(None)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[CONFIG.vocab_size]])
    with pytest.raises(ValueError, match="sampling params are for 2 rows"):
        engine.generate([[1]], SamplingParams.make(2))
    direct = SamplingParams.make(2)  # built field by field, as a server does: checked all the same
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]; row 1 has 0.0"):
        engine.generate([[1], [2]], direct.replace(top_p=jnp.array([1.0, 0.0])))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0 \\(0 = greedy\\); row 0 has nan"):
        engine.generate([[1], [2]], direct.replace(temperature=jnp.array([np.nan, 1.0])))
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams.make(1, temperature=float("nan"))
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        engine.generate([[1]], seed=2**32)
    other = tiny_config(vocab_size=CONFIG.vocab_size + 1, num_layers=1, hidden_size=16)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(CONFIG, PARAMS, DraftModelDrafter(other, tiny_params(other, 1)), max_len=MAX_LEN)
    with pytest.raises(ValueError, match="vocabulary"):
        eagle3_drafter(CONFIG, PARAMS).check_target(other)
    head = DRAFTERS["eagle3-chain"].params
    with pytest.raises(ValueError, match=r"drafter_params\['head'\]\['fc'\]: expected \(\(96, 32\)"):
        engine_for("eagle3-chain").generate(PROMPTS, drafter_params={**head, "head": {**head["head"], "fc": head["head"]["fc"].T}})


def test_new_prompts_do_not_recompile():
    """Warmed up for a batch size, nothing compiles again for new prompts, lengths, sampling or streaming."""
    engine = Engine(CONFIG, PARAMS, DRAFTERS["eagle3-tree"], max_len=MAX_LEN)
    jitted = (engine._fresh_jit, engine._prefill_jit, engine._place_jit, engine._decode_jit)
    engine.warmup(4, refills=True)
    sizes = [f._cache_size() for f in jitted]
    assert sizes == [2, 8, 1, 1]  # prefill widths 16, 32, 64, 128 for a batch and for one row put into it
    for length in (2, 17, 40, 70, 90):  # every prefill width, in full chunks and tails
        prompts = [(p * length)[:length] for p in PROMPTS]
        engine.generate(prompts, SamplingParams.make(4, temperature=0.7, top_p=0.9), max_new_tokens=20, seed=length)
    engine.generate([p * 3 for p in PROMPTS], max_new_tokens=12, on_step=lambda rows: None, steps_per_sync=2)
    assert [f._cache_size() for f in jitted] == sizes
    single = engine.generate(PROMPTS[:1], max_new_tokens=8)  # a new batch size compiles once more
    assert single.tokens == engine_for(None).generate(PROMPTS[:1], max_new_tokens=8).tokens
    assert [f._cache_size() for f in jitted] == [2, 8, 1, 2]  # its decode loop
    # One prompt into a running batch of four, any slot, any length: compiled by the warmup.
    state = engine.admit(engine.init_state(4), [1], PROMPTS[:1], 8)
    state = engine.admit(state, [3], [PROMPTS[2] * 5], 8)
    assert [f._cache_size() for f in jitted] == [2, 8, 1, 2]


def test_a_one_shot_warmup_compiles_what_its_prompts_need():
    """`warmup_prompts` compiles the prefill widths the prompts use and the decode loop, nothing
    else: the run after it compiles nothing and returns what an engine warmed up whole does."""
    engine = Engine(CONFIG, PARAMS, DRAFTERS["eagle3-chain"], max_len=MAX_LEN)
    jitted = (engine._fresh_jit, engine._prefill_jit, engine._place_jit, engine._decode_jit)
    prompts = [(p * 30)[:length] for p, length in zip(PROMPTS, (20, 25, 30, 40))]  # one 64-wide window
    sampling = SamplingParams.make(4, temperature=0.7)
    assert engine.warmup_prompts(prompts, sampling) > 0
    sizes = [f._cache_size() for f in jitted]
    assert sizes == [1, 1, 0, 1]
    run = engine.generate(prompts, sampling, max_new_tokens=20, seed=3)
    assert [f._cache_size() for f in jitted] == sizes
    assert run.tokens == engine_for("eagle3-chain").generate(prompts, sampling, max_new_tokens=20, seed=3).tokens


def test_prefill_windows_end_in_the_narrowest_width_that_holds_the_rest():
    engine = engine_for(None)
    assert engine._prefill_windows(9) == [(0, 16)]
    assert engine._prefill_windows(300) == [(0, 128), (128, 128), (256, 64)]
    # Chunked into 16s or into one 128 and a tail, a prompt prefills to the same cache.
    narrow = Engine(CONFIG, PARAMS, DRAFTERS["eagle3-chain"], max_len=MAX_LEN, prefill_chunk=16)
    prompts = [(p * 20)[:length] for p, length in zip(PROMPTS, (19, 33, 45, 60))]
    assert narrow.generate(prompts, max_new_tokens=24).tokens == engine_for("eagle3-chain").generate(prompts, max_new_tokens=24).tokens


@pytest.mark.parametrize("method", ["eagle3-tree", "draft-random"])  # a head's state, a draft model's cache
def test_a_finished_slot_takes_a_new_prompt(method, autoregressive):
    """Slots: row 0 finishes early and takes a new prompt while row 1 keeps decoding."""
    engine, greedy = engine_for(method), SamplingParams.make(2)
    state = engine.admit(engine.init_state(2), [0, 1], PROMPTS[:2], [5, NEW_TOKENS])
    while bool(state.active[0]):
        state = engine.decode(state, greedy, 1)
    assert engine.outputs(state)[0] == autoregressive[0][:5] and bool(state.active[1])
    state = engine.admit(state, [0], [PROMPTS[2]], NEW_TOKENS)
    state = engine.decode(state, greedy, 2 * NEW_TOKENS)
    assert engine.outputs(state) == [autoregressive[2], autoregressive[1]]
    with pytest.raises(ValueError, match="distinct slots"):
        engine.admit(state, [2], [PROMPTS[0]], 4)


def assert_same_state(kept, fresh, *, atol=1e-5):
    """Two drafter states (or target caches) hold the same: every cache's entries below its rows'
    lengths, every other leaf whole."""
    is_cache = lambda x: isinstance(x, kv.KVCache)
    for a, b in zip(jax.tree.leaves(kept, is_leaf=is_cache), jax.tree.leaves(fresh, is_leaf=is_cache)):
        if not is_cache(a):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol)
            continue
        lengths = np.asarray(a.lengths)
        np.testing.assert_array_equal(lengths, np.asarray(b.lengths))
        for row, length in enumerate(lengths):
            for x, y in ((a.k, b.k), (a.v, b.v)):  # [L, B, Hkv, S, D]
                np.testing.assert_allclose(x[:, row, :, :length], y[:, row, :, :length], atol=atol)


#: Drafters of every kind of state: none, a head's cache and output (with and without a queue of
#: postponed entries), a draft model's cache, Medusa's last feature, Lookahead's pool.
REUSING = [None, "ngram", "eagle3-chain", "eagle3-ngram-auto", "eagle1-tree", "draft-random", "medusa-chain", "lookahead"]


@pytest.mark.parametrize("method", REUSING)
def test_a_row_keeps_the_cached_prefix_of_its_next_prompt(method):
    """A conversation's next turn in the row that held the last: only the tokens past what the
    row's cache holds are prefilled, the drafter's state equals a fresh admission's, and the row
    generates what the prompt does afresh."""
    engine, greedy = engine_for(method), SamplingParams.make(2)
    finished = engine.decode(engine.admit(engine.init_state(2), [0, 1], PROMPTS[:2], 12), greedy, 100)
    next_turn = PROMPTS[0] + engine.outputs(finished)[0] + [30, 31, 32, 33]  # the context, the reply, a new message
    diverging = PROMPTS[1][:2] + [50, 51, 52, 53, 54]  # shares two tokens with row 1's prompt
    prompts, max_new = [next_turn, diverging], NEW_TOKENS - 12
    rereads = int(method not in (None, "ngram"))  # a drafter with state reads the last kept position again

    marked = jax.tree.map(jnp.copy, finished)
    marked = marked.replace(cache=marked.cache.replace(k=marked.cache.k.at[:, :, :, :3].set(1e4)))  # kept slots keep it
    k = np.asarray(engine.admit(marked, [0, 1], prompts, max_new, reuse_prefix=True).cache.k)  # [L, B, Hkv, S, D]
    assert np.all(k[:, 0, :, :3] == 1e4)  # row 0 kept its whole context
    shared = 2 - rereads
    assert np.all(k[:, 1, :, :shared] == 1e4) and not np.any(k[:, 1, :, shared] == 1e4)  # row 1 kept the shared slots

    state = engine.admit(finished, [0, 1], prompts, max_new, reuse_prefix=True)
    fresh = engine.admit(engine.init_state(2), [0, 1], prompts, max_new)
    assert list(np.asarray(state.cache.lengths)) == [len(next_turn) - 1, len(diverging) - 1]
    assert_same_state(state.cache, fresh.cache)  # kept or prefilled, every slot holds the prompt's keys and values
    assert_same_state(state.drafter_state, fresh.drafter_state, atol=1e-4)
    assert engine.outputs(engine.decode(state, greedy, 100)) == engine_for(None).generate(prompts, max_new_tokens=max_new).tokens


def test_a_head_keeps_its_entries_only_up_to_the_first_gap():
    """An adaptive head drops the oldest entries of a long plain stretch and reads the rest when it
    drafts again, leaving a gap in its cache: a next turn keeps its entries up to the gap (the
    first prompt) and prefills the rest."""
    def engine_at(costs):  # the same head; the costs decide whether it drafts
        return Engine(CONFIG, PARAMS, AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=3), costs=costs), max_len=MAX_LEN)

    plain, eager, greedy = engine_at([1.0, 50.0, 50.0, 50.0]), engine_at([1.0, 0.5, 0.5, 0.5]), SamplingParams.make(1)
    state = plain.decode(plain.admit(plain.init_state(1), [0], PROMPTS[:1], 60), greedy, 40)  # 40 entries queued
    finished = eager.decode(state, greedy, 100)
    head, prompt_entries = finished.drafter_state, len(PROMPTS[0]) - 1
    assert int(finished.steps_by_depth[1:].sum()) > 0  # it drafted, reading what the queue kept
    assert int(head.backlog.aligned[0]) == prompt_entries < int(head.cache.lengths[0])
    next_turn = PROMPTS[0] + eager.outputs(finished)[0] + [30, 31]
    state = eager.admit(finished, [0], [next_turn], 8, reuse_prefix=True)
    fresh = eager.admit(eager.init_state(1), [0], [next_turn], 8)
    assert_same_state(state.drafter_state, fresh.drafter_state, atol=1e-4)
    assert eager.outputs(eager.decode(state, greedy, 20)) == eager.outputs(eager.decode(fresh, greedy, 20))


def test_a_drafter_that_cannot_keep_its_state_refuses_a_kept_prefix():
    class Forgetful(OracleTreeDrafter):  # state of the prompt, and no keep_prefix
        def init_state(self, batch_size, max_len):
            return jnp.zeros((batch_size,), jnp.int32)

    engine = Engine(CONFIG, PARAMS, Forgetful(CONFIG, PARAMS, depth=1), max_len=MAX_LEN)
    assert not engine.reuses_prefixes and engine_for("eagle3-chain").reuses_prefixes
    with pytest.raises(ValueError, match="cannot keep a cached prefix"):
        engine.admit(engine.init_state(1), [0], PROMPTS[:1], 4, reuse_prefix=True)


@pytest.mark.parametrize("method", ["draft-random", "eagle3-tree"])
def test_a_row_samples_the_same_wherever_it_sits(method):
    """Per-row random streams: (seed, index in its admission) fixes a row's samples."""
    engine, hot = engine_for(method), lambda batch: SamplingParams.make(batch, temperature=1.0)
    alone = engine.generate(PROMPTS[:1], hot(1), max_new_tokens=24, seed=5).tokens[0]
    assert engine.generate(PROMPTS[:2], hot(2), max_new_tokens=24, seed=5).tokens[0] == alone
    state = engine.admit(engine.init_state(2), [0], PROMPTS[1:2], 24, seed=9)
    state = engine.decode(state, hot(2), 3)
    state = engine.admit(state, [1], PROMPTS[:1], 24, seed=5)  # joins a running batch, in slot 1
    assert engine.outputs(engine.decode(state, hot(2), 100))[1] == alone
    assert engine.generate(PROMPTS[:1], hot(1), max_new_tokens=24, seed=6).tokens[0] != alone


def test_streaming_matches_one_shot():
    engine = engine_for("ngram")
    seen = []
    streamed = engine.generate(PROMPTS, max_new_tokens=24, on_step=seen.append, steps_per_sync=3)
    assert streamed.tokens == engine.generate(PROMPTS, max_new_tokens=24).tokens
    assert len(seen) > 1 and all(len(a) <= len(b) for a, b in zip(seen[0], seen[-1]))


def test_profile_step_times_every_piece():
    timings = engine_for("eagle3-tree").profile_step(PROMPTS, repeats=2)
    assert sorted(timings) == ["decode", "draft", "verify"]
    assert all(0 < t < 10 for t in timings.values())


def test_an_engine_warns_when_the_process_is_short_of_memory_maps(monkeypatch):
    config = tiny_config()
    params = tiny_params(config, 0)
    monkeypatch.setattr(engine_module, "memory_maps", lambda: (60000, 65530))
    with pytest.warns(ResourceWarning, match="holds 60000 of the 65530 memory maps"):
        Engine(config, params, max_len=64)
    monkeypatch.setattr(engine_module, "memory_maps", lambda: (1000, 65530))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        Engine(config, params, max_len=64)


def test_memory_maps_counts_this_process():
    held, cap = memory_maps()
    assert 0 < held < cap


def test_trace_once_runs_the_python_once_and_replays_its_computation():
    """The decode step's conditionals take a function's result shapes from the one trace that
    also builds its branch: the function's Python runs once per use, its results unchanged."""
    calls = []

    def fn(x):
        calls.append(x.shape)
        return {"double": 2 * x, "norm": jnp.sqrt(jnp.sum(x * x)), "nothing": None}

    @jax.jit
    def replayed_and_gated(x, pred):
        replay, shapes = trace_once(lambda: fn(x))
        assert shapes["double"].shape == x.shape and shapes["norm"].dtype == x.dtype and shapes["nothing"] is None
        return replay(), run_or_zeros(pred, lambda: fn(x))

    x = jnp.arange(6.0).reshape(2, 3)
    for pred in (True, False):
        replayed, gated = replayed_and_gated(x, pred)
        expected = fn(x)
        np.testing.assert_array_equal(replayed["double"], expected["double"])
        np.testing.assert_allclose(replayed["norm"], expected["norm"], rtol=1e-6)
        np.testing.assert_array_equal(gated["double"], expected["double"] if pred else jnp.zeros_like(x))
        assert gated["nothing"] is None and float(gated["norm"]) == pytest.approx(float(expected["norm"]) if pred else 0.0)
    assert len(calls) == 2 + 2  # one trace for each of the two uses (a second call reuses the compilation), 2 eager
