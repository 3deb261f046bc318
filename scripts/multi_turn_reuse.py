"""A conversation's second turn admitted into the row that served its first, keeping what the row's
cache holds (`Engine.admit(reuse_prefix=True)`), against prefilling it whole; side by side, warm.

    python scripts/multi_turn_reuse.py --methods ar,eagle3:3 --num-questions 16

SmolLM2 with the shipped drafts, MT-bench's questions (category-balanced), greedy, batch 1. Each
first turn is generated (--max-new-tokens); its second turn (the question, the reply and the
second question in the chat template) is then admitted into the same row both ways, interleaved
--repeats times, each from a copy of the finished state: the time to the second turn's first token
(admission and one decode step) and the tokens prefilled. Both ways must then generate the same
--check-tokens tokens.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from infer import prompts as prompt_sets  # noqa: E402
from specjax import checkpoints  # noqa: E402
from specjax import tokenizer as tokenizer_lib  # noqa: E402
from specjax.drafters.registry import BuildContext, MethodSpec  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402


def second_turn(tokenizer, turns: list[str], reply: str) -> list[int]:
    messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": reply}, {"role": "user", "content": turns[1]}]
    return tokenizer.encode(tokenizer.render_chat(messages))


def ttft(engine: Engine, finished, prompt: list[int], reuse: bool, greedy) -> float:
    """Seconds from a copy of `finished` to the second turn's first token, admitted into row 0."""
    state = jax.block_until_ready(jax.tree.map(jnp.copy, finished))
    start = time.perf_counter()
    state = engine.decode(engine.admit(state, [0], [prompt], 1, reuse_prefix=reuse), greedy, 1)
    jax.block_until_ready(state.pending)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,eagle3:3")
    parser.add_argument("--num-questions", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="of the first turn")
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=1024)
    args = parser.parse_args()
    path = checkpoints.default_model_path()
    config, params = checkpoints.load_model(path)
    tokenizer, greedy = tokenizer_lib.load(path), SamplingParams.make(1)
    questions = prompt_sets.mt_bench_questions()[: args.num_questions]
    for label in args.methods.split(","):
        spec = MethodSpec.parse(label)
        drafter = None if spec.method == "ar" else spec.build(BuildContext(config, params, None, jnp.float32))
        engine = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids)
        engine.warmup(1)  # every prefill width of a one-row admission
        cases = []  # (finished first turn, second-turn prompt)
        for _, turns in questions:
            first = tokenizer.encode(tokenizer.chat_prompt(turns[0]))
            state = engine.admit(engine.init_state(1), [0], [first], args.max_new_tokens)
            while bool(state.active[0]):
                state = engine.decode(state, greedy, 16)
            reply = engine.outputs(state)[0]
            text = tokenizer.decode([t for t in reply if t not in engine.eos_ids], skip_special_tokens=True)
            cases.append((state, second_turn(tokenizer, turns, text)))
        for reuse in (True, False):  # compiles what a kept prefix needs
            ttft(engine, *cases[0], reuse, greedy)
        seconds = {True: [[] for _ in cases], False: [[] for _ in cases]}
        for repeat in range(args.repeats):
            for i, (finished, prompt) in enumerate(cases):
                for reuse in ((True, False) if (repeat + i) % 2 else (False, True)):
                    seconds[reuse][i].append(ttft(engine, finished, prompt, reuse, greedy))
        prompt_tokens = [len(prompt) for _, prompt in cases]
        kept = [int(engine.kept_prefixes(finished, prompt)[0]) for finished, prompt in cases]
        for finished, prompt in cases:
            outputs = []
            for reuse in (True, False):
                state = engine.admit(jax.tree.map(jnp.copy, finished), [0], [prompt], args.check_tokens, reuse_prefix=reuse)
                outputs.append(engine.outputs(engine.decode(state, greedy, args.check_tokens))[0])
            if outputs[0] != outputs[1]:
                raise SystemExit(f"{label}: the second turn differs with a kept prefix: {outputs[0]} != {outputs[1]}")
        fresh = [statistics.median(s) for s in seconds[False]]
        reused = [statistics.median(s) for s in seconds[True]]
        ratios = [f / r for f, r in zip(fresh, reused)]
        print(
            f"{label}: {len(cases)} second turns of {statistics.median(prompt_tokens):.0f} tokens (median), "
            f"{statistics.median(kept):.0f} kept; prefilled {sum(prompt_tokens)} -> {sum(p - k for p, k in zip(prompt_tokens, kept))} tokens; "
            f"time to first token, median {1e3 * statistics.median(fresh):.0f} ms -> {1e3 * statistics.median(reused):.0f} ms "
            f"(per turn {statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x); same {args.check_tokens} tokens both ways",
            flush=True,
        )


if __name__ == "__main__":
    main()
