"""python -m infer.loadtest: the server under load, with and without speculation, continuous vs static batching.

    python -m infer.loadtest                                   # ar vs eagle3:3 on SmolLM2, concurrency 1, 4, 16
    python -m infer.loadtest --methods ar,eagle3:3 --concurrency 1,4,16 --requests 32 --out loadtest.json
    python -m infer.loadtest --prompts mt-bench --turns 2 --prefix-reuse on,off   # conversations, reuse on vs off
    python -m infer.loadtest --tiny                            # a tiny random model: checks the harness in seconds
    python -m infer.loadtest --url http://127.0.0.1:8000       # load a running `python -m infer.serve`

For every method, concurrency C and schedule, an in-process server (infer.serve, C slots unless
--max-batch) takes the same list of chat requests from C closed-loop clients (each sends its next
request when the previous one has finished), streaming through the official openai client.
Reported: generated tokens/s and requests/s over the run, and percentiles of time to first token
(TTFT), inter-token latency (ITL: a request's (last token - first token) / (tokens - 1)) and
end-to-end latency, with tau from the server's own statistics.

Schedules: `continuous` admits a request as soon as a slot frees up; `static` (the baseline) waits
until the whole batch has finished before admitting the next one (skipped at concurrency 1, where
they coincide). Requests ask for a varying number of tokens (uniform in --min-tokens..--max-tokens,
the same list for every configuration), which is where waiting for whole batches costs. Greedy by
default, so every configuration must return the same texts; the run checks it.

Conversations (`--turns T`, e.g. `--prompts mt-bench --turns 2`): each client holds a conversation
and sends its next user turn with the whole history, the server's replies included, as soon as the
last reply has arrived. `--prefix-reuse on,off` serves the same load with and without prefix reuse
(a next turn prefilling only what its slot's cache lacks): reported beside the rest are the share
of prompt tokens the server found cached and the time to first token of the later turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from infer import common
from infer import prompts as prompt_sets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.parser("python -m infer.loadtest", __doc__)
    common.add_model_args(parser, matmuls="one")
    load = parser.add_argument_group("load")
    load.add_argument("--methods", default=None, help="methods to serve in turn (default: ar,eagle3:3; with --tiny ar,ngram:3)")
    load.add_argument("--concurrency", type=common.positive_ints, default=[1, 4, 16], help="closed-loop clients, e.g. 1,4,16")
    load.add_argument("--schedules", default="continuous,static", help="continuous, static or both")
    load.add_argument("--max-batch", type=common.POSITIVE_INT, default=None, help="server slots (default: the concurrency)")
    load.add_argument("--requests", type=common.POSITIVE_INT, default=32, help="requests per configuration")
    load.add_argument("--prompts", default="chat", help="built-in set (chat, code, mt-bench) or a jsonl file ('prompt' or 'turns')")
    load.add_argument("--turns", type=common.POSITIVE_INT, default=1, help="user turns per conversation (mt-bench has 2)")
    load.add_argument("--prefix-reuse", default="on", help="serve with prefix reuse on, off, or both (on,off)")
    load.add_argument("--reuse-min-gain", type=common.NON_NEGATIVE_INT, default=None,
                      help="the server's --reuse-min-gain (default: the server's default)")
    load.add_argument("--min-tokens", type=common.POSITIVE_INT, default=16)
    load.add_argument("--max-tokens", type=common.POSITIVE_INT, default=128)
    load.add_argument("--temperature", type=common.NON_NEGATIVE, default=0.0)
    load.add_argument("--seed", type=common.SEED, default=0, help="draws the requests' token limits")
    load.add_argument("--steps-per-sync", type=common.POSITIVE_INT, default=4)
    load.add_argument("--tiny", action="store_true", help="a tiny random model and word tokenizer (no weights; measures nothing real)")
    load.add_argument("--url", default=None, help="load a running server instead (one configuration per concurrency)")
    load.add_argument("--out", default="loadtest.json")
    args = parser.parse_args(argv)
    if args.min_tokens > args.max_tokens:
        parser.error("--min-tokens must be <= --max-tokens")
    if args.requests % args.turns:
        parser.error(f"--requests {args.requests} is not a whole number of conversations of --turns {args.turns}")
    args.reuse_list = [s for s in args.prefix_reuse.split(",") if s]
    if not args.reuse_list or any(s not in ("on", "off") for s in args.reuse_list):
        parser.error(f"--prefix-reuse: expected on and/or off, got {args.prefix_reuse!r}")
    args.schedule_list = [s for s in args.schedules.split(",") if s]
    if not args.schedule_list or any(s not in ("continuous", "static") for s in args.schedule_list):
        parser.error(f"--schedules: expected continuous and/or static, got {args.schedules!r}")
    from infer.bench import split_methods

    args.methods = args.methods or ("ar,ngram:3" if args.tiny else "ar,eagle3:3")
    args.method_specs = split_methods(args.methods)
    if args.methods.split(",")[0].split(":")[0] != "ar":
        args.method_specs = args.method_specs[1:]  # bench always adds ar; here only what was asked
    common.check_draft_flag(args, args.method_specs)
    if args.url and args.tiny:
        parser.error("--url loads a running server; --tiny builds one")
    return args


# --------------------------------------------------------------------------- the load


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


async def _one(client, model: str, messages: list[dict], max_tokens: int, temperature: float) -> dict:
    start = time.perf_counter()
    first = last = None
    text, tokens, prompt, cached = "", 0, 0, 0
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
        stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
        for choice in chunk.choices:
            if choice.delta.content:
                now = time.perf_counter()
                first = first or now
                last = now
                text += choice.delta.content
    end = time.perf_counter()
    first, last = first or end, last or end
    return {"start": start, "first": first, "last": last, "end": end, "tokens": tokens, "text": text,
            "prompt_tokens": prompt, "cached_tokens": cached}


async def run_load(url: str, model: str, conversations: list[list[str]], limits: list[int], concurrency: int,
                   temperature: float) -> dict:
    """`concurrency` closed-loop clients work through the conversations in order, each sending its
    turns one after another (`limits`: max_tokens per request, conversation by conversation);
    per-request timings, the later turns' apart."""
    import httpx
    import openai

    http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency + 4))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)
    await _one(client, model, [{"role": "user", "content": conversations[0][0]}], 2, temperature)  # the HTTP path warm
    turns = len(conversations[0])
    results: list[dict | None] = [None] * (len(conversations) * turns)
    next_index = 0

    async def worker():
        nonlocal next_index
        while next_index < len(conversations):
            c, next_index = next_index, next_index + 1
            history: list[dict] = []
            for t, question in enumerate(conversations[c]):
                history.append({"role": "user", "content": question})
                result = await _one(client, model, history, limits[c * turns + t], temperature)
                results[c * turns + t] = result | {"turn": t}
                history.append({"role": "assistant", "content": result["text"]})

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - begin
    await http.aclose()
    done = [r for r in results if r is not None]
    later = [r for r in done if r["turn"] > 0]
    tokens = sum(r["tokens"] for r in done)
    return {
        "wall_s": wall,
        "requests": len(done),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(done) / wall,
        "ttft_ms": percentiles([(r["first"] - r["start"]) * 1e3 for r in done]),
        "later_ttft_ms": percentiles([(r["first"] - r["start"]) * 1e3 for r in later]),
        "cached_share": sum(r["cached_tokens"] for r in done) / max(sum(r["prompt_tokens"] for r in done), 1),
        "itl_ms": percentiles([(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in done if r["tokens"] > 1]),
        "latency_s": percentiles([r["end"] - r["start"] for r in done]),
        "texts": [r["text"] for r in results],
    }


# --------------------------------------------------------------------------- models


def tiny_model():
    """A random 2-layer model over a 10-word vocabulary with a chat template (no files needed)."""
    import jax
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specjax.models import llama
    from specjax.models.config import ModelConfig
    from specjax.tokenizer import Tokenizer

    words = "<unk> <end> <user> <bot> hi there hello you bye see".split()
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<bot> ' }}{{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}<bot> {% endif %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<end>", chat_template=template)
    config = ModelConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, eos_token_ids=(1,))
    params = llama.init_params(config, jax.random.key(0))
    params = params | {"lm_head": params["lm_head"] * 30.0}  # sharper than N(0, 0.02): varied output lengths
    prompts = [" ".join(words[4 + (i * 7 + j) % 6] for j in range(3 + i)) for i in range(8)]
    return config, params, Tokenizer(hf), prompts


