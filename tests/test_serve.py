"""The OpenAI-compatible server (infer.serve) through the official `openai` client, on a loopback port.

A tiny random model and a word-level tokenizer: the server's outputs are checked against the
engine's own `generate`, at the server's batch size so nothing compiles twice.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from engine_helpers import tiny_config, tiny_params, word_tokenizer
from infer import serve
from infer.serve import ServeOptions, ServerThread, create_app
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams
from specjax.tokenizer import Tokenizer

CONFIG = tiny_config(vocab_size=10, eos=(1,))  # the word tokenizer's 10 words; '<end>' ends a row
PARAMS = tiny_params(CONFIG, seed=0, scale=30.0)
SLOTS = 4
MAX_LEN = 128
MODEL = "tiny"
WORDS = "hi there hello you bye see".split()


def words(n: int, offset: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + offset) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def engine():
    # Prefill chunks of 16 tokens: longer prompts take several admission chunks.
    return Engine(CONFIG, PARAMS, NgramDrafter(num_draft=3), max_len=MAX_LEN, prefill_chunk=16)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(word_tokenizer())


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    # Conversations of a few words: a slot is worth choosing over the least recently used for 8 more tokens.
    options = ServeOptions(model_name=MODEL, max_batch=SLOTS, max_queue=64, steps_per_sync=3, reuse_min_gain=8)
    app = create_app(engine, tokenizer, options)
    with ServerThread(app) as running:
        running.compiled = compile_counts(engine)  # after the warm-up at startup
        running.metrics = app.state.metrics
        yield running


def compile_counts(engine: Engine) -> list[int]:
    return [f._cache_size() for f in (engine._fresh_jit, engine._prefill_jit, engine._place_jit, engine._decode_jit)]


CLIENTS: list[openai.OpenAI] = []


@pytest.fixture(scope="module", autouse=True)
def close_clients():
    yield
    for client in CLIENTS:
        client.close()


def client_for(url: str, timeout: float = 60.0) -> openai.OpenAI:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout,
                           http_client=httpx.Client(trust_env=False))
    CLIENTS.append(client)
    return client


@pytest.fixture(scope="module")
def client(server):
    return client_for(server.url)


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    rendered = tokenizer.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered)


def reference(engine, tokenizer, prompts: list[list[int]], max_tokens: list[int], sampling=None, seed=0) -> list[tuple[str, int]]:
    """(text, completion tokens) from engine.generate, in batches of the server's slot count."""
    out = []
    for start in range(0, len(prompts), SLOTS):
        batch, limits = prompts[start : start + SLOTS], max_tokens[start : start + SLOTS]
        pad = SLOTS - len(batch)
        stats = engine.generate(batch + [[2]] * pad, sampling or SamplingParams.make(SLOTS), limits + [1] * pad, seed=seed)
        for tokens in stats.tokens[: len(batch)]:
            body = tokens[:-1] if tokens and tokens[-1] in engine.eos_ids else tokens
            out.append((tokenizer.decode(body, skip_special_tokens=True), len(tokens)))
    return out


def collect_stream(stream) -> tuple[str, str | None, object]:
    text, reason, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
            reason = choice.finish_reason or reason
    return text, reason, usage


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.01)


# --------------------------------------------------------------------------- the API


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", trust_env=False).json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="hi there", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics", trust_env=False).text
    for name in ("specjax_requests_total", "specjax_queue_length", "specjax_tokens_per_second", "specjax_tau",
                 'specjax_acceptance_by_position{position="3"}', "specjax_time_to_first_token_seconds_bucket",
                 "specjax_inter_token_latency_seconds_count", "specjax_generated_tokens_total"):
        assert name in text, name
    assert 'specjax_requests_total{outcome="completed"}' in text


