"""A decode step of this code against an earlier revision's engine, side by side in one process.

Per method: the decode step of the revision (its whole engine and drafter, imported beside the
current one) and of this code, milliseconds, medians of interleaved repeats of `--steps` steps
decoded from one state per engine (MT-bench prompts, greedy, `--context` tokens generated first),
both with `--matmuls`. Both must emit the same tokens; the script checks it.

    python scripts/step_vs_revision.py --baseline a4809c8 --methods ar,ngram:5,eagle3:3,eagle3+ngram:3 --batch-size 1,4
    python scripts/step_vs_revision.py --baseline 0d02d28 --matmuls streamed --methods eagle3:3,eagle3+ngram:3 --batch-size 1
    python scripts/step_vs_revision.py --baseline 1314c2a --methods eagle3:auto3,ngram:auto5 --force-depth 0 --batch-size 1,4

The first measured greedy steps without vocabulary-wide work (a4809c8 is the engine before them), the
second a draft head's blocks through the streamed kernels (0d02d28 streams the target's only), the
third the depth-0 steps of adaptive methods (every step held at `--force-depth`) before and after the
EAGLE head's backlog became a ring (1314c2a shifts it every step).
"""

import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from infer import common
from infer import prompts as prompt_sets
from infer.bench import split_methods
from revision import baseline_engine_class, baseline_package
from specjax.drafters import adaptive
from specjax.engine import Engine

parser = common.parser("step_vs_revision.py", __doc__)
common.add_model_args(parser, matmuls="one")
parser.add_argument("--baseline", required=True, help="the git revision to measure against")
parser.add_argument("--methods", default="ar,ngram:5,eagle3:3,eagle3+ngram:3", help="as infer.bench's (ar is always included)")
parser.add_argument("--batch-size", type=common.positive_ints, default=[1, 4])
parser.add_argument("--context", type=int, default=64, help="tokens decoded before timing")
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--force-depth", type=int, default=None, help="hold every adaptive (:auto) method at this draft depth")
args = parser.parse_args()

config, params, tok = common.load_target(args)
prompts = prompt_sets.token_ids(tok, "mt-bench", 16)
old = baseline_package(args.baseline)
old_registry = importlib.import_module(f"{old}.drafters.registry")
old_base = importlib.import_module(f"{old}.drafters.base")
old_sampling = importlib.import_module(f"{old}.sampling")
matmuls = {} if args.matmuls == "xla" else {"matmuls": args.matmuls}  # revisions before the kernels take no matmuls
max_len = -(-(max(map(len, prompts)) + args.context + 8 * args.steps + 16) // 256) * 256  # whole attention chunks
print(f"SmolLM2, greedy, {args.context} tokens decoded before timing; ms per step of {args.steps} steps, "
      f"median of {args.repeats} interleaved repeats; matmuls {args.matmuls}; baseline {args.baseline}")

for batch in args.batch_size:
    ids = (prompts * batch)[:batch]
    for label in [spec.label for spec in split_methods(args.methods)]:  # ar first: the run's control
        variants = {}
        for name, engine_cls, registry, base, sampling_lib in (
            (f"{args.baseline}", baseline_engine_class(args.baseline), old_registry, old_base, old_sampling),
            ("now", Engine, importlib.import_module("specjax.drafters.registry"),
             importlib.import_module("specjax.drafters.base"), importlib.import_module("specjax.sampling")),
        ):
            spec = registry.MethodSpec.parse(label)
            drafter = spec.build(base.BuildContext(config, params, None, jnp.float32))
            if args.force_depth is not None and getattr(drafter, "variants", None) is not None:
                drafter.costs = adaptive.forcing_costs(args.force_depth, drafter.max_depth)
            engine = engine_cls(config, params, drafter, max_len=max_len, eos_ids=(), **matmuls)
            sampling = sampling_lib.SamplingParams.make(batch)
            state = engine.admit(engine.init_state(batch), range(batch), ids, args.context + 8 * args.steps + 8)
            state = jax.block_until_ready(engine.decode(state, sampling, args.context))
            variants[name] = (engine, state, sampling)

        def run(name):
            engine, state, sampling = variants[name]
            copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # decode donates its state
            start = time.perf_counter()
            out = jax.block_until_ready(engine.decode(copy, sampling, args.steps))
            return (time.perf_counter() - start) / args.steps, out

        outputs = {name: engine.outputs(run(name)[1]) for name, (engine, _, _) in variants.items()}  # compiles
        if len({str(o) for o in outputs.values()}) != 1:
            raise SystemExit(f"{label}, batch {batch}: the revisions emitted different tokens")
        times = {name: [] for name in variants}
        for round_ in range(args.repeats):
            for name in (list(variants) if round_ % 2 == 0 else list(variants)[::-1]):
                times[name].append(run(name)[0])
        base, new = (np.array(t) for t in times.values())
        print(f"batch {batch} {label:16s} " + "  ".join(f"{name} {np.median(t) * 1e3:7.2f}" for name, t in times.items())
              + f"  baseline/now {np.median(base / new):.3f}x (rounds {np.min(base / new):.3f}-{np.max(base / new):.3f})",
              flush=True)
