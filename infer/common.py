"""Flags, validation and loading shared by the infer/ command lines.

Every command line takes the same model and sampling flags with the same defaults; methods come
from `specjax.drafters.registry`. Numeric flags are range-checked while parsing, and a flag that
does not apply to the chosen method is an error, all before any weights are loaded.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from specjax import checkpoints, host_cache
from specjax import tokenizer as tokenizer_lib
from specjax.drafters.base import BuildContext, Drafter
from specjax.drafters.base import TREE
from specjax.drafters.lookahead import SHAPE as LOOKAHEAD
from specjax.drafters.registry import METHODS, MethodSpec, parse_shape
from specjax.engine import Stats
from specjax.models import block_matmul, llama
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingParams
from specjax.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MAX_SEED = 2**32 - 1  # JAX keys hold 32 bits: larger seeds would alias smaller ones


def _ranged(kind, low=None, high=None, low_open=False, what=""):
    """An argparse type: `kind` parsed, finite, within [low, high] (low excluded if low_open)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what or kind.__name__}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


POSITIVE_INT = _ranged(int, 1, what="an integer >= 1")
NON_NEGATIVE_INT = _ranged(int, 0, what="an integer >= 0")
NON_NEGATIVE = _ranged(float, 0.0, what="a number >= 0")
SEED = _ranged(int, 0, MAX_SEED, what=f"a seed in [0, {MAX_SEED}]")


def positive_ints(text: str) -> list[int]:
    """'1,4' -> [1, 4], every entry >= 1."""
    return [POSITIVE_INT(part) for part in text.split(",")]


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser that takes no abbreviations (`--method` must not pass for `--methods`)."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )


def matmul_modes(text: str) -> list[str]:
    """'xla,streamed' -> ['xla', 'streamed']: `block_matmul` modes, each once."""
    modes = text.split(",")
    for mode in modes:
        if mode not in block_matmul.MODES:
            raise argparse.ArgumentTypeError(f"{mode!r} is not a matmul mode ({', '.join(block_matmul.MODES)})")
    if len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"{text!r} names a mode twice")
    return modes


