"""scripts/speculation_report.py runs, and its numbers agree with specjax.theory."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from specjax import theory

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "speculation_report.py"
SIGMAS = 5.0  # measured quantities within this many standard errors of the prediction


@pytest.fixture(scope="module")
def report() -> tuple[dict, str]:
    spec = importlib.util.spec_from_file_location("speculation_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = []
    return module.main(out=lines.append), "\n".join(lines)


def test_prints_every_section(report):
    _, text = report
    for section in ("(a)", "(b)", "(c)", "(d)", "(e)", "(f)"):
        assert section in text


def test_leviathan_check_passes(report):
    leviathan = report[0]["leviathan"]
    assert leviathan["statistic"] < leviathan["critical"]
    assert leviathan["pvalue"] > 1e-4 and leviathan["fit_pvalue"] > 1e-4


def test_draft_length_table_is_the_closed_form(report):
    table = report[0]["draft_length"]
    alpha, c = table["alpha"], table["c"]
    for row in table["table"]:
        assert row["tokens_per_call"] == pytest.approx(theory.expected_accepted(alpha, row["n"]))
        assert row["time_per_token"] == pytest.approx(1 / theory.speedup(alpha, row["n"], c))
    assert table["best_n"] == 1 + int(np.argmax([theory.speedup(alpha, n, c) for n in range(1, 11)]))
    assert table["optimal"] == theory.optimal_draft_length(alpha, c)


def test_measured_acceptance_matches_overlap(report):
    for row in report[0]["draft_quality"]:
        assert abs(row["measured"] - row["overlap"]) <= SIGMAS * row["standard_error"], row
        for n, tokens in row["tokens_per_call"].items():
            assert tokens == pytest.approx(theory.expected_accepted(row["measured"], n))


def test_tree_and_chain_match_their_predictions(report):
    tree, chain = report[0]["tree_vs_chain"]["tree"], report[0]["tree_vs_chain"]["chain"]
    for measured in (tree, chain):
        assert abs(measured["tokens_per_call"] - measured["theory"]) < SIGMAS * measured["standard_error"]
    for measured, exact, trials in [
        (tree["per_node_measured"], tree["per_node_exact"], tree["per_node_trials"]),
        (chain["per_position_measured"], chain["per_position_exact"], chain["per_position_trials"]),
    ]:
        measured, exact, trials = map(np.asarray, (measured, exact, trials))
        standard_error = np.sqrt(exact * (1 - exact) / trials)
        assert np.all(np.abs(measured - exact) < SIGMAS * standard_error), (measured, exact)
    assert chain["theory"] == pytest.approx(theory.expected_accepted_from_curve(chain["per_position_exact"]))


def test_two_sequences_lengths_and_visibility(report):
    sequences = report[0]["two_sequences"]
    lengths = np.asarray(sequences["lengths"])  # [steps + 1, 2]
    assert sequences["accepted"] == [[3, 2]] * (len(lengths) - 1)
    np.testing.assert_array_equal(np.diff(lengths, axis=0), [[4, 3]] * (len(lengths) - 1))
    assert sequences["reads_committed_only"]


def test_optimal_settings(report):
    found = {(row["alpha"], row["c"]): (row["n"], row["speedup"]) for row in report[0]["optimal"]}
    assert found == {key: theory.optimal_draft_length(*key) for key in [(0.8, 0.05), (0.95, 0.02)]}
    assert found[(0.8, 0.05)][0] == 8 and found[(0.95, 0.02)][0] == 31
