"""Draft-tree topology as arrays with static shapes.

A tree has N = T + 1 nodes per row. Node 0 is the root: the pending token, already sampled,
not yet in the KV cache. Nodes are in topological order (`parents[b, i] < i`), and siblings
appear in draft-score order (a lower index is tried first by the verifier). A chain is the
tree whose node i has parent i - 1.

The topology is per row (EAGLE-2 builds a different tree for every row and step), but its
sizes (nodes, depth) are Python ints fixed per compilation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Tree:
    parents: jax.Array  # [B, N] int32; parents[:, 0] = -1
    depths: jax.Array  # [B, N] int32; depths[:, 0] = 0
    max_depth: int = struct.field(pytree_node=False)  # deepest node's depth (static)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1]

    @property
    def is_chain(self) -> bool:
        """Static: one node per depth (node i's parent is i - 1)."""
        return self.num_nodes == self.max_depth + 1

    def ancestor_mask(self) -> jax.Array:
        """[B, N, N] bool: node i may attend to node j iff j is i or one of its ancestors."""
        return ancestor_mask(self.parents, self.max_depth)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, N] parents -> [B, N, N] ancestor-or-self mask, by max_depth pointer-doubling-free hops."""
    num_nodes = parents.shape[-1]
    nodes = jnp.arange(num_nodes)
    mask = jnp.broadcast_to(nodes[:, None] == nodes[None, :], parents.shape + (num_nodes,))
    ancestor = jnp.broadcast_to(nodes, parents.shape)  # [B, N], walks up one level per hop
    for _ in range(max_depth):
        ancestor = jnp.where(ancestor > 0, jnp.take_along_axis(parents, jnp.maximum(ancestor, 0), -1), 0)
        mask = mask | (ancestor[..., :, None] == nodes)
    return mask


def pool_size(depth: int, top_k: int) -> int:
    """Candidates of an EAGLE-2 tree: top_k at level 1, then top_k children of the top_k best per level."""
    return top_k + (depth - 1) * top_k**2


def causal_mask(size: int) -> jax.Array:
    """[T, T] bool lower-triangular mask: a chain's ancestor-or-self mask, shared by every row."""
    return jnp.tril(jnp.ones((size, size), bool))


def chain(batch_size: int, num_draft: int) -> Tree:
    """A chain of num_draft drafted tokens below the root."""
    parents = np.arange(-1, num_draft, dtype=np.int32)
    return Tree(
        parents=jnp.broadcast_to(jnp.asarray(parents), (batch_size, num_draft + 1)),
        depths=jnp.broadcast_to(jnp.arange(num_draft + 1, dtype=jnp.int32), (batch_size, num_draft + 1)),
        max_depth=num_draft,
    )


def from_branching(batch_size: int, branching: list[int]) -> Tree:
    """A full static tree: every node at depth d has branching[d] children, listed breadth-first.

    from_branching(B, [2, 2, 2]) has 2 + 4 + 8 = 14 drafted nodes and 8 root-to-leaf paths.
    """
    parents, depths, level = [-1], [0], [0]
    for depth, fanout in enumerate(branching, start=1):
        next_level = []
        for parent in level:
            for _ in range(fanout):
                next_level.append(len(parents))
                parents.append(parent)
                depths.append(depth)
        level = next_level
    parents_np = np.asarray(parents, np.int32)
    depths_np = np.asarray(depths, np.int32)
    return Tree(
        parents=jnp.broadcast_to(jnp.asarray(parents_np), (batch_size, len(parents))),
        depths=jnp.broadcast_to(jnp.asarray(depths_np), (batch_size, len(parents))),
        max_depth=len(branching),
    )


def from_paths(batch_size: int, paths: list[tuple[int, ...]]) -> Tree:
    """A static tree whose node i + 1 is paths[i], a tuple of child ranks from the root (Medusa's
    "choices": (0, 1) is the second child of the root's first child). Nodes keep the given order,
    which must list every path after its parent; the empty path is the root."""
    index = {(): 0}
    parents, depths = [-1], [0]
    for path in paths:
        path = tuple(path)
        if not path or path in index:
            raise ValueError(f"tree paths must be distinct and non-empty; got {path!r} twice or empty")
        if path[:-1] not in index:
            raise ValueError(f"tree path {path!r} comes before its parent {path[:-1]!r}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        depths.append(len(path))
    return Tree(
        parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch_size, len(parents))),
        depths=jnp.broadcast_to(jnp.asarray(depths, jnp.int32), (batch_size, len(parents))),
        max_depth=max(depths),
    )
