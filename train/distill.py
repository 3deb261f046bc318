"""Self-distillation: regenerate the assistant turns of conversations with the target itself.

EAGLE-3 drafts learn best on the target's own outputs (the distribution they are verified
against), not on whatever model or human wrote the dataset. Each assistant turn is replaced by
the target's greedy (or sampled) continuation of everything before it, turn by turn, through the
specjax engine (plain autoregressive decoding, one compilation for the whole run) with continuous
batching: a row whose turn ends takes the next turn at once instead of idling until the longest
turn of its batch ends.

Results are appended to a jsonl file in input order; rerunning with the same inputs resumes
after the last record written, and with more inputs (the same ones first) goes on after them, so a
corpus grows by appending; fewer inputs use the first records. An archive (the same records,
gzip-compressed, small enough to keep in the repository) carries the work to another machine: a
run starts from its records and rewrites it as it goes.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from specjax.drafters.base import Drafter
from specjax.engine import Engine
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingParams

Messages = list[dict[str, str]]


def prompt_ids(tokenizer, messages: Messages) -> list[int]:
    """The chat-template tokens of messages, ending with the generation prompt of the next assistant turn."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def regenerate(
    engine: Engine, tokenizer, conversations: list[Messages], *, batch_size: int, max_prompt_tokens: int,
    max_new_tokens: int, temperature: float, seed: int, first_index: int = 0, admit_more=lambda: True,
    steps_per_sync: int = 8,
) -> Iterator[tuple[int, Messages, int]]:
    """Regenerate every assistant turn of `conversations`, turn by turn, with continuous batching.

    Yields (index, messages, tokens generated) as each conversation completes, in any order.
    `batch_size` engine rows stay busy: when a row's turn ends (EOS or max_new_tokens), that
    conversation's next assistant turn, else the next conversation, is prefilled into the row,
    so no row idles while the longest turn of a batch finishes. A next turn goes to the row its
    conversation just left, which keeps the context in its cache and prefills only the new
    messages (`Engine.admit(reuse_prefix=True)`, where the engine's drafter allows it). Turn `t` of conversation
    `first_index + i` samples from its own seed, whatever row or company it gets. A conversation
    whose context outgrows max_prompt_tokens ends before that turn (it may be left with no
    assistant turn and then keeps its user turns). New conversations start only while
    admit_more() is true; those started are finished.
    """
    eos = set(engine.eos_ids)
    pending = [[dict(m) for m in c] for c in conversations]
    next_turn, generated = [0] * len(pending), [0] * len(pending)
    fresh = collections.deque(range(len(pending)))  # conversations not started
    ready: collections.deque[int] = collections.deque()  # started, between turns
    rows: list[int | None] = [None] * batch_size  # the conversation each engine row is generating for
    left: list[int | None] = [None] * batch_size  # the conversation that last left each row
    state = engine.init_state(batch_size)
    sampling = SamplingParams.make(batch_size, temperature=temperature)

    def next_prompt(i: int) -> list[int] | None:
        """The prompt of conversation i's next assistant turn (None: it has none that fits)."""
        messages = pending[i]
        turn = next((t for t in range(next_turn[i], len(messages)) if messages[t]["role"] == "assistant"), None)
        if turn is None:
            return None
        ids = prompt_ids(tokenizer, messages[:turn])
        if len(ids) > max_prompt_tokens:
            del messages[turn:]  # the context no longer fits: the conversation ends here
            return None
        next_turn[i] = turn
        return ids

    while True:
        for row in [r for r, i in enumerate(rows) if i is None]:
            while ready or (fresh and admit_more()):
                if left[row] in ready:  # its context is still in this row's cache
                    ready.remove(left[row])
                    i = left[row]
                else:
                    i = ready.popleft() if ready else fresh.popleft()
                ids = next_prompt(i)
                if ids is None:
                    yield first_index + i, _trimmed(pending[i]), generated[i]
                    continue
                turn_seed = int(np.random.SeedSequence([seed, first_index + i, next_turn[i]]).generate_state(1)[0])
                state = engine.admit(state, [row], [ids], max_new_tokens, seed=turn_seed, reuse_prefix=engine.reuses_prefixes)
                rows[row] = i
                break
        if all(i is None for i in rows):
            return
        state = engine.decode(state, sampling, steps_per_sync, refills=True)  # a finished row's slot takes the next prompt
        active = np.asarray(state.active)
        if all(active[r] for r, i in enumerate(rows) if i is not None):
            continue
        outputs = engine.outputs(state)
        for row, i in enumerate(rows):
            if i is not None and not active[row]:
                response = [t for t in outputs[row] if t not in eos]  # generation stops at the first EOS
                generated[i] += len(response)
                pending[i][next_turn[i]] = {"role": "assistant", "content": tokenizer.decode(response)}
                next_turn[i] += 1
                ready.appendleft(i)  # its next turn first: conversations finish, and are written, early
                rows[row], left[row] = None, i