def served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", trust_env=False, timeout=30).json()["data"][0]["id"]


# --------------------------------------------------------------------------- the run


def table(rows: list[dict]) -> str:
    header = (f"{'method':<16}{'schedule':<12}{'reuse':>6}{'conc':>5}{'slots':>6}{'tok/s':>9}{'req/s':>7}"
              f"{'TTFT ms p50/p90/p99':>24}{'later turns':>12}{'cached':>7}{'ITL ms p50/p90/p99':>22}"
              f"{'latency s p50/p90/p99':>24}{'tau':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        trio = lambda d, fmt: "/".join(format(d[k], fmt) for k in ("p50", "p90", "p99"))
        lines.append(
            f"{r['method']:<16}{r['schedule']:<12}{r['reuse']:>6}{r['concurrency']:>5}{r['slots']:>6}{r['tokens_per_s']:>9.1f}"
            f"{r['requests_per_s']:>7.2f}{trio(r['ttft_ms'], '.0f'):>24}{r['later_ttft_ms']['p50']:>12.0f}"
            f"{r['cached_share']:>7.0%}{trio(r['itl_ms'], '.1f'):>22}"
            f"{trio(r['latency_s'], '.2f'):>24}{r['tau']:>6.2f}"
        )
    return "\n".join(lines)


def conversation_list(available: list[list[str]], count: int, turns: int, source: str) -> list[list[str]]:
    """`count` conversations of `turns` user turns, cycling through those of a set that have enough."""
    usable = [c[:turns] for c in available if len(c) >= turns]
    if not usable:
        raise ValueError(f"--turns {turns}: no conversation of {source!r} has that many user turns (mt-bench has 2)")
    return [usable[i % len(usable)] for i in range(count)]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    limits = [int(x) for x in rng.integers(args.min_tokens, args.max_tokens + 1, args.requests)]
    count = args.requests // args.turns
    rows: list[dict] = []

    if args.url:
        conversations = conversation_list(prompt_sets.conversations(args.prompts), count, args.turns, args.prompts)
        model = served_model(args.url)
        for concurrency in args.concurrency:
            result = asyncio.run(run_load(args.url, model, conversations, limits, concurrency, args.temperature))
            rows.append({"method": "external", "schedule": "?", "reuse": "?", "concurrency": concurrency, "slots": 0,
                         "tau": float("nan"), **result})
        return _report(args, rows)

    from infer.serve import ServeOptions, ServerThread, create_app
    from specjax.engine import Engine

    if args.tiny:
        common.use_compile_cache(args.compile_cache)
        config, params, tokenizer, texts = tiny_model()
        available = [[text, texts[(i + 3) % len(texts)]] for i, text in enumerate(texts)]
    else:
        config, params, tokenizer = common.load_target(args)
        available = prompt_sets.conversations(args.prompts)
    conversations = conversation_list(available, count, args.turns, "tiny" if args.tiny else args.prompts)
    # The longest last prompt: every user turn and, before each later one, a reply of up to --max-tokens.
    need = max(len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "\n".join(c)}])))
               for c in conversations) + 8 * args.turns + args.turns * args.max_tokens
    target = common.engine_targets(config, params, [args.matmuls])[args.matmuls]
    for spec in args.method_specs:
        drafter = common.build_drafter(spec, args, config, params)
        if need + drafter.num_nodes > args.max_len:
            raise ValueError(f"--max-len {args.max_len} is too small: the longest conversation and --max-tokens need "
                             f"{need + drafter.num_nodes}")
        engine = Engine(*target, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=args.matmuls)
        for concurrency in args.concurrency:
            slots = args.max_batch or concurrency
            for schedule in args.schedule_list:
                if schedule == "static" and concurrency == 1 and slots == 1:
                    continue  # one request at a time: the same schedule
                for reuse in args.reuse_list:
                    options = ServeOptions(model_name="loadtest", max_batch=slots, max_queue=max(concurrency, 1) * 2,
                                           steps_per_sync=args.steps_per_sync, schedule=schedule, prefix_reuse=reuse == "on",
                                           **({} if args.reuse_min_gain is None else {"reuse_min_gain": args.reuse_min_gain}))
                    app = create_app(engine, tokenizer, options)
                    with ServerThread(app) as server:  # compiles for `slots` at startup (once per engine and size)
                        metrics = app.state.metrics
                        before = metrics.accepted_hist.copy()
                        result = asyncio.run(run_load(server.url, "loadtest", conversations, limits, concurrency, args.temperature))
                        hist = metrics.accepted_hist - before
                    counts = np.arange(hist.size) + 1
                    tau = float((hist * counts).sum() / max(hist.sum(), 1))
                    rows.append({"method": spec.label, "schedule": schedule, "reuse": reuse, "concurrency": concurrency,
                                 "slots": slots, "tau": tau, **result})
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    return _report(args, rows)


def _report(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    print()
    print(table(rows))
    if args.temperature == 0 and len(rows) > 1:
        same = all(r["texts"] == rows[0]["texts"] for r in rows)
        print(f"greedy outputs identical across all configurations: {'yes' if same else 'NO'}")
    meta = {k: v for k, v in vars(args).items() if k != "method_specs"}
    Path(args.out).write_text(json.dumps({"args": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
