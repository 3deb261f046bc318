"""Lookahead decoding (Fu et al. 2024): Jacobi iteration harvests n-grams, no draft model.

Every step runs, in the target's one forward, beside the verified tree:
- the lookahead branch (auxiliary nodes, never verified or committed): a window of W columns
  and N - 1 levels of past Jacobi iterates; level j of column i sits at offset i + j from the
  pending token (level 0 of column 0 is the pending token itself, the tree's root). A node sees
  the level-0 tokens of columns up to its own and the lower levels of its own column. The
  target's greedy prediction at the top level is the next iterate of every column.
- the verification branch: the G n-grams of the pool that start with the pending token, as G
  chains of N - 1 tokens below the root, verified by the point-mass rule (they depend only on
  the history, so the output is exactly the target's).

After each step every column yields an n-gram (its N - 1 levels and its new iterate), stored
in a per-row pool keyed by its first token: G slots per key, the oldest replaced first, an
n-gram already there not stored twice. The pool is direct-mapped ([B, V, G, N - 1] tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Drafter, Method, Priors, Proposal
from specjax.tree import Tree


SHAPE = "WINDOW,NGRAM,GUESSES"  # the three numbers of the method spec `lookahead:W,N,G`


@struct.dataclass
class LookaheadState:
    levels: jax.Array  # [B, N - 1, W] Jacobi iterates, oldest level first (level 0, column 0 unused: the root)
    pool: jax.Array  # [B, V, G, N - 1] n-grams after their first token
    count: jax.Array  # [B, V] n-grams stored per first token (<= G)
    head: jax.Array  # [B, V] the slot the next n-gram of this first token replaces


class LookaheadDrafter(Drafter):
    """Window W, n-gram size N (>= 3), G verified n-grams per step."""

    def __init__(self, vocab_size: int, window: int = 2, ngram: int = 3, guesses: int = 2):
        if window < 1 or guesses < 1 or ngram < 3:
            raise ValueError(f"lookahead needs W >= 1, N >= 3, G >= 1; got W={window}, N={ngram}, G={guesses}")
        self.vocab_size, self.window, self.ngram, self.guesses = vocab_size, window, ngram, guesses
        self.num_aux = window * (ngram - 1) - 1
        offsets, mask = _lookahead_branch(window, ngram, self.num_nodes)
        self._aux_offsets, self._aux_mask = jnp.asarray(offsets), jnp.asarray(mask)

    @property
    def num_nodes(self) -> int:
        return 1 + self.guesses * (self.ngram - 1)

    @property
    def max_depth(self) -> int:
        return self.ngram - 1

    def check_target(self, target_config) -> None:
        if target_config.vocab_size != self.vocab_size:
            raise ValueError(f"lookahead pool built for {self.vocab_size} tokens, the target has {target_config.vocab_size}")

    keeps_prefixes = True  # its state starts empty for every prompt and reads nothing of it

    def init_state(self, batch_size: int, max_len: int) -> LookaheadState:
        depth, width, guesses = self.ngram - 1, self.window, self.guesses
        zeros = lambda *shape: jnp.zeros((batch_size,) + shape, jnp.int32)
        return LookaheadState(
            levels=zeros(depth, width), pool=zeros(self.vocab_size, guesses, depth),
            count=zeros(self.vocab_size), head=zeros(self.vocab_size),
        )

    def propose(self, params, state: LookaheadState, key, ctx, sampling):
        batch, depth, guesses = ctx.pending.shape[0], self.ngram - 1, self.guesses
        rows = jnp.arange(batch)
        found = state.pool[rows, ctx.pending]  # [B, G, N - 1]
        count = state.count[rows, ctx.pending]  # [B]
        # Empty slots repeat the first n-gram (a repeated sibling is never accepted twice), or the
        # pending token when there is none: any choice that depends only on the history is exact.
        first = jnp.where(count[:, None] > 0, found[:, 0], ctx.pending[:, None])  # [B, N - 1]
        guesses_tokens = jnp.where((jnp.arange(guesses) < count[:, None])[:, :, None], found, first[:, None])
        tokens = jnp.concatenate([ctx.pending[:, None], guesses_tokens.reshape(batch, guesses * depth)], 1)  # [B, N]
        parents, depths = _chains(guesses, depth)
        tree = Tree(
            parents=jnp.broadcast_to(parents, (batch, self.num_nodes)),
            depths=jnp.broadcast_to(depths, (batch, self.num_nodes)),
            max_depth=depth,
        )
        window = jnp.concatenate([state.levels[:, 0, 1:], state.levels[:, 1:].reshape(batch, -1)], 1)  # [B, A]
        return state, Proposal(
            tree=tree,
            tokens=tokens,
            aux_tokens=window,
            aux_offsets=jnp.broadcast_to(self._aux_offsets, window.shape),
            aux_mask=jnp.broadcast_to(self._aux_mask, (batch,) + self._aux_mask.shape),
        )

    def update(self, params, state: LookaheadState, ctx, proposal, commit, features, aux_logits=None):
        iterate = jnp.argmax(aux_logits[:, -self.window :], -1).astype(jnp.int32)  # [B, W] the top level's next
        levels = state.levels.at[:, 0, 0].set(ctx.pending)  # [B, N - 1, W]
        ngrams = jnp.concatenate([levels, iterate[:, None]], 1)  # [B, N, W]: column i is an n-gram
        pool, count, head = jax.vmap(self._store)(state.pool, state.count, state.head, ngrams, ctx.active)
        return LookaheadState(levels=ngrams[:, 1:], pool=pool, count=count, head=head)

    def _store(self, pool, count, head, ngrams, active):
        """One row: add the W columns of ngrams [N, W] to its pool, in column order."""

        def add(column, carry):
            pool, count, head = carry
            first, rest = ngrams[0, column], ngrams[1:, column]  # [], [N - 1]
            known = jnp.any(jnp.all(pool[first] == rest, -1) & (jnp.arange(self.guesses) < count[first]))
            keep = active & ~known
            slot = head[first]
            pool = pool.at[first, slot].set(jnp.where(keep, rest, pool[first, slot]))
            count = count.at[first].add(jnp.where(keep & (count[first] < self.guesses), 1, 0))
            head = head.at[first].set(jnp.where(keep, (slot + 1) % self.guesses, slot))
            return pool, count, head

        return jax.lax.fori_loop(0, self.window, add, (pool, count, head))


def _chains(guesses: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """[1 + G * D] parents and depths of G chains of D tokens below the root, chain after chain."""
    parents, depths = [-1], [0]
    for _ in range(guesses):
        for level in range(depth):
            parents.append(0 if level == 0 else len(parents) - 1)
            depths.append(level + 1)
    return np.asarray(parents, np.int32), np.asarray(depths, np.int32)


def _lookahead_branch(window: int, ngram: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets [A] and mask [A, num_nodes + A] of the window's auxiliary nodes.

    Auxiliary order: level 0 columns 1 .. W-1, then levels 1 .. N-2, columns 0 .. W-1.
    """
    cells = [(0, column) for column in range(1, window)]
    cells += [(level, column) for level in range(1, ngram - 1) for column in range(window)]
    index = {cell: num_nodes + i for i, cell in enumerate(cells)}
    index[(0, 0)] = 0  # the root
    mask = np.zeros((len(cells), num_nodes + len(cells)), bool)
    for row, (level, column) in enumerate(cells):
        seen = [(0, c) for c in range(column + 1)] + [(lower, column) for lower in range(1, level + 1)]
        mask[row, [index[cell] for cell in seen]] = True
    offsets = np.asarray([level + column for level, column in cells], np.int32)
    return offsets, mask


METHOD = Method(
    "lookahead",
    "Lookahead decoding: Jacobi iterates feed an n-gram pool, verified in the same forward (no draft)",
    build=lambda spec, context: LookaheadDrafter(context.target_config.vocab_size, *spec.shape),
    shape=(SHAPE, (2, 3, 2)),  # best of the sweep on a 2-core CPU (README); accelerators: e.g. 15,5,15
    priors=Priors(
        alpha={"chat": 0.2, "code": 0.45, "structured": 0.45, "long-form": 0.2, "creative": 0.1},
        temperature_decay=0.9,
        draft_cost=0.0,
    ),
)
