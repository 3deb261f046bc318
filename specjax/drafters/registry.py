"""Every decoding method by name, and the spec syntax the command lines share.

A spec is `NAME` (the method's defaults), `NAME:N` (N drafted tokens per step) or, for a tree
method, `NAME:DEPTH,TOPK,NODES` (an EAGLE-2 dynamic tree). Adding a method is a drafter module
that declares `METHOD = Method(...)` and one line in `METHODS` (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses

from specjax.drafters import autoregressive, draft_model, eagle3, ngram, ngram_first
from specjax.drafters.base import Method
from specjax.tree import pool_size

METHODS: dict[str, Method] = {
    method.name: method
    for method in (autoregressive.METHOD, ngram.METHOD, draft_model.METHOD, eagle3.METHOD, ngram_first.METHOD)
}


def parse_tree(text: str) -> tuple[int, int, int]:
    """'D,K,T' -> (depth, top_k, nodes), checked against the candidate pool."""
    try:
        depth, top_k, nodes = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"a tree is DEPTH,TOPK,NODES (e.g. 5,8,32), got {text!r}") from None
    if min(depth, top_k, nodes) < 1 or nodes > pool_size(depth, top_k):
        raise ValueError(f"tree {text}: need positive values and NODES <= TOPK + (DEPTH-1)*TOPK^2 (the candidate pool)")
    return depth, top_k, nodes


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method and its parameters, every default filled in; an inapplicable one is a ValueError."""

    method: str
    num_spec: int | None = None
    tree: tuple[int, int, int] | None = None
    min_ngram: int | None = None

    def __post_init__(self):
        info = METHODS.get(self.method)
        if info is None:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if info.num_spec is None and (self.num_spec is not None or self.tree):
            raise ValueError(f"{self.method} drafts nothing: it takes no number of drafted tokens and no tree")
        if self.tree and not info.trees:
            raise ValueError(f"{self.method} drafts chains, not trees; give it a number of drafted tokens")
        if self.tree and self.num_spec is not None:
            raise ValueError(f"{self.method}: give a chain length or a tree, not both")
        if self.min_ngram is not None and info.min_ngram is None:
            raise ValueError(f"{self.method} does no prompt lookup: it takes no min_ngram")
        if self.num_spec is not None and self.num_spec < 1:
            raise ValueError(f"{self.method}: the number of drafted tokens must be >= 1, got {self.num_spec}")
        if self.min_ngram is not None and self.min_ngram < 1:
            raise ValueError(f"{self.method}: min_ngram must be >= 1, got {self.min_ngram}")
        if self.num_spec is None and not self.tree and info.num_spec is not None:
            object.__setattr__(self, "num_spec", info.num_spec)
        if self.min_ngram is None:
            object.__setattr__(self, "min_ngram", info.min_ngram)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """'ar', 'ngram:5', 'eagle3', 'eagle3:4,2,8' -> a spec."""
        method, _, params = text.partition(":")
        if not params:
            return cls(method)
        if "," in params:
            return cls(method, tree=parse_tree(params))
        if not params.isdigit():
            raise ValueError(f"{text!r}: expected METHOD:N (N drafted tokens) or METHOD:DEPTH,TOPK,NODES")
        return cls(method, num_spec=int(params))

    @property
    def info(self) -> Method:
        return METHODS[self.method]

    @property
    def label(self) -> str:
        if self.tree:
            return f"{self.method}:" + ",".join(map(str, self.tree))
        return self.method if self.num_spec is None else f"{self.method}:{self.num_spec}"
