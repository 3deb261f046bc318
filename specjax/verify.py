"""Verification: how much of a draft the target accepts, and the token that follows it.

Both rules are exact: the emitted tokens (the accepted drafts, then `next_token`) are
distributed as if sampled one by one from the target's processed distribution q
(`sampling.probs`). Greedy rows (temperature 0) take the argmax walk, with no randomness.

chain:        drafts sampled from known distributions p (Leviathan et al. 2023; Chen et al. 2023).
tree:         deterministic candidates (EAGLE-2 top-k, n-gram, Medusa), verified by the point-mass
              rule of docs/architecture.md: at an accepted node with residual r (starting at q), try the
              children in index order, accept child c with probability r(c), on rejection zero r(c)
              and renormalise; if every child is rejected, sample from r.
sampled_tree: each node's children drawn one after another without replacement from its draft
              distribution p (multi-draft speculative sampling, as SpecInfer): child j is tried
              with the residual r_j and p_j = p without the earlier siblings, renormalised, and
              accepted with probability min(1, r_j(c) / p_j(c)); on rejection
              r_{j+1} = normalise(max(r_j - p_j, 0)). Given the earlier siblings, c_j is drawn from
              p_j, so each try is one step of the chain rule and the node emits exactly q.
greedy:       an all-greedy batch under any of them, from the target's argmax tokens alone.

Conventions that keep both rules exact and safe:
- Acceptance test: draft d is accepted iff u * p(d) < q(d) with u ~ U(0, 1), that is with
  probability min(1, q(d) / p(d)). Where p(d) = 0 (d cannot have come from p; only rounding
  of a drafter's probabilities gets here) this accepts iff q(d) > 0, the limit of
  min(1, q/p) as p -> 0. A token with q(d) = 0 is never accepted.
- Residual: normalise(max(q - p, 0)). It has no mass only where q <= p everywhere, i.e.
  p == q, where rejection has probability 0; there it falls back to q.
- A deterministic child with token t is a point-mass draft p = one_hot(t); rejecting a set of
  children is the residual against the sum of their point masses. One `_residual` serves both.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.sampling import SamplingParams
from specjax.tree import Tree

Residual = Callable[[jax.Array, jax.Array], jax.Array]


@struct.dataclass
class Verdict:
    """The outcome of verifying one draft per row.

    accepted:    [B] int32, drafted tokens accepted (0 .. depth).
    next_token:  [B] int32, the token sampled after them (residual on rejection, else bonus).
    path:        [B, D + 1] int32, accepted node indices from the root (path[:, 0] = 0); entries
                 past `accepted` repeat the last accepted node. For a chain, node i is draft i - 1.
    accepted_at: [B, D] bool, position i (depth i + 1) accepted, i.e. i < accepted.
    """

    accepted: jax.Array  # [B] int32
    next_token: jax.Array  # [B] int32
    path: jax.Array  # [B, D + 1] int32
    accepted_at: jax.Array  # [B, D] bool


def _residual(q: jax.Array, p: jax.Array) -> jax.Array:
    """normalise(max(q - p, 0)) over the last axis; q where that has no mass (p == q)."""
    excess = jnp.maximum(q - p, 0.0)  # [..., V]
    mass = jnp.sum(excess, axis=-1, keepdims=True)  # [..., 1]
    return jnp.where(mass > 0, excess / jnp.where(mass > 0, mass, 1.0), q)


def _row_noise(key: jax.Array, num_tests: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """One row's randomness from a single draw: num_tests acceptance uniforms in (0, 1) and
    Gumbel noise [vocab] for the next token (one random call compiles far faster than several)."""
    uniform = jax.random.uniform(key, (num_tests + vocab,), minval=jnp.finfo(jnp.float32).tiny)
    return uniform[:num_tests], -jnp.log(-jnp.log(uniform[num_tests:]))


def _noise(key: jax.Array, params: SamplingParams, num_tests: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Every row's randomness, uniform [B, num_tests] and Gumbel [B, vocab], from one key or [B]
    per-row keys. Greedy rows use none of it, so an all-greedy batch skips drawing it."""
    batch = params.batch_size
    keys = key if key.ndim else jax.random.split(key, batch)
    return jax.lax.cond(
        jnp.all(params.greedy),
        lambda: (jnp.ones((batch, num_tests)), jnp.zeros((batch, vocab))),
        lambda: jax.vmap(_row_noise, (0, None, None))(keys, num_tests, vocab),
    )


