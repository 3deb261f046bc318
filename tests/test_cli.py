"""The command lines on the embedded SmolLM2 (slow: real weights) and their error messages."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

from infer import bench, common, generate, tune
from specjax.drafters.registry import MethodSpec

PROMPT = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta."


@pytest.fixture(scope="module", autouse=True)
def read_each_checkpoint_once():
    """The commands here load the same embedded SmolLM2 again and again: each file (and dtype) is
    read once per module, its first command reading it for real (loading has its own tests)."""
    models, tokenizers = {}, {}
    load_model, load_tokenizer = common.checkpoints.load_model, common.tokenizer_lib.load

    def model_once(path, *dtype):
        if (str(path), *dtype) not in models:
            models[str(path), *dtype] = load_model(path, *dtype)
        return models[str(path), *dtype]

    def tokenizer_once(path):
        if str(path) not in tokenizers:
            tokenizers[str(path)] = load_tokenizer(path)
        return tokenizers[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common.checkpoints, "load_model", model_once)
        patch.setattr(common.tokenizer_lib, "load", tokenizer_once)
        yield


def run_generate(capsys, *argv: str) -> str:
    generate.main(list(argv))
    return capsys.readouterr().out


@pytest.mark.slow
def test_generate_speculative_text_equals_autoregressive(capsys):
    common = ["--prompt", PROMPT, "--max-new-tokens", "12", "--max-len", "256", "--no-stream"]
    plain = run_generate(capsys, *common)
    ngram = run_generate(capsys, "--method", "ngram", "--num-spec", "4", *common)
    text = lambda out: out.split("--- [0] ")[1].split("\n[")[0]
    assert text(plain) == text(ngram)
    assert "tokens/s" in ngram and "compile" in ngram
    assert "tau" in ngram and "acceptance by position" in ngram
    streamed = run_generate(capsys, "--method", "ngram", "--num-spec", "4", *common[:-1])
    assert streamed.startswith(text(plain))
    # The shipped draft, its 4-token verification blocks through the streamed matmul kernels.
    ngram_first = run_generate(capsys, "--method", "eagle3+ngram", "--num-spec", "3", "--matmuls", "streamed", *common)
    assert text(ngram_first) == text(plain) and "tau" in ngram_first
    for tree in ([], ["--tree", "3,2,5"]):  # the shipped Medusa heads, a chain and a static tree
        heads = run_generate(capsys, "--method", "medusa", *tree, *common)
        assert text(heads) == text(plain) and "tau" in heads
    for method in (["eagle1"], ["eagle1", "--tree", "3,2,5"], ["eagle1-static"]):  # the shipped EAGLE-1 draft
        feature_draft = run_generate(capsys, "--method", *method, *common)
        assert text(feature_draft) == text(plain) and "tau" in feature_draft


@pytest.mark.slow
def test_chat_keeps_the_conversation_in_the_cache(capsys, monkeypatch):
    """--chat: the second turn prefills only what follows the first turn's context, and answers
    what the whole conversation prefilled afresh does."""
    import io
    import re

    from specjax import checkpoints
    from specjax import tokenizer as tokenizer_lib
    from specjax.engine import Engine

    questions = ["Name three colors.", "", "Which of them is the color of the sky?"]  # a blank line is skipped
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(questions) + "\n"))
    admit, reused = Engine.admit, []
    def spy(self, *args, reuse_prefix=False, **kwargs):
        reused.append(reuse_prefix)
        return admit(self, *args, reuse_prefix=reuse_prefix, **kwargs)
    monkeypatch.setattr(Engine, "admit", spy)
    generate.main(["--chat", "--method", "eagle3", "--num-spec", "3", "--max-new-tokens", "16", "--max-len", "256"])
    captured = capsys.readouterr()
    assert reused[-2:] == [True, True]  # the two turns (after the warm-up's admissions)
    monkeypatch.setattr(Engine, "admit", admit)
    turns = [tuple(map(int, found)) for found in re.findall(r"turn \d: (\d+) of (\d+) prompt tokens", captured.err)]
    path = checkpoints.default_model_path()
    tokenizer = tokenizer_lib.load(path)
    engine = Engine(*checkpoints.load_model(path), max_len=256, eos_ids=tokenizer.eos_token_ids)

    def reply(ids):  # greedy, the whole prompt prefilled afresh
        tokens = engine.generate([ids], max_new_tokens=16).tokens[0]
        return tokenizer.decode([t for t in tokens if t not in engine.eos_ids], skip_special_tokens=True)

    first = tokenizer.encode(tokenizer.chat_prompt(questions[0]))
    messages = [{"role": "user", "content": questions[0]}, {"role": "assistant", "content": reply(first)},
                {"role": "user", "content": questions[2]}]
    second = tokenizer.encode(tokenizer.render_chat(messages))
    assert captured.out == f"{reply(first)}\n{reply(second)}\n"
    assert turns[0] == (0, len(first)) and turns[1][1] == len(second)
    assert len(first) <= turns[1][0] < len(second)  # the first turn's context, then the new message
    with pytest.raises(ValueError, match="--chat reads its messages from stdin"):
        generate.main(["--chat", "--prompt", "hi"])


@pytest.mark.slow
def test_generate_rejects_a_prompt_longer_than_the_cache():
    with pytest.raises(ValueError, match="cache slots"):
        generate.main(["--prompt", "word " * 200, "--max-len", "128", "--max-new-tokens", "8"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temprature", "0.5"], "unrecognized arguments: --temprature"),
        (["--temperature", "nan"], "--temperature: expected a number >= 0, got 'nan'"),
        (["--top-p", "0"], "--top-p: expected a number in (0, 1]"),
        (["--max-len", "0"], "--max-len: expected an integer >= 1"),
        (["--steps-per-sync", "-1"], "--steps-per-sync: expected an integer >= 1"),
        (["--seed", str(2**64)], "--seed: expected a seed in [0, 4294967295]"),
        (["--tree", "3,2"], "--tree: expected DEPTH,TOPK,NODES (three positive integers"),
        (["--tree", "2,2,9"], "NODES must be <= TOPK + (DEPTH-1)*TOPK^2"),
        (["--lookahead", "4,0,4"], "--lookahead: expected WINDOW,NGRAM,GUESSES"),
        (["--method", "hydra"], "--method: invalid choice: 'hydra'"),
    ],
)
def test_bad_flags_are_named_while_parsing(argv, message, capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "ar", "--num-spec", "3"], "ar drafts nothing"),
        (["--method", "ngram", "--tree", "3,2,4"], "--tree does not apply to --method ngram"),
        (["--method", "eagle3+ngram", "--tree", "3,2,4"], "--tree does not apply to --method eagle3\\+ngram"),
        (["--method", "eagle3", "--lookahead", "4,3,4"], "--lookahead does not apply to --method eagle3"),
        (["--method", "lookahead", "--num-spec", "3"], "lookahead takes WINDOW,NGRAM,GUESSES, not a number"),
        (["--method", "eagle3", "--min-ngram", "2"], "eagle3 does no prompt lookup"),
        (["--method", "ngram", "--draft", "somewhere"], "--draft is not used by ngram:5"),
        (["--raw", "--system", "be brief"], "--system applies to the chat template"),
        (["--prompts-file", "/nonexistent.jsonl"], "/nonexistent.jsonl: No such file"),
    ],
)
def test_inapplicable_flags_fail_before_loading(argv, message, monkeypatch):
    monkeypatch.setattr(generate.common, "load_target", lambda args: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=message):
        generate.main(argv)


def test_max_len_beyond_the_models_positions_is_refused(monkeypatch):
    from engine_helpers import tiny_config

    config = tiny_config()  # 4096 positions
    monkeypatch.setattr(generate.common.checkpoints, "load_model", lambda path, dtype: (config, {}))
    with pytest.raises(ValueError, match="--max-len 8192 exceeds the model's 4096 positions"):
        generate.main(["--max-len", "8192", "--model", "tiny"])


def test_a_command_run_again_loads_its_compiled_programs(tmp_path, monkeypatch, caplog):
    """--compile-cache: the first run writes its compiled programs there; a run that has nothing
    compiled in memory (as a new process) loads its decode and prefill programs from there instead
    of compiling them, and generates the same tokens; `off` neither reads nor writes. (The test
    processes run with JAX's cache off: on here.)"""
    import logging

    import jax
    from checkpoint_helpers import tiny_llama, word_tokenizer

    from specjax.engine import Engine

    model = tmp_path / "model"
    tiny_llama().save_pretrained(model)
    word_tokenizer().save_pretrained(model)
    argv = ["--model", str(model), "--raw", "--prompt", "hi there you", "--method", "ngram", "--num-spec", "2",
            "--max-new-tokens", "6", "--max-len", "64", "--no-stream", "--compile-cache"]
    outputs = []
    engine_generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda *a, **k: outputs.append(engine_generate(*a, **k)) or outputs[-1])
    caplog.set_level(logging.DEBUG, logger="jax._src.compiler")

    def run(cache: str) -> tuple[list[list[int]], dict[str, set[str]]]:
        """The tokens generated, and the engine's programs the cache held ("hit") or not ("miss")."""
        jax.clear_caches()
        caplog.clear()
        generate.main(argv + [cache])
        found = {"hit": set(), "miss": set()}
        for record in caplog.records:
            text = record.getMessage().lower()
            kind = "hit" if "cache hit" in text else "miss" if "cache miss" in text else None
            found.get(kind, set()).update(p for p in ("jit__decode", "jit__prefill_chunk") if f"'{p}'" in text)
        return outputs[-1].tokens, found

    cache = tmp_path / "xla"
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this tiny model's programs too
    try:
        first, found = run(str(cache))
        assert found["miss"] == {"jit__decode", "jit__prefill_chunk"} and not found["hit"]
        assert any(name.startswith("jit__decode") for name in os.listdir(cache))
        again, found = run(str(cache))
        assert again == first and found["hit"] == {"jit__decode", "jit__prefill_chunk"} and not found["miss"]
        written = sorted(os.listdir(cache))
        unused, found = run("off")
        assert unused == first and not found["hit"] and sorted(os.listdir(cache)) == written
    finally:
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def test_prompts_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "system", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=f"{path}:3: expected a 'prompt' string or 'messages' with a user turn"):
        generate.read_prompts_file(str(path))
    path.write_text('{"prompt": "hi"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object"):
        generate.read_prompts_file(str(path))
    path.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        generate.read_prompts_file(str(path))
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}\n')
    assert generate.read_prompts_file(str(path)) == ["b"]


