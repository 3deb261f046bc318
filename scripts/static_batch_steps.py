"""How many steps, and how much modelled time, a static batch takes when its rows speculate: the
batch runs until its slowest row is done, so tokens gained by a row that finishes early anyway
save no step, while every drafting step costs the whole batch.

For one adaptive method (its depth costs fixed to the ones given, so nothing is timed and the run
is reproducible), decodes the prompt set in static batches twice: priced as a static batch (what
`Engine.generate` does) and priced as if finished rows were refilled (what a server does). Prints,
per batch, the verifier calls of each row and of the batch (its slowest row), and its modelled
time, sum over steps of cost(depth), beside plain decoding's steps:

    python scripts/static_batch_steps.py --prompts mt-bench --num-prompts 16 --batch-size 4 \
        --method ngram:auto5 --costs 1,1.24,1.49,1.64,1.81,1.95
"""

import numpy as np

from infer import common
from infer import prompts as prompt_sets
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams

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
plain = Engine(config, params, common.build_drafter(MethodSpec.parse("ar"), args, config, params), max_len=args.max_len, eos_ids=tok.eos_token_ids)
engine = Engine(
    config, params, AdaptiveDepth(common.build_drafter(spec, args, config, params), costs=args.costs),
    max_len=args.max_len, eos_ids=tok.eos_token_ids,
)
costs, sampling = np.asarray(args.costs), SamplingParams.make(args.batch_size)


def run(batch, refills):
    """(verifier calls per row [B], modelled time) of one static batch priced as `refills` says."""
    state = engine.admit(engine.init_state(len(batch)), range(len(batch)), batch, args.max_new_tokens)
    state = engine.decode(state, sampling, args.max_new_tokens, refills=refills)
    return np.asarray(state.accepted_hist).sum(-1), float(np.asarray(state.steps_by_depth) @ costs)


totals = {"plain": 0.0, "static": [0, 0.0, 0.0], "refilled": [0, 0.0, 0.0]}  # batch steps, mean row calls, time
ar_calls = 0.0
for start in range(0, len(ids) - args.batch_size + 1, args.batch_size):
    batch = ids[start : start + args.batch_size]
    calls = plain.generate(batch, max_new_tokens=args.max_new_tokens).calls
    totals["plain"] += int(calls.max())
    ar_calls += float(calls.mean())
    line = [f"ar: rows {' '.join(f'{int(c):3d}' for c in calls)}  batch {int(calls.max()):3d}"]
    for name in ("static", "refilled"):
        calls, time = run(batch, name == "refilled")
        totals[name][0] += int(calls.max())
        totals[name][1] += float(calls.mean())
        totals[name][2] += time
        line.append(f"priced {name}: rows {' '.join(f'{int(c):3d}' for c in calls)}  batch {int(calls.max()):3d}  time {time:5.1f}")
    print(f"prompts {start:2d}-{start + args.batch_size - 1:2d}   " + "   |   ".join(line))
for name in ("static", "refilled"):
    steps, mean, time = totals[name]
    print(
        f"{args.method} priced {name}: row calls {mean / ar_calls:.2f}x of plain decoding's, batch steps "
        f"{steps / totals['plain']:.2f}x, modelled time {time / totals['plain']:.2f}x (speedup {totals['plain'] / time:.2f}x)"
    )