def test_completion_and_chat_streaming_and_not(engine, tokenizer, client):
    prompt, question = words(5), words(6, offset=2)
    (plain, plain_len), (chat, chat_len) = reference(engine, tokenizer, [tokenizer.encode(prompt), chat_ids(tokenizer, question)], [24, 24])

    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == plain and done.usage.completion_tokens == plain_len
    assert done.choices[0].finish_reason == ("length" if plain_len == 24 else "stop")
    text, reason, usage = collect_stream(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert (text, reason, usage.completion_tokens) == (plain, done.choices[0].finish_reason, plain_len)

    messages = [{"role": "user", "content": question}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == chat and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == chat_len and answer.usage.prompt_tokens == len(chat_ids(tokenizer, question))
    text, reason, _ = collect_stream(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True))
    assert (text, reason) == (chat, answer.choices[0].finish_reason)


def test_sixteen_concurrent_greedy_requests_equal_generate(engine, tokenizer, server, client):
    """16 requests on 4 slots: admitted as slots free up (prompts of 1 to 3 prefill chunks), mixed
    chat/completion and streaming; each equals the engine's own greedy output."""
    texts = [words(3 + 3 * i, offset=i) for i in range(16)]  # 3 .. 48 words
    limits = [8 + (5 * i) % 40 for i in range(16)]
    kinds = [("chat" if i % 2 else "completion", i % 3 == 0) for i in range(16)]
    ids = [chat_ids(tokenizer, t) if kind == "chat" else tokenizer.encode(t) for t, (kind, _) in zip(texts, kinds)]
    expected = reference(engine, tokenizer, ids, limits)

    def one(i):
        kind, stream = kinds[i]
        args = dict(model=MODEL, max_tokens=limits[i], temperature=0, stream=stream)
        if kind == "chat":
            response = client.chat.completions.create(messages=[{"role": "user", "content": texts[i]}], **args)
        else:
            response = client.completions.create(prompt=texts[i], **args)
        if stream:
            return collect_stream(response)[0]
        return response.choices[0].message.content if kind == "chat" else response.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [text for text, _ in expected]
    assert compile_counts(engine) == server.compiled


def test_a_next_turn_keeps_what_its_slot_holds(engine, tokenizer, server, client):
    """A chat's second turn goes to the slot that served its first and prefills only what that
    slot's cache lacks (at least the first turn's prompt); it answers what a fresh prefill does."""
    first = [{"role": "user", "content": words(9, offset=3)}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": words(4, offset=1)}]
    rendered = tokenizer.render_chat(second)
    (expected, _), = reference(engine, tokenizer, [tokenizer.encode(rendered)], [12])
    cached_before = server.metrics.cached_prompt_tokens
    answer = client.chat.completions.create(model=MODEL, messages=second, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == expected
    cached = answer.usage.prompt_tokens_details.cached_tokens
    first_prompt = len(chat_ids(tokenizer, first[0]["content"]))
    assert cached >= first_prompt > reply.usage.prompt_tokens_details.cached_tokens  # the first turn shared the template's start
    assert server.metrics.cached_prompt_tokens - cached_before == cached
    assert f"specjax_cached_prompt_tokens_total {server.metrics.cached_prompt_tokens}" in httpx.get(
        server.url + "/metrics", trust_env=False).text


def _turn(client, history: list[dict], question: str, max_tokens: int = 6) -> tuple[list[dict], int]:
    """One more turn of a greedy chat: (the conversation with the question and its answer, cached tokens)."""
    messages = history + [{"role": "user", "content": question}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    reply = {"role": "assistant", "content": answer.choices[0].message.content}
    return messages + [reply], answer.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("min_gain", [8, 0])
def test_a_new_conversation_leaves_the_freshest_their_slots(engine, tokenizer, min_gain):
    """On 4 slots: a new conversation, which shares only the chat template's opening with any slot,
    takes the least recently used free slot (an empty one first), and a next turn the slot that
    served its last; with every slot taken the least recently served conversation goes, and the
    others' next turns keep their whole past. With a minimum gain of 0 a request takes the slot
    that keeps the most of it, the template's opening included."""
    options = ServeOptions(model_name=MODEL, max_batch=SLOTS, steps_per_sync=3, reuse_min_gain=min_gain)
    with ServerThread(create_app(engine, tokenizer, options)) as running:  # compiled already: same engine, same slots
        client = client_for(running.url)
        first_prompt = lambda history: len(chat_ids(tokenizer, history[0]["content"]))
        long, _ = _turn(client, [], words(30, offset=1))
        oldest, _ = _turn(client, [], words(8, offset=2))
        if min_gain == 0:
            assert _turn(client, long, words(3))[1] < first_prompt(long)  # the second took its slot
            return
        long, cached = _turn(client, long, words(3))
        assert cached >= first_prompt(long)
        third, _ = _turn(client, [], words(2, offset=3))
        fourth, _ = _turn(client, [], words(12, offset=4))
        _turn(client, [], words(9, offset=5))  # every slot holds a conversation: the least recently served goes
        for history in (long, third, fourth):  # each keeps at least its last prompt
            assert _turn(client, history, words(2))[1] >= len(tokenizer.encode(tokenizer.render_chat(history[:-1])))
        assert _turn(client, oldest, words(2))[1] < first_prompt(oldest)


def test_seeded_sampling_is_reproducible(engine, tokenizer, client):
    prompt = words(6, offset=1)
    params = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=1.0, top_p=0.95, seed=1234)
    alone = client.completions.create(**params).choices[0].text
    # Twice more while unseeded sampled requests share the batch: same text, whatever slot it lands in.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(client.completions.create, model=MODEL, prompt=words(4 + i), max_tokens=30, temperature=1.0) for i in range(4)]
        again = [pool.submit(lambda: client.completions.create(**params).choices[0].text) for _ in range(2)]
        assert [f.result() for f in again] == [alone, alone]
        [f.result() for f in noise]
    sampling = SamplingParams.make(SLOTS, temperature=1.0, top_p=0.95)
    (expected, _), = reference(engine, tokenizer, [tokenizer.encode(prompt)], [30], sampling, seed=1234)
    assert alone == expected
    others = {client.completions.create(**{**params, "seed": seed}).choices[0].text for seed in range(4)}
    assert len(others) > 1  # the seed matters


def test_stop_strings(engine, tokenizer, client):
    prompt = words(5, offset=4)
    (full, _), = reference(engine, tokenizer, [tokenizer.encode(prompt)], [40])
    stop = " ".join(full.split()[2:4])  # two words from inside the reference output
    expected = full[: full.index(stop)]
    args = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never said"])
    done = client.completions.create(**args)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, "stop")
    assert collect_stream(client.completions.create(stream=True, **args))[:2] == (expected, "stop")


def test_bad_requests_get_a_400_naming_the_problem(client):
    cases = [
        (dict(prompt=words(130)), "cache"),
        (dict(prompt=words(20), max_tokens=120), "max_tokens=120"),
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt="hi", top_p=0), "top_p"),
        (dict(prompt="hi", n=2), "n: only n=1"),
        (dict(prompt="hi", seed=-5), "seed"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt=[3, 99]), "outside the vocabulary"),
        (dict(prompt=""), "empty"),
        (dict(prompt="hi", stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(prompt="hi", extra_body={"top_k": "many"}), "top_k"),
        (dict(prompt="hi", logprobs=2), "logprobs"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as raised:
            client.completions.create(model=MODEL, **{"max_tokens": 4, **kwargs})
        assert raised.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)


# --------------------------------------------------------------------------- load and faults


class FaultyEngine:
    """The test engine behind a gate, with a delay and injected failures (same compiled functions)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # set while a decode call waits at the closed gate
        self.delay = 0.0
        self.fail_prompt: list[int] | None = None
        self.fail_decode = False
        self.refills: set[bool] = set()  # what the scheduler told `decode` of its slots

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def admit(self, state, rows, prompts, *args, **kwargs):
        if self.fail_prompt in prompts:
            raise RuntimeError("injected admission failure")
        return self.engine.admit(state, rows, prompts, *args, **kwargs)

    def decode(self, *args, **kwargs):
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait()
            self.blocked.clear()
        time.sleep(self.delay)
        if self.fail_decode:
            self.fail_decode = False
            raise RuntimeError("injected decode failure")
        self.refills.add(kwargs.get("refills", False))
        return self.engine.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def faulty(engine, tokenizer, server):
    proxy = FaultyEngine(engine)
    app = create_app(proxy, tokenizer, ServeOptions(model_name=MODEL, max_batch=SLOTS, max_queue=64, steps_per_sync=3))
    with ServerThread(app) as running:
        running.proxy, running.scheduler, running.metrics = proxy, app.state.scheduler, app.state.metrics
        yield running
        proxy.gate.set()


def long_prompt(engine, tokenizer, length: int = 100) -> str:
    """A prompt whose greedy output runs to `length` tokens without an EOS."""
    candidates = [words(n, offset) for offset in range(len(WORDS)) for n in (2, 3, 5, 8)]
    runs = reference(engine, tokenizer, [tokenizer.encode(text) for text in candidates], [length] * len(candidates))
    return next(text for text, (_, generated) in zip(candidates, runs) if generated == length)


def test_queue_bound_answers_429(faulty):
    client, scheduler = client_for(faulty.url), faulty.scheduler
    scheduler.options.max_queue = 2
    faulty.proxy.gate.clear()  # decoding stalls: one running request, then the queue fills up
    pool = concurrent.futures.ThreadPoolExecutor(4)
    send = lambda i: pool.submit(client.completions.create, model=MODEL, prompt=words(3, i), max_tokens=10, temperature=0)
    try:
        accepted = [send(0)]
        wait_for(faulty.proxy.blocked.is_set)
        for i in (1, 2):
            accepted.append(send(i))
            wait_for(lambda: scheduler.queue_length == i)
        with pytest.raises(openai.RateLimitError) as raised:
            send(3).result()
        assert raised.value.status_code == 429 and (scheduler.running, scheduler.queue_length) == (1, 2)
        assert raised.value.body["type"] == "rate_limit_error" and "capacity" in raised.value.body["message"]
    finally:
        faulty.proxy.gate.set()
        scheduler.options.max_queue = 64
    assert all(f.result().choices[0].finish_reason in ("stop", "length") for f in accepted)
    pool.shutdown()
    assert faulty.proxy.refills == {True}  # continuous batching: adaptive depth prices every row's tokens


def test_client_disconnect_frees_the_slot(engine, tokenizer, faulty):
    client, scheduler, metrics = client_for(faulty.url), faulty.scheduler, faulty.metrics
    prompt = long_prompt(engine, tokenizer)
    faulty.proxy.delay = 0.05
    try:
        cancelled = metrics.requests["cancelled"]
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
        wait_for(lambda: metrics.requests["cancelled"] == cancelled + 1 and scheduler.running == 0)
        # Non-streaming too: a client that times out is noticed and its slot freed.
        with pytest.raises(openai.APITimeoutError):
            client_for(faulty.url, timeout=0.3).completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0)
        wait_for(lambda: metrics.requests["cancelled"] == cancelled + 2 and scheduler.running == 0)
    finally:
        faulty.proxy.delay = 0.0
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).choices[0].text is not None


def test_a_failing_request_does_not_take_others_down(engine, tokenizer, faulty):
    client = client_for(faulty.url)
    bad, good = words(4, 3), words(4, 1)
    faulty.proxy.fail_prompt = tokenizer.encode(bad)
    (expected, _), = reference(engine, tokenizer, [tokenizer.encode(good)], [20])
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            goods = [pool.submit(client.completions.create, model=MODEL, prompt=good, max_tokens=20, temperature=0) for _ in range(3)]
            failing = pool.submit(client.completions.create, model=MODEL, prompt=bad, max_tokens=20, temperature=0)
            with pytest.raises(openai.InternalServerError, match="injected admission failure"):
                failing.result()
            assert [f.result().choices[0].text for f in goods] == [expected] * 3
    finally:
        faulty.proxy.fail_prompt = None
    # A failed decode call fails the running rows, and the server carries on.
    faulty.proxy.fail_decode = True
    with pytest.raises(openai.InternalServerError, match="injected decode failure"):
        client.completions.create(model=MODEL, prompt=good, max_tokens=20, temperature=0)
    assert client.completions.create(model=MODEL, prompt=good, max_tokens=20, temperature=0).choices[0].text == expected
    assert httpx.get(faulty.url + "/health", trust_env=False).json()["status"] == "ok"


def test_graceful_shutdown_drains_then_cancels(engine, tokenizer, server):
    proxy = FaultyEngine(engine)
    proxy.delay = 0.02
    prompt = long_prompt(engine, tokenizer)
    (expected, _), = reference(engine, tokenizer, [tokenizer.encode(prompt)], [40])
    options = ServeOptions(model_name=MODEL, max_batch=SLOTS, steps_per_sync=1, drain_timeout_s=20.0, warmup=False)
    app = create_app(proxy, tokenizer, options)
    running = ServerThread(app).start()
    stream = client_for(running.url).completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    stopper = threading.Thread(target=running.stop)
    stopper.start()  # shutdown begins while the request is running: it drains
    rest = collect_stream(chunks)
    assert (first + rest[0], rest[1]) == (expected, "length")
    stopper.join(30)
    assert not running.thread.is_alive() and not app.state.scheduler.alive

    # Past the drain timeout, running requests are cancelled and the server still stops.
    proxy.delay = 0.1
    app = create_app(proxy, tokenizer, ServeOptions(model_name=MODEL, max_batch=SLOTS, steps_per_sync=1, drain_timeout_s=0.3, warmup=False))
    running = ServerThread(app).start()
    stream = client_for(running.url).completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    begin = time.monotonic()
    running.stop()
    assert not running.thread.is_alive() and not app.state.scheduler.alive and time.monotonic() - begin < 10
    assert app.state.metrics.requests["cancelled"] == 1 and app.state.scheduler.running == 0
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        collect_stream(chunks)


def test_a_whole_batch_admitted_into_reused_slots_compiles_nothing(engine, tokenizer, server):
    """Four requests at once when every slot is free take them in least-recently-used order
    (here 3, 2, 1, 0); the admission stays the whole-batch one compiled at startup."""
    scheduler = serve.Scheduler(engine, tokenizer, ServeOptions(model_name=MODEL, max_batch=SLOTS), serve.Metrics(engine.max_depth))
    scheduler.slot_used[:] = [3.0, 2.0, 1.0, 0.0]
    prompts = [tokenizer.encode(words(3 + i, offset=i)) for i in range(SLOTS)]
    group = [
        serve.GenRequest(id=str(i), prompt_ids=p, max_tokens=5, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                         stop=[], seed=None, stream=False, include_usage=False, loop=None, events=None)
        for i, p in enumerate(prompts)
    ]
    scheduler._admit(group)
    assert compile_counts(engine) == server.compiled
    history = np.asarray(scheduler.state.history)
    assert sorted(r.row for r in group) == list(range(SLOTS))
    for request in group:
        assert scheduler.slots[request.row] is request
        assert history[request.row, : len(request.prompt_ids)].tolist() == request.prompt_ids


def test_nothing_recompiled_as_requests_came_and_went(engine, server):
    # Compiled at startup: reset and prefill for the batch and for one-row admissions, one decode loop.
    assert compile_counts(engine) == server.compiled == [2, 2, 1, 1]


def test_method_flag_takes_a_spec():
    args = serve.parse_args(["--method", "eagle3:3", "--max-batch", "8", "--port", "0"])
    assert (args.spec.label, args.max_batch) == ("eagle3:3", 8)
    assert serve.parse_args(["--method=eagle3:4,2,8"]).spec.label == "eagle3:4,2,8"
    assert serve.parse_args(["--method", "ngram", "--num-spec", "5"]).spec.label == "ngram:5"
    assert serve.parse_args(["--method", "eagle3:auto4"]).spec == MethodSpec("eagle3", num_spec=4, adaptive=True)
    assert serve.parse_args(["--method", "eagle3+ngram", "--auto"]).spec.label == "eagle3+ngram:auto3"
    with pytest.raises(ValueError, match="drop --num-spec"):
        serve.parse_args(["--method", "eagle3:3", "--num-spec", "4"])


def test_loadtest_runs_on_a_tiny_model(tmp_path, capsys):
    from infer import loadtest

    out = tmp_path / "loadtest.json"
    rows = loadtest.main(["--tiny", "--methods", "ngram:3", "--concurrency", "2", "--requests", "6",
                          "--min-tokens", "4", "--max-tokens", "16", "--max-len", "128", "--out", str(out)])
    assert [(r["method"], r["schedule"], r["concurrency"]) for r in rows] == [("ngram:3", "continuous", 2), ("ngram:3", "static", 2)]
    assert all(r["requests"] == 6 and r["tokens"] > 0 and r["ttft_ms"]["p50"] > 0 and r["tau"] >= 1 for r in rows)
    printed = capsys.readouterr().out
    assert "TTFT ms p50/p90/p99" in printed and "greedy outputs identical across all configurations: yes" in printed
    assert out.exists()


def test_loadtest_holds_conversations_with_and_without_reuse(tmp_path, capsys):
    """Two-turn conversations, served with prefix reuse and without: the same replies; only with
    reuse are prompt tokens found cached (the later turns keep their first turn). A slot for each of
    the 4 conversations (which one a new conversation evicts from fewer slots is up to timing), and a
    gain these short prompts reach (at the default 64, a later turn takes the least recently used slot)."""
    from infer import loadtest

    common = ["--tiny", "--methods", "ngram:3", "--concurrency", "2", "--max-batch", "4", "--reuse-min-gain", "4", "--min-tokens", "4",
              "--max-tokens", "12", "--max-len", "128", "--schedules", "continuous", "--out", str(tmp_path / "loadtest.json")]
    rows = loadtest.main(common + ["--turns", "2", "--requests", "8", "--prefix-reuse", "on,off"])
    assert [r["reuse"] for r in rows] == ["on", "off"]
    on, off = rows
    assert on["requests"] == off["requests"] == 8 and on["later_ttft_ms"]["p50"] > 0
    assert on["cached_share"] > 0.2 and off["cached_share"] == 0
    assert "greedy outputs identical across all configurations: yes" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--turns 3: no conversation"):
        loadtest.main(common + ["--turns", "3", "--requests", "6"])
    with pytest.raises(SystemExit):
        loadtest.main(common + ["--turns", "2", "--requests", "7"])


@pytest.mark.slow
def test_smollm2_with_the_shipped_draft_equals_generate():
    """The command line's engine (embedded SmolLM2, --method eagle3:3): three concurrent chats on two slots."""
    args = serve.parse_args(["--method", "eagle3:3", "--max-batch", "2", "--max-len", "256"])
    engine, tokenizer, name = serve.build_engine(args)
    assert name == "SmolLM2-135M-Instruct"
    app = create_app(engine, tokenizer, ServeOptions(model_name=name, max_batch=2))
    questions = ["Repeat exactly: alpha beta gamma delta.", "What is the capital of France?", "Count from one to five."]
    ids = [tokenizer.encode(tokenizer.chat_prompt(q)) for q in questions]
    expected = [tokens for pair in ([ids[0], ids[1]], [ids[2], ids[2]]) for tokens in engine.generate(pair, max_new_tokens=24).tokens][:3]
    expected = [tokenizer.decode(t[:-1] if t[-1] in engine.eos_ids else t, skip_special_tokens=True) for t in expected]
    with ServerThread(app) as server:
        client = client_for(server.url, timeout=300)
        ask = lambda q: client.chat.completions.create(model=name, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = [r.choices[0].message.content for r in pool.map(ask, questions)]
        assert answers == expected
        assert compile_counts(engine) == [2, 8, 1, 1] and app.state.metrics.tau > 1.0  # 4 prefill widths, 2 batch sizes