def _draw(gumbel: jax.Array, probabilities: jax.Array) -> jax.Array:
    """Gumbel-max: argmax(log p + gumbel) is distributed as p; zero-probability tokens never win."""
    return jnp.argmax(jnp.log(probabilities) + gumbel).astype(jnp.int32)


def emitted_tokens(verdict: Verdict, node_tokens: jax.Array) -> jax.Array:
    """The tokens a step emits, in order: accepted nodes' tokens, then next_token; -1 after.

    node_tokens: [B, N] tokens of the nodes `verdict.path` indexes, root first (for a chain:
    the pending token, then the drafts). Returns [B, D + 1] int32.
    """
    path_tokens = jnp.take_along_axis(node_tokens, verdict.path[:, 1:], axis=1)  # [B, D]
    positions = jnp.arange(verdict.path.shape[1])  # [D + 1]
    accepted = verdict.accepted[:, None]  # [B, 1]
    padded = jnp.pad(path_tokens, ((0, 0), (0, 1)))  # [B, D + 1]
    emitted = jnp.where(positions < accepted, padded, verdict.next_token[:, None])
    return jnp.where(positions <= accepted, emitted, -1).astype(jnp.int32)


def _chain_row(
    uniform: jax.Array,  # [N] acceptance uniforms
    gumbel: jax.Array,  # [V]
    draft_tokens: jax.Array,  # [N]
    draft_probs: jax.Array,  # [N, V]
    target_probs: jax.Array,  # [N + 1, V]
    greedy: jax.Array,  # [] bool
    residual: Residual,
) -> tuple[jax.Array, jax.Array]:
    """(accepted, next_token) for one row of `chain`."""
    num_draft = draft_probs.shape[0]
    q_drafted = jnp.take_along_axis(target_probs[:-1], draft_tokens[:, None], axis=-1)[:, 0]  # [N]
    p_drafted = jnp.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]  # [N]
    sampled_ok = uniform * p_drafted < q_drafted
    greedy_ok = draft_tokens == jnp.argmax(target_probs[:-1], axis=-1)
    ok = jnp.where(greedy, greedy_ok, sampled_ok)  # [N]
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    # At the stop position: residual against the rejected draft's p, or the bonus (p = 0).
    q_stop = target_probs[accepted]  # [V]
    if num_draft == 0:
        p_stop = jnp.zeros_like(q_stop)
    else:
        p_stop = jnp.where(accepted < num_draft, draft_probs[jnp.minimum(accepted, num_draft - 1)], 0.0)
    next_token = jnp.where(greedy, jnp.argmax(q_stop), _draw(gumbel, residual(q_stop, p_stop)))
    return accepted.astype(jnp.int32), next_token.astype(jnp.int32)


def _chain(key, draft_tokens, draft_probs, target_probs, params, residual: Residual) -> Verdict:
    """`chain` with the residual rule as a parameter (tests swap in wrong rules)."""
    batch_size, num_draft = draft_tokens.shape
    row = functools.partial(_chain_row, residual=residual)
    uniform, gumbel = _noise(key, params, num_draft, target_probs.shape[-1])
    accepted, next_token = jax.vmap(row)(uniform, gumbel, draft_tokens, draft_probs, target_probs, params.greedy)
    positions = jnp.arange(num_draft + 1, dtype=jnp.int32)
    return Verdict(
        accepted=accepted,
        next_token=next_token,
        path=jnp.minimum(positions[None, :], accepted[:, None]),
        accepted_at=positions[None, :-1] < accepted[:, None],
    )


@jax.jit
def chain(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    params: SamplingParams,
) -> Verdict:
    """Verify a chain of N drafts per row by speculative (rejection) sampling.

    key:          one key, or [B] per-row keys (each row's randomness then is its own).
    draft_tokens: [B, N] int, drawn one by one from draft_probs.
    draft_probs:  [B, N, V], the exact distribution each draft was drawn from (one-hot for a
                  deterministic drafter).
    target_probs: [B, N + 1, V], processed q (`sampling.probs`); row i is q after i drafts.
    Accept d_i with probability min(1, q_i(d_i) / p_i(d_i)); at the first rejection sample
    from normalise(max(q_i - p_i, 0)); if all N are accepted, the bonus comes from q_N.
    Greedy rows accept while d_i == argmax q_i and emit argmax q at the stop position.
    """
    return _chain(key, draft_tokens, draft_probs, target_probs, params, _residual)


