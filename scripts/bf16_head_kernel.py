"""An EAGLE-3 head's matmuls for SmolLM2 (one decoder layer's shapes and an 8192-token draft
vocabulary) at 1 and 4 rows on XLA:CPU, in one process: float32 weights through XLA (what the
engine ran before), bfloat16 weights through XLA (float32 rows, float32 sums), and bfloat16
weights through the streamed kernel (`block_matmul.dense`, the weights packed). Cold: a 128 MB sweep evicts the
caches before each call, as the target's forward does before a draft's first forward; warm: the
weights were just read, as at a chain's later forwards. Milliseconds, medians of interleaved repeats.

    python scripts/bf16_head_kernel.py [--repeats 101]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import block_matmul

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--repeats", type=int, default=101)
args = parser.parse_args()

shapes = {  # [K, N] of the head's matrices
    "fc": (1728, 576), "q_proj": (1152, 576), "k_proj, v_proj": (1152, 192), "o_proj": (576, 576),
    "gate_proj, up_proj": (576, 1536), "down_proj": (1536, 576), "lm_head": (576, 8192),
}
variants = {
    "f32 XLA": (jnp.float32, jax.jit(lambda x, w: x @ w)),
    "bf16 XLA": (jnp.bfloat16, jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))),
    "bf16 kernel": (jnp.bfloat16, jax.jit(lambda x, w: block_matmul.dense(x, w, "streamed"))),
}
sweep = jnp.ones(32 << 20, jnp.float32)  # 128 MB
evict = jax.jit(lambda a: (a * 1.0001).sum())
rng = np.random.default_rng(0)
print(f"jax {jax.__version__}; milliseconds, median of {args.repeats} interleaved repeats; ratio: f32 XLA / bf16 kernel")
for cache in ("cold", "warm"):
    for label, (k, n) in shapes.items():
        for rows in (1, 4):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)
            inputs = {name: (x, w.astype(dtype)) for name, (dtype, _) in variants.items()}
            inputs["bf16 kernel"] = (x, block_matmul.pack(inputs["bf16 kernel"][1]))  # as the engine holds a draft head
            results = [np.asarray(fn(*inputs[name])) for name, (_, fn) in variants.items()]  # compiled
            np.testing.assert_allclose(results[2], results[1], rtol=0, atol=1e-4 * np.abs(results[1]).max())
            times = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (_, fn) in variants.items():
                    if cache == "cold":
                        jax.block_until_ready(evict(sweep))
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*inputs[name]))
                    times[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
            cells = "  ".join(f"{name} {value:6.3f}" for name, value in ms.items())
            print(f"{cache} {label:<19} [{k}, {n}] x {rows} rows  {cells}  {ms['f32 XLA'] / ms['bf16 kernel']:.2f}x")
