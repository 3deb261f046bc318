"""How many steps a static batch takes when its rows speculate: the batch runs until its slowest
row is done, so tokens gained by a row that finishes early anyway save no step.

For each adaptive method (its depth costs fixed to the ones given, so nothing is timed and the
run is reproducible), decodes the prompt set in static batches and prints, per batch, the
verifier calls of each row and of the batch (its slowest row), beside plain decoding's:

    python scripts/static_batch_steps.py --prompts mt-bench --num-prompts 16 --batch-size 4 \
        --method ngram:auto5 --costs 1,1.24,1.49,1.64,1.81,1.95
"""

from infer import common
from infer import prompts as prompt_sets
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine

parser = common.parser("static_batch_steps.py", __doc__)
common.add_model_args(parser)
parser.add_argument("--prompts", default="mt-bench")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--num-prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--method", required=True, help="an adaptive method, e.g. ngram:auto5")
parser.add_argument("--costs", required=True, type=lambda t: [float(c) for c in t.split(",")], help="[D + 1] depth costs")
args = parser.parse_args()

config, params, tok = common.load_target(args)
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
spec = MethodSpec.parse(args.method.replace(":auto", ":"))
engines = {
    "ar": Engine(config, params, common.build_drafter(MethodSpec.parse("ar"), args, config, params), max_len=args.max_len, eos_ids=tok.eos_token_ids),
    args.method: Engine(
        config, params, AdaptiveDepth(common.build_drafter(spec, args, config, params), costs=args.costs),
        max_len=args.max_len, eos_ids=tok.eos_token_ids,
    ),
}
totals = {name: [0, 0.0] for name in engines}  # batch steps, mean row calls
for start in range(0, len(ids) - args.batch_size + 1, args.batch_size):
    batch = ids[start : start + args.batch_size]
    line = []
    for name, engine in engines.items():
        calls = engine.generate(batch, max_new_tokens=args.max_new_tokens).calls  # [B]
        totals[name][0] += int(calls.max())
        totals[name][1] += float(calls.mean())
        line.append(f"{name}: rows {' '.join(f'{int(c):3d}' for c in calls)}  batch {int(calls.max()):3d}")
    print(f"prompts {start:2d}-{start + args.batch_size - 1:2d}   " + "   |   ".join(line))
(ar_steps, ar_mean), (steps, mean) = totals["ar"], totals[args.method]
print(f"{args.method}: row calls {mean / ar_mean:.2f}x of plain decoding's, batch steps {steps / ar_steps:.2f}x")