def _walk(ok, tried_before, ancestors, depths, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """From the root, follow at each node the first child whose test passed.

    ok [N] (False for the root), tried_before [N, N] ([j, k]: sibling k is tried before j),
    ancestors [N, N] ancestor-or-self mask, depths [N]. Returns the stop node (the deepest on the
    path) and the path [D + 1] (node at each depth; past the stop, the stop node repeats).
    """
    first_ok = ok & ~jnp.any(tried_before & ok[None, :], axis=1)  # [N], the child the walk takes
    moves = first_ok | (depths == 0)
    on_path = jnp.all(moves[None, :] | ~ancestors, axis=1)  # [N], every ancestor-or-self taken
    stop = jnp.argmax(jnp.where(on_path, depths, -1))
    at_depth = on_path[None, :] & (depths[None, :] == jnp.arange(max_depth + 1)[:, None])  # [D + 1, N]
    return stop, jnp.where(jnp.any(at_depth, axis=1), jnp.argmax(at_depth, axis=1), stop)


def _sibling_order(parents: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """parents [N] -> (drafted [N]: every node but the root; siblings [N, N]; tried_before
    [N, N]: [j, k] sibling k is tried before j, as it comes earlier)."""
    nodes = jnp.arange(parents.shape[0])
    drafted = nodes > 0
    siblings = (parents[:, None] == parents[None, :]) & drafted[:, None] & drafted[None, :]
    return drafted, siblings, siblings & (nodes[None, :] < nodes[:, None])


def _greedy_row(
    parents: jax.Array,  # [N]
    depths: jax.Array,  # [N]
    ancestors: jax.Array,  # [N, N] ancestor-or-self mask
    node_tokens: jax.Array,  # [N]
    target_tokens: jax.Array,  # [N] argmax q at each node
    max_depth: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(accepted, next_token, path) for one greedy row of any rule."""
    drafted, _, tried_before = _sibling_order(parents)
    ok = drafted & (node_tokens == target_tokens[jnp.maximum(parents, 0)])  # [N]
    stop, path = _walk(ok, tried_before, ancestors, depths, max_depth)
    return depths[stop].astype(jnp.int32), target_tokens[stop].astype(jnp.int32), path.astype(jnp.int32)


@jax.jit
def greedy(tree: Tree, node_tokens: jax.Array, target_tokens: jax.Array) -> Verdict:
    """Verify an all-greedy batch from the target's argmax tokens alone: the verdict `chain`,
    `tree` and `sampled_tree` give greedy rows (from the root, the first child whose token is
    argmax q at its parent; then argmax q at the stop node), without any [V]-wide work.

    tree:          topology; node 0 is the root (the pending token), siblings in try order.
    node_tokens:   [B, N] int, node_tokens[:, 0] is the pending token.
    target_tokens: [B, N] int, argmax of the target's logits at node i.
    """
    row = functools.partial(_greedy_row, max_depth=tree.max_depth)
    accepted, next_token, path = jax.vmap(row)(tree.parents, tree.depths, tree.ancestor_mask(), node_tokens, target_tokens)
    return _tree_verdict(accepted, next_token, path, tree.max_depth)


def _tree_verdict(accepted, next_token, path, max_depth: int) -> Verdict:
    return Verdict(
        accepted=accepted,
        next_token=next_token,
        path=path,
        accepted_at=jnp.arange(max_depth)[None, :] < accepted[:, None],
    )


def _tree_row(
    uniform: jax.Array,  # [N] one acceptance uniform per node
    gumbel: jax.Array,  # [V]
    parents: jax.Array,  # [N]
    depths: jax.Array,  # [N]
    ancestors: jax.Array,  # [N, N] ancestor-or-self mask
    node_tokens: jax.Array,  # [N]
    target_probs: jax.Array,  # [N, V]
    greedy: jax.Array,  # [] bool
    max_depth: int,
    residual: Residual,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(accepted, next_token, path) for one row of `tree`.

    Every node is tried at most once (when the walk sits at its parent), so each node gets its
    own uniform and all acceptance tests are evaluated at once; the walk follows, at each node,
    the first child that passes. A try only looks at q at the sibling tokens, so its residual
    is taken on a compressed vocabulary of N slots: one per sibling (q_parent of its token, 0
    for a repeat of an earlier sibling's token) and one for every other token. O(N^2 + V).
    """
    nodes = jnp.arange(target_probs.shape[0])
    parent = jnp.maximum(parents, 0)  # [N]
    drafted, siblings, tried_before = _sibling_order(parents)  # [N], [N, N], [N, N]
    same_token = siblings & (node_tokens[:, None] == node_tokens[None, :])  # [N, N]
    token_slot = jnp.argmax(same_token, axis=1)  # [N], the first sibling with this node's token
    q_token = target_probs[parent, node_tokens]  # [N] q_parent(token)
    slot_q = jnp.where(drafted & (token_slot == nodes), q_token, 0.0)  # [N], repeats hold no mass
    sibling_q = jnp.where(siblings, slot_q[None, :], 0.0)  # [N, N]
    other_q = jnp.maximum(1.0 - jnp.sum(sibling_q, axis=1, keepdims=True), 0.0)  # [N, 1]
    # The root is nobody's sibling, so its column holds the mass of every other token.
    compressed_q = jnp.where(nodes[None, :] == 0, other_q, sibling_q)  # [N, N]
    r_when_tried = residual(compressed_q, tried_before.astype(compressed_q.dtype))  # [N, N]
    r_token = jnp.take_along_axis(r_when_tried, token_slot[:, None], axis=1)[:, 0]  # [N]
    greedy_ok = node_tokens == jnp.argmax(target_probs, axis=-1)[parent]
    ok = jnp.where(greedy, greedy_ok, uniform < r_token) & drafted  # [N]
    stop, path = _walk(ok, tried_before, ancestors, depths, max_depth)
    accepted = depths[stop]
    # The stop node's children were all tried and rejected (none for a leaf: the bonus).
    q_stop = target_probs[stop]  # [V]
    children_mass = jnp.zeros_like(q_stop).at[node_tokens].add((parents == stop).astype(q_stop.dtype))  # [V]
    next_token = jnp.where(greedy, jnp.argmax(q_stop), _draw(gumbel, residual(q_stop, children_mass)))
    return accepted.astype(jnp.int32), next_token.astype(jnp.int32), path.astype(jnp.int32)


def _tree(key, tree, node_tokens, target_probs, params, residual: Residual) -> Verdict:
    """`tree` with the residual rule as a parameter (tests swap in wrong rules)."""
    row = functools.partial(_tree_row, max_depth=tree.max_depth, residual=residual)
    uniform, gumbel = _noise(key, params, node_tokens.shape[1], target_probs.shape[-1])
    accepted, next_token, path = jax.vmap(row)(
        uniform, gumbel, tree.parents, tree.depths, tree.ancestor_mask(), node_tokens, target_probs, params.greedy
    )
    return _tree_verdict(accepted, next_token, path, tree.max_depth)


@jax.jit
def tree(
    key: jax.Array,
    tree: Tree,
    node_tokens: jax.Array,
    target_probs: jax.Array,
    params: SamplingParams,
) -> Verdict:
    """Verify a tree of deterministic candidates per row by the point-mass rule.

    key:          one key, or [B] per-row keys.
    tree:         topology; node 0 is the root (the pending token), siblings in try order.
                  tree.max_depth may exceed a row's deepest node (per-row topologies);
                  path and accepted_at are sized by it.
    node_tokens:  [B, N] int, node_tokens[:, 0] is the pending token.
    target_probs: [B, N, V], processed q at node i (the distribution of the token after it).
    At the accepted node with residual r (starting at its q), child c is accepted with
    probability r(c); on rejection r(c) = 0 and r is renormalised; if every child is rejected
    the next token is drawn from r, at a leaf from q. Siblings may repeat a token (the repeat
    then has r = 0). Greedy rows follow the first child whose token is argmax q.
    """
    return _tree(key, tree, node_tokens, target_probs, params, _residual)


def _sampled_tree_row(
    uniform: jax.Array,  # [N] one acceptance uniform per node
    gumbel: jax.Array,  # [V]
    parents: jax.Array,  # [N]
    ancestors: jax.Array,  # [N, N] ancestor-or-self mask
    depths: jax.Array,  # [N]
    node_tokens: jax.Array,  # [N]
    draft_probs: jax.Array,  # [N - 1, V] the distribution node i + 1 was drawn from (its parent's p)
    target_probs: jax.Array,  # [N, V]
    greedy: jax.Array,  # [] bool
    max_depth: int,
    residual: Residual,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(accepted, next_token, path) for one row of `sampled_tree`.

    Every node tries its children in rounds, the j-th child in round j, all nodes at once: after
    the rounds each node holds its residual once every child was rejected. A child with
    p_j(c) = 0 (drawn after p's support ran out) is never accepted and changes nothing.
    """
    num_nodes = target_probs.shape[0]
    nodes = jnp.arange(num_nodes)
    drafted, _, tried_before = _sibling_order(parents)
    rank = jnp.sum(tried_before, axis=1)  # [N] position among siblings
    children = (parents[None, :] == nodes[:, None]) & drafted[None, :]  # [parent, child]
    first_child = jnp.argmax(children & (rank == 0)[None, :], axis=1)  # [N]
    p_of = jnp.concatenate([jnp.zeros_like(draft_probs[:1]), draft_probs])  # [N, V] by node
    p = jnp.where(jnp.any(children, axis=1)[:, None], p_of[first_child], 0.0)  # [N, V] each node's p_j

    def round_(j, carry):
        r, p, ok = carry  # [N, V], [N, V], [N]
        child_mask = children & (rank == j)[None, :]  # [N, N]
        child = jnp.argmax(child_mask, axis=1)  # [N], meaningless where a node has no j-th child
        token = node_tokens[child]  # [N]
        p_token, r_token = p[nodes, token], r[nodes, token]  # [N]
        tried = jnp.any(child_mask, axis=1) & (p_token > 0)  # [N]
        passes = tried & (uniform[child] * p_token < r_token)
        ok = ok | jnp.any(child_mask & passes[:, None], axis=0)
        remaining = p.at[nodes, token].set(0.0)
        mass = jnp.sum(remaining, axis=1, keepdims=True)
        r = jnp.where(tried[:, None], residual(r, p), r)
        p = jnp.where(tried[:, None], remaining / jnp.where(mass > 0, mass, 1.0), p)
        return r, p, ok

    max_children = jnp.max(jnp.where(drafted, rank, -1)) + 1
    r, _, sampled_ok = jax.lax.fori_loop(0, max_children, round_, (target_probs, p, jnp.zeros(num_nodes, bool)))
    greedy_ok = node_tokens == jnp.argmax(target_probs, axis=-1)[jnp.maximum(parents, 0)]
    ok = jnp.where(greedy, greedy_ok, sampled_ok) & drafted  # [N]
    stop, path = _walk(ok, tried_before, ancestors, depths, max_depth)
    next_token = jnp.where(greedy, jnp.argmax(target_probs[stop]), _draw(gumbel, r[stop]))
    return depths[stop].astype(jnp.int32), next_token.astype(jnp.int32), path.astype(jnp.int32)


def _sampled_tree(key, tree, node_tokens, draft_probs, target_probs, params, residual: Residual) -> Verdict:
    """`sampled_tree` with the residual rule as a parameter (tests swap in wrong rules)."""
    row = functools.partial(_sampled_tree_row, max_depth=tree.max_depth, residual=residual)
    uniform, gumbel = _noise(key, params, node_tokens.shape[1], target_probs.shape[-1])
    accepted, next_token, path = jax.vmap(row)(
        uniform, gumbel, tree.parents, tree.ancestor_mask(), tree.depths, node_tokens, draft_probs, target_probs, params.greedy
    )
    return _tree_verdict(accepted, next_token, path, tree.max_depth)


@jax.jit
def sampled_tree(
    key: jax.Array,
    tree: Tree,
    node_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    params: SamplingParams,
) -> Verdict:
    """Verify a tree whose siblings were sampled without replacement (multi-draft speculative sampling).

    key:          one key, or [B] per-row keys.
    tree:         topology; siblings in the order they were drawn.
    node_tokens:  [B, N] int, node_tokens[:, 0] is the pending token.
    draft_probs:  [B, N - 1, V] the distribution p node i + 1 and its siblings were drawn from (their
                  parent's); without replacement: a token occurs at most once among siblings.
    target_probs: [B, N, V], processed q at node i.
    Greedy rows follow the first child whose token is argmax q, as `tree`.
    """
    return _sampled_tree(key, tree, node_tokens, draft_probs, target_probs, params, _residual)