def test_method_specs_parse_and_fail_clearly():
    specs = bench.split_methods("ngram:5,eagle3:4,4,16,eagle3:3,eagle3+ngram:3")
    assert [s.label for s in specs] == ["ar", "ngram:5", "eagle3:4,4,16", "eagle3:3", "eagle3+ngram:3"]
    with pytest.raises(ValueError, match="unknown method 'hydra'"):
        bench.split_methods("hydra:3")
    with pytest.raises(ValueError, match="ngram drafts chains, not trees"):
        bench.split_methods("ngram:4,4,16")
    with pytest.raises(ValueError, match="eagle3\\+ngram drafts chains, not trees"):
        bench.split_methods("eagle3+ngram:4,2,8")
    with pytest.raises(ValueError, match="ar drafts nothing"):
        bench.split_methods("ar:3")
    lookahead = bench.split_methods("lookahead,lookahead:8,4,2")
    assert [s.label for s in lookahead] == ["ar", "lookahead:2,3,2", "lookahead:8,4,2"]
    with pytest.raises(ValueError, match="expected WINDOW,NGRAM,GUESSES"):
        bench.split_methods("lookahead:4,3")


def test_bench_and_tune_refuse_flags_they_do_not_take(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--method", "ngram"])  # not an abbreviation of --methods
    assert "unrecognized arguments: --method" in capsys.readouterr().err
    for argv in (["--num-spec", "3"], ["--tree", "3,2,4"]):
        with pytest.raises(SystemExit):
            tune.parse_args(argv)
    with pytest.raises(ValueError, match="--draft is not used by ar, ngram:5"):
        bench.parse_args(["--methods", "ar,ngram:5", "--draft", "somewhere"])
    with pytest.raises(ValueError, match="not a method tune can rank"):
        tune.parse_args(["--methods", "ar"])



def test_passes_interleave_engines_batch_by_batch_in_alternating_order():
    calls = []

    class Engine:  # decodes a batch in 1 s per row-token, recording who decoded what
        def __init__(self, name):
            self.name = name

        def generate(self, batch, sampling, max_new_tokens, seed=0):
            calls.append((self.name, batch, max_new_tokens))
            return types.SimpleNamespace(decode_s=float(len(batch)), num_generated=len(batch) * max_new_tokens)

    batches = [["p0"], ["p1"], ["p2"]]
    passes = bench.interleaved_passes({k: Engine(k) for k in ("ar", "m1", "m2")}, batches, None, max_new_tokens=8, repeats=2)
    timed = [(name, batch[0]) for name, batch, n in calls if n == 8]
    assert [name for name, _, n in calls if n != 8] == ["ar", "m1", "m2"]  # compiled first, outside the timing
    assert timed[:9] == [("ar", "p0"), ("m1", "p0"), ("m2", "p0"), ("m2", "p1"), ("m1", "p1"), ("ar", "p1"),
                         ("ar", "p2"), ("m1", "p2"), ("m2", "p2")]
    assert timed[9:12] == [("m2", "p0"), ("m1", "p0"), ("ar", "p0")]  # the order keeps alternating across passes
    assert {k: [(s, n, len(runs)) for s, n, runs in v] for k, v in passes.items()} == {k: [(3.0, 24, 3)] * 2 for k in ("ar", "m1", "m2")}


def test_figures_by_category_pool_the_rows_of_each_category():
    def run(hist, reached, seconds):  # one batch: [rows, D + 1] calls by accepted drafts, [rows, D] positions verified
        hist, reached = np.array(hist), np.array(reached)
        return types.SimpleNamespace(accepted_hist=hist, reached=reached, tokens=[[]] * len(hist),
                                     num_generated=int((hist * [1, 2, 3]).sum()), decode_s=seconds)

    def passes(slowdown):
        batches = [run([[2, 1, 0]], [[3, 1]], 1.0), run([[0, 0, 4]], [[4, 4]], 2.0), run([[1, 1, 1]], [[3, 2]], 3.0),
                   run([[4, 0, 0]], [[4, 0]], 4.0 * slowdown)]
        return [(0.0, 0, batches), (0.0, 0, batches)]

    table = bench.by_category(passes(1.0), ["a", "b", "a", "c"])
    assert table["a"]["tau"] == (2 + 2 + 1 + 2 + 3) / 6 and table["b"]["tau"] == 3.0 and table["c"]["tau"] == 1.0
    assert table["a"]["acceptance_by_position"] == [(1 + 2) / (3 + 3), 1 / (1 + 2)]
    assert table["b"]["acceptance_by_position"] == [1.0, 1.0] and table["c"]["acceptance_by_position"] == [0.0, 0.0]
    assert table["a"]["tokens_per_s_by_repeat"] == [(4 + 6) / (1.0 + 3.0)] * 2 and table["c"]["tokens_per_s_by_repeat"] == [1.0] * 2

    rows = [{"method": m, "batch_size": 1, "tokens_per_s_by_repeat": [1.0, 1.0], "tau": 1.0, "adaptive": True,
             "t_draft_ms": 0.0, "t_decode_ms": 1.0, "t_verify_ms": 1.0, "by_category": bench.by_category(passes(s), ["a", "b", "a", "c"])}
            for m, s in (("ar", 1.0), ("ngram:3", 2.0))]
    bench.summarise(rows)
    assert rows[1]["by_category"]["c"]["speedup"] == pytest.approx(0.5) and rows[1]["by_category"]["a"]["speedup"] == 1.0
    assert "  c" in bench.category_table(rows)

    two_rows = [run([[2, 1, 0], [0, 0, 4]], [[1, 0], [4, 4]], 1.0)]  # one batch holding two categories
    assert bench.by_category([(0.0, 0, two_rows)], ["a", "b"])["a"]["tokens_per_s_by_repeat"] is None


def test_draft_flag_goes_to_one_method_or_every_drafting_method():
    args = bench.parse_args(["--methods", "draft:3,eagle3:3,medusa", "--draft", "draft=runs/lm", "--draft", "eagle3=a=b"])
    assert common.draft_paths(args.draft) == {"draft": "runs/lm", "eagle3": "a=b"}
    assert common.draft_paths(["some/dir=1"]) == {None: "some/dir=1"}  # not METHOD=PATH: a path holding '='
    for argv, message in (
        (["--draft", "eagle9=x"], "unknown method 'eagle9'"),
        (["--draft", "eagle3=x", "--draft", "eagle3=y"], "--draft given twice for eagle3"),
        (["--draft", "x", "--draft", "y"], "--draft given twice for every method"),
        (["--draft", "medusa=x"], r"--draft medusa=PATH is not used by ar, ngram:5, eagle3:3"),
    ):
        with pytest.raises(ValueError, match=message):
            bench.parse_args(["--methods", "ngram:5,eagle3:3", *argv])


def test_compare_draft_benches_each_drafting_method_again_on_another_draft():
    args = bench.parse_args(["--methods", "ngram:3,eagle3:3,eagle3+ngram:3", "--draft", "new", "--compare-draft", "old=a/b",
                             "--compare-draft", "older=c", "--control"])
    plan = bench.engine_plan(args)
    assert list(plan) == ["ar", "ngram:3", "eagle3:3", "eagle3:3@old", "eagle3:3@older", "eagle3+ngram:3",
                          "eagle3+ngram:3@old", "eagle3+ngram:3@older", bench.CONTROL]
    assert plan["eagle3:3"] == (MethodSpec("eagle3", 3), None, "xla") and plan["eagle3+ngram:3@older"][1] == "c"
    for argv, message in (
        (["--compare-draft", "a/b"], "give NAME=PATH"),
        (["--compare-draft", "old="], "give NAME=PATH"),
        (["--compare-draft", "x=a", "--compare-draft", "x=b"], "--compare-draft given twice for 'x'"),
    ):
        with pytest.raises(ValueError, match=message):
            bench.parse_args(["--methods", "eagle3:3", *argv])
    with pytest.raises(ValueError, match="--compare-draft is not used by ar, ngram:3"):
        bench.parse_args(["--methods", "ngram:3", "--compare-draft", "x=a"])


def test_bench_runs_every_method_in_each_matmul_mode_the_first_the_baseline(capsys):
    plan = bench.engine_plan(bench.parse_args(["--methods", "ngram:3", "--matmuls", "xla,streamed", "--control"]))
    assert list(plan) == ["ar", "ngram:3", bench.CONTROL, "ar [streamed]", "ngram:3 [streamed]", f"{bench.CONTROL} [streamed]"]
    assert [entry[2] for entry in plan.values()] == ["xla"] * 3 + ["streamed"] * 3
    assert {entry[2] for entry in bench.engine_plan(bench.parse_args(["--matmuls", "streamed"])).values()} == {"streamed"}
    for argv, message in ((["--matmuls", "xla,fast"], "'fast' is not a matmul mode"), (["--matmuls", "xla,xla"], "names a mode twice")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one engine, one mode
        generate.parse_args(["--matmuls", "xla,streamed"])
    assert generate.parse_args(["--matmuls", "streamed"]).matmuls == "streamed"


def test_bench_speedup_is_the_median_of_ratios_within_a_round():
    """A machine twice as fast in the second round and slow for one method's third pass: each
    round compares the method with ar's pass of the same round (ratio of medians would be 0.75)."""
    row = lambda method, rates: {"method": method, "batch_size": 1, "tokens_per_s_by_repeat": rates, "tau": 1.0,
                                 "adaptive": True, "t_draft_ms": 0.0, "t_decode_ms": 1.0, "t_verify_ms": 1.0}
    results = [row("ar", [10.0, 20.0, 30.0]), row("ngram:3", [11.0, 22.0, 15.0])]
    bench.summarise(results)
    assert results[1]["speedup"] == pytest.approx(1.1) and results[1]["speedup_by_repeat"] == pytest.approx([1.1, 1.1, 0.5])
    assert results[0]["speedup"] == pytest.approx(1.0)


def test_bench_speedup_in_mode_is_over_plain_decoding_in_the_same_matmul_mode():
    """Streamed plain decoding 1.3x the baseline's: a streamed method 1.3x as fast again reads 1.69x
    over the baseline and 1.3x in its mode; the table shows the `in mode` column only for several modes."""
    row = lambda method, mode, rates: {"method": method, "matmuls": mode, "batch_size": 1, "tokens_per_s_by_repeat": rates,
                                       "tau": 1.0, "adaptive": True, "t_draft_ms": 0.0, "t_decode_ms": 1.0, "t_verify_ms": 1.0,
                                       "acceptance_by_position": [], "tokens_per_s": rates[0], "drafting_share": 0.0}
    results = [row("ar", "xla", [10.0, 20.0, 10.0]), row("ngram:3", "xla", [12.0, 24.0, 9.0]),
               row("ar [streamed]", "streamed", [13.0, 26.0, 13.0]), row("ngram:3 [streamed]", "streamed", [16.9, 33.8, 16.9])]
    bench.summarise(results)
    assert [r["speedup"] for r in results] == pytest.approx([1.0, 1.2, 1.3, 1.69])
    assert [r["speedup_in_mode"] for r in results] == pytest.approx([1.0, 1.2, 1.0, 1.3])
    header, _, *lines = bench.table(results).splitlines()
    assert "in mode" in header and lines[3].split()[7] == "1.30"  # ngram:3 [streamed] 1 tau tok/s 1.69 CI 1.30
    bench.summarise(results[:2])
    assert "in mode" not in bench.table(results[:2])


def test_the_speedup_interval_covers_the_median_as_often_as_it_claims():
    """Order statistics of a skewed, bursty sample (a machine that is sometimes slow) cover its
    median at least as often as the stated coverage (>= 95% from six repeats on), and no more
    than a little above it: a pair one step wider or narrower would miss either way."""
    rng = np.random.default_rng(0)
    true_median = 1.0  # of 1 + lognormal bursts that hit half the rounds
    draw = lambda n: 1.0 + np.where(rng.random(n) < 0.5, -rng.uniform(0.0, 0.05, n), rng.lognormal(-3.0, 1.0, n))
    for n in (6, 9, 21):
        coverage = bench.median_interval(draw(n))[2]
        assert 0.95 <= coverage < 0.99
        hits = np.mean([low <= true_median <= high for low, high, _ in (bench.median_interval(draw(n)) for _ in range(4000))])
        assert abs(hits - coverage) < 0.015  # 4000 draws: standard error <= 0.004
    low, high, coverage = bench.median_interval([0.9, 1.1, 1.0])
    assert (low, high) == (0.9, 1.1) and coverage == pytest.approx(0.75)  # too few repeats: the range, at 75%


@pytest.mark.slow
def test_bench_writes_table_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--methods", "ar,ngram:3", "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "8",
                "--repeats", "1", "--max-len", "512", "--out", str(out), "--plots", str(tmp_path), "--control"])
    printed = capsys.readouterr().out
    assert "of bound" in printed and "plain decoding again, ran at" in printed
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["batch_size"]) for r in results] == [("ar", 2), ("ngram:3", 2), (bench.CONTROL, 2)]
    control = results[2]
    assert control["tau"] == 1.0 and control["tokens"] == results[0]["tokens"] and control["speedup_by_repeat"][0] > 0
    for r in results:
        assert r["tokens_per_s"] > 0 and r["t_decode_ms"] > 0 and 1.0 <= r["tau"] <= 4.0
        assert r["speedup"] == pytest.approx(1.0) if r["method"] == "ar" else r["speedup"] > 0
    assert (tmp_path / "speedup.png").stat().st_size > 0 and (tmp_path / "acceptance.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_reports_tau_by_mt_bench_category(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--methods", "ar,ngram:3", "--batch-size", "2", "--num-prompts", "4", "--max-new-tokens", "8",
                "--repeats", "1", "--prompts", "mt-bench", "--out", str(out)])
    assert "by MT-bench category" in capsys.readouterr().out
    for r in json.loads(out.read_text())["results"]:
        assert list(r["by_category"]) == ["writing", "roleplay", "reasoning", "math"]  # the first 4 of the round-robin
        taus = [c["tau"] for c in r["by_category"].values()]
        assert min(taus) <= r["tau"] <= max(taus)
        assert all(c["speedup"] is None for c in r["by_category"].values())  # batches of 2 mix categories
