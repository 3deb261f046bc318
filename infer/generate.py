"""python -m infer.generate: generate text, speculative or not.

    python -m infer.generate --prompt "Write a haiku about JAX"           # embedded SmolLM2, plain decoding
    python -m infer.generate --method eagle3 --prompt "..."              # the shipped EAGLE-3 draft
    python -m infer.generate --method ngram --num-spec 6 --prompt "..."   # prompt lookup
    python -m infer.generate --model path/to/hf_dir --prompts-file prompts.jsonl --temperature 0.7
    python -m infer.generate --method eagle3 --chat                      # a conversation, one message per line

In --chat mode every line on stdin is the next user message; each turn keeps what the cache holds of
the conversation so far and prefills only the new messages (`Engine.admit(reuse_prefix=True)`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from infer import common
from specjax.engine import Engine
from specjax.sampling import SamplingParams
from specjax.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.parser("python -m infer.generate", __doc__)
    common.add_model_args(parser, matmuls="one")
    common.add_method_args(parser)
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    source.add_argument("--prompts-file", help='jsonl with {"prompt": ...} (or {"messages": [...]}) per line')
    source.add_argument("--raw", action="store_true", help="feed prompts as raw text (default: chat template)")
    source.add_argument("--system", default=None, help="system message for chat mode")
    source.add_argument("--chat", action="store_true", help="a conversation: each line on stdin is the next user message")
    common.add_sampling_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--no-stream", action="store_true", help="print only when the batch is done")
    out.add_argument("--steps-per-sync", type=common.POSITIVE_INT, default=4, help="decode steps between streamed updates")
    return parser.parse_args(argv)


def read_prompts_file(path: str) -> list[str]:
    """User prompts of a jsonl file: {"prompt": ...} or {"messages": [...]} (the last user turn) per line."""
    texts = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not a JSON object ({error.msg})") from None
                if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                    texts.append(record["prompt"])
                    continue
                messages = record.get("messages") if isinstance(record, dict) else None
                user = [m.get("content") for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
                if not user or not isinstance(user[-1], str):
                    raise ValueError(f"{path}:{number}: expected a 'prompt' string or 'messages' with a user turn")
                texts.append(user[-1])
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    return texts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = common.method_spec(args)  # every flag checked before anything loads
    if args.raw and args.system is not None:
        raise ValueError("--system applies to the chat template, not to --raw prompts")
    if args.chat and (args.raw or args.prompt or args.prompts_file):
        raise ValueError("--chat reads its messages from stdin; drop --raw, --prompt and --prompts-file")
    texts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    texts = texts or ["Write a short Python function that checks whether a number is prime."]
    sampling = common.sampling_params(args, len(texts))
    config, params, tokenizer = common.load_target(args)
    drafter = common.build_drafter(spec, args, config, params)
    if args.chat:
        engine = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=args.matmuls)
        chat(engine, tokenizer, args, sampling)
        return
    prompts = texts if args.raw else [tokenizer.chat_prompt(text, system=args.system) for text in texts]
    token_ids = [tokenizer.encode(p) for p in prompts]
    engine = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=args.matmuls)
    engine.validate(token_ids, sampling, args.max_new_tokens)  # fail before compiling
    compile_s = engine.warmup_prompts(token_ids, sampling)  # only what this run uses: a quicker start

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
    print(common.method_summary(spec.label, stats, compile_s))


def chat(engine: Engine, tokenizer: Tokenizer, args: argparse.Namespace, sampling: SamplingParams) -> None:
    """--chat: one row, one turn per line of stdin (blank lines skipped), streamed; after each
    reply a line on stderr says how much of the prompt the cache already held."""
    compile_s = engine.warmup(1, refills=True)
    print(f"[compiled in {compile_s:.1f} s; a message per line, end with EOF]", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    state = engine.init_state(1)
    for turn, line in enumerate(line for line in sys.stdin if line.strip()):
        messages.append({"role": "user", "content": line.strip()})
        ids = tokenizer.encode(tokenizer.render_chat(messages))
        try:
            engine.validate([ids], sampling, args.max_new_tokens)
        except ValueError as error:
            raise ValueError(f"turn {turn + 1}: the conversation no longer fits: {error}") from None
        kept = int(engine.kept_prefixes(state, ids)[0])
        start = time.perf_counter()
        seed = (args.seed + turn) % 2**32
        state = engine.admit(state, [0], [ids], args.max_new_tokens, seed=seed, reuse_prefix=engine.reuses_prefixes)
        printed, first_token_s = "", None
        while bool(state.active[0]):
            state = engine.decode(state, sampling, args.steps_per_sync)
            reply = [t for t in engine.outputs(state)[0] if t not in engine.eos_ids]
            text = tokenizer.decode(reply, skip_special_tokens=True)
            first_token_s = first_token_s or time.perf_counter() - start
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
        print()
        messages.append({"role": "assistant", "content": printed})
        print(f"[turn {turn + 1}: {kept} of {len(ids)} prompt tokens in the cache; first tokens after "
              f"{1e3 * first_token_s:.0f} ms]", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
