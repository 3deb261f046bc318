"""python -m infer.tune: which decoding method, with which parameters, for a workload.

    python -m infer.tune --task code --batch-size 1 --temperature 0
    python -m infer.tune --task chat --bench bench.json --markdown recommendation.md
    python -m infer.tune --task code --measure            # short sweep on the real model, pick empirically

The cost model (specjax.theory): a step emits tau tokens for one verification over N + 1 tokens
plus the drafting, so speedup = tau / (T_verify(N + 1) / T_decode + draft cost / T_decode).
tau comes from an acceptance rate (chains) or a per-node reach probability (EAGLE-2 trees).
Without measurements it uses the stated priors below; --bench replaces them with a bench
run's acceptance curves and cost ratios, and --measure runs the best few candidates for real.
A chain method that takes it also gets its adaptive form `NAME:autoD` (the engine picks the depth
0 .. D every step, drafters/adaptive.py), which --measure times beside the fixed chain.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from infer import common
from infer.bench import CONTROL
from specjax import theory
from specjax.drafters.registry import METHODS, MethodSpec
from specjax.drafters.base import TREE
from specjax.drafters.lookahead import SHAPE as LOOKAHEAD
from specjax.tree import pool_size

TASKS = ("chat", "code", "structured", "long-form", "creative")
# Each method's priors (acceptance per task, its decay with temperature, draft cost) are stated
# guesses from published EAGLE-3 / prompt-lookup results, declared with the method
# (`Method.priors`) and replaced by --bench or --measure.
# Verifying k tokens at batch B costs 1 + VERIFY_SLOPE * (k - 1) * B decode steps (prior; CPU-like).
VERIFY_SLOPE = 0.13


@dataclasses.dataclass
class Candidate:
    spec: MethodSpec
    tau: float
    cost: float  # decode steps per verifier call, drafting included
    reasoning: str

    @property
    def speedup(self) -> float:
        return self.tau / self.cost


def verify_ratio(num_tokens: int, batch_size: int, measured: dict[int, float] | None) -> float:
    """T_verify(k) / T_decode: measured points (interpolated) or the prior."""
    if measured:
        ks = sorted(measured)
        return float(np.interp(num_tokens, ks, [measured[k] for k in ks]))
    return 1.0 + VERIFY_SLOPE * (num_tokens - 1) * batch_size


def tree_tau(alpha: float, depth: int, top_k: int, nodes: int) -> float:
    """Expected tokens per call of an EAGLE-2 tree: 1 + the T largest reach probabilities.

    The child of rank j (0-based) at a node is accepted, given its elder siblings were not,
    with probability alpha * 0.5^j (prior); reach probabilities fall along every path, so the
    T largest form an ancestor-closed tree, as EAGLE-2's reranking keeps.
    """
    rank_prob = alpha * 0.5 ** np.arange(top_k)  # conditional on elder siblings rejected
    exclusive = rank_prob * np.concatenate([[1.0], np.cumprod(1 - rank_prob)[:-1]])  # [K]
    reach, level = [], np.array([1.0])
    for _ in range(depth):
        level = (level[:, None] * exclusive[None, :]).ravel()
        reach.append(level)
    return 1.0 + float(np.sort(np.concatenate(reach))[::-1][:nodes].sum())


def chain_tau(alpha: float, n: int, curve: list[float] | None) -> float:
    if curve:
        extended = [curve[min(i, len(curve) - 1)] for i in range(n)]
        return float(theory.expected_accepted_from_curve(np.array(extended)))
    return theory.expected_accepted(alpha, n)


def candidates(args, measured: dict) -> list[Candidate]:
    """Every configuration in the search space with its predicted speedup."""
    out = [Candidate(MethodSpec("ar"), 1.0, 1.0, "plain decoding: one token per target step")]
    for method in args.method_names:
        priors = METHODS[method].priors
        alpha = priors.alpha[args.task] * np.exp(-priors.temperature_decay * args.temperature)
        info = measured.get(method, {})
        if "alpha" in info:
            alpha = info["alpha"]
        c = info.get("c", priors.draft_cost)
        source = "measured" if info else "prior"
        shape = (METHODS[method].shape or ("",))[0]
        chains = []
        for n in range(1, 9) if METHODS[method].num_spec else ():
            tau = chain_tau(alpha, n, info.get("curve"))
            cost = verify_ratio(n + 1, args.batch_size, measured.get("verify")) + n * c
            why = f"alpha={alpha:.2f} ({source}), tau={tau:.2f}, cost={cost:.2f} decode steps (verify {n + 1} tokens + {n} drafts at c={c:.2f})"
            chains.append(Candidate(MethodSpec(method, num_spec=n), tau, cost, why))
        out += chains + adaptive(chains)
        for window, ngram, guesses in itertools.product((2, 4, 8), (3, 4, 5), (2, 4, 8)) if shape == LOOKAHEAD else ():
            # The best of G pool n-grams is accepted like a chain of N - 1 (prior); the window rides along.
            tau = chain_tau(alpha, ngram - 1, info.get("curve"))
            block = (guesses + window) * (ngram - 1)
            cost = verify_ratio(block, args.batch_size, measured.get("verify"))
            why = f"alpha={alpha:.2f} ({source}), tau={tau:.2f}, cost={cost:.2f} (one forward over {block} tokens: window and guesses)"
            out.append(Candidate(MethodSpec(method, shape=(window, ngram, guesses)), tau, cost, why))
        for depth, top_k, nodes in itertools.product((3, 4, 5, 6), (2, 4, 8), (8, 16, 32, 64)) if shape == TREE else ():
            if nodes > pool_size(depth, top_k) or nodes < depth:
                continue
            tau = tree_tau(alpha, depth, top_k, nodes)
            cost = verify_ratio(nodes + 1, args.batch_size, measured.get("verify")) + depth * c * (1 + 0.1 * top_k)
            why = f"alpha={alpha:.2f} ({source}), tau={tau:.2f}, cost={cost:.2f} (verify {nodes + 1} tokens, {depth} head levels of {top_k})"
            out.append(Candidate(MethodSpec(method, shape=(depth, top_k, nodes)), tau, cost, why))
    return sorted(out, key=lambda c: -c.speedup)


def adaptive_form(spec: MethodSpec) -> MethodSpec | None:
    """`NAME:autoN` for the chain `NAME:N`; None where the method has no adaptive form."""
    try:
        return dataclasses.replace(spec, adaptive=True)
    except ValueError:  # not a chain method (ar, trees, lookahead) or one that cannot vary it (draft)
        return None


def adaptive(chains: list[Candidate]) -> list[Candidate]:
    """The adaptive form of a method's best chain, up to that chain's depth D (none if it has none).

    Every step the engine picks the depth d in 0 .. D with the most tokens per unit of cost, so
    the model predicts the best fixed depth's speedup, floored at plain decoding (d = 0: tau 1, cost 1).
    """
    best = max(chains, key=lambda c: c.speedup, default=None)
    spec = adaptive_form(best.spec) if best else None
    if spec is None:
        return []
    tau, cost = (best.tau, best.cost) if best.speedup > 1.0 else (1.0, 1.0)
    why = (f"adaptive depth 0..{spec.num_spec}: the best fixed depth's prediction ({best.spec.label}, "
           f"{best.speedup:.2f}x), floored at plain decoding")
    return [Candidate(spec, tau, cost, why)]


def measured_from_bench(path: str) -> dict:
    """Acceptance curves, draft cost ratios and verify-cost points from a bench JSON."""
    results = json.loads(Path(path).read_text())["results"]
    measured: dict = {"verify": {1: 1.0}}
    for r in results:
        if r["method"] == CONTROL or "@" in r["method"] or " [" in r["method"]:
            continue  # plain decoding again; a method on another draft; in another --matmuls mode than the baseline
        spec = MethodSpec.parse(r["method"])
        if spec.method == "ar" or spec.adaptive:  # adaptive rows mix depths and draft where acceptance runs high
            continue
        measured["verify"][r["block"]] = r["verify_over_decode"]
        if spec.num_spec is not None:
            steps = spec.num_spec
            measured[spec.method] = {
                "curve": r["acceptance_by_position"],
                "alpha": float(np.mean(r["acceptance_by_position"])),
                "c": r["c"] / max(steps, 1),
            }
    return measured


def switch_temperature(args, measured: dict) -> float | None:
    """The lowest temperature at which no method is predicted to beat plain decoding."""
    for temperature in np.arange(0.0, 2.01, 0.1):
        probe = argparse.Namespace(**{**vars(args), "temperature": float(temperature)})
        if candidates(probe, measured)[0].spec.method == "ar":
            return float(temperature)
    return None


def sweep_specs(args, ranked: list[Candidate]) -> list[MethodSpec]:
    """What --measure runs: ar, the first method at its defaults, the --measure-top best predicted
    fixed configurations, and the best-ranked chain with its adaptive form (side by side)."""
    defaults = [MethodSpec(name) for name in args.method_names[:1]]
    fixed = [c.spec for c in ranked if not c.spec.adaptive]
    chain = next((spec for spec in fixed if adaptive_form(spec)), None)
    paired = [chain, adaptive_form(chain)] if chain else []
    return list(dict.fromkeys([MethodSpec("ar")] + defaults + fixed[: args.measure_top] + paired))


def measure(args, ranked: list[Candidate]) -> list[tuple[MethodSpec, float]]:
    """Run `sweep_specs` on the task's prompts, interleaved."""
    from infer import prompts as prompt_sets
    from infer.bench import interleaved_passes
    from specjax.engine import Engine

    config, params, tokenizer = common.load_target(args)
    prompt_set = "code" if args.task in ("code", "structured") else "chat"
    texts = prompt_sets.load(prompt_set)[: args.num_prompts]
    cycled = [texts[i % len(texts)] for i in range(max(args.batch_size, len(texts)))]
    token_ids = [tokenizer.encode(tokenizer.chat_prompt(t)) for t in cycled]
    batches = [token_ids[i : i + args.batch_size] for i in range(0, len(token_ids) - args.batch_size + 1, args.batch_size)]
    target = common.engine_targets(config, params, [args.matmuls])[args.matmuls]
    engines = {
        spec: Engine(*target, common.build_drafter(spec, args, config, params),
                     max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=args.matmuls)
        for spec in sweep_specs(args, ranked)
    }
    sampling = common.sampling_params(args, args.batch_size)
    passes = interleaved_passes(engines, batches, sampling, args.max_new_tokens, args.repeats, args.seed)
    results = []
    for spec, runs in passes.items():
        results.append((spec, float(np.median([tokens / seconds for seconds, tokens, _ in runs]))))
        print(f"  measured {spec.label:<16} {results[-1][1]:7.1f} tokens/s", file=sys.stderr)
    return results


