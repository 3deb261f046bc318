"""Which bfloat16 dots XLA:CPU runs fast: the three dots of a dense layer's training step (forward,
input gradient, weight gradient) at an EAGLE-3 TTT shape, each written several ways, timed in one
process (medians of interleaved repeats) as a ratio to the float32 dot.

On a CPU with AMX-BF16 (`lscpu | grep amx`), jaxlib 0.10 runs a bf16 x bf16 dot that accumulates
in float32 (`preferred_element_type`) on the tile unit, several times an f32 dot; the same dot
rounding to bf16, or the weight gradient written as a flat contraction over the token axis of both
operands, falls to a slow path. `specjax.models.dense` uses the fast forms. On a CPU without AMX
every bf16 form is slower than f32 (`results/xla_cpu_block_matmuls_bf16.txt`, an AMD EPYC).

    python scripts/xla_cpu_bf16_dots.py [--tokens 4096 --inputs 1152 --outputs 1536]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tokens", type=int, default=4096, help="T: rows of the batch (8 x 512 in the TTT step)")
parser.add_argument("--inputs", type=int, default=1152, help="K: the EAGLE-3 layer's q/k/v input width")
parser.add_argument("--outputs", type=int, default=1536, help="N")
parser.add_argument("--repeats", type=int, default=9)
args = parser.parse_args()

T, K, N = args.tokens, args.inputs, args.outputs
F32, BF16 = jnp.float32, jnp.bfloat16
keys = jax.random.split(jax.random.key(0), 3)
x, w, dy = (jax.random.normal(k, shape) for k, shape in zip(keys, [(T, K), (K, N), (T, N)]))
contract_last = (((1,), (1,)), ((), ()))

dots = {  # what: {form: function of (x, w, dy)}; "float32" gets the f32 operands, every other form their bf16 casts
    "forward x @ w": {
        "float32": lambda x, w, dy: x @ w,
        "bf16 -> bf16": lambda x, w, dy: x @ w,
        "bf16 -> f32 (preferred_element_type)": lambda x, w, dy: jnp.dot(x, w, preferred_element_type=F32),
    },
    "input gradient dy w^T": {
        "float32": lambda x, w, dy: dy @ w.T,
        "bf16 -> f32, dy @ w.T": lambda x, w, dy: jnp.dot(dy, w.T, preferred_element_type=F32),
        "bf16 -> f32, dot_general contracting N": lambda x, w, dy: jax.lax.dot_general(dy, w, contract_last, preferred_element_type=F32),
    },
    "weight gradient x^T dy": {
        "float32": lambda x, w, dy: jnp.einsum("tk,tn->kn", x, dy),
        "bf16 -> f32, flat tk,tn->kn": lambda x, w, dy: jnp.einsum("tk,tn->kn", x, dy, preferred_element_type=F32),
        "bf16 -> f32, unit axis ctk,ctn->kn": lambda x, w, dy: jnp.einsum("ctk,ctn->kn", x[None], dy[None], preferred_element_type=F32),
    },
}

print(f"jax {jax.__version__}; T={T} K={K} N={N}; milliseconds, median of {args.repeats} interleaved repeats; ratio to float32")
for what, forms in dots.items():
    compiled = {}
    for name, form in forms.items():
        operands = (x, w, dy) if name == "float32" else tuple(a.astype(BF16) for a in (x, w, dy))
        compiled[name] = (jax.jit(form), operands)
        jax.block_until_ready(compiled[name][0](*operands))
    times = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, (fn, operands) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*operands))
            times[name].append(time.perf_counter() - start)
    base = np.median(times["float32"])
    for name, samples in times.items():
        print(f"{what:24s} {name:40s} {1e3 * np.median(samples):8.2f}  ({np.median(samples) / base:.2f}x)")
