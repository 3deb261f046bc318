"""Plain decoding's step against an adaptive engine's depth-0 step, side by side in one process.

Both verify the pending token alone; the adaptive one also runs the drafter's depth-0 variant
inside a `lax.switch`, so it does strictly more work. Steps per second, interleaved repeats:

    python scripts/baseline_step_check.py --prompts chat --batch-size 1
"""

import numpy as np

from infer import bench, common
from infer import prompts as prompt_sets
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams

parser = common.parser("baseline_step_check.py", __doc__)
common.add_model_args(parser)
parser.add_argument("--prompts", default="chat")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--num-prompts", type=int, default=8)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

config, params, tok = common.load_target(args)
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
build = lambda spec: common.build_drafter(MethodSpec.parse(spec), args, config, params)


def depth_zero(spec: str) -> AdaptiveDepth:
    drafter = build(spec)
    return AdaptiveDepth(drafter, costs=[1.0] + [np.inf] * drafter.max_depth)  # every step at depth 0


drafters = {"ar": build("ar"), "ngram:5 at depth 0": depth_zero("ngram:5"),
            "eagle3:3 at depth 0": depth_zero("eagle3:3")}
engines = {name: Engine(config, params, d, max_len=args.max_len, eos_ids=tok.eos_token_ids) for name, d in drafters.items()}
batches = [ids[i : i + args.batch_size] for i in range(0, len(ids) - args.batch_size + 1, args.batch_size)]
passes = bench.interleaved_passes(engines, batches, SamplingParams.make(args.batch_size), 64, args.repeats)
for name, runs in passes.items():
    rates = [sum(int(r.accepted_hist.sum()) for r in p[2]) / args.batch_size / p[0] for p in runs]
    print(f"{name:<22} steps/s per repeat {' '.join(f'{r:5.1f}' for r in rates)}  median {np.median(rates):5.1f}")
