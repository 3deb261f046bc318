"""Training data: chat conversations -> fixed-length token rows with a response mask.

Conversations come from local json / jsonl / parquet files, in any of the
usual shapes: `conversations` or `messages` lists of {role, content}, or ShareGPT {from, value}.
They are rendered with the target's chat template; the loss mask marks the tokens of assistant
turns (what the template emits for the turn after the generation prompt, end-of-turn included).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def load_tokenizer(path: str):
    """A transformers tokenizer (with chat template) from an HF directory or a .gguf file."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    return AutoTokenizer.from_pretrained(path)


def _messages(record: Any) -> list[dict[str, str]]:
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
    turns = record.get("conversations")
    if turns is None:  # parquet fills a column missing from a record with None
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise ValueError(f"record has neither 'conversations' nor 'messages' (a list of turns): {sorted(record)}")
    messages = []
    for turn in turns:
        role = _ROLES.get(turn.get("role") or turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("content") if role else None
        content = turn.get("value") if role and content is None else content
        if not isinstance(content, str):
            raise ValueError(f"a turn needs a known role and text content, got {turn!r}")
        messages.append({"role": role, "content": content})
    return messages


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None


def _records(file: str) -> list[tuple[str, Any]]:
    """(where, record) of every record of a .jsonl, .json (a list, or JSON lines) or .parquet file."""
    path = Path(file)
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{file}: data files must be .json, .jsonl or .parquet")
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return [(f"{file} row {i}", r) for i, r in enumerate(pyarrow.parquet.read_table(path).to_pylist())]
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return [(f"{file} record {i}", r) for i, r in enumerate(_parse_json(text, file))]
    lines = enumerate(text.splitlines(), 1)
    return [(f"{file}:{n}", _parse_json(line, f"{file}:{n}")) for n, line in lines if line.strip()]


def load_conversations(files: tuple[str, ...] | list[str]) -> list[list[dict[str, str]]]:
    """Every conversation of the files with an assistant turn (nothing to learn otherwise), in file order.

    A missing, empty or malformed file is an error naming it (and the line or record).
    """
    if not files:
        raise ValueError("no data_files given")
    conversations = []
    for file in files:
        records = _records(file)
        if not records:
            raise ValueError(f"data file {file} holds no records")
        for where, record in records:
            try:
                conversations.append(_messages(record))
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
    kept = [c for c in conversations if any(m["role"] == "assistant" for m in c)]
    if not kept:
        raise ValueError(f"no conversation with an assistant turn in {', '.join(files)}")
    return kept


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [T] int32, response mask [T] bool) of one conversation under the chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # character ranges of assistant turns
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not text.startswith(through) or not through.startswith(before):
                raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
            spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = np.asarray(encoded["input_ids"], np.int32)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]])
    mask = np.zeros(len(tokens), bool)
    for begin, end in spans:
        mask |= (starts >= begin) & (starts < end)
    return tokens, mask


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Conversations as fixed-length rows, right-padded with token 0 (mask False)."""

    tokens: np.ndarray  # [N, T] int32
    loss_mask: np.ndarray  # [N, T] bool, True on response tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, indices) -> TokenRows:
        return TokenRows(self.tokens[indices], self.loss_mask[indices])


def to_rows(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pack: bool = False) -> TokenRows:
    """Truncate / pad to seq_len; rows without any response token are dropped.

    pack: fill each row with consecutive whole conversations while they fit (no padding wasted;
    a later conversation attends to the earlier ones, for the target and the draft alike).
    """
    kept = [(t[:seq_len], m[:seq_len]) for t, m in samples if m[:seq_len].any()]
    grouped: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for sample in kept:
        if pack and grouped and sum(len(t) for t, _ in grouped[-1]) + len(sample[0]) <= seq_len:
            grouped[-1].append(sample)
        else:
            grouped.append([sample])
    tokens = np.zeros((len(grouped), seq_len), np.int32)
    mask = np.zeros((len(grouped), seq_len), bool)
    for row, group in enumerate(grouped):
        t, m = np.concatenate([t for t, _ in group]), np.concatenate([m for _, m in group])
        tokens[row, : len(t)], mask[row, : len(m)] = t, m
    return TokenRows(tokens, mask)


def draft_vocab_ids(rows: TokenRows, draft_vocab_size: int, target_vocab_size: int) -> np.ndarray:
    """[Vd] sorted target ids: the most frequent response tokens (ties: lower id first).

    If the responses use fewer distinct tokens, the lowest unused ids fill the vocabulary.
    """
    counts = Counter(rows.tokens[rows.loss_mask].tolist())
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:draft_vocab_size]
    unused = np.setdiff1d(np.arange(target_vocab_size), ranked)[: draft_vocab_size - len(ranked)]
    return np.sort(np.concatenate([np.asarray(ranked, np.int64), unused]))


def batch_indices(num_rows: int, batch_size: int, micro_step: int, seed: int) -> np.ndarray:
    """[batch_size] row indices of a micro-step: a fresh permutation per epoch, last partial batch dropped.

    A pure function of the step, so resuming at any step replays exactly the same batches.
    """
    per_epoch = num_rows // batch_size
    if per_epoch == 0:
        raise ValueError(f"{num_rows} training rows cannot fill a batch of {batch_size}")
    epoch, index = divmod(micro_step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return np.sort(order[index * batch_size : (index + 1) * batch_size])
