"""Self-distillation: regenerate the assistant turns of conversations with the target itself.

EAGLE-3 drafts learn best on the target's own outputs (the distribution they are verified
against), not on whatever model or human wrote the dataset. Each assistant turn is replaced by
the target's greedy (or sampled) continuation of everything before it, turn by turn, batched
through the specjax engine (plain autoregressive decoding, one compilation for the whole run).

Results are appended to a jsonl file a chunk at a time; rerunning with the same inputs resumes
after the last chunk written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specjax.engine import Engine
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingParams

Messages = list[dict[str, str]]


def prompt_ids(tokenizer, messages: Messages) -> list[int]:
    """The chat-template tokens of messages, ending with the generation prompt of the next assistant turn."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def regenerate_chunk(
    engine: Engine, tokenizer, conversations: list[Messages], *, batch_size: int, max_prompt_tokens: int,
    max_new_tokens: int, temperature: float, seed: int,
) -> tuple[list[Messages], int]:
    """Regenerate every assistant turn of up to batch_size conversations, turn by turn.

    Returns the conversations and the number of tokens generated. A conversation whose context
    outgrows max_prompt_tokens ends before that turn (so it may be left with no assistant turn, and
    then keeps its user turns).
    """
    if len(conversations) > batch_size:
        raise ValueError(f"{len(conversations)} conversations for a batch of {batch_size}")
    eos = set(engine.eos_ids)
    pending = [list(c) for c in conversations]
    generated = 0
    for turn in range(max(len(c) for c in conversations)):
        rows, prompts = [], []
        for i, messages in enumerate(pending):
            if turn < len(messages) and messages[turn]["role"] == "assistant":
                ids = prompt_ids(tokenizer, messages[:turn])
                if len(ids) > max_prompt_tokens:
                    del messages[turn:]  # the context no longer fits: the conversation ends here
                    continue
                rows.append(i)
                prompts.append(ids)
        if not rows:
            continue
        # A fixed batch size (one compilation); padding rows stop after one token.
        padded = prompts + [prompts[0]] * (batch_size - len(prompts))
        limits = [max_new_tokens] * len(prompts) + [1] * (batch_size - len(prompts))
        sampling = SamplingParams.make(batch_size, temperature=temperature)
        outputs = engine.generate(padded, sampling, max_new_tokens=limits, seed=seed + turn).tokens
        for i, tokens in zip(rows, outputs):
            response = [t for t in tokens if t not in eos]  # generation stops at the first EOS
            generated += len(response)
            pending[i][turn] = {"role": "assistant", "content": tokenizer.decode(response)}
    trimmed = []  # nothing after the last assistant turn; one with none keeps its input (resume checks it)
    for messages in pending:
        last_assistant = max((t for t, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        trimmed.append(messages[: last_assistant + 1] if last_assistant >= 0 else messages)
    return trimmed, generated


def regenerate_to_file(
    path: Path, records: list[dict[str, Any]], target_config: ModelConfig, target_params, tokenizer, *,
    batch_size: int = 32, max_prompt_tokens: int = 512, max_new_tokens: int = 256, temperature: float = 0.0,
    seed: int = 0, time_budget_s: float = float("inf"),
) -> int:
    """Regenerate `records` ({"conversations": messages, ...}) into the jsonl file at `path`.

    Resumes after the records already in the file (which must be the same inputs: the first
    user turn of each is checked). Returns the number of records written so far; less than
    len(records) only when the time budget ran out.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.read_text().splitlines() if path.exists() else []
    for line_number, (line, record) in enumerate(zip(written, records), 1):
        if _first_user_turn(json.loads(line)["conversations"]) != _first_user_turn(record["conversations"]):
            raise ValueError(f"{path}:{line_number} was regenerated from different inputs; delete the file to start over")
    if len(written) > len(records):
        raise ValueError(f"{path} holds {len(written)} records, more than the {len(records)} inputs")
    if len(written) == len(records):
        return len(written)
    max_len = -(-(max_prompt_tokens + max_new_tokens + 1) // 64) * 64
    eos_ids = tuple(dict.fromkeys(target_config.eos_token_ids + ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())))
    engine = Engine(target_config, target_params, max_len=max_len, attention_chunk=64, eos_ids=eos_ids)
    start, generated, done = time.time(), 0, len(written)
    progress = tqdm(total=len(records), initial=len(written), unit="conv", desc="self-distill", dynamic_ncols=True)
    with path.open("a") as file:
        for first in range(len(written), len(records), batch_size):
            if time.time() - start > time_budget_s:
                break
            chunk = records[first : first + batch_size]
            results, tokens = regenerate_chunk(
                engine, tokenizer, [r["conversations"] for r in chunk], batch_size=batch_size,
                max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + first,
            )
            for record, messages in zip(chunk, results):
                file.write(json.dumps({**record, "conversations": messages}) + "\n")
            file.flush()
            done += len(chunk)
            generated += tokens
            progress.update(len(chunk))
            progress.set_postfix(tok_s=f"{generated / (time.time() - start):.0f}")
    progress.close()
    return done


def _first_user_turn(messages: Messages) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def load_regenerated(path: Path) -> list[Messages]:
    """The regenerated conversations that kept at least one assistant turn."""
    conversations = [json.loads(line)["conversations"] for line in path.read_text().splitlines()]
    return [c for c in conversations if any(m["role"] == "assistant" for m in c)]
