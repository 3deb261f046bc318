"""Plain autoregressive decoding as a drafter: the tree is the pending token alone.

Verification by the point-mass rule over a root without children samples the next token from
q, which is plain sampling; the engine has no special case for it.
"""

from __future__ import annotations

from specjax import tree as tree_lib
from specjax.drafters.base import Drafter, Method, Proposal


class Autoregressive(Drafter):
    """Drafts nothing: every step verifies only the pending token and samples one more."""

    num_nodes = 1
    max_depth = 0

    def propose(self, params, state, key, ctx, sampling):
        return state, Proposal(tree=tree_lib.chain(ctx.pending.shape[0], 0), tokens=ctx.pending[:, None])


METHOD = Method("ar", "plain autoregressive decoding (the baseline)", build=lambda spec, context: Autoregressive())
