"""Options and loading shared by the infer/ command lines."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax import checkpoints
from specjax.drafters.base import Drafter
from specjax.engine import Stats
from specjax.models.config import ModelConfig
from specjax import tokenizer as tokenizer_lib
from specjax.tokenizer import Tokenizer

METHODS = ("ar", "ngram", "draft", "eagle3", "eagle3+ngram")  # eagle3+ngram: lookup-first, EAGLE-3 chain elsewhere
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_tree(text: str) -> tuple[int, int, int]:
    """'D,K,T' -> (depth, top_k, nodes)."""
    try:
        depth, top_k, nodes = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree takes DEPTH,TOPK,NODES (e.g. 5,8,32), got {text!r}") from None
    if min(depth, top_k, nodes) < 1 or nodes > top_k + (depth - 1) * top_k**2:
        raise argparse.ArgumentTypeError(
            f"--tree {text}: need positive values and NODES <= TOPK + (DEPTH-1)*TOPK^2 (the candidate pool)"
        )
    return depth, top_k, nodes


def add_model_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    model.add_argument("--max-len", type=int, default=1024, help="KV cache slots per row")
    spec = parser.add_argument_group("speculation")
    spec.add_argument("--method", choices=METHODS, default="ar")
    spec.add_argument("--num-spec", type=int, default=5, help="drafted tokens per step (chain)")
    spec.add_argument("--tree", type=parse_tree, default=None, help="EAGLE-2 dynamic tree DEPTH,TOPK,NODES (eagle3)")
    spec.add_argument("--draft", default=None, help="draft model (HF dir / .gguf) or EAGLE-3 draft directory")


def load_target(args: argparse.Namespace) -> tuple[ModelConfig, dict, Tokenizer]:
    path = args.model or checkpoints.default_model_path()
    config, params = checkpoints.load_model(path, DTYPES[args.dtype])
    return config, params, tokenizer_lib.load(path)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A decoding method and its parameters: 'ar', 'ngram:5', 'draft:4', 'eagle3:5', 'eagle3:5,8,32'."""

    method: str
    num_spec: int = 5
    tree: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.tree and self.method != "eagle3":
            raise ValueError(f"{self.method}: only eagle3 drafts trees (DEPTH,TOPK,NODES); use a chain of N tokens")

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        method, _, params = text.partition(":")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} in {text!r}; choose from {', '.join(METHODS)}")
        if not params:
            return cls(method)
        if params.count(",") == 2:
            return cls(method, tree=parse_tree(params))
        if not params.isdigit() or int(params) < 1:
            raise ValueError(f"{text!r}: expected METHOD:N with N >= 1 drafted tokens, or eagle3:DEPTH,TOPK,NODES")
        return cls(method, num_spec=int(params))

    @property
    def label(self) -> str:
        if self.method == "ar":
            return "ar"
        if self.tree:
            return f"{self.method}:" + ",".join(map(str, self.tree))
        return f"{self.method}:{self.num_spec}"


def build_drafter(spec: MethodSpec, config: ModelConfig, params, draft_path: str | None, dtype: str) -> Drafter | None:
    """The drafter for a method spec, with its parameters."""
    if spec.method == "ar":
        return None
    if spec.method == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        return NgramDrafter(num_draft=spec.num_spec)
    if spec.method == "draft":
        from specjax.drafters.draft_model import DraftModelDrafter

        if draft_path is None:
            raise ValueError("--method draft needs --draft PATH (a small model sharing the target's tokenizer)")
        draft_config, draft_params = checkpoints.load_model(draft_path, DTYPES[dtype])
        return DraftModelDrafter(draft_config, draft_params, num_draft=spec.num_spec)
    from specjax.checkpoints.eagle3 import load_eagle3
    from specjax.drafters.eagle3 import Eagle3Drafter, default_draft_path
    from specjax.drafters.lookup_first import LookupFirstDrafter
    from specjax.models import eagle3 as eagle3_model

    head_config, head_params, vocab = load_eagle3(
        draft_path or default_draft_path(), target_vocab_size=config.vocab_size, dtype=DTYPES[dtype]
    )
    depth, top_k, nodes = spec.tree or (spec.num_spec, 1, spec.num_spec)
    head = Eagle3Drafter(
        head_config, head_params, vocab, params["embed_tokens"], depth=depth, top_k=top_k, tree_nodes=nodes,
        feature_layers=eagle3_model.feature_layers(config.num_layers),
    )
    return LookupFirstDrafter(head) if spec.method == "eagle3+ngram" else head


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
    return "\n".join(lines)