def add_model_args(parser: argparse.ArgumentParser, matmuls: str | None = None) -> None:
    """--model, --dtype, --max-len, --draft; --matmuls for a command that builds engines with it:
    matmuls="one" (a mode) or "several" (a comma-separated list of modes to compare)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    model.add_argument("--max-len", type=POSITIVE_INT, default=1024, help="KV cache slots per row")
    model.add_argument("--draft", action="append", default=[], metavar="[METHOD=]PATH",
                       help="what a method drafts with: a draft model (HF dir / .gguf), or an EAGLE-3, EAGLE-1 or "
                       "Medusa draft directory (default: the shipped one); METHOD=PATH gives it to one method "
                       "(repeatable, e.g. --draft draft=runs/lm --draft eagle3=runs/e3)")
    model.add_argument("--compile-cache", default=None, metavar="DIR|off",
                       help="where compiled programs are kept between runs, so a command run again with the same "
                       "model, method and shapes loads them instead of compiling (default: the xla folder of "
                       "$SPECJAX_CACHE, else ~/.cache/specjax; off: compile afresh)")
    matmul_help = ("how the target's weight matmuls run: xla, or streamed (XLA:CPU, float32: every matmul through a "
                   "kernel that reads each packed weight once for all rows, built with g++ on first use; docs/architecture.md)")
    if matmuls == "several":
        model.add_argument("--matmuls", type=matmul_modes, default=["xla"], help=matmul_help + "; a comma-separated "
                           "list runs every method in each mode, the first one the baseline")
    elif matmuls == "one":
        model.add_argument("--matmuls", choices=block_matmul.MODES, default="xla", help=matmul_help)


def add_method_args(parser: argparse.ArgumentParser) -> None:
    """One method: --method and its knobs (each an error where the method has no such knob)."""
    spec = parser.add_argument_group("speculation")
    choices = "; ".join(f"{m.name}: {m.help}" for m in METHODS.values())
    spec.add_argument("--method", choices=list(METHODS), default="ar", help=choices)
    spec.add_argument("--num-spec", type=POSITIVE_INT, default=None, help="drafted tokens per step (default: the method's)")
    spec.add_argument("--tree", type=_shape_arg(TREE), default=None, help=f"a tree {TREE}: an EAGLE-2 dynamic tree (eagle3, eagle1), a static tree of top-k rank paths (medusa, eagle1-static)")
    spec.add_argument("--lookahead", type=_shape_arg(LOOKAHEAD), default=None, help=f"{LOOKAHEAD} (lookahead)")
    spec.add_argument("--min-ngram", type=POSITIVE_INT, default=None, help="shortest suffix match for prompt lookup")
    spec.add_argument("--auto", action="store_true", help="adaptive draft length: each step drafts 0 .. --num-spec "
                      "tokens, whatever pays (chain methods: ngram, eagle3, eagle3+ngram, eagle1, medusa)")


def _shape_arg(name: str):
    def parse(text: str) -> tuple[int, int, int]:
        try:
            return parse_shape(text, name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    gen = parser.add_argument_group("sampling")
    gen.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128)
    gen.add_argument("--temperature", type=NON_NEGATIVE, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="0 disables")
    gen.add_argument("--top-p", type=_ranged(float, 0.0, 1.0, low_open=True, what="a number in (0, 1]"), default=1.0)
    gen.add_argument("--min-p", type=_ranged(float, 0.0, 1.0, what="a number in [0, 1)"), default=0.0)
    gen.add_argument("--seed", type=SEED, default=0)


def method_spec(args: argparse.Namespace) -> MethodSpec:
    """The spec of --method and its knobs; a knob or --draft the method does not take is an error."""
    shapes = [(flag, value, name) for flag, value, name in (("--tree", args.tree, TREE), ("--lookahead", args.lookahead, LOOKAHEAD)) if value]
    for flag, _, name in shapes:
        if (METHODS[args.method].shape or ("",))[0] != name:
            raise ValueError(f"{flag} does not apply to --method {args.method}")
    spec = MethodSpec(args.method, args.num_spec, shapes[0][1] if shapes else None, args.min_ngram, args.auto)
    check_draft_flag(args, [spec])
    return spec


def draft_paths(values: list[str]) -> dict[str | None, str]:
    """--draft values -> {method name: path}, None for a PATH every drafting method takes."""
    paths: dict[str | None, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not (sep and name.isidentifier()):  # a plain path (which may itself hold '=')
            name, path = None, value
        elif name not in METHODS:
            raise ValueError(f"--draft {value}: unknown method {name!r}; choose from {', '.join(METHODS)}")
        if name in paths:
            raise ValueError(f"--draft given twice for {name or 'every method'}: {paths[name]!r} and {path!r}")
        paths[name] = path
    return paths


def check_draft_flag(args: argparse.Namespace, specs: list[MethodSpec]) -> None:
    """Every --draft goes to a method in `specs` that drafts with one; else a ValueError naming it."""
    labels = ", ".join(s.label for s in specs)
    for name in draft_paths(args.draft):
        takers = [spec for spec in specs if spec.info.draft and name in (None, spec.method)]
        if not takers:
            flag = "--draft" if name is None else f"--draft {name}=PATH"
            raise ValueError(f"{flag} is not used by {labels}")


def sampling_params(args: argparse.Namespace, batch_size: int) -> SamplingParams:
    return SamplingParams.make(batch_size, args.temperature, args.top_k, args.top_p, args.min_p)


#: Bytes the compilation cache keeps before it drops its least recently used programs (SmolLM2's
#: decode step is about 1 MB there).
COMPILE_CACHE_BYTES = 1 << 30


def use_compile_cache(setting: str | None) -> None:
    """Point JAX's persistent compilation cache at --compile-cache (a directory, None for the default
    one, "off" for none): programs that took over a second to compile are written there and loaded
    by a later run that compiles the same program (same model, method, shapes, XLA flags and jaxlib)."""
    directory = None if setting == "off" else setting or str(host_cache.directory() / "xla")
    jax.config.update("jax_compilation_cache_dir", directory)
    if jax.config.jax_compilation_cache_max_size == -1:  # unless the user sized it
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
    compilation_cache.reset_cache()  # the setting holds even where this process compiled before


def load_target(args: argparse.Namespace) -> tuple[ModelConfig, dict, Tokenizer]:
    """The target's config, weights and tokenizer (--model, --dtype), with --compile-cache in use."""
    use_compile_cache(args.compile_cache)
    path = args.model or checkpoints.default_model_path()
    config, params = checkpoints.load_model(path, DTYPES[args.dtype])
    if args.max_len > config.max_position_embeddings:
        raise ValueError(f"--max-len {args.max_len} exceeds the model's {config.max_position_embeddings} positions")
    return config, params, tokenizer_lib.load(path)


def engine_targets(config: ModelConfig, params, modes) -> dict[str, tuple[ModelConfig, dict]]:
    """{mode: (config, params)} as an engine in each --matmuls mode holds the target, made once so that
    every engine of a mode shares it (a streamed engine would otherwise pack its own copy of every matrix)."""
    return {mode: llama.streamed(config, params) if mode == "streamed" else (config, params) for mode in modes}


def build_drafter(spec: MethodSpec, args: argparse.Namespace, config: ModelConfig, params, draft: str | None = None) -> Drafter:
    """The spec's drafter; --draft goes to the methods that draft with one (METHOD=PATH to that method),
    unless `draft` names the one to use."""
    if draft is None and spec.info.draft:
        paths = draft_paths(args.draft)
        draft = paths.get(spec.method, paths.get(None))
    return spec.build(BuildContext(config, params, draft, DTYPES[args.dtype]))


def method_summary(label: str, stats: Stats, compile_s: float) -> str:
    """The closing lines: timings (compilation apart) and speculation statistics."""
    tokens = stats.num_generated
    lines = [
        f"[{label}] prefill {stats.prefill_s * 1e3:.0f} ms | decode {tokens} tokens in "
        f"{stats.decode_s:.2f} s = {stats.decode_tokens_per_s:.1f} tokens/s | {len(stats.tokens)} row(s) | "
        f"compile {compile_s:.1f} s (excluded)"
    ]
    if stats.accepted_hist.shape[-1] > 1:
        per_position = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
        lines.append(
            f"tau {stats.tau:.2f} tokens/verifier call | {int(np.sum(stats.calls))} calls | "
            f"acceptance by position: {per_position}"
        )
    if stats.drafting_share < 1.0 and stats.accepted_hist.shape[-1] > 1:
        lines.append(f"adaptive draft length: drafted in {stats.drafting_share:.0%} of verifier calls")
    return "\n".join(lines)
