"""Prompt-lookup (n-gram) drafting: no model, no training.

The longest suffix of the sequence (up to `max_ngram` tokens, at least `min_ngram`) is searched
for in everything generated or prompted so far; the tokens that followed its most recent earlier
occurrence are proposed as a chain. Proposals are deterministic, so they are verified with the
point-mass tree rule and the output distribution is exactly the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import tree as tree_lib
from specjax.drafters.base import ChainDrafter, Method, Priors, Proposal, StepContext
from specjax.sampling import SamplingParams


def lookup(
    history: jax.Array, length: jax.Array, num_draft: int, max_ngram: int, min_ngram: int
) -> tuple[jax.Array, jax.Array]:
    """Continuation of the most recent earlier match of the sequence's suffix (one row).

    history: [S] tokens; the sequence is history[:length + 1] (the pending token at `length`).
    Returns ([num_draft] proposed tokens, [] int32 size of the matched suffix, 0 if none).
    Without any match it proposes the last token repeated.
    """
    seq_len = history.shape[0]
    last = length  # index of the pending token, the end of the suffix
    ends = jnp.arange(seq_len)  # candidate end index j of an earlier occurrence
    best_end = jnp.full((), -1, jnp.int32)
    best_size = jnp.zeros((), jnp.int32)
    matches = jnp.ones((seq_len,), bool)
    for size in range(1, max_ngram + 1):
        offset = size - 1
        shifted = jnp.roll(history, offset)  # shifted[j] = history[j - offset]
        matches &= (shifted == history[last - offset]) & (ends >= offset)
        candidates = matches & (ends < last)
        found_end = jnp.max(jnp.where(candidates, ends, -1))
        longer_found = (size >= min_ngram) & (found_end >= 0) & (last >= offset)
        best_end = jnp.where(longer_found, found_end, best_end)
        best_size = jnp.where(longer_found, size, best_size)
    indices = jnp.minimum(best_end + 1 + jnp.arange(num_draft), last)
    return jnp.where(best_end >= 0, history[indices], history[last]), best_size


def lookup_rows(ctx: StepContext, num_draft: int, max_ngram: int, min_ngram: int) -> tuple[jax.Array, jax.Array]:
    """`lookup` for every row of the batch: ([B, num_draft] proposed tokens, [B] matched suffix size)."""
    return jax.vmap(lookup, in_axes=(0, 0, None, None, None))(ctx.history, ctx.lengths, num_draft, max_ngram, min_ngram)


def first_guess_rows(ctx: StepContext, max_ngram: int, min_ngram: int) -> tuple[jax.Array, jax.Array]:
    """`Drafter.first_guess` of a lookup: ([B] first looked-up token, [B] matched suffix size, 0 if none)."""
    guess, matched = lookup_rows(ctx, 1, max_ngram, min_ngram)  # [B, 1], [B]
    return guess[:, 0], matched


class NgramDrafter(ChainDrafter):
    """Chain of `num_draft` tokens from prompt lookup."""

    def __init__(self, num_draft: int = 5, min_ngram: int = 1, max_ngram: int | None = None):
        super().__init__(num_draft)
        max_ngram = max(3, min_ngram) if max_ngram is None else max_ngram
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, params, state, key, ctx: StepContext, sampling: SamplingParams):
        drafts, _ = lookup_rows(ctx, self.num_draft, self.max_ngram, self.min_ngram)  # [B, N]
        tokens = jnp.concatenate([ctx.pending[:, None], drafts], axis=1)  # [B, N + 1]
        chain = tree_lib.chain(ctx.pending.shape[0], self.num_draft)
        return state, Proposal(tree=chain, tokens=tokens)

    drafts_without_guess = False  # without a match the lookup proposes the last token repeated

    @property
    def guess_classes(self) -> int:
        return self.max_ngram + 1  # the matched suffix's length, 0 without a match

    def first_guess(self, ctx: StepContext):
        return first_guess_rows(ctx, self.max_ngram, self.min_ngram)


METHOD = Method(
    "ngram",
    "prompt lookup: the continuation of the sequence's latest earlier suffix match (no model)",
    build=lambda spec, context: NgramDrafter(num_draft=spec.num_spec, min_ngram=spec.min_ngram),
    num_spec=5,
    min_ngram=1,
    priors=Priors(
        alpha={"chat": 0.25, "code": 0.6, "structured": 0.55, "long-form": 0.2, "creative": 0.1},
        temperature_decay=0.9,
        draft_cost=0.0,
    ),
)
