"""jnp.argmax against `sampling.argmax` (a max, then the first index that holds it) on XLA:CPU, in one
process: the greedy verdict's argmax over SmolLM2's vocabulary for the blocks the engine verifies,
and a draft's over an EAGLE-3 draft vocabulary. Microseconds, medians of interleaved repeats.

    python scripts/xla_cpu_argmax.py [--repeats 301]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--repeats", type=int, default=301)
args = parser.parse_args()

shapes = {
    "plain decoding, batch 1 [1, 1, 49152]": (1, 1, 49152),
    "a chain of 3, batch 1 [1, 4, 49152]": (1, 4, 49152),
    "a chain of 3, batch 4 [4, 4, 49152]": (4, 4, 49152),
    "a draft, batch 1 [1, 8192]": (1, 8192),
}
variants = {"jnp.argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)), "sampling.argmax": jax.jit(sampling.argmax)}
print(f"jax {jax.__version__}; microseconds, median of {args.repeats} interleaved repeats")
for label, shape in shapes.items():
    logits = jax.random.normal(jax.random.key(0), shape)
    results = [np.asarray(fn(logits)) for fn in variants.values()]  # compiled
    np.testing.assert_array_equal(*results)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(logits))
            times[name].append(time.perf_counter() - start)
    old, new = (1e6 * float(np.median(times[name])) for name in variants)
    print(f"{label:<40} jnp.argmax {old:7.0f}  sampling.argmax {new:7.0f}  {old / new:.2f}x")
