"""`dense(x, w) = x @ w` for trained weights, with a gradient XLA:CPU computes without transposing activations.

Autodiff's weight gradient of x @ w is a dot contracting the token axis of both x and dy. XLA:CPU
hands dots to YNNPACK, which takes neither operand transposed, so it materialises x^T and dy^T,
and fuses the copy into whatever elementwise op produced dy (the SwiGLU's backward, the norms):
those transposing fusions cost a quarter of an EAGLE-3 training step, more than the dots they feed
(`scripts/training_throughput.py ttt`). Here the backward keeps dy as computed (an optimization
barrier stops the fusion) and writes dw as the same contraction, which XLA's own dot reads in place.
Forward values and gradients are those of x @ w (summation order aside); inference is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    return x @ w


def _forward(x, w):
    return x @ w, (x, w)


def _backward(saved, dy):
    x, w = saved
    dy = jax.lax.optimization_barrier(dy)  # computed in its own layout, not fused into a transposing copy
    dw = jnp.einsum("tk,tn->kn", x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))  # [K, N]
    return dy @ w.T, dw


dense.defvjp(_forward, _backward)
