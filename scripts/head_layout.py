"""SmolLM2's tied LM head over T rows, as an earlier revision streamed it and as this code does, in one process.

The revision reads the embedding's [V, H] rows (XLA's matrix-vector loop at T = 1, the `row_dot`
kernel at 2..8 rows); this code gives the engine's streamed mode its own [H, V] copy of the head
(`llama.with_untied_head`), packed in panels for the kernel (`llama.streamed`), which reads it in
memory order at every T.
Milliseconds, medians of interleaved repeats; both give the float32 logits of x @ embed^T.

    python scripts/head_layout.py --baseline 62ec039 [--rows 1,2,4,6,8] [--repeats 41]
"""

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from revision import baseline_package

from specjax import checkpoints
from specjax.models import block_matmul, llama

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--baseline", required=True, help="a revision whose streamed mode reads the tied embedding's rows")
parser.add_argument("--rows", default="1,2,4,6,8", help="T values")
parser.add_argument("--repeats", type=int, default=41)
args = parser.parse_args()

config, params = checkpoints.load_model(checkpoints.default_model_path())
_, streamed = llama.streamed(config, params)
old = importlib.import_module(f"{baseline_package(args.baseline)}.models.block_matmul")
embed, head = params["embed_tokens"], streamed["lm_head"]  # [V, H], [H, V] packed
variants = {
    args.baseline: (jax.jit(lambda x, e: old.tied_head(x, e, "streamed")), embed),
    "now": (jax.jit(lambda x, w: block_matmul.head(x, w, "streamed")), head),
}
rng = np.random.default_rng(0)
print(f"SmolLM2 LM head [{config.vocab_size} x {config.hidden_size}], float32; ms, median of {args.repeats} interleaved repeats")
for t in (int(t) for t in args.rows.split(",")):
    x = jnp.asarray(rng.normal(size=(t, config.hidden_size)), jnp.float32)
    outputs = {name: np.asarray(fn(x, w)) for name, (fn, w) in variants.items()}  # compiled
    np.testing.assert_allclose(outputs["now"], outputs[args.baseline], rtol=0, atol=1e-4 * np.abs(outputs["now"]).max())
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (fn, w) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x, w))
            times[name].append(time.perf_counter() - start)
    old_ms, new_ms = (1e3 * float(np.median(times[name])) for name in (args.baseline, "now"))
    print(f"T={t}: {args.baseline} {old_ms:6.2f}  now {new_ms:6.2f}  baseline/now {old_ms / new_ms:.2f}x")
