"""Build the offline EAGLE-3 training corpus for SmolLM2-135M-Instruct as chat jsonl.

Prompts come from three offline sources: chatterbot-corpus English dialogs (`pip install
chatterbot-corpus`), questions about the Python documentation (Debian `python3.11-doc` rst), and
functions of the Python standard library (to explain, or to edit and repeat), and everyday
requests built from a grid of topics and templates. Responses are the target's own greedy
outputs (self-distillation with `train.distill`, so the draft learns the distribution it will be
verified against), produced by the specjax engine (batched greedy decoding).

    PYTHONPATH=. python scripts/build_smollm2_corpus.py --out data/smollm2_corpus.jsonl --num-prompts 2000

`--reference-out` also writes the chatterbot dialogs with their human replies (free extra data).
Each line: {"source": ..., "conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}.
An interrupted run resumes where it stopped (same arguments).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

import jax.numpy as jnp
import yaml

from specjax.checkpoints import default_model_path, load_model
from train import distill
from train.data import load_tokenizer

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")


def chatterbot_dialogs() -> list[list[str]]:
    """The English chatterbot-corpus dialogs: alternating user / bot turns."""
    import chatterbot_corpus

    dialogs = []
    for path in sorted((Path(chatterbot_corpus.__file__).parent / "data" / "english").glob("*.yml")):
        for dialog in yaml.safe_load(path.read_text()).get("conversations", []):
            if len(dialog) >= 2 and all(isinstance(turn, str) for turn in dialog):
                dialogs.append(dialog[: len(dialog) // 2 * 2])
    return dialogs


def chatterbot_prompts() -> list[str]:
    """Every statement of the chatterbot dialogs that is followed by a reply."""
    return [turn for dialog in chatterbot_dialogs() for turn in dialog[:-1]]


def write_reference_dialogs(path: Path) -> None:
    """The chatterbot dialogs with their human-written replies (no generation needed)."""
    with path.open("w") as file:
        for dialog in chatterbot_dialogs():
            turns = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(dialog)]
            file.write(json.dumps({"source": "chatterbot_reference", "conversations": turns}) + "\n")


def _rst_sections(text: str) -> list[tuple[str, str]]:
    """(title, first paragraph) of each section of an rst document."""
    lines = text.splitlines()
    sections = []
    for i in range(len(lines) - 1):
        title, underline = lines[i].strip(), lines[i + 1].strip()
        if title and len(underline) >= len(title) and re.fullmatch(r"([=\-~*^])\1+", underline or "x"):
            body = []
            for line in lines[i + 2 :]:
                if body and not line.strip():
                    break
                if line.strip() and not line.startswith(("..", "   ")):
                    body.append(line.strip())
            sections.append((title, " ".join(body)))
    return sections


def python_doc_prompts() -> list[str]:
    """Questions about the Python documentation: FAQ questions, section topics, passages to explain."""
    prompts = []
    for path in sorted(DOCS_DIR.rglob("*.rst.txt")):
        for title, paragraph in _rst_sections(path.read_text(errors="ignore")):
            title = re.sub(r":\w+:`~?([^`]+)`", r"\1", title).strip("`* ")
            if not 3 <= len(title) <= 80 or title.lower().startswith(("changelog", "what's new")):
                continue
            if title.endswith("?"):
                prompts.append(title)
            elif path.parts[-2] in ("library", "tutorial", "howto", "reference"):
                prompts.append(f"Explain {title} in Python, with a short example.")
            if 120 <= len(paragraph) <= 600:
                prompts.append(f"Explain this passage from the Python documentation in simple words:\n\n{paragraph}")
    return prompts


def stdlib_code_prompts() -> list[str]:
    """Explain-this-function and write-this-function prompts from standard library sources."""
    prompts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            code = ast.get_source_segment(source, node) or ""
            if not 4 <= code.count("\n") <= 30:
                continue
            prompts.append(f"Explain what this Python function does:\n\n```python\n{code}\n```")
            doc = ast.get_docstring(node)
            if doc:
                signature = f"{node.name}({ast.unparse(node.args)})"
                prompts.append(f"Write a Python function `{signature}`: {doc.splitlines()[0]}")
    return prompts


_EDIT_INSTRUCTIONS = (
    "Add a docstring to every function in this code and repeat the whole code:",
    "Add type hints to this function and show the complete result:",
    "Add short comments to this code and repeat it in full:",
    "Rewrite this function with clearer variable names and show the full code:",
    "Repeat this code, adding a docstring that explains the arguments:",
)


def stdlib_edit_prompts() -> list[str]:
    """Edit-and-repeat prompts over standard library functions (the response copies most of the code)."""
    prompts = []
    for prompt in stdlib_code_prompts():
        if prompt.startswith("Explain what this Python function does:"):
            code = prompt.split("\n\n", 1)[1]
            instruction = _EDIT_INSTRUCTIONS[len(prompts) % len(_EDIT_INSTRUCTIONS)]
            prompts.append(f"{instruction}\n\n{code}")
    return prompts


_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the human heart", "vaccines", "inflation",
    "compound interest", "the Roman Empire", "the printing press", "the French Revolution", "climate change",
    "recycling", "electric cars", "solar panels", "the internet", "machine learning", "a healthy breakfast",
    "learning a new language", "public speaking", "time management", "job interviews", "saving money",
    "training for a 5k run", "growing tomatoes", "adopting a cat", "baking bread", "making coffee at home",
    "the moon landing", "earthquakes", "rainbows", "honey bees", "the Olympic Games", "chess", "jazz music",
    "Shakespeare", "the pyramids of Egypt", "the Great Wall of China", "coral reefs", "rain forests",
    "sleep", "meditation", "first aid for a small cut", "packing for a trip", "a birthday party for a child",
    "writing a resume", "remote work", "video games", "photography", "the stock market", "democracy",
    "gravity", "magnets", "dinosaurs", "the seasons", "tides", "the immune system", "coffee", "tea",
)
_CHAT_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Give me three interesting facts about {topic}.",
    "What are some tips about {topic}?",
    "Write a short paragraph about {topic}.",
    "Write a short poem about {topic}.",
    "What should a beginner know about {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "Write a friendly message to a friend about {topic}.",
    "What are the pros and cons of {topic}?",
    "Answer briefly: why does {topic} matter?",
)


def general_chat_prompts() -> list[str]:
    """Everyday assistant requests from a grid of topics and request templates."""
    return [template.format(topic=topic) for topic in _TOPICS for template in _CHAT_TEMPLATES]


SOURCES = {
    "chatterbot": chatterbot_prompts,
    "python_docs": python_doc_prompts,
    "stdlib": stdlib_code_prompts,
    "stdlib_edit": stdlib_edit_prompts,
    "general_chat": general_chat_prompts,
}


def collect_prompts(num_prompts: int, seed: int, sources: list[str]) -> list[tuple[str, str]]:
    """(source, prompt) pairs: an equal share from each source (as available), shuffled, deduplicated."""
    rng = random.Random(seed)
    chosen = []
    for name in sources:
        prompts = sorted(set(SOURCES[name]()))
        rng.shuffle(prompts)
        print(f"{name}: {len(prompts)} prompts available", file=sys.stderr)
        chosen += [(name, p) for p in prompts[: num_prompts // len(sources)]]
    rng.shuffle(chosen)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None, help="target checkpoint (default: the SmolLM2 GGUF)")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, from {', '.join(SOURCES)}")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-out", type=Path, help="also write the chatterbot dialogs with their own replies")
    parser.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; stop after this")
    args = parser.parse_args()
    sources = args.sources.split(",")
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        parser.error(f"unknown sources: {', '.join(unknown)}")

    if args.reference_out:
        write_reference_dialogs(args.reference_out)
    model_path = args.model or default_model_path()
    tokenizer = load_tokenizer(str(model_path))
    config, params = load_model(model_path, jnp.float32)
    records = [
        {"source": source, "conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}]}
        for source, prompt in collect_prompts(args.num_prompts, args.seed, sources)
    ]
    # Similar prompt lengths share a batch; sources stay mixed over time.
    window = 8 * args.batch_size
    length = {id(r): len(tokenizer(r["conversations"][0]["content"])["input_ids"]) for r in records}
    records = [r for first in range(0, len(records), window) for r in sorted(records[first : first + window], key=lambda r: length[id(r)])]
    written = distill.regenerate_to_file(
        args.out,
        records,
        config,
        params,
        tokenizer,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        time_budget_s=args.time_budget,
    )
    print(f"{written}/{len(records)} conversations in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
