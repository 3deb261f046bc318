"""Training-pipeline throughput against an earlier revision's code, side by side in one process (warm).

    python scripts/training_throughput.py distill --baseline ffdb866   # chunked vs continuous batching
    python scripts/training_throughput.py ttt --baseline ffdb866,7bd893c   # the TTT step of each revision and now
    python scripts/training_throughput.py distill --baseline ffdb866 --baseline-engine   # all of it: its engine too
    python scripts/training_throughput.py distill --methods ngram:auto5   # speculative regeneration too

distill: self-distillation of ShareGPT conversations (max 4 turns) with SmolLM2, greedy, on one
engine: the baseline's `regenerate_chunk` (every turn of a batch waits for its longest row) against
`train.distill.regenerate` (continuous batching); also checks that both wrote the same conversations.
With --baseline-engine the chunked baseline also runs on the baseline revision's own engine (its whole
`specjax` package, imported as `specjax_<rev>`), so the ratio is everything since then. --methods adds
continuous batching on a speculative engine per method (`distill_method`; greedy, so the same text).
--without-reuse adds continuous batching whose rows never keep a turn's cached context (the control for
`Engine.admit(reuse_prefix=True)`); --continuous-baseline REV continuous batching on REV's engine.
ttt: one EAGLE-3 TTT step (loss, gradient, AdamW) on packed ShareGPT rows with the target's real
features and logits: each baseline revision's `train/ttt.py` on its own `specjax` (the draft model
too), against the current code in f32 and bf16; ratios are to the first revision.
The baseline modules are read with `git show REV:train/...` (run inside the repository).
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from specjax import checkpoints  # noqa: E402
from specjax.drafters.base import BuildContext  # noqa: E402
from specjax.drafters.registry import MethodSpec  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.models import eagle3, llama  # noqa: E402
from train import data, distill, eagle3_method, sharegpt, ttt  # noqa: E402

from revision import baseline_engine_class, baseline_module  # noqa: E402


def interleaved(variants: dict, repeats: int) -> dict:
    """{name: [seconds, ...]} over `repeats` rounds of one call of each variant."""
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def _without_reuse(engine_class):
    """`engine_class` (this revision's Engine or an earlier one's, as `distill.regenerate` calls it)
    whose rows never keep a cached prefix (`Engine.admit(reuse_prefix=...)`)."""
    class Before(engine_class):
        reuses_prefixes = False

        def admit(self, *args, reuse_prefix=False, **kwargs):
            return super().admit(*args, **kwargs)
    return Before


def measure_distill(args, config, params, tokenizer):
    chunked = baseline_module(args.baseline, "train/distill.py")
    conversations = sharegpt.load(sharegpt.source_path("sharegpt"), max_turns=4, max_records=400).train[: args.conversations]
    eos = distill.stop_ids(config, tokenizer)
    max_prompt = 512
    max_len = -(-(max_prompt + args.max_new_tokens + 1) // 64) * 64
    engine = Engine(config, params, max_len=max_len, attention_chunk=64, eos_ids=eos)
    old_engine = baseline_engine_class(args.baseline)(config, params, max_len=max_len, attention_chunk=64, eos_ids=eos) if args.baseline_engine else engine
    settings = dict(batch_size=args.batch_size, max_prompt_tokens=max_prompt, max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0)
    results = {}

    def run_chunked(items=conversations):
        out, tokens = [], 0
        for first in range(0, len(items), args.batch_size):
            chunk, generated = chunked.regenerate_chunk(old_engine, tokenizer, items[first : first + args.batch_size], **settings)
            out, tokens = out + chunk, tokens + generated
        results["chunked"] = out, tokens

    def continuous(name, engine):
        def run(items=conversations):
            done = sorted(distill.regenerate(engine, tokenizer, items, **settings))
            results[name] = [m for _, m, _ in done], sum(t for _, _, t in done)
        return run

    variants = {"chunked": run_chunked, "continuous": continuous("continuous", engine)}
    warmed = []  # engines of this revision (and --continuous-baseline's), warmed before timing
    if args.without_reuse:  # the control: every turn's prompt prefilled whole
        warmed.append(_without_reuse(Engine)(config, params, max_len=max_len, attention_chunk=64, eos_ids=eos))
        variants["continuous, no reuse"] = continuous("continuous, no reuse", warmed[-1])
    if args.continuous_baseline:  # today's scheduling on that revision's engine
        before = _without_reuse(baseline_engine_class(args.continuous_baseline))
        name = f"continuous, {args.continuous_baseline} engine"
        warmed.append(before(config, params, max_len=max_len, attention_chunk=64, eos_ids=eos))
        variants[name] = continuous(name, warmed[-1])
    for method in filter(None, args.methods.split(";")):
        drafter = MethodSpec.parse(method).build(BuildContext(config, params, None, np.float32))
        name = f"continuous, {method}"
        warmed.append(Engine(config, params, drafter, max_len=max_len, attention_chunk=64, eos_ids=eos))
        variants[name] = continuous(name, warmed[-1])
    for run in variants.values():
        run(conversations[:2])  # compile
    for current in [engine, *warmed]:
        current.warmup(args.batch_size, refills=True)  # every prefill width, for a batch and for one row
    times = interleaved(variants, args.repeats)
    print(f"{len(conversations)} ShareGPT conversations (max 4 turns), batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, SmolLM2 float32, greedy")
    for name, (written, _) in results.items():
        same = sum(a == b for a, b in zip(results["chunked"][0], written))
        print(f"{name:24s} identical conversations to chunked {same}/{len(conversations)}")
    return {name: results[name][1] / np.array(seconds) for name, seconds in times.items()}


def measure_ttt(args, config, params, tokenizer):
    revisions = args.baseline.split(",")
    baselines = {rev: baseline_module(rev, "train/ttt.py", own_package=True) for rev in revisions}
    batch, length, draft_vocab = 8, args.seq_len, 8192
    conversations = sharegpt.load(sharegpt.source_path("sharegpt"), max_turns=4, max_records=300).train[:200]
    rows = data.to_rows([data.tokenize_conversation(tokenizer, c) for c in conversations], length, pack=True)
    vocab_ids = data.draft_vocab_ids(rows, draft_vocab, config.vocab_size)
    vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(vocab_ids), config.vocab_size)
    draft = eagle3.Eagle3Config.from_target(config, draft_vocab)
    head = eagle3.init_params(draft, jax.random.key(0))
    target_outputs = jax.jit(eagle3_method.target_outputs, static_argnums=1)
    batches = []
    for i in range(3):
        tokens, mask = (jnp.asarray(a[i * batch : (i + 1) * batch]) for a in (rows.tokens, rows.loss_mask))
        batches.append(dict(embeddings=llama.embed(params, tokens), mask=mask, **target_outputs(params, config, tokens, vocab)))
    in_loss = np.mean([float((ttt.shift_left(b["mask"], 2) & ttt.shift_left(b["in_vocab"], 1)).mean()) for b in batches])
    optimizer = optax.adamw(1e-4)

    def make_step(module, dtype):
        def loss(p, b):
            p = jax.tree.map(lambda x: x.astype(dtype), p)
            return module.ttt_loss(p, draft, b["embeddings"].astype(dtype), b["features"].astype(dtype), b["target_logits"],
                                   b["in_vocab"], b["mask"], num_steps=5, decay=0.8)

        @jax.jit
        def step(p, opt_state, b):
            (total, _), grads = jax.value_and_grad(loss, has_aux=True)(p, b)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, total

        def run():
            p, opt_state = head, optimizer.init(head)
            for b in batches:
                p, opt_state, total = step(p, opt_state, b)
            jax.block_until_ready(total)
        return run

    variants = {f"{rev} f32": make_step(module, jnp.float32) for rev, module in baselines.items()}
    variants.update({"now f32": make_step(ttt, jnp.float32), "now bf16": make_step(ttt, jnp.bfloat16)})
    for run in variants.values():
        run()  # compile
    times = interleaved(variants, args.repeats)
    print(f"TTT step, batch {batch} x {length} packed ShareGPT rows (response share {rows.loss_mask.mean():.2f}, "
          f"{in_loss:.2f} of positions in the step-0 loss), draft vocabulary {draft_vocab}, 5 steps")
    return {name: batch * length * len(batches) / np.array(seconds) for name, seconds in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["distill", "ttt"])
    parser.add_argument("--baseline", default="ffdb866", help="git revision whose code is the baseline (ttt: several, comma-separated)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline-engine", action="store_true", help="distill: the baseline runs on its own revision's engine")
    parser.add_argument("--continuous-baseline", default="", help="distill: also continuous batching on this revision's engine")
    parser.add_argument("--without-reuse", action="store_true", help="distill: also continuous batching without prefix reuse")
    parser.add_argument("--methods", default="", help="distill: speculative methods to regenerate with too, separated by ';'")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    path = checkpoints.default_model_path()
    config, params = checkpoints.load_model(path, np.float32)
    tokenizer = data.load_tokenizer(str(path))
    rates = (measure_distill if args.what == "distill" else measure_ttt)(args, config, params, tokenizer)
    base = np.median(next(iter(rates.values())))
    for name, per_repeat in rates.items():
        print(f"{name:24s} tokens/s {' '.join(f'{r:7.1f}' for r in per_repeat)}  median {np.median(per_repeat):7.1f}  "
              f"ratio {np.median(per_repeat) / base:.2f}x")


if __name__ == "__main__":
    main()
