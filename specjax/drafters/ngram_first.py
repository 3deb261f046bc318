"""N-gram first: prompt lookup where the text repeats itself, any chain drafter everywhere else.

Per row and per step: if the sequence's last `min_ngram` or more tokens occurred earlier, the
tokens that followed that occurrence are the chain (`ngram.lookup`); otherwise the fallback
drafter's chain is. Both chains have the same length, so the verification block keeps its
static shape. The method `eagle3+ngram` is this combinator over the EAGLE-3 chain.

Exactness: lookup drafts are deterministic and the choice depends only on the history. Over a
point-mass fallback the whole chain is verified by the point-mass rule; over a sampled
fallback (rule "rejection") a looked-up row's draft distribution is the one-hot of its tokens,
for which the rejection rule is the point-mass rule. The fallback's state follows the accepted
path whichever chain it came from (its `update` runs every step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax import tree as tree_lib
from specjax.drafters import eagle3
from specjax.drafters.base import Drafter, Method, Priors, Proposal, StepContext, Wrapper, trace_once
from specjax.drafters.ngram import first_guess_rows, lookup_rows
from specjax.sampling import SamplingParams


class NgramFirst(Wrapper):
    """Prompt lookup on a suffix match of >= min_ngram tokens, else the fallback chain drafter (`inner`)."""

    def __init__(self, fallback: Drafter, *, min_ngram: int = 3, max_ngram: int | None = None):
        if fallback.num_nodes != fallback.max_depth + 1:
            raise ValueError(f"n-gram-first drafting needs a chain drafter; got a tree of {fallback.num_nodes} nodes")
        max_ngram = min_ngram if max_ngram is None else max_ngram
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        super().__init__(fallback)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def at_depth(self, depth: int) -> NgramFirst:
        return NgramFirst(self.inner.at_depth(depth), min_ngram=self.min_ngram, max_ngram=self.max_ngram)

    @property
    def guess_classes(self) -> int:
        return self.max_ngram + 1  # the matched suffix's length (>= min_ngram), 0: the fallback drafts

    def first_guess(self, ctx: StepContext):
        """The lookup's first token where the suffix matches; the fallback's needs its forwards."""
        return first_guess_rows(ctx, self.max_ngram, self.min_ngram)

    def propose(self, params, state, key: jax.Array, ctx: StepContext, sampling: SamplingParams):
        batch, depth = ctx.pending.shape[0], self.max_depth
        looked_up, matched = lookup_rows(ctx, depth, self.max_ngram, self.min_ngram)  # [B, D], [B]
        use_lookup = matched >= self.min_ngram  # [B]
        inner_propose, (_, probe) = trace_once(lambda: self.inner.propose(params, state, key, ctx, sampling))
        sampled = probe.rule == "rejection"
        one_hot = lambda tokens: sampling_lib.unless_greedy(  # [B, D] -> [B, D, V]
            sampling, lambda: jax.nn.one_hot(tokens, probe.draft_probs.shape[-1], dtype=probe.draft_probs.dtype))

        def with_fallback():
            new_state, proposal = inner_propose()
            tokens = jnp.where(use_lookup[:, None], looked_up, proposal.tokens[:, 1:])  # [B, D]
            if not sampled:
                return new_state, (tokens, None)
            return new_state, (tokens, jnp.where(use_lookup[:, None, None], one_hot(looked_up), proposal.draft_probs))

        if self.propose_changes_state:  # the fallback must draft every step to keep its state
            state, (drafted, draft_probs) = with_fallback()
        else:  # skip the fallback's drafting forwards when no live row needs them; only the
            # drafts pass through the cond, not the unchanged state (XLA would copy its caches)
            lookup_only = lambda: (looked_up, one_hot(looked_up) if sampled else None)
            drafted, draft_probs = jax.lax.cond(jnp.all(use_lookup | ~ctx.active), lookup_only, lambda: with_fallback()[1])
        tokens = jnp.concatenate([ctx.pending[:, None], drafted], axis=1)  # [B, D + 1]
        return state, Proposal(tree=tree_lib.chain(batch, depth), tokens=tokens, draft_probs=draft_probs, rule=probe.rule)


def _build(spec, context) -> NgramFirst:
    head = eagle3.METHOD.build(dataclasses.replace(spec, method="eagle3", min_ngram=None), context)
    return NgramFirst(head, min_ngram=spec.min_ngram)


METHOD = Method(
    "eagle3+ngram",
    "n-gram first: prompt lookup where the suffix repeats, the EAGLE-3 chain elsewhere",
    build=_build,
    num_spec=3,
    draft=eagle3.METHOD.draft,
    min_ngram=3,
    # The EAGLE-3 prior, plus part of what lookup adds where text repeats.
    priors=Priors(
        alpha={"chat": 0.71, "code": 0.82, "structured": 0.8, "long-form": 0.66, "creative": 0.55},
        temperature_decay=0.45,
        draft_cost=0.05,
    ),
)
