"""infer.tune: the cost-model recommendation, measured inputs, and the empirical --measure sweep."""

from __future__ import annotations

import json
import re

import pytest

from infer import tune
from specjax import theory


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


@pytest.mark.slow
def test_measure_picks_at_least_the_default(capsys):
    text = tune.main(["--task", "code", "--measure", "--measure-top", "1", "--max-new-tokens", "16",
                      "--repeats", "1", "--max-len", "512", "--num-prompts", "1"])
    rows = dict(re.findall(r"\| (\S+) \| (\d+\.\d+) \| \d+\.\d+x \|", text))
    chosen = re.search(r"\*\*Use `(\S+)`\*\*: measured (\d+\.\d+)", text)
    assert "ar" in rows and len(rows) >= 2
    assert float(chosen.group(2)) >= max(float(v) for v in rows.values())
