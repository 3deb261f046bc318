"""python -m infer.generate: generate text, speculative or not.

    python -m infer.generate --prompt "Write a haiku about JAX"           # embedded SmolLM2, EAGLE-3 draft
    python -m infer.generate --method ngram --num-spec 6 --prompt "..."   # prompt lookup
    python -m infer.generate --model path/to/hf_dir --prompts-file prompts.jsonl --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import sys

from infer.common import MethodSpec, add_model_args, build_drafter, load_target, method_summary
from specjax.engine import Engine
from specjax.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    source.add_argument("--prompts-file", help='jsonl with {"prompt": ...} (or {"messages": [...]}) per line')
    source.add_argument("--raw", action="store_true", help="feed prompts as raw text (default: chat template)")
    source.add_argument("--system", default=None, help="system message for chat mode")
    gen = parser.add_argument_group("sampling")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-stream", action="store_true", help="print only when the batch is done")
    gen.add_argument("--steps-per-sync", type=int, default=4, help="decode steps between streamed updates")
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace, tokenizer) -> list[str]:
    texts: list[str] = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "prompt" in record:
                    texts.append(record["prompt"])
                elif "messages" in record:
                    user = [m["content"] for m in record["messages"] if m["role"] == "user"]
                    texts.append(user[-1])
                else:
                    raise ValueError(f"{args.prompts_file}:{number}: expected a 'prompt' or 'messages' key")
    if not texts:
        texts = ["Write a short Python function that checks whether a number is prime."]
    if args.raw:
        return texts
    return [tokenizer.chat_prompt(text, system=args.system) for text in texts]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config, params, tokenizer = load_target(args)
    spec = MethodSpec(args.method, args.num_spec, args.tree)
    drafter = build_drafter(spec, config, params, args.draft, args.dtype)
    prompts = read_prompts(args, tokenizer)
    token_ids = [tokenizer.encode(p) for p in prompts]
    engine = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids)
    sampling = SamplingParams.make(len(prompts), args.temperature, args.top_k, args.top_p, args.min_p)
    engine.validate(token_ids, sampling, args.max_new_tokens)  # fail before compiling
    compile_s = engine.warmup(len(prompts))

    stream = not args.no_stream and len(prompts) == 1
    printed = [""]

    def on_step(rows: list[list[int]]) -> None:
        text = tokenizer.decode(rows[0])
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text

    stats = engine.generate(
        token_ids,
        sampling,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        on_step=on_step if stream else None,
        steps_per_sync=args.steps_per_sync if stream else None,
    )
    if stream:
        print()
    else:
        for row, tokens in enumerate(stats.tokens):
            print(f"--- [{row}] {tokenizer.decode(tokens)}")
    print(method_summary(spec.label, stats, compile_s))


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
