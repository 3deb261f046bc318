"""Build the offline EAGLE-3 training corpus for SmolLM2-135M-Instruct as chat jsonl.

Prompts come from three offline sources: chatterbot-corpus English dialogs (`pip install
chatterbot-corpus`), questions about the Python documentation (Debian `python3.11-doc` rst), and
functions of the Python standard library. Responses are the target's own greedy outputs
(self-distillation, so the draft learns the distribution it will be verified against), produced
by the specjax engine (batched greedy decoding).

    PYTHONPATH=. python scripts/build_smollm2_corpus.py --out data/smollm2_corpus.jsonl --num-prompts 2000

`--reference-out` also writes the chatterbot dialogs with their human replies (free extra data).
Each line: {"source": ..., "conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}.
Existing lines are kept and skipped, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import jax.numpy as jnp
import yaml

from specjax.checkpoints import default_model_path, load_model
from specjax.engine import Engine
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


def collect_prompts(num_prompts: int, seed: int) -> list[tuple[str, str]]:
    """(source, prompt) pairs: a third from each source (as available), shuffled, deduplicated."""
    rng = random.Random(seed)
    sources = {"chatterbot": chatterbot_prompts(), "python_docs": python_doc_prompts(), "stdlib": stdlib_code_prompts()}
    chosen = []
    for name, prompts in sources.items():
        prompts = sorted(set(prompts))
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
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-out", type=Path, help="also write the chatterbot dialogs with their own replies")
    parser.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; stop after this")
    args = parser.parse_args()

    if args.reference_out:
        write_reference_dialogs(args.reference_out)
    model_path = args.model or default_model_path()
    tokenizer = load_tokenizer(str(model_path))
    config, params = load_model(model_path, jnp.float32)
    eos = set(config.eos_token_ids) | {tokenizer.eos_token_id}

    done = set()
    if args.out.exists():
        done = {json.loads(line)["conversations"][0]["content"] for line in args.out.read_text().splitlines()}
    pending = []
    for source, prompt in collect_prompts(args.num_prompts, args.seed):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if prompt not in done and len(ids) <= args.max_prompt_tokens:
            pending.append((source, prompt, list(ids)))
    window = 8 * args.batch_size  # similar lengths share a batch; sources stay mixed over time
    pending = [
        item
        for first in range(0, len(pending), window)
        for item in sorted(pending[first : first + window], key=lambda item: len(item[2]))
    ]
    print(f"{len(done)} done, {len(pending)} to generate", file=sys.stderr)

    # One engine (one compilation) for every batch: greedy, plain autoregressive decoding.
    max_len = -(-(args.max_prompt_tokens + args.max_new_tokens + 1) // 64) * 64
    engine = Engine(config, params, max_len=max_len, attention_chunk=64, eos_ids=tuple(eos))
    start, generated = time.time(), 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out_file:
        for first in range(0, len(pending), args.batch_size):
            if time.time() - start > args.time_budget:
                break
            batch = pending[first : first + args.batch_size]
            prompts = [ids for _, _, ids in batch]
            prompts += [prompts[0]] * (args.batch_size - len(prompts))  # a fixed batch size: no recompilation
            outputs = engine.generate(prompts, max_new_tokens=args.max_new_tokens).tokens
            for row, (source, prompt, _) in enumerate(batch):
                response = [t for t in outputs[row] if t not in eos]  # generation stops at the first EOS
                generated += len(response)
                record = {
                    "source": source,
                    "conversations": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": tokenizer.decode(response)},
                    ],
                }
                out_file.write(json.dumps(record) + "\n")
            out_file.flush()
            elapsed = time.time() - start
            print(f"{first + len(batch)}/{len(pending)} prompts, {generated / elapsed:.1f} tok/s", file=sys.stderr)


if __name__ == "__main__":
    main()
