"""The target's forward over a block of T tokens per row with XLA's matmuls and with the streamed
block matmuls (`matmuls="streamed"`, docs/architecture.md "Streamed block matmuls"), side by side
in one process: milliseconds (medians of interleaved repeats), each block's time over XLA's
one-token forward at the same batch size, and streamed over XLA at the same block.

The forward is the one a decode step verifies with: SmolLM2 against a 2048-slot cache holding
--live tokens per row, the tied LM head included.

    python scripts/streamed_matmuls.py [--blocks 1,2,4,6,8] [--batch-sizes 1,4]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoints
from specjax.kv_cache import KVCache
from specjax.models import llama
from specjax.tree import causal_mask

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--blocks", default="1,2,4,6,8", help="tokens per row T")
parser.add_argument("--batch-sizes", default="1,4")
parser.add_argument("--live", type=int, default=300, help="committed tokens per row in the cache")
parser.add_argument("--repeats", type=int, default=15)
args = parser.parse_args()

config, params = checkpoints.load_model(checkpoints.default_model_path())
models = {"xla": (config, params), "streamed": llama.streamed(config, params)}  # as the engine holds them in each mode
cases = {}
for batch in map(int, args.batch_sizes.split(",")):
    cache = KVCache.init(config.num_layers, batch, 2048, config.num_kv_heads, config.head_dim)
    cache = cache.replace(lengths=jnp.full((batch,), args.live, jnp.int32))
    for block in map(int, args.blocks.split(",")):
        tokens = jnp.full((batch, block), 100, jnp.int32)
        positions = args.live + jnp.broadcast_to(jnp.arange(block), (batch, block))
        for matmuls in ("xla", "streamed"):
            model_config, model_params = models[matmuls]
            forward = jax.jit(lambda p, t, q, c, m=matmuls, T=block, mc=model_config: llama.forward(p, mc, t, q, c, causal_mask(T), matmuls=m).logits)
            jax.block_until_ready(forward(model_params, tokens, positions, cache))  # compile
            cases[batch, block, matmuls] = (forward, model_params, tokens, positions, cache)
times = {key: [] for key in cases}
for _ in range(args.repeats):
    for key, (forward, model_params, tokens, positions, cache) in cases.items():
        start = time.perf_counter()
        jax.block_until_ready(forward(model_params, tokens, positions, cache))
        times[key].append(time.perf_counter() - start)
ms = {key: 1e3 * float(np.median(v)) for key, v in times.items()}
print(f"jax {jax.__version__}; SmolLM2 float32, {args.live} cached tokens per row; ms, median of {args.repeats} interleaved repeats")
print(f"{'batch':>5} {'T':>3} {'xla ms':>8} {'streamed ms':>12} {'xla / T=1':>10} {'streamed / T=1':>15} {'streamed / xla':>15}")
for batch, block, matmuls in cases:
    if matmuls == "xla":
        one = ms[batch, 1, "xla"] if (batch, 1, "xla") in ms else float("nan")
        xla, streamed = ms[batch, block, "xla"], ms[batch, block, "streamed"]
        print(f"{batch:>5} {block:>3} {xla:>8.2f} {streamed:>12.2f} {xla / one:>10.2f} {streamed / one:>15.2f} {streamed / xla:>15.2f}")
