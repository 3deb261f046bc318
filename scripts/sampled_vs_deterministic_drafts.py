"""EAGLE-3 drafts sampled from the head (rejection rule; multi-draft on trees) vs deterministic
top-k drafts (point-mass rule), side by side in one process: tau and tokens/s per temperature.

    python scripts/sampled_vs_deterministic_drafts.py --temperatures 0,1 --prompts mt-bench --specs eagle3:3,eagle3:3,2,6
"""

import jax.numpy as jnp
import numpy as np

from infer import bench, common
from infer import prompts as prompt_sets
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.engine import Engine
from specjax.sampling import SamplingParams


class Deterministic(Eagle3Drafter):
    """The EAGLE-2 grower as for greedy rows (each node's top-k children, the best nodes kept),
    verified by the point-mass rule: the drafts of specjax before sampled drafting."""

    def propose(self, params, state, key, ctx, sampling):
        greedy = sampling.replace(temperature=jnp.zeros_like(sampling.temperature))
        return state, self.grow_tree(params, state, key, ctx, greedy).replace(draft_probs=None, rule="point_mass")


parser = common.parser("sampled_vs_deterministic_drafts.py", __doc__)
common.add_model_args(parser)
parser.add_argument("--temperatures", default="0,1")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--prompts", default="mt-bench")
parser.add_argument("--num-prompts", type=int, default=8)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--specs", default="eagle3:3", help="EAGLE-3 chains and trees, as infer.bench --methods")
args = parser.parse_args()

config, params, tok = common.load_target(args)
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
engines = {"ar": Engine(config, params, None, max_len=args.max_len, eos_ids=tok.eos_token_ids)}
for spec in bench.split_methods(args.specs)[1:]:
    sampled, deterministic = (common.build_drafter(spec, args, config, params) for _ in range(2))
    deterministic.__class__ = Deterministic
    for name, drafter in ((f"{spec.label} deterministic", deterministic), (f"{spec.label} sampled", sampled)):
        engines[name] = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tok.eos_token_ids)
batch = args.batch_size
batches = [ids[i : i + batch] for i in range(0, len(ids), batch)]
print(f"{args.prompts}, {len(ids)} prompts, batch {batch}, {args.max_new_tokens} new tokens, {args.repeats} interleaved repeats")
for temperature in map(float, args.temperatures.split(",")):
    sampling = SamplingParams.make(batch, temperature=temperature)
    passes = bench.interleaved_passes(engines, batches, sampling, args.max_new_tokens, args.repeats, seed=0)
    ar = None
    for name, runs in passes.items():
        seconds = float(np.median([p[0] for p in runs]))
        hist = sum(r.accepted_hist.sum(0) for p in runs for r in p[2])  # every repeat's calls
        tau = float((hist * (np.arange(hist.size) + 1)).sum() / hist.sum())
        rate = runs[-1][1] / seconds
        ar = ar or rate
        print(f"T={temperature:<4} {name:<28} tau {tau:.2f}  {rate:6.1f} tok/s  speedup {rate / ar:.2f}", flush=True)