def _trimmed(messages: Messages) -> Messages:
    """Nothing after the last assistant turn; one with none keeps its input (resume checks it)."""
    last_assistant = max((t for t, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[: last_assistant + 1] if last_assistant >= 0 else messages


def stop_ids(target_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The token ids that end a turn: the model's EOS ids and the tokenizer's, once each."""
    extra = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return tuple(dict.fromkeys(target_config.eos_token_ids + extra))


def regenerate_to_file(
    path: Path, records: list[dict[str, Any]], target_config: ModelConfig, target_params, tokenizer, *,
    batch_size: int = 32, max_prompt_tokens: int = 512, max_new_tokens: int = 256, temperature: float = 0.0,
    seed: int = 0, time_budget_s: float = float("inf"), archive: Path | None = None, archive_every: int = 100,
    drafter: Drafter | None = None,
) -> int:
    """Regenerate `records` ({"conversations": messages, ...}) into the jsonl file at `path`.

    Records are written in input order as soon as every earlier one is (a stop loses at most the
    conversations in flight). Resumes after the records already in the file (which must be the
    same inputs: the first user turn of each is checked); a file holding more records than there are
    inputs (a larger run's) serves its first len(records). Returns the number of the inputs' records
    in the file; less than len(records) only when the time budget ran out (no conversation starts
    after it; those started are finished). `drafter`: the engine's method (None: plain decoding; a
    speculative one writes the same text greedily, faster where it pays). With an `archive` (see `write_archive`), records it holds
    beyond the file's are copied into the file first, and it is rewritten every `archive_every`
    records and at the end.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    written = _complete_lines(path)
    if archive is not None and archive.exists():
        written = _restore_from_archive(path, written, archive)
    for line_number, (line, record) in enumerate(zip(written, records), 1):
        if _first_user_turn(json.loads(line)["conversations"]) != _first_user_turn(record["conversations"]):
            raise ValueError(f"{path}:{line_number} was regenerated from different inputs; delete the file to start over")
    if len(written) >= len(records):
        if archive is not None:
            write_archive(path, archive)
        return len(records)
    max_len = -(-(max_prompt_tokens + max_new_tokens + 1) // 64) * 64
    eos_ids = stop_ids(target_config, tokenizer)
    engine = Engine(target_config, target_params, drafter, max_len=max_len, attention_chunk=64, eos_ids=eos_ids)
    start, generated, done = time.time(), 0, len(written)
    todo = records[done:]
    finished: dict[int, Messages] = {}  # completed out of order, waiting for the ones before them
    progress = tqdm(total=len(records), initial=done, unit="conv", desc="self-distill", dynamic_ncols=True)
    with path.open("a") as file:
        for index, messages, tokens in regenerate(
            engine, tokenizer, [r["conversations"] for r in todo], batch_size=batch_size,
            max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
            first_index=done, admit_more=lambda: time.time() - start <= time_budget_s,
        ):
            finished[index] = messages
            generated += tokens
            while done in finished:
                file.write(json.dumps({**records[done], "conversations": finished.pop(done)}) + "\n")
                done += 1
                if archive is not None and done % archive_every == 0:
                    file.flush()
                    write_archive(path, archive)
            file.flush()
            progress.update(done - progress.n)
            progress.set_postfix(tok_s=f"{generated / (time.time() - start):.0f}")
    progress.close()
    if archive is not None:
        write_archive(path, archive)
    return done


def read_archive(archive: Path) -> list[str]:
    """The records (jsonl lines) of a gzip archive written by `write_archive`."""
    try:
        with gzip.open(archive, "rt") as file:
            return file.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as error:  # not gzip, cut short, not text
        raise ValueError(f"{archive} is not a whole gzip archive of distilled records ({error})") from error


def write_archive(path: Path, archive: Path) -> None:
    """Replace `archive` with the complete records of the jsonl file at `path`, gzip-compressed.

    The same records give the same bytes (no name or time in the gzip header), so a repository
    that keeps the archive sees a change only when records were added.
    """
    lines = _complete_lines(path)
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with partial.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as file:
        file.write("".join(line + "\n" for line in lines).encode())
    os.replace(partial, archive)


def _restore_from_archive(path: Path, written: list[str], archive: Path) -> list[str]:
    """Extend the file's records with the archive's later ones; both must agree where they overlap."""
    archived = read_archive(archive)
    for line_number, (ours, theirs) in enumerate(zip(written, archived), 1):
        if ours != theirs:
            raise ValueError(f"{path}:{line_number} differs from record {line_number} of the archive {archive}; "
                             "one of them was regenerated from other inputs or settings")
    if len(archived) <= len(written):
        return written
    print(f"{path}: {len(archived) - len(written)} regenerated conversations taken from {archive}")
    with path.open("a") as file:
        file.write("".join(line + "\n" for line in archived[len(written):]))
    return archived


def _complete_lines(path: Path) -> list[str]:
    """The file's newline-terminated lines; a partial last line (a stop mid-write) is cut off the file."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    if len(complete) < len(text):
        print(f"{path}: dropping a partial last record ({len(text) - len(complete)} characters) written by an interrupted run")
        path.write_text(complete)
    return complete.splitlines()


def _first_user_turn(messages: Messages) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def load_regenerated(path: Path, count: int | None = None) -> list[Messages]:
    """The regenerated conversations of the first `count` records (None: all) that kept at least one assistant turn."""
    conversations = [json.loads(line)["conversations"] for line in path.read_text().splitlines()[:count]]
    return [c for c in conversations if any(m["role"] == "assistant" for m in c)]
