"""Plain decoding's step against an adaptive engine's step forced to one draft depth, side by
side in one process, on real prompts; and the depth costs the engine itself measures.

At depth 0 the adaptive engine verifies the pending token alone, like plain decoding, but also
runs the drafter's depth-0 variant inside a `lax.switch`, so it does strictly more work. At a
depth d > 0 every step drafts and verifies d tokens: its time relative to the depth-0 step is what
the engine prices as cost(d), measured on its first batch (`Engine.measure_depth_costs`), printed beside it.
Steps per second, interleaved repeats:

    python scripts/baseline_step_check.py --prompts chat --batch-size 1
    python scripts/baseline_step_check.py --prompts chat --batch-size 4 --depths 0,1,3
"""

import numpy as np

from infer import bench, common
from infer import prompts as prompt_sets
from specjax.drafters import adaptive
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
parser.add_argument("--methods", default="ngram:5,eagle3:3", help="chain methods to force")
parser.add_argument("--depths", type=lambda t: [int(d) for d in t.split(",")], default=[0], help="forced depths, e.g. 0,1,3")
args = parser.parse_args()

config, params, tok = common.load_target(args)
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
build = lambda spec: common.build_drafter(MethodSpec.parse(spec), args, config, params)
engine = lambda drafter: Engine(config, params, drafter, max_len=args.max_len, eos_ids=tok.eos_token_ids)


def forced(spec: str, depth: int) -> AdaptiveDepth:
    drafter = build(spec)
    return AdaptiveDepth(drafter, costs=adaptive.forcing_costs(depth, drafter.max_depth))


methods = args.methods.split(",")
engines = {"ar": engine(build("ar"))} | {f"{m} at depth {d}": engine(forced(m, d)) for m in methods for d in args.depths}
batches = [ids[i : i + args.batch_size] for i in range(0, len(ids) - args.batch_size + 1, args.batch_size)]
measured = {}  # the costs an adaptive engine measures on its first batch (these prompts)
for m in methods:
    auto = engine(build(m.replace(":", ":auto")))
    auto.generate(batches[0], max_new_tokens=4)
    measured[m] = np.asarray(auto.depth_costs(args.batch_size))
passes = bench.interleaved_passes(engines, batches, SamplingParams.make(args.batch_size), 64, args.repeats)
medians = {}
for name, runs in passes.items():
    rates = [sum(int(r.accepted_hist.sum()) for r in p[2]) / args.batch_size / p[0] for p in runs]
    medians[name] = np.median(rates)
    print(f"{name:<22} steps/s per repeat {' '.join(f'{r:5.1f}' for r in rates)}  median {medians[name]:5.1f}")
if args.depths != [0]:
    print("step time relative to the same method's depth-0 step: on these prompts / as the engine measured it")
    for m in methods:
        base = medians.get(f"{m} at depth 0")
        for d in args.depths:
            if base is not None and d > 0:
                print(f"{m:<10} depth {d}: {base / medians[f'{m} at depth {d}']:5.2f} / {measured[m][d]:5.2f}")
