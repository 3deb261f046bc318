"""python -m infer.bench: decoding methods side by side, in one process, warm.

    python -m infer.bench --methods ar,ngram:5,eagle3:5,eagle3:4,4,16 --batch-size 1,4 --prompts code

For every method and batch size: tau (tokens per verifier call, bonus included), acceptance by
draft position, decode tokens/s, speedup over autoregressive decoding at the same batch size,
the measured cost ratios c = T_draft / T_decode and T_verify(N) / T_decode, and the fraction of
the cost-model bound tau * T_decode / (T_verify(N) + T_draft) that the engine reaches.
Compilation is excluded (a warm-up run first); times are medians over --repeats interleaved runs, and
the speedup is the median of each run's ratio to the autoregressive run of the same round.
Greedy decoding by default, so every method emits the same tokens. --control adds a second
plain-decoding engine built like the first (`ar (control)`): its speedup over ar is what two
identical engines differ by in this run, the resolution of every other speedup.
--compare-draft NAME=PATH benches every method that drafts with a draft a second time on PATH,
labelled METHOD@NAME: two drafts of one method side by side (e.g. a new EAGLE-3 head and the shipped one).
--matmuls xla,streamed runs every method in each matmul mode (docs/architecture.md, "Streamed block
matmuls"), labelled "METHOD [streamed]" after the first mode, which stays the baseline; the
`in mode` column is then each method's speedup over plain decoding in its own mode.
With --prompts mt-bench, also per MT-bench category: tau, acceptance by position, and the speedup
where every batch holds one category (batch size 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import scipy.stats
from tqdm import tqdm

from infer import common
from infer import prompts as prompt_sets
from specjax import theory
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine, Stats, acceptance_by_position, tokens_per_call


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.parser("python -m infer.bench", __doc__)
    common.add_model_args(parser, matmuls="several")
    parser.add_argument("--methods", default="ar,ngram:5,eagle3:5", help="methods to compare, e.g. ar,ngram:5,eagle3:5,eagle3:4,4,16 (ar is always included)")
    parser.add_argument("--batch-size", type=common.positive_ints, default=[1, 4], help="batch sizes, e.g. 1,4")
    parser.add_argument("--prompts", default="code", help="built-in set (chat, code) or a jsonl file")
    parser.add_argument("--num-prompts", type=common.POSITIVE_INT, default=4, help="prompts per batch-size run (cycled to fill batches)")
    common.add_sampling_args(parser)
    parser.add_argument("--repeats", type=common.POSITIVE_INT, default=3)
    parser.add_argument("--compare-draft", action="append", default=[], metavar="NAME=PATH",
                        help="also bench every method that drafts with a draft on PATH, labelled METHOD@NAME (repeatable)")
    parser.add_argument("--control", action="store_true", help=f"add a second plain-decoding engine ({CONTROL!r}) to show the run's resolution")
    parser.add_argument("--out", default="bench.json", help="JSON results")
    parser.add_argument("--plots", default=None, help="directory for PNG plots (speedup, acceptance)")
    args = parser.parse_args(argv)
    args.method_specs = split_methods(args.methods)
    common.check_draft_flag(args, args.method_specs)
    args.compare_drafts = compare_drafts(args.compare_draft, args.method_specs)
    return args


def compare_drafts(values: list[str], specs: list[MethodSpec]) -> dict[str, str]:
    """--compare-draft values -> {name: path}; a value without NAME=, a name given twice, or no
    method to use it is a ValueError."""
    drafts: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not (sep and name.isidentifier() and path):
            raise ValueError(f"--compare-draft {value!r}: give NAME=PATH (NAME labels the runs, e.g. shipped=specjax/drafts/...)")
        if name in drafts:
            raise ValueError(f"--compare-draft given twice for {name!r}: {drafts[name]!r} and {path!r}")
        drafts[name] = path
    if drafts and not any(spec.info.draft for spec in specs):
        raise ValueError(f"--compare-draft is not used by {', '.join(s.label for s in specs)}: none drafts with a draft")
    return drafts


def engine_plan(args: argparse.Namespace) -> dict[str, tuple[MethodSpec, str | None, str]]:
    """{label: (spec, draft path or None for --draft's, matmul mode)}: the methods, each drafting one
    again on every --compare-draft (METHOD@NAME, right after it), the control, then all of that again
    in every further --matmuls mode ("LABEL [MODE]")."""
    plan: dict[str, tuple[MethodSpec, str | None]] = {}
    for spec in args.method_specs:
        plan[spec.label] = spec, None
        if spec.info.draft:
            plan |= {f"{spec.label}@{name}": (spec, path) for name, path in args.compare_drafts.items()}
    plan |= {CONTROL: (MethodSpec("ar"), None)} if args.control else {}
    return {mode_label(label, mode, args.matmuls[0]): (*entry, mode) for mode in args.matmuls for label, entry in plan.items()}


def mode_label(label: str, mode: str, baseline_mode: str) -> str:
    """A method's label in a --matmuls mode: as it is in the first (baseline) mode, "LABEL [MODE]" in the others."""
    return label if mode == baseline_mode else f"{label} [{mode}]"


#: The label of --control's engine: plain decoding again, built and timed like `ar`.
CONTROL = "ar (control)"


def split_methods(text: str) -> list[MethodSpec]:
    """'ar,ngram:5,eagle3:4,4,16' -> specs; a bare number continues the spec before it."""
    labels: list[str] = []
    for part in text.replace(";", ",").split(","):
        if part.isdigit() and labels:
            labels[-1] += "," + part
        else:
            labels.append(part)
    specs = [MethodSpec.parse(label) for label in labels]
    if not specs or specs[0].method != "ar":
        specs.insert(0, MethodSpec("ar"))  # the baseline every speedup is measured against
    return specs


def interleaved_passes(engines: dict, batches, sampling, max_new_tokens: int, repeats: int, seed: int = 0) -> dict:
    """Compile every engine, then `repeats` passes over every batch:
    {key: [(decode seconds, decoded tokens, the batches' Stats), ...]}, one entry per pass.

    Interleaved batch by batch: every engine decodes a batch before any decodes the next, in an
    order reversed from one batch to the next (ar, m1, m2, then m2, m1, ar, ...). So engines are
    timed seconds apart, not a whole pass apart, and a machine whose speed drifts (a shared host)
    moves every method alike, early and late in the order alike.
    """
    for engine in engines.values():
        engine.generate(batches[0], sampling, max_new_tokens=4)  # compile
    keys = list(engines)
    passes: dict = {key: [] for key in keys}
    for round_ in range(repeats):
        runs: dict = {key: [] for key in keys}
        for i, batch in enumerate(batches):
            for key in keys if (round_ * len(batches) + i) % 2 == 0 else keys[::-1]:
                runs[key].append(engines[key].generate(batch, sampling, max_new_tokens=max_new_tokens, seed=seed))
        for key in keys:
            passes[key].append((sum(r.decode_s for r in runs[key]), sum(r.num_generated for r in runs[key]), runs[key]))
    return passes


def by_category(passes: list, row_categories: list[str]) -> dict[str, dict]:
    """Per prompt category: tau and acceptance by position over its rows (the last pass), and its
    tokens/s in each pass where every batch holds one category (else None: batches mix them).

    passes: one engine's [(seconds, tokens, runs)] (`interleaved_passes`); row_categories: each row's
    category, in the order of the batches' rows."""
    runs = passes[-1][2]
    hist, reached = np.concatenate([r.accepted_hist for r in runs]), np.concatenate([r.reached for r in runs])
    bounds = np.cumsum([0] + [len(r.tokens) for r in runs])
    batch_categories = [set(row_categories[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    pure = all(len(c) == 1 for c in batch_categories)
    table = {}
    for category in dict.fromkeys(row_categories):
        rows = np.array([c == category for c in row_categories])
        batches = [i for i, c in enumerate(batch_categories) if c == {category}]
        rate = lambda runs: sum(runs[i].num_generated for i in batches) / sum(runs[i].decode_s for i in batches)
        table[category] = {
            "tau": tokens_per_call(hist[rows]),
            "acceptance_by_position": acceptance_by_position(hist[rows], reached[rows]).tolist(),
            "tokens_per_s_by_repeat": [rate(p[2]) for p in passes] if pure else None,
        }
    return table


def bench_batch_size(engines: dict[str, Engine], batches, args, row_categories: list[str] | None = None) -> list[dict]:
    """All methods ({label: engine}) at one batch size: warm-up, --repeats interleaved passes (medians), step profiles.

    row_categories: the prompt category of each row of `batches` (in order), for the figures by category."""
    batch_size = len(batches[0])
    sampling = common.sampling_params(args, batch_size)
    passes = interleaved_passes(engines, batches, sampling, args.max_new_tokens, args.repeats, args.seed)
    results = []
    for label, engine in engines.items():
        seconds = float(np.median([p[0] for p in passes[label]]))
        _, tokens, runs = passes[label][-1]
        stats = Stats(  # the last pass's batches as one
            accepted_hist=np.concatenate([r.accepted_hist for r in runs]), reached=np.concatenate([r.reached for r in runs]),
            steps_by_depth=np.sum([r.steps_by_depth for r in runs], axis=0),
            prefill_s=0.0, decode_s=seconds, tokens=[t for r in runs for t in r.tokens],
        )
        timings = engine.profile_step(batches[0], sampling)
        results.append({
            "method": label,
            "batch_size": batch_size,
            "decode_s": seconds,
            "tokens": int(tokens),
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_by_repeat": [p[1] / p[0] for p in passes[label]],
            "tau": stats.tau,
            "block": engine.num_nodes + engine.drafter.num_aux,  # tokens in the verifying forward (the largest, if adaptive)
            "acceptance_by_position": stats.acceptance_by_position.tolist(),
            "drafting_share": stats.drafting_share,  # verifier calls that verified drafts (adaptive: below 1)
            "steps_by_depth": stats.steps_by_depth.tolist(),  # the batches' decode steps at each draft depth
            "adaptive": engine.drafter.variants is not None,
            "t_decode_ms": timings["decode"] * 1e3,
            "t_verify_ms": timings["verify"] * 1e3,
            "t_draft_ms": timings["draft"] * 1e3,
        })
        if engine.drafter.variants is not None:  # what each depth costs, relative to depth 0, as the engine priced it
            results[-1]["depth_costs"] = np.asarray(engine.depth_costs(batch_size)).tolist()
        if row_categories is not None:
            results[-1]["by_category"] = by_category(passes[label], row_categories)
    return results


def median_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of `values`: (low, high, coverage).

    Order statistics x_(k) <= x_(n + 1 - k) cover the median with probability 1 - 2 P(Bin(n, 1/2) < k)
    whatever the distribution; k is the largest whose coverage reaches `confidence`. Below six values
    no pair reaches 95%: then (min, max) and the lower coverage they have."""
    x, n = np.sort(np.asarray(values, float)), len(values)
    coverage = 1 - 2 * scipy.stats.binom.cdf(np.arange((n + 1) // 2), n, 0.5)  # [k - 1] for k = 1 .. (n + 1) // 2, falling
    k = max(1, int(np.count_nonzero(coverage >= confidence)))
    return float(x[k - 1]), float(x[n - k]), float(coverage[k - 1])


def summarise(results: list[dict]) -> None:
    """Add speedup, cost ratios and the cost-model bound, relative to ar at the same batch size.

    The speedup is the median over repeats of each repeat's ratio to ar's pass of the same repeat
    (the passes are interleaved), so a machine whose speed drifts between repeats moves both alike;
    `speedup_interval` is that median's 95% confidence interval (`median_interval`, wider with few repeats).
    Results of several --matmuls modes (each row's "matmuls"; ar's is the baseline) also get
    `speedup_in_mode`: the same median of ratios to plain decoding in the row's own mode."""
    baseline_mode = next(r.get("matmuls") for r in results if r["method"] == "ar")
    plain = {(r["batch_size"], r.get("matmuls")): r for r in results if r["method"] == mode_label("ar", r.get("matmuls"), baseline_mode)}
    for r in results:
        ar, mode_ar = plain[r["batch_size"], baseline_mode], plain[r["batch_size"], r.get("matmuls")]
        ratios = np.array(r["tokens_per_s_by_repeat"]) / np.array(ar["tokens_per_s_by_repeat"])
        r["speedup_by_repeat"] = ratios.tolist()
        r["speedup"] = float(np.median(ratios))
        *r["speedup_interval"], r["interval_coverage"] = median_interval(ratios)
        mode_ratios = np.array(r["tokens_per_s_by_repeat"]) / np.array(mode_ar["tokens_per_s_by_repeat"])
        r["speedup_in_mode"] = float(np.median(mode_ratios))
        *r["speedup_in_mode_interval"], _ = median_interval(mode_ratios)
        for name, category in r.get("by_category", {}).items():  # speedup per category where batches hold one
            rates, ar_rates = category["tokens_per_s_by_repeat"], ar["by_category"][name]["tokens_per_s_by_repeat"]
            category["speedup"] = None if rates is None else float(np.median(np.array(rates) / np.array(ar_rates)))
        r["c"] = r["t_draft_ms"] / r["t_decode_ms"]
        r["verify_over_decode"] = r["t_verify_ms"] / r["t_decode_ms"]
        draft_ms = r["t_draft_ms"] if r["method"] != "ar" else 0.0
        # The bound prices every step at the full block; an adaptive method's steps vary, so it has none.
        r["bound"] = None if r["adaptive"] else theory.cost_model_bound(r["tau"], r["t_decode_ms"], r["t_verify_ms"], draft_ms)
        r["fraction_of_bound"] = None if r["adaptive"] else r["speedup"] / r["bound"]


def table(results: list[dict]) -> str:
    """One line per method and batch size; with several --matmuls modes, an `in mode` column: the
    speedup over plain decoding in the method's own mode (`speedup` is over the baseline mode's)."""
    several_modes = len({r.get("matmuls") for r in results}) > 1
    in_mode_header = f"{'in mode':>8}" if several_modes else ""
    header = (f"{'method':<16}{'batch':>6}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'95% CI':>12}{in_mode_header}"
              f"{'c':>7}{'Tv/Td':>7}{'bound':>7}{'of bound':>9}{'drafted':>9}  acceptance by position")
    lines = [header, "-" * len(header)]
    number = lambda x: "-" if x is None else f"{x:.2f}"
    for r in results:
        accept = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        low, high = r["speedup_interval"]
        interval = "-" if r["method"] == "ar" else f"{low:.2f}-{high:.2f}"
        in_mode = f"{r['speedup_in_mode']:>8.2f}" if several_modes else ""
        lines.append(
            f"{r['method']:<16}{r['batch_size']:>6}{r['tau']:>7.2f}{r['tokens_per_s']:>9.1f}{r['speedup']:>9.2f}{interval:>12}"
            f"{in_mode}{r['c']:>7.2f}{r['verify_over_decode']:>7.2f}{number(r['bound']):>7}{number(r['fraction_of_bound']):>9}"
            f"{r['drafting_share']:>9.2f}  {accept}"
        )
    return "\n".join(lines)


def category_table(results: list[dict]) -> str:
    """Per method and batch size, each prompt category's tau, speedup (where batches hold one
    category) and acceptance by position."""
    lines = []
    for r in results:
        lines.append(f"{r['method'] + ', batch ' + str(r['batch_size']):<24}{'tau':>7}{'speedup':>9}  acceptance by position")
        for name, category in r["by_category"].items():
            speedup = "-" if category.get("speedup") is None else f"{category['speedup']:.2f}"
            accept = " ".join(f"{a:.2f}" for a in category["acceptance_by_position"])
            lines.append(f"  {name:<22}{category['tau']:>7.2f}{speedup:>9}  {accept}")
    return "\n".join(lines)


def plot(results: list[dict], directory: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        rows = [r for r in results if r["method"] == method]
        ax.plot([r["batch_size"] for r in rows], [r["speedup"] for r in rows], marker="o", label=method)
    ax.set(xlabel="batch size", ylabel="speedup over autoregressive", title="Speedup by batch size")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in [m for m in methods[1:] if m != CONTROL]:  # plain decoding drafts nothing
        row = next(r for r in results if r["method"] == method)
        curve = row["acceptance_by_position"]
        ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{method} (batch {row['batch_size']})")
    ax.set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1.05), title="Acceptance by position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close("all")
    return [out / "speedup.png", out / "acceptance.png"]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    common.sampling_params(args, 1)  # checked before loading
    prompt_sets.load(args.prompts)  # a bad prompt set is named before the model loads
    config, params, tokenizer = common.load_target(args)
    token_ids = prompt_sets.token_ids(tokenizer, args.prompts, args.num_prompts)
    categories = prompt_sets.categories(args.prompts)
    plan = engine_plan(args)
    targets = common.engine_targets(config, params, args.matmuls)
    engines = {
        label: Engine(*targets[matmuls], common.build_drafter(spec, args, config, params, draft),
                      max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=matmuls)
        for label, (spec, draft, matmuls) in plan.items()
    }
    results = []
    for batch_size in tqdm(args.batch_size, desc="bench", unit="batch size"):
        cycled = [token_ids[i % len(token_ids)] for i in range(max(batch_size, len(token_ids)))]
        batches = [cycled[i : i + batch_size] for i in range(0, len(cycled) - batch_size + 1, batch_size)]
        rows = len(batches) * batch_size
        row_categories = None if categories is None else [categories[i % len(token_ids)] for i in range(rows)]
        results += bench_batch_size(engines, batches, args, row_categories)
    results.sort(key=lambda r: (list(engines).index(r["method"]), r["batch_size"]))
    for r in results:
        r["matmuls"] = plan[r["method"]][2]
    summarise(results)
    print(table(results))
    for r in results:
        if r["method"] == mode_label(CONTROL, r["matmuls"], args.matmuls[0]):
            low, high = r["speedup_in_mode_interval"]
            ar = mode_label("ar", r["matmuls"], args.matmuls[0])
            print(f"batch {r['batch_size']}: {r['method']}, plain decoding again, ran at {r['speedup_in_mode']:.3f}x of {ar} "
                  f"({r['interval_coverage']:.0%} CI {low:.3f}-{high:.3f}): a speedup whose interval holds 1.0 is not resolved by this run")
    if categories is not None:
        print("\nby MT-bench category\n" + category_table(results))
    meta = {k: v for k, v in vars(args).items() if k not in ("method_specs", "compare_drafts")}
    Path(args.out).write_text(json.dumps({"args": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.plots:
        for path in plot(results, args.plots):
            print(f"wrote {path}")
    return results


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