def render(args, ranked: list[Candidate], switch: float | None, measured_runs) -> str:
    best = ranked[0]
    lines = [
        "# specjax decoding recommendation",
        "",
        f"Workload: task **{args.task}**, batch size **{args.batch_size}**, temperature **{args.temperature}**"
        + (f", latency target {args.latency_target} ms/token" if args.latency_target else "") + ".",
        f"Evidence: {'bench JSON ' + args.bench if args.bench else 'priors of the cost model'}"
        + (" and a measured sweep" if measured_runs else "") + ".",
        "",
    ]
    if measured_runs:
        ar_rate = dict((s.label, r) for s, r in measured_runs)["ar"]
        winner, rate = max(measured_runs, key=lambda sr: sr[1])
        lines += [f"**Use `{winner.label}`**: measured {rate:.1f} tokens/s, {rate / ar_rate:.2f}x autoregressive.", "",
                  "| configuration | measured tokens/s | vs ar |", "|---|---|---|"]
        lines += [f"| {s.label} | {r:.1f} | {r / ar_rate:.2f}x |" for s, r in measured_runs]
        lines.append("")
    else:
        lines += [f"**Use `{best.spec.label}`**: predicted {best.speedup:.2f}x over autoregressive decoding.", ""]
    lines += ["Predicted by the cost model (best first):", "", "| configuration | tau | cost per call | predicted speedup | reasoning |",
              "|---|---|---|---|---|"]
    lines += [f"| {c.spec.label} | {c.tau:.2f} | {c.cost:.2f} | {c.speedup:.2f}x | {c.reasoning} |" for c in ranked[:8]]
    lines.append("")
    if switch is None:
        lines.append("Speculation is predicted to pay at every temperature up to 2.0.")
    else:
        lines.append(f"Temperature switch: from temperature {switch:.1f} up, plain decoding (`ar`) is predicted to be as fast; switch methods there.")
    if args.latency_target and args.t_decode_ms:
        expected = args.t_decode_ms / best.speedup
        verdict = "meets" if expected <= args.latency_target else "misses"
        lines.append(f"Expected latency {expected:.1f} ms/token {verdict} the target of {args.latency_target} ms/token "
                     f"(T_decode {args.t_decode_ms:.1f} ms).")
    lines += ["", "How to run it:", "", f"    python -m infer.generate {cli_flags(ranked[0].spec if not measured_runs else max(measured_runs, key=lambda sr: sr[1])[0])}"]
    return "\n".join(lines) + "\n"


