"""Plain decoding's step against an adaptive engine's depth-0 step, side by side in one process.

Both verify the pending token alone; the adaptive one also runs the drafter's depth-0 variant
inside a `lax.switch`, so it does strictly more work. Steps per second, interleaved repeats:

    python scripts/baseline_step_check.py --prompts chat --batch-size 1
"""

import argparse

import jax.numpy as jnp
import numpy as np

from infer import bench
from infer import prompts as prompt_sets
from specjax import checkpoints, tokenizer as tok_lib
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import BuildContext
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompts", default="chat")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--num-prompts", type=int, default=8)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

path = checkpoints.default_model_path()
config, params = checkpoints.load_model(path, jnp.float32)
tok = tok_lib.load(path)
ids = [tok.encode(tok.chat_prompt(t)) for t in prompt_sets.load(args.prompts)[: args.num_prompts]]
context = BuildContext(config, params, None, jnp.float32)


def depth_zero(spec: str) -> AdaptiveDepth:
    drafter = MethodSpec.parse(spec).build(context)
    return AdaptiveDepth(drafter, costs=[1.0] + [np.inf] * drafter.max_depth)  # every step at depth 0


drafters = {"ar": MethodSpec.parse("ar").build(context), "ngram:5 at depth 0": depth_zero("ngram:5"),
            "eagle3:3 at depth 0": depth_zero("eagle3:3")}
engines = {name: Engine(config, params, d, max_len=1024, eos_ids=tok.eos_token_ids) for name, d in drafters.items()}
batches = [ids[i : i + args.batch_size] for i in range(0, len(ids) - args.batch_size + 1, args.batch_size)]
passes = bench.interleaved_passes(engines, batches, SamplingParams.make(args.batch_size), 64, args.repeats)
for name, runs in passes.items():
    rates = [sum(int(r.accepted_hist.sum()) for r in p[2]) / args.batch_size / p[0] for p in runs]
    print(f"{name:<22} steps/s per repeat {' '.join(f'{r:5.1f}' for r in rates)}  median {np.median(rates):5.1f}")
