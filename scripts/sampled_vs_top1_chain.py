"""EAGLE-3 chain drafts sampled from the head (rejection rule) vs the deterministic top-1 chain
(point-mass rule), side by side in one process at temperature T: tau and tokens/s.

    python scripts/sampled_vs_top1_chain.py TEMPERATURE BATCH   # e.g. 0.7 1 (chat prompts, 64 tokens)
"""

import sys

import jax.numpy as jnp
import numpy as np

from infer import bench
from infer import prompts as prompt_sets
from specjax import checkpoints, tokenizer as tok_lib
from specjax.drafters.base import BuildContext
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams


class TopOneChain(Eagle3Drafter):
    """The deterministic top-1 chain: the EAGLE-2 grower with top-k 1 as for greedy rows (its
    draft distributions are point masses, for which the rejection rule is the point-mass rule)."""
    def propose(self, params, state, key, ctx, sampling):
        return state, self.grow_tree(params, state, key, ctx, SamplingParams.make(ctx.pending.shape[0]))


temperature, batch = float(sys.argv[1]), int(sys.argv[2])
path = checkpoints.default_model_path()
config, params = checkpoints.load_model(path, jnp.float32)
tok = tok_lib.load(path)
ids = [tok.encode(tok.chat_prompt(t)) for t in prompt_sets.load("chat")[:8]]
ctx = BuildContext(config, params, None, jnp.float32)
sampled = MethodSpec.parse("eagle3:3").build(ctx)
top1 = MethodSpec.parse("eagle3:3").build(ctx); top1.__class__ = TopOneChain
engines = {name: Engine(config, params, d, max_len=1024, eos_ids=tok.eos_token_ids) for name, d in
           [("ar", None), ("eagle3:3 top-1 chain (point mass)", top1), ("eagle3:3 sampled chain (rejection)", sampled)]}
batches = [ids[i:i + batch] for i in range(0, len(ids), batch)]
sampling = SamplingParams.make(batch, temperature=temperature)
passes = bench.interleaved_passes(engines, batches, sampling, 64, repeats=3, seed=0)
ar = None
for name, runs in passes.items():
    seconds = float(np.median([p[0] for p in runs])); tokens = runs[-1][1]
    hist = sum(r.accepted_hist.sum(0) for r in runs[-1][2]); calls = hist.sum()
    tau = float((hist * (np.arange(hist.size) + 1)).sum() / calls)
    rate = tokens / seconds; ar = ar or rate
    print(f"T={temperature} batch {batch} {name:<36} tau {tau:.2f}  {rate:6.1f} tok/s  speedup {rate / ar:.2f}")
