"""Why verifying a block costs more than decoding one token on XLA:CPU: the target's matmuls timed
alone at T rows (T = tokens verified per row at batch 1), in one process, medians of interleaved
repeats, as a ratio to T = 1.

At T = 1 XLA emits its own matrix-vector kernel, which streams each weight once (memory-bound);
at T >= 2 the dot goes to a library GEMM (a YNNPACK fusion in jaxlib 0.10), which here takes
about 1.6-1.8x as long for the same weights. That step, not the drafts, is most of the price of
a one-draft chain (`Engine.measure_depth_costs`: cost(1) about 1.4 at batch 1). Run with
XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= to see XLA's own GEMM instead (another process,
so compare its ratios, not its milliseconds); `--dtypes float32,bfloat16` times both in one process:

    python scripts/xla_cpu_block_matmuls.py [--dtypes float32,bfloat16]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoints

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", default="1,2,4,6,8", help="T values")
parser.add_argument("--repeats", type=int, default=15)
parser.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16 (weights and inputs)")
args = parser.parse_args()

config, params = checkpoints.load_model(checkpoints.default_model_path())
layers = params["layers"]
rows = [int(t) for t in args.rows.split(",")]


def all_layers(name):
    """x [T, K] times one projection of every layer (the weights stream from memory, as in a step)."""
    return lambda x, weights: sum(jnp.sum(x @ w) for w in weights), [layer[name] for layer in layers]


def tied_head(x, embed):
    return jnp.sum(jnp.einsum("tk,nk->tn", x, embed))


cases = {}
for dtype in args.dtypes.split(","):
    cast = lambda tree, dtype=dtype: jax.tree.map(lambda w: w.astype(dtype), tree)
    for name in ("q_proj", "gate_proj", "down_proj"):
        fn, weights = all_layers(name)
        cases[f"{name} x{len(layers)} layers {dtype}"] = (fn, cast(weights), dtype)
    cases[f"LM head (tied) {dtype}"] = (tied_head, cast(params["embed_tokens"]), dtype)
rng = np.random.default_rng(0)
print(f"jax {jax.__version__}; milliseconds, median of {args.repeats} interleaved repeats; ratio to T = 1")
for label, (fn, weights, dtype) in cases.items():
    fn = jax.jit(fn)
    width = (weights[0] if isinstance(weights, list) else weights.T).shape[0]
    inputs = {t: jnp.asarray(rng.normal(size=(t, width)), dtype) for t in rows}
    for x in inputs.values():
        jax.block_until_ready(fn(x, weights))  # compile
    times = {t: [] for t in rows}
    for _ in range(args.repeats):
        for t, x in inputs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x, weights))
            times[t].append(time.perf_counter() - start)
    median = {t: 1e3 * float(np.median(v)) for t, v in times.items()}
    cells = "  ".join(f"T={t}: {median[t]:6.2f} ({median[t] / median[rows[0]]:.2f}x)" for t in rows)
    print(f"{label:<36} {cells}")
