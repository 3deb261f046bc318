"""The KV cache's layout, [L, B, Hkv, S, D] against the slots-before-heads [L, B, S, Hkv, D] of an
earlier revision (its whole engine, imported beside the current one), side by side in one process.

Plain decoding's step, milliseconds, medians of interleaved repeats of `--steps` steps decoded from
one state per engine (MT-bench prompts, `--context` tokens generated first, greedy):

    python scripts/cache_layout.py --baseline 2c37e5b --batch-size 1,4,16
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from infer import common
from infer import prompts as prompt_sets
from revision import baseline_engine_class
from specjax.engine import Engine
from specjax.sampling import SamplingParams

parser = common.parser("cache_layout.py", __doc__)
common.add_model_args(parser)
parser.add_argument("--baseline", required=True, help="git revision with the [L, B, S, Hkv, D] cache")
parser.add_argument("--batch-size", type=common.positive_ints, default=[1, 4, 16])
parser.add_argument("--context", type=int, default=300, help="tokens decoded before timing")
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--attention-chunk", type=int, default=64)
args = parser.parse_args()

config, params, tok = common.load_target(args)
prompts = prompt_sets.token_ids(tok, "mt-bench", 16)
classes = {"[L, B, S, Hkv, D] (baseline)": baseline_engine_class(args.baseline), "[L, B, Hkv, S, D]": Engine}
max_len = -(-(max(map(len, prompts)) + args.context + args.steps + 1) // args.attention_chunk) * args.attention_chunk
print(f"SmolLM2, plain decoding, cache of {max_len} slots, attention chunk {args.attention_chunk}, "
      f"{args.context} tokens decoded before timing; ms per step, median of {args.repeats}")
for batch in args.batch_size:
    ids = (prompts * batch)[:batch]
    sampling = SamplingParams.make(batch)
    engines, states = {}, {}
    for name, cls in classes.items():
        engine = cls(config, params, max_len=max_len, attention_chunk=args.attention_chunk, eos_ids=())
        state = engine.admit(engine.init_state(batch), range(batch), ids, args.context + 2 * args.steps + 2)
        states[name] = jax.block_until_ready(engine.decode(state, sampling, args.context))
        engines[name] = engine

    def seconds(name):
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, states[name]))  # decode donates its state
        start = time.perf_counter()
        jax.block_until_ready(engines[name].decode(copy, sampling, args.steps))
        return (time.perf_counter() - start) / args.steps

    for name in engines:
        seconds(name)  # compile
    times = {name: [] for name in engines}
    for round_ in range(args.repeats):
        for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
            times[name].append(seconds(name))
    base, new = (np.array(t) for t in times.values())
    print(f"batch {batch:3d}: " + "  ".join(f"{name} {np.median(t) * 1e3:7.2f}" for name, t in times.items())
          + f"  baseline/new {np.median(base / new):.2f}x")
