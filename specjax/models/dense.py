"""`dense(x, w) = x @ w` for trained weights, with a gradient XLA:CPU computes without transposing activations.

Autodiff's weight gradient of x @ w is a dot contracting the token axis of both x and dy. XLA:CPU
hands dots to YNNPACK, which takes neither operand transposed, so it materialises x^T and dy^T,
and fuses the copy into whatever elementwise op produced dy (the SwiGLU's backward, the norms):
those transposing fusions cost a quarter of an EAGLE-3 training step, more than the dots they feed
(`scripts/training_throughput.py ttt`). Here the backward keeps dy as computed (an optimization
barrier stops the fusion) and writes dw as the same contraction, which XLA's own dot reads in place.

bfloat16 operands: every dot accumulates in float32 (`preferred_element_type`) and rounds once.
On a CPU with AMX-BF16 that is also what makes it fast: XLA:CPU (jaxlib 0.10) sends a bf16 x bf16
-> f32 dot to a GEMM that uses the tile unit, about 4.5x an f32 dot of the same shape, while a
bf16 -> bf16 dot, and the flat token-contracting dot of dw, run 3-5x slower than that
(`scripts/xla_cpu_bf16_dots.py`). dw contracts over a leading unit axis as well, which XLA hands
to the fast GEMM. Float32 operands keep the plain forms (there the extra axis costs ~15%).
Forward values and gradients are those of x @ w (summation order aside); float32 inference is unchanged
(a bf16 draft's dots now accumulate in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: dot_general dimension numbers of dy [T, N] times w [K, N] contracting N: dx without transposing w.
_CONTRACT_LAST = (((1,), (1,)), ((), ()))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N], accumulated in float32, in the dtype x @ w has."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.result_type(x, w))


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    return _dot(x, w)


def _forward(x, w):
    return _dot(x, w), (x, w)


def _weight_gradient(x: jax.Array, dy: jax.Array) -> jax.Array:
    """x [T, K], dy [T, N] -> x^T dy [K, N] in float32 (module doc)."""
    if x.dtype == jnp.float32 and dy.dtype == jnp.float32:
        return jnp.einsum("tk,tn->kn", x, dy)
    return jnp.einsum("ctk,ctn->kn", x[None], dy[None], preferred_element_type=jnp.float32)


def _backward(saved, dy):
    x, w = saved
    dy = jax.lax.optimization_barrier(dy)  # computed in its own layout, not fused into a transposing copy
    flat_dy = dy.reshape(-1, dy.shape[-1])  # [T, N]
    dx = jax.lax.dot_general(flat_dy, w, _CONTRACT_LAST, preferred_element_type=jnp.float32)  # [T, K]
    dw = _weight_gradient(x.reshape(-1, x.shape[-1]), flat_dy)  # [K, N]
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_forward, _backward)
