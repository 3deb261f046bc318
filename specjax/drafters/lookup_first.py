"""Prompt lookup where the text repeats itself, an EAGLE-3 chain everywhere else.

Per row and per step: if the last `min_match` or more tokens occurred earlier in the sequence,
the tokens that followed that occurrence are the chain (n-gram lookup, see `ngram.lookup`);
otherwise the EAGLE-3 head's greedy chain is. Both chains have the same length, so the
verification block keeps its static shape.

Both proposals are deterministic, and the choice between them depends only on the history, so
the point-mass tree rule keeps the output distribution exactly the target's. The head's state
follows the accepted path whichever chain it came from: an EAGLE-3 head re-reads accepted tokens
with the target's own features (`Eagle3Drafter.update`), never its drafted ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import tree as tree_lib
from specjax.drafters.base import Drafter, Proposal, StepContext
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.ngram import lookup
from specjax.sampling import SamplingParams


class LookupFirstDrafter(Drafter):
    """An EAGLE-3 chain drafter whose rows switch to prompt lookup on a suffix match of >= min_match tokens."""

    def __init__(self, head: Eagle3Drafter, *, min_match: int = 3, max_ngram: int | None = None):
        if head.top_k != 1 or head.tree_nodes != head.depth:
            raise ValueError(
                f"lookup-first drafting needs an EAGLE-3 chain (top_k 1, nodes = depth); got depth {head.depth}, "
                f"top_k {head.top_k}, nodes {head.tree_nodes}"
            )
        max_ngram = min_match if max_ngram is None else max_ngram
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        self.head, self.min_match, self.max_ngram = head, min_match, max_ngram
        self.params = head.params
        self.feature_layers = head.feature_layers

    @property
    def num_nodes(self) -> int:
        return self.head.num_nodes

    @property
    def max_depth(self) -> int:
        return self.head.max_depth

    def check_target(self, target_config) -> None:
        self.head.check_target(target_config)

    def init_state(self, batch_size: int, max_len: int):
        return self.head.init_state(batch_size, max_len)

    def prefill(self, params, state, chunk):
        return self.head.prefill(params, state, chunk)

    def propose(self, params, state, key: jax.Array, ctx: StepContext, sampling: SamplingParams):
        state, hidden, logits = self.head.read_unread(params, state, ctx)
        looked_up, matched = jax.vmap(lookup, in_axes=(0, 0, None, None, None))(
            ctx.history, ctx.lengths, self.head.depth, self.max_ngram, self.min_match
        )  # [B, D], [B]
        use_lookup = matched >= self.min_match  # [B]

        def with_head():
            drafted = self.head.draft(params, state.cache, hidden, logits, ctx).tokens[:, 1:]  # [B, D]
            return jnp.where(use_lookup[:, None], looked_up, drafted)

        # The head's chain costs sequential forwards; skip them when no live row needs it.
        drafted = jax.lax.cond(jnp.all(use_lookup | ~ctx.active), lambda: looked_up, with_head)
        tokens = jnp.concatenate([ctx.pending[:, None], drafted], axis=1)  # [B, D + 1]
        return state, Proposal(tree=tree_lib.chain(ctx.pending.shape[0], self.head.depth), tokens=tokens)

    def update(self, params, state, ctx, proposal, verdict, features):
        return self.head.update(params, state, ctx, proposal, verdict, features)