def cli_flags(spec: MethodSpec) -> str:
    """infer.generate's flags for the spec (`common.method_spec` parses them back to it)."""
    flags = f"--method {spec.method}"
    if spec.shape:
        return flags + f" {'--tree' if spec.tree else '--lookahead'} {','.join(map(str, spec.shape))}"
    flags = flags if spec.num_spec is None else flags + f" --num-spec {spec.num_spec}"
    return flags + " --auto" if spec.adaptive else flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.parser("python -m infer.tune", __doc__)
    common.add_model_args(parser, matmuls="one")
    tunable = [m.name for m in METHODS.values() if m.priors]
    parser.add_argument("--methods", default="eagle3,eagle3+ngram,ngram", help=f"methods to consider, from {', '.join(tunable)}")
    parser.add_argument("--task", choices=TASKS, default="chat")
    parser.add_argument("--batch-size", type=common.POSITIVE_INT, default=1)
    parser.add_argument("--latency-target", type=common.NON_NEGATIVE, default=None, help="ms per token")
    parser.add_argument("--t-decode-ms", type=common.NON_NEGATIVE, default=None, help="one decode step of the target, if known (bench JSON fills it)")
    parser.add_argument("--bench", default=None, help="bench JSON with measured acceptance and costs")
    parser.add_argument("--measure", action="store_true", help="run the best predicted configurations and pick empirically")
    parser.add_argument("--measure-top", type=common.POSITIVE_INT, default=3)
    parser.add_argument("--num-prompts", type=common.POSITIVE_INT, default=4, help="--measure: prompts of the task's built-in set, cycled into batches")
    common.add_sampling_args(parser)
    parser.add_argument("--repeats", type=common.POSITIVE_INT, default=2)
    parser.add_argument("--markdown", default=None, help="also write the recommendation to this Markdown file")
    args = parser.parse_args(argv)
    args.method_names = [name for name in args.methods.split(",") if name]
    for name in args.method_names:
        if name not in tunable:
            raise ValueError(f"--methods: {name!r} is not a method tune can rank; choose from {', '.join(tunable)}")
    if "draft" in args.method_names and not args.draft:
        raise ValueError("--methods draft needs --draft PATH (a small model sharing the target's tokenizer)")
    common.check_draft_flag(args, [MethodSpec(name) for name in args.method_names])
    common.sampling_params(args, args.batch_size)
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    measured = measured_from_bench(args.bench) if args.bench else {}
    if args.bench and args.t_decode_ms is None:
        rows = json.loads(Path(args.bench).read_text())["results"]
        args.t_decode_ms = float(np.median([r["t_decode_ms"] for r in rows if r["batch_size"] == args.batch_size] or [np.nan]))
    ranked = candidates(args, measured)
    switch = switch_temperature(args, measured)
    runs = measure(args, ranked) if args.measure else None
    text = render(args, ranked, switch, runs)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return text


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
