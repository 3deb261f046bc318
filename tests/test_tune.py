"""infer.tune: the cost-model recommendation, measured inputs, and the empirical --measure sweep."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from infer import common, generate, tune
from specjax import theory
from specjax.drafters.registry import MethodSpec


def test_tree_with_one_child_per_node_is_a_chain():
    for alpha in (0.3, 0.7, 0.9):
        assert tune.tree_tau(alpha, depth=5, top_k=1, nodes=5) == pytest.approx(theory.expected_accepted(alpha, 5))


def test_wider_trees_accept_more_per_call():
    assert tune.tree_tau(0.6, 4, 4, 16) > tune.tree_tau(0.6, 4, 1, 4)
    assert tune.tree_tau(0.6, 4, 4, 32) >= tune.tree_tau(0.6, 4, 4, 16)


def test_recommendation_follows_the_workload(tmp_path):
    code = tune.main(["--task", "code", "--markdown", str(tmp_path / "rec.md")])
    assert "**Use `ar`**" not in code and (tmp_path / "rec.md").read_text() == code
    hot = tune.main(["--task", "creative", "--temperature", "1.9", "--batch-size", "4"])
    assert "**Use `ar`**" in hot
    big_batch = tune.main(["--task", "code", "--batch-size", "64"])
    assert "**Use `ar`**" in big_batch  # verification is no longer nearly free


def test_bench_measurements_replace_the_priors(tmp_path):
    bench = {"results": [
        {"method": "ar", "batch_size": 1, "block": 1, "acceptance_by_position": [], "verify_over_decode": 1.0, "c": 0.0, "t_decode_ms": 50.0},
        {"method": "ngram:4", "batch_size": 1, "block": 5, "acceptance_by_position": [0.95, 0.95, 0.95, 0.95],
         "verify_over_decode": 1.2, "c": 0.0, "t_decode_ms": 50.0},
    ]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    text = tune.main(["--task", "chat", "--bench", str(path), "--latency-target", "20"])
    assert "(measured)" in text
    best = float(re.search(r"predicted (\d+\.\d+)x", text).group(1))
    assert best > 3.0  # 0.95 acceptance with cheap verification: far above the chat prior
    assert "ms/token meets the target" in text


@pytest.mark.parametrize("batch_size", [1, 64])
def test_adaptive_candidates_predict_the_best_fixed_depth_floored_at_plain_decoding(batch_size):
    args = tune.parse_args(["--task", "code", "--batch-size", str(batch_size)])
    ranked = tune.candidates(args, {})
    adaptive = [c for c in ranked if c.spec.adaptive]
    assert sorted(c.spec.method for c in adaptive) == sorted(args.method_names)  # every default method takes :auto
    for auto in adaptive:
        chains = [c for c in ranked if c.spec.method == auto.spec.method and not c.spec.adaptive and not c.spec.shape]
        within = [c.speedup for c in chains if c.spec.num_spec <= auto.spec.num_spec]
        assert auto.speedup == pytest.approx(max([1.0] + within))  # the engine's best depth 0 .. D
        assert auto.speedup >= max(c.speedup for c in chains) and auto.speedup >= 1.0
        assert MethodSpec.parse(auto.spec.label) == auto.spec
        assert "best fixed depth" in auto.reasoning and "floored at plain decoding" in auto.reasoning
    if batch_size == 64:  # no fixed chain pays here: the adaptive forms fall back to plain decoding, ar still leads
        assert all(auto.speedup == 1.0 for auto in adaptive) and ranked[0].spec == MethodSpec("ar")


def test_adaptive_only_where_the_drafter_can_vary_its_depth():
    ranked = tune.candidates(tune.parse_args(["--methods", "draft,ngram,lookahead", "--draft", "unused"]), {})
    assert {c.spec.method for c in ranked if c.spec.adaptive} == {"ngram"}


def test_bench_adaptive_rows_do_not_replace_a_chains_acceptance(tmp_path):
    row = {"batch_size": 1, "block": 5, "verify_over_decode": 1.2, "c": 0.0}
    bench = {"results": [{**row, "method": "ngram:4", "acceptance_by_position": [0.9] * 4},
                         {**row, "method": "ngram:auto4", "acceptance_by_position": [0.2] * 4}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert tune.measured_from_bench(str(path))["ngram"]["alpha"] == pytest.approx(0.9)


def test_bench_rows_of_the_control_and_of_a_compared_draft_are_not_evidence(tmp_path):
    row = {"batch_size": 1, "block": 4, "verify_over_decode": 1.2, "c": 0.3}
    bench = {"results": [{**row, "method": "eagle3:3", "acceptance_by_position": [0.6] * 3},
                         {**row, "method": "eagle3:3@shipped", "acceptance_by_position": [0.1] * 3},
                         {**row, "method": "ar (control)", "acceptance_by_position": []}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert tune.measured_from_bench(str(path))["eagle3"]["alpha"] == pytest.approx(0.6)


@pytest.mark.parametrize("argv", [["--task", "code"], ["--task", "chat", "--batch-size", "64"], ["--methods", "eagle3", "--measure-top", "1"]])
def test_measure_sweeps_the_best_chain_fixed_and_adaptive(argv):
    args = tune.parse_args(argv)
    ranked = tune.candidates(args, {})
    specs = tune.sweep_specs(args, ranked)
    best_chain = next(c.spec for c in ranked if c.spec.num_spec and not c.spec.adaptive)
    assert specs[0] == MethodSpec("ar") and len(set(specs)) == len(specs)
    assert best_chain in specs and [s for s in specs if s.adaptive] == [dataclasses.replace(best_chain, adaptive=True)]
    fixed = [c.spec for c in ranked if not c.spec.adaptive][: args.measure_top]
    assert all(spec in specs for spec in fixed)


def test_every_rendered_command_parses_back_to_its_spec():
    args = tune.parse_args(["--task", "code", "--methods", "eagle3,eagle3+ngram,ngram,lookahead"])
    ranked = tune.candidates(args, {})
    for candidate in ranked:
        generate_args = generate.parse_args(tune.cli_flags(candidate.spec).split())
        assert common.method_spec(generate_args) == candidate.spec
    auto = next(c.spec for c in ranked if c.spec.adaptive)
    text = tune.render(args, ranked, None, [(MethodSpec("ar"), 10.0), (ranked[0].spec, 15.0), (auto, 20.0)])
    assert f"**Use `{auto.label}`**" in text
    command = re.search(r"python -m infer\.generate (.+)", text).group(1)
    assert "--auto" in command.split()
    assert common.method_spec(generate.parse_args(command.split())) == auto


@pytest.mark.slow
def test_measure_picks_at_least_the_default(capsys):
    text = tune.main(["--task", "code", "--methods", "ngram", "--measure", "--measure-top", "1", "--max-new-tokens", "16",
                      "--repeats", "1", "--max-len", "512", "--num-prompts", "1"])
    rows = dict(re.findall(r"\| (\S+) \| (\d+\.\d+) \| \d+\.\d+x \|", text))
    chosen = re.search(r"\*\*Use `(\S+)`\*\*: measured (\d+\.\d+)", text)
    assert "ar" in rows and len(rows) >= 2
    assert float(chosen.group(2)) >= max(float(v) for v in rows.values())
