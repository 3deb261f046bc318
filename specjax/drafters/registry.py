"""Every decoding method by name, and the spec syntax the command lines share.

A spec is `NAME` (the method's defaults), `NAME:N` (N drafted tokens per step), `NAME:auto` or
`NAME:autoN` (a chain of up to N drafts whose length the engine chooses every step,
`drafters/adaptive.py`; N defaults to the method's) or, for a method that takes three numbers,
`NAME:A,B,C` (`eagle3:DEPTH,TOPK,NODES`, an EAGLE-2 dynamic tree; `lookahead:WINDOW,NGRAM,GUESSES`). Adding a method is a drafter module
that declares `METHOD = Method(...)` and one line in `METHODS` (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses

from specjax.drafters import autoregressive, draft_model, eagle1, eagle3, lookahead, medusa, ngram, ngram_first
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import TREE, BuildContext, Drafter, Method
from specjax.tree import pool_size

METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        autoregressive.METHOD, ngram.METHOD, draft_model.METHOD, medusa.METHOD, eagle1.METHOD, eagle1.STATIC_METHOD,
        eagle3.METHOD, ngram_first.METHOD, lookahead.METHOD,
    )
}


def parse_shape(text: str, name: str = TREE) -> tuple[int, int, int]:
    """'A,B,C' -> three positive ints; an EAGLE-2 tree (name TREE) must fit its candidate pool."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"expected {name} (three positive integers, e.g. 4,2,8), got {text!r}")
    if name == TREE and shape[2] > pool_size(*shape[:2]):
        raise ValueError(f"tree {text}: NODES must be <= TOPK + (DEPTH-1)*TOPK^2 (the candidate pool)")
    return shape


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method and its parameters, every default filled in; an inapplicable one is a ValueError.

    num_spec: drafted tokens per step (chain methods); shape: the three numbers of a method that
    takes them (`Method.shape`: an EAGLE-2 tree, Lookahead's window); min_ngram: prompt lookup;
    adaptive: num_spec is the longest chain, the engine picks the length every step.
    """

    method: str
    num_spec: int | None = None
    shape: tuple[int, int, int] | None = None
    min_ngram: int | None = None
    adaptive: bool = False

    def __post_init__(self):
        info = METHODS.get(self.method)
        if info is None:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if info.num_spec is None and info.shape is None and (self.num_spec is not None or self.shape):
            raise ValueError(f"{self.method} drafts nothing: it takes no number of drafted tokens and no tree")
        if self.shape and not info.shape:
            raise ValueError(f"{self.method} drafts chains, not trees; give it a number of drafted tokens")
        if self.num_spec is not None and info.num_spec is None:
            raise ValueError(f"{self.method} takes {info.shape[0]}, not a number of drafted tokens")
        if self.shape and self.num_spec is not None:
            raise ValueError(f"{self.method}: give a chain length or {info.shape[0]}, not both")
        if self.shape:
            parse_shape(",".join(map(str, self.shape)), info.shape[0])
        if self.min_ngram is not None and info.min_ngram is None:
            raise ValueError(f"{self.method} does no prompt lookup: it takes no min_ngram")
        if self.num_spec is not None and self.num_spec < 1:
            raise ValueError(f"{self.method}: the number of drafted tokens must be >= 1, got {self.num_spec}")
        if self.adaptive and (info.num_spec is None or self.shape or not info.adaptive):
            raise ValueError(f"{self.method}: only chain methods that draft without writing state take auto (an adaptive draft length)")
        if self.min_ngram is not None and self.min_ngram < 1:
            raise ValueError(f"{self.method}: min_ngram must be >= 1, got {self.min_ngram}")
        if self.num_spec is None and not self.shape:
            object.__setattr__(self, "num_spec", info.num_spec)
            object.__setattr__(self, "shape", info.shape and info.shape[1])
        if self.min_ngram is None:
            object.__setattr__(self, "min_ngram", info.min_ngram)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """'ar', 'ngram:5', 'eagle3:auto6', 'eagle3', 'eagle3:4,2,8', 'lookahead:4,3,4' -> a spec."""
        method, _, params = text.partition(":")
        if not params:
            return cls(method)
        if params.startswith("auto") and (params == "auto" or params[4:].isdigit()):
            return cls(method, num_spec=int(params[4:]) if params != "auto" else None, adaptive=True)
        if "," in params:
            info = METHODS.get(method)
            return cls(method, shape=parse_shape(params, info.shape[0] if info and info.shape else TREE))
        if not params.isdigit():
            raise ValueError(
                f"{text!r}: expected METHOD:N (N drafted tokens), METHOD:auto[N] (adaptive, up to N) "
                "or METHOD:A,B,C (a tree, a lookahead window)"
            )
        return cls(method, num_spec=int(params))

    @property
    def info(self) -> Method:
        return METHODS[self.method]

    def build(self, context: BuildContext) -> Drafter:
        """The method's drafter, wrapped for an adaptive draft length when the spec says auto."""
        drafter = self.info.build(self, context)
        return AdaptiveDepth(drafter) if self.adaptive else drafter

    @property
    def tree(self) -> tuple[int, int, int] | None:
        """The EAGLE-2 tree (DEPTH, TOPK, NODES), for a method that drafts trees."""
        return self.shape if self.info.shape and self.info.shape[0] == TREE else None

    @property
    def label(self) -> str:
        if self.shape:
            return f"{self.method}:" + ",".join(map(str, self.shape))
        if self.adaptive:
            return f"{self.method}:auto{self.num_spec}"
        return self.method if self.num_spec is None else f"{self.method}:{self.num_spec}"
