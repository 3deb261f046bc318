"""python -m infer.serve: an OpenAI-compatible server with continuous batching and speculation.

    python -m infer.serve --method eagle3:3 --max-batch 8 --port 8000      # the shipped EAGLE-3 draft
    python -m infer.serve --method ngram --num-spec 5 --model path/to/hf_dir

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: /v1/chat/completions and /v1/completions (streaming as server-sent events or not),
/v1/models, /health, /metrics (Prometheus text). Per request: temperature, top_p, top_k, min_p,
max_tokens, stop, seed; n=1. Defaults follow the OpenAI API (temperature 1).

Scheduling: --max-batch slots share one engine state. A scheduler thread admits queued
requests into free slots between decode calls, one admission per call while rows are running
(a request's prompt is prefilled in the engine's fixed chunks, through a one-row state copied
into its slot, so it costs one row and not the whole batch), then runs --steps-per-sync decode
steps for every live row (one right after an admission, for a prompt first token) and streams
what they produced. A row that finishes, hits a
stop string or whose client goes away frees its slot for the next admission; speculation is
per row and unchanged. Shapes never change, so nothing recompiles as requests come and go.
A seeded request is admitted alone with its seed and samples exactly what
`Engine.generate([prompt], sampling, seed=seed)` samples, whatever else is running (with a fixed
draft length: an adaptive one picks one depth for the whole batch, so a sampled row's draws, though
exact in distribution, depend on what runs beside it).
Prefix reuse: a request goes to the least recently used free slot, unless another one's cache
holds at least --reuse-min-gain more tokens of its prompt (then to the one that holds the most):
a conversation's next turn finds the slot that served its last, and a new conversation leaves
the freshest ones their slots. Only the rest of the prompt is prefilled
(`Engine.admit(reuse_prefix=True)`; usage reports the kept tokens as
`prompt_tokens_details.cached_tokens`). A seeded sampled request is prefilled afresh, so that it
samples exactly what `generate` does; `--no-prefix-reuse` turns reuse off.
`--schedule static` waits for the whole batch to finish before admitting again (the baseline
`python -m infer.loadtest` compares against).

Past --max-queue waiting requests the server answers 429; bad parameters and prompts too long
for the cache get a 400 naming the problem; a failure inside one request answers that request
with a 500 and leaves the others running. On shutdown (SIGINT/SIGTERM) running requests drain
for up to --drain-timeout seconds, then are cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from infer import common
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.sampling import SamplingParams
from specjax.tokenizer import Tokenizer

log = logging.getLogger("infer.serve")


# --------------------------------------------------------------------------- options and errors


@dataclasses.dataclass
class ServeOptions:
    model_name: str = "specjax"
    max_batch: int = 8
    max_queue: int = 64  # waiting requests (not counting the running ones) before 429
    steps_per_sync: int = 4  # decode steps between host syncs (streaming granularity)
    default_max_tokens: int = 256  # when a request gives none (capped by what fits in the cache)
    schedule: Literal["continuous", "static"] = "continuous"
    batch_wait_s: float = 0.05  # static schedule: how long a partial batch waits for more requests
    drain_timeout_s: float = 30.0
    warmup: bool = True  # compile every function at startup
    prefix_reuse: bool = True  # a request keeps what a free slot's cache holds of its prompt
    # A request passes over the least recently used free slot for one that keeps more of its
    # prompt only when it keeps at least this many tokens more there.
    reuse_min_gain: int = 64

    def __post_init__(self):
        if self.max_batch < 1 or self.max_queue < 0 or self.steps_per_sync < 1 or self.default_max_tokens < 1:
            raise ValueError(f"invalid options {self}")
        if self.reuse_min_gain < 0:
            raise ValueError(f"reuse_min_gain must be >= 0, got {self.reuse_min_gain}")
        if self.schedule not in ("continuous", "static"):
            raise ValueError(f"schedule must be 'continuous' or 'static', got {self.schedule!r}")


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


# --------------------------------------------------------------------------- metrics


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count); observations may carry a count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, count: int = 1) -> None:
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[index] += count
        self.sum += value * count
        self.count += count

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == math.inf else bound}"}} {total}')
        return out + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters and histograms behind /metrics; updated from the scheduler thread and the handlers."""

    OUTCOMES = ("completed", "cancelled", "error", "rejected_queue_full", "rejected_invalid")
    WINDOW_S = 10.0  # tokens/s over this trailing window

    def __init__(self, num_draft: int):
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(self.OUTCOMES, 0)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.accepted_hist = np.zeros(num_draft + 1, np.int64)  # verifier calls by accepted drafts
        self.reached = np.zeros(num_draft, np.int64)  # verifier calls that verified draft position i
        self.recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.started, self.started_perf = time.time(), time.perf_counter()

    def observe(self, histogram: Histogram, value: float, count: int = 1) -> None:
        with self.lock:
            histogram.observe(value, count)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def tokens(self, now: float, count: int) -> None:
        with self.lock:
            self.generated_tokens += count
            self.recent.append((now, count))

    def tokens_per_s(self, now: float) -> float:
        with self.lock:
            while self.recent and self.recent[0][0] < now - self.WINDOW_S:
                self.recent.popleft()
            span = min(self.WINDOW_S, max(now - self.started_perf, 1e-9))
            return sum(c for _, c in self.recent) / span

    @property
    def tau(self) -> float:
        counts = np.arange(self.accepted_hist.size) + 1
        return float((self.accepted_hist * counts).sum() / max(self.accepted_hist.sum(), 1))

    @property
    def acceptance_by_position(self) -> np.ndarray:
        accepted = np.cumsum(self.accepted_hist[::-1])[::-1][1:]  # calls with accepted > i
        return accepted / np.maximum(self.reached, 1)

    def render(self, queue_length: int, running: int, slots: int) -> str:
        now = time.perf_counter()
        rate = self.tokens_per_s(now)
        with self.lock:
            lines: list[str] = []

            def metric(name, kind, help_, samples):
                lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
                lines.extend(samples)

            metric("specjax_requests_total", "counter", "Requests by outcome.",
                   [f'specjax_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()])
            metric("specjax_queue_length", "gauge", "Requests waiting for a slot.", [f"specjax_queue_length {queue_length}"])
            metric("specjax_running_requests", "gauge", "Requests holding a slot.", [f"specjax_running_requests {running}"])
            metric("specjax_slots", "gauge", "Batch slots (--max-batch).", [f"specjax_slots {slots}"])
            metric("specjax_prompt_tokens_total", "counter", "Prompt tokens admitted.", [f"specjax_prompt_tokens_total {self.prompt_tokens}"])
            metric("specjax_cached_prompt_tokens_total", "counter", "Prompt tokens a slot's cache already held (not prefilled).",
                   [f"specjax_cached_prompt_tokens_total {self.cached_prompt_tokens}"])
            metric("specjax_generated_tokens_total", "counter", "Tokens generated.", [f"specjax_generated_tokens_total {self.generated_tokens}"])
            metric("specjax_tokens_per_second", "gauge", f"Generated tokens per second over the last {self.WINDOW_S:.0f} s.",
                   [f"specjax_tokens_per_second {rate:.3f}"])
            metric("specjax_verifier_calls_total", "counter", "Target verification calls (one per row per decode step).",
                   [f"specjax_verifier_calls_total {int(self.accepted_hist.sum())}"])
            metric("specjax_accepted_drafts_total", "counter", "Verifier calls by number of accepted drafted tokens.",
                   [f'specjax_accepted_drafts_total{{accepted="{k}"}} {int(v)}' for k, v in enumerate(self.accepted_hist)])
            metric("specjax_tau", "gauge", "Tokens emitted per verifier call (the bonus token included), since start.",
                   [f"specjax_tau {self.tau:.4f}"])
            metric("specjax_acceptance_by_position", "gauge", "P(draft position i accepted | position i reached), since start.",
                   [f'specjax_acceptance_by_position{{position="{i + 1}"}} {a:.4f}' for i, a in enumerate(self.acceptance_by_position)])
            for name, hist, help_ in (
                ("specjax_time_to_first_token_seconds", self.ttft, "From arrival to the first generated token."),
                ("specjax_inter_token_latency_seconds", self.itl, "Between generated tokens of a request (per token)."),
                ("specjax_request_latency_seconds", self.latency, "From arrival to the last token."),
                ("specjax_queue_wait_seconds", self.queue_wait, "From arrival to admission into a slot."),
            ):
                metric(name, "histogram", help_, hist.lines(name))
            return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- requests and the scheduler


@dataclasses.dataclass(eq=False)
class GenRequest:
    """One generation request, shared by its handler (event loop) and the scheduler thread."""

    id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # scheduler-side progress
    row: int | None = None
    cached_tokens: int = 0  # prompt tokens its slot's cache held
    done: bool = False
    num_tokens: int = 0
    sent: str = ""
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def groupable(self) -> bool:
        """Admissible together with others: nothing random to reproduce (greedy or unseeded)."""
        return self.seed is None or self.temperature == 0.0

    def deliver(self, event: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


def _state_lost(state) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


class Scheduler:
    """Continuous batching over `max_batch` slots of one engine state, in one thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, options: ServeOptions, metrics: Metrics):
        self.engine, self.tokenizer, self.options, self.metrics = engine, tokenizer, options, metrics
        self.batch = options.max_batch
        self.cond = threading.Condition()
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.cancels: list[tuple[GenRequest, dict | None]] = []
        self.slots: list[GenRequest | None] = [None] * self.batch
        self.accepting = True
        self.stopping = False
        self.rng = np.random.default_rng()
        self.thread: threading.Thread | None = None
        self.eos = set(engine.eos_ids)
        self._reset_state()

    # ---------------------------------------------------------------- called from the handlers

    def submit(self, request: GenRequest) -> None:
        with self.cond:
            if not self.accepting:
                raise ShuttingDown
            if len(self.waiting) >= self.options.max_queue:
                raise QueueFull
            self.waiting.append(request)
            self.cond.notify()

    def cancel(self, request: GenRequest, event: dict | None = None) -> None:
        """Stop a request (client gone, shutdown); its slot is freed before the next decode call."""
        with self.cond:
            if not request.done:
                self.cancels.append((request, event))
                self.cond.notify()

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="specjax-scheduler", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, cancel what is left (queued or running), end the thread."""
        shutdown = error_event(503, "the server is shutting down", "server_error")
        with self.cond:
            self.accepting = False
            for request in list(self.waiting) + [s for s in self.slots if s is not None]:
                self.cancels.append((request, shutdown))
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ---------------------------------------------------------------- the scheduler thread

    def _reset_state(self) -> None:
        b = self.batch
        self.state = self.engine.init_state(b)
        self.seen_hist = np.zeros((b, 2 * self.engine.max_depth + 1), np.int64)  # accepted_hist | reached
        self.temperature, self.top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
        self.top_k, self.min_p = np.zeros(b, np.int32), np.zeros(b, np.float32)
        self.sampling = self._sampling()
        self.slot_used = np.full(b, -np.inf)  # when each slot's last request ended (perf_counter)

    def _sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=jnp.asarray(self.temperature), top_k=jnp.asarray(self.top_k),
            top_p=jnp.asarray(self.top_p), min_p=jnp.asarray(self.min_p),
        )

    def _admissible(self, now: float) -> tuple[bool, float | None]:
        """(whether queued requests can be admitted now, seconds until they can)."""
        if not self.waiting or self.running == self.batch:
            return False, None
        if self.options.schedule == "continuous":
            return True, None
        if self.running:
            return False, None  # static: the whole batch must finish first
        if len(self.waiting) >= self.batch:
            return True, None
        wait = self.waiting[0].arrival + self.options.batch_wait_s - now
        return wait <= 0, max(wait, 0.0)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while True:
                    ready, wait = self._admissible(time.perf_counter())
                    if self.cancels or self.running or ready or (self.stopping and not self.waiting):
                        break
                    self.cond.wait(wait)
                cancels, self.cancels = self.cancels, []
                if self.stopping and not self.running and not self.waiting and not cancels:
                    return
            try:
                self._iteration(cancels)
            except Exception as error:  # never let the thread die: fail the batch, start afresh
                log.exception("scheduler iteration failed")
                self._fail_running(f"internal error: {type(error).__name__}: {error}")

    def _iteration(self, cancels) -> None:
        for request, event in cancels:
            self._cancel_now(request, event)
        idle, admitted = self.running == 0, False
        while True:
            with self.cond:
                ready, _ = self._admissible(time.perf_counter())
                group = self._pop_group() if ready else []
            if not group:
                break
            self._admit(group)
            admitted = True
            if not idle and self.options.schedule == "continuous":
                break  # one admission between decode calls: the running rows keep streaming
        if self.running:
            # Right after an admission one step only, so the new request's first token streams at once.
            steps = 1 if admitted else self.options.steps_per_sync
            self.state = self.engine.decode(self.state, self.sampling, steps, refills=self.options.schedule == "continuous")
            self._collect()

    def _pop_group(self) -> list[GenRequest]:
        """The head of the queue: a seeded sampled request alone (its seed is its random stream),
        else the run of greedy / unseeded requests after it, up to the free slots."""
        free = self.batch - self.running
        group = [self.waiting.popleft()]
        if group[0].groupable:
            while self.waiting and len(group) < free and self.waiting[0].groupable:
                group.append(self.waiting.popleft())
        return group

    def warmup(self) -> None:
        """Compile everything a request can need: the batch's functions and the one-row admission."""
        self.engine.warmup(self.batch, refills=True)

    def _seed(self, request: GenRequest) -> int:
        return request.seed if not request.groupable else int(self.rng.integers(0, 2**32 - 1))

    def _admit(self, group: list[GenRequest]) -> None:
        """Prefill `group` into free slots: a whole batch in one admission, fewer one row at a time
        (each number of rows admitted at once compiles once)."""
        if 1 < len(group) < self.batch:
            for request in group:
                self._admit([request])
            return
        reuse = self.options.prefix_reuse and self.engine.reuses_prefixes and group[0].groupable
        try:
            rows, kept = self._rows_for(group, reuse)
            if len(group) == self.batch:  # slots in order: a whole-batch admission, not a permuted placement (which compiles again)
                rows, group, kept = map(list, zip(*sorted(zip(rows, group, kept), key=lambda t: t[0])))
            prompts, limits = [g.prompt_ids for g in group], [g.max_tokens for g in group]
            self.state = self.engine.admit(self.state, rows, prompts, limits, seed=self._seed(group[0]), reuse_prefix=reuse)
        except Exception as error:
            log.exception("admission failed")
            if _state_lost(self.state):  # it failed after the state was donated: the batch is gone
                self._fail_running(f"internal error while admitting another request: {error}")
            if len(group) > 1:  # find the culprit: admit them one by one
                for request in group:
                    self._admit([request])
            else:
                status = 400 if isinstance(error, ValueError) else 500
                self._finish_error(group[0], status, f"{type(error).__name__}: {error}")
            return
        now = time.perf_counter()
        for row, request, cached in zip(rows, group, kept):
            self.slots[row], request.row, request.cached_tokens = request, row, int(cached)
            self.seen_hist[row] = 0
            self.temperature[row], self.top_p[row] = request.temperature, request.top_p
            self.top_k[row], self.min_p[row] = request.top_k, request.min_p
            self.metrics.observe(self.metrics.queue_wait, now - request.arrival)
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(request.prompt_ids)
                self.metrics.cached_prompt_tokens += int(cached)
        self.sampling = self._sampling()

    def _rows_for(self, group: list[GenRequest], reuse: bool) -> tuple[list[int], list[int]]:
        """Free slots for `group` and the prompt tokens each keeps. In order, each request takes the
        least recently used free slot, unless another keeps at least `reuse_min_gain` tokens more
        of its prompt: then the one that keeps the most (ties to the least recently used). So a
        conversation's next turn finds the slot that served its last, and a new conversation, which
        shares little more than the chat template's opening with any slot, leaves the freshest
        conversations their slots."""
        free = sorted((r for r, s in enumerate(self.slots) if s is None), key=lambda r: (self.slot_used[r], r))
        rows, kept = [], []
        for request in group:
            keeps = self.engine.kept_prefixes(self.state, request.prompt_ids) if reuse else np.zeros(self.batch, np.int64)  # [B]
            best = max(free, key=lambda r: keeps[r])  # the first of the best: the least recently used
            row = best if keeps[best] - keeps[free[0]] >= self.options.reuse_min_gain else free[0]
            free.remove(row)
            rows.append(row)
            kept.append(int(keeps[row]))
        return rows, kept

    def _collect(self) -> None:
        """After a decode call: statistics, new text for every running request, finished rows freed."""
        outputs = self.engine.outputs(self.state)
        active = np.asarray(self.state.active)
        hist = np.concatenate([np.asarray(self.state.accepted_hist), np.asarray(self.state.reached)], 1).astype(np.int64)
        delta = np.maximum(hist - self.seen_hist, 0).sum(0)
        self.seen_hist = hist
        with self.metrics.lock:
            self.metrics.accepted_hist += delta[: self.engine.max_depth + 1]
            self.metrics.reached += delta[self.engine.max_depth + 1 :]
        now = time.perf_counter()
        for row, request in enumerate(self.slots):
            if request is None:
                continue
            try:
                self._advance(request, outputs[row], bool(active[row]), now)
            except Exception as error:  # one request's failure is its own
                log.exception("request %s failed", request.id)
                self._finish_error(request, 500, f"internal error: {type(error).__name__}: {error}")

    def _advance(self, request: GenRequest, tokens: list[int], active: bool, now: float) -> None:
        new = len(tokens) - request.num_tokens
        if new > 0:
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.observe(self.metrics.ttft, now - request.arrival)
            else:
                self.metrics.observe(self.metrics.itl, (now - request.last_token_at) / new, new)
            request.last_token_at, request.num_tokens = now, len(tokens)
            self.metrics.tokens(now, new)
        eos = not active and bool(tokens) and tokens[-1] in self.eos
        text = self.tokenizer.decode(tokens[:-1] if eos else tokens, skip_special_tokens=True)
        reason = None
        if request.stop:
            hits = [i for i in (text.find(s) for s in request.stop) if i >= 0]
            if hits:
                text, reason = text[: min(hits)], "stop"
        if reason is None and not active:
            reason = "stop" if eos else "length"
        if reason is not None:
            self._finish(request, text, reason)
            return
        visible = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for its next token
        for s in request.stop:  # hold back a tail that may be the start of a stop string
            for k in range(min(len(s) - 1, len(visible)), 0, -1):
                if visible.endswith(s[:k]):
                    visible = visible[:-k]
                    break
        if request.stream and len(visible) > len(request.sent):
            request.deliver({"kind": "delta", "text": visible[len(request.sent):]})
            request.sent = visible

    def _usage(self, request: GenRequest) -> dict:
        prompt = len(request.prompt_ids)
        return {
            "prompt_tokens": prompt, "completion_tokens": request.num_tokens, "total_tokens": prompt + request.num_tokens,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
        }

    def _release(self, request: GenRequest) -> None:
        request.done = True
        if request.row is not None:
            row, request.row = request.row, None
            if self.slots[row] is request:
                self.slots[row] = None
                self.slot_used[row] = time.perf_counter()
                self.state = self.state.replace(active=self.state.active.at[row].set(False))

    def _finish(self, request: GenRequest, text: str, reason: str) -> None:
        self._release(request)
        end = request.last_token_at or time.perf_counter()
        self.metrics.observe(self.metrics.latency, end - request.arrival)
        self.metrics.count("completed")
        request.deliver({
            "kind": "done", "text": text, "delta": text[len(request.sent):] if text.startswith(request.sent) else "",
            "finish_reason": reason, "usage": self._usage(request),
        })

    def _finish_error(self, request: GenRequest, status: int, message: str) -> None:
        self._release(request)
        self.metrics.count("error")
        request.deliver(error_event(status, message, "server_error" if status >= 500 else "invalid_request_error"))

    def _cancel_now(self, request: GenRequest, event: dict | None) -> None:
        if request.done:
            return
        if request.row is None:
            with self.cond:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(request)
        self._release(request)
        self.metrics.count("cancelled")
        if event is not None:
            request.deliver(event)

    def _fail_running(self, message: str) -> None:
        if _state_lost(self.state):
            self._reset_state()
        for request in [s for s in self.slots if s is not None]:
            self._finish_error(request, 500, message)


def error_event(status: int, message: str, type_: str) -> dict:
    return {"kind": "error", "status": status, "message": message, "type": type_}


# --------------------------------------------------------------------------- the HTTP API


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 disable (vLLM's and ours)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=common.MAX_SEED)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


def _unsupported(body: _Body) -> None:
    if body.n not in (None, 1):
        raise bad_request(f"n: only n=1 is supported, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported", name)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if getattr(body, "logprobs", None):
        raise bad_request("logprobs are not supported", "logprobs")
    for name in ("tools", "echo", "suffix"):
        if getattr(body, name, None):
            raise bad_request(f"{name} is not supported", name)
    if getattr(body, "best_of", None) not in (None, 1):
        raise bad_request("best_of is not supported", "best_of")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise bad_request(f"stop: at most 4 stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: stop strings must not be empty", "stop")
    return stops


def _message_text(message: _Message, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def create_app(engine: Engine, tokenizer: Tokenizer | Any, options: ServeOptions | None = None) -> FastAPI:
    """The server's app around an already-built engine and tokenizer (a `specjax.tokenizer.Tokenizer`
    or a transformers tokenizer). The scheduler starts and stops with the app's lifespan."""
    options = options or ServeOptions()
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer(tokenizer)
    metrics = Metrics(engine.max_depth)
    scheduler = Scheduler(engine, tokenizer, options, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if options.warmup:
            start = time.perf_counter()
            await asyncio.to_thread(scheduler.warmup)
            log.info("compiled for %d slots in %.1f s", options.max_batch, time.perf_counter() - start)
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, options.drain_timeout_s + 10)

    app = FastAPI(title="specjax", lifespan=lifespan)
    app.state.engine, app.state.scheduler, app.state.metrics, app.state.options = engine, scheduler, metrics, options

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        if error.status == 400:
            metrics.count("rejected_invalid")
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {"loc": ("body",), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        metrics.count("rejected_invalid")
        return bad_request(f"{where}: {first.get('msg')}", param).response()

    def check_model(name: str | None) -> None:
        if name is not None and name != options.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{options.model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    def make_request(body: _Body, prompt_ids: list[int], max_tokens: int | None) -> GenRequest:
        _unsupported(body)
        check_model(body.model)
        stops = _stops(body.stop)
        room = engine.max_len - len(prompt_ids) - engine.num_nodes
        if max_tokens is None:
            if room < 1:
                raise bad_request(
                    f"the prompt has {len(prompt_ids)} tokens and leaves no room to generate in the "
                    f"{engine.max_len}-slot cache ({engine.num_nodes} slots go to speculation); shorten the prompt",
                    "messages" if isinstance(body, ChatBody) else "prompt")
            max_tokens = min(options.default_max_tokens, room)
        elif max_tokens > room:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; with max_tokens={max_tokens} (and {engine.num_nodes} slots "
                f"for speculation) it needs {len(prompt_ids) + max_tokens + engine.num_nodes} cache slots, but the "
                f"cache has {engine.max_len}; shorten the prompt or lower max_tokens", "max_tokens")
        try:
            engine.validate([prompt_ids], SamplingParams.make(1), max_tokens)
        except ValueError as error:
            raise bad_request(str(error).replace("prompt 0", "the prompt"), "prompt") from None
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        loop = asyncio.get_running_loop()
        return GenRequest(
            id=uuid.uuid4().hex, prompt_ids=prompt_ids, max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
            min_p=0.0 if body.min_p is None else body.min_p, stop=stops, seed=body.seed,
            stream=bool(body.stream), include_usage=bool(body.stream and (body.stream_options or {}).get("include_usage")),
            loop=loop, events=asyncio.Queue(),
        )

    def submit(request: GenRequest) -> None:
        try:
            scheduler.submit(request)
        except QueueFull:
            metrics.count("rejected_queue_full")
            raise APIError(429, f"the server is at capacity: {scheduler.running} of {options.max_batch} slots busy and "
                                f"{options.max_queue} requests queued; retry later", "rate_limit_error", None,
                           "rate_limit_exceeded") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", "server_error") from None

    async def respond(http: Request, request: GenRequest, kind: str):
        submit(request)
        created, model = int(time.time()), options.model_name
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + request.id
        if request.stream:
            return StreamingResponse(
                _stream(request, rid, created, model, kind), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        event = await _wait(http, request)
        if event["kind"] == "error":
            return APIError(event["status"], event["message"], event["type"]).response()
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": event["text"]}, "logprobs": None,
                      "finish_reason": event["finish_reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": event["text"], "logprobs": None, "finish_reason": event["finish_reason"]}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                "usage": event["usage"], "system_fingerprint": None}

    async def _wait(http: Request, request: GenRequest) -> dict:
        """The request's final event; a client that goes away cancels it."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(request.events.get(), timeout=0.5)
                except TimeoutError:
                    if await http.is_disconnected():
                        scheduler.cancel(request)
                        return error_event(499, "client disconnected", "cancelled")
                    continue
                if event["kind"] in ("done", "error"):
                    return event
        except asyncio.CancelledError:
            scheduler.cancel(request)
            raise

    async def _stream(request: GenRequest, rid: str, created: int, model: str, kind: str):
        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if kind == "chat":
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

        try:
            if kind == "chat":
                yield chunk(None, None, role=True)
            while True:
                event = await request.events.get()
                if event["kind"] == "delta":
                    yield chunk(event["text"], None)
                elif event["kind"] == "done":
                    if event["delta"]:
                        yield chunk(event["delta"], None)
                    yield chunk(None, event["finish_reason"])
                    if request.include_usage:
                        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                        yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                    "usage": event["usage"]})
                    break
                else:
                    yield _sse(APIError(event["status"], event["message"], event["type"]).body())
                    break
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (the response task is cancelled)
            if not request.done:
                scheduler.cancel(request)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)]
        if not tokenizer.hf.chat_template:
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            text = tokenizer.render_chat(messages)
        except Exception as error:  # jinja raises for roles or orders a template does not take
            raise bad_request(f"messages: the chat template refused them ({error})", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(http, make_request(body, encode(text), max_tokens), "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise bad_request(f"prompt: one prompt per request (n=1), got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise bad_request(f"prompt: one prompt per request (n=1), got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        return await respond(http, make_request(body, ids, body.max_tokens), "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": int(metrics.started),
                                            "owned_by": "specjax", "max_model_len": engine.max_len}]}

    @app.get("/health")
    async def health():
        if not scheduler.alive or not scheduler.accepting:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", "running": scheduler.running, "queued": scheduler.queue_length}

    @app.get("/metrics")
    async def metrics_endpoint():
        text = metrics.render(scheduler.queue_length, scheduler.running, options.max_batch)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- running it


class ServerThread:
    """Serve an app with uvicorn in a background thread on a loopback port (tests, load tests).

        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float | None = None):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        timeout = app.state.options.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        # log_config=None: an embedded server leaves the host process's logging as it is (uvicorn's own
        # configuration would shut down every handler there, and some close the streams they write to).
        config = uvicorn.Config(app, log_level="warning", log_config=None, timeout_graceful_shutdown=timeout, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self, timeout: float = 300.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _split_method(argv: list[str]) -> list[str]:
    """Let --method take a spec as bench does ('eagle3:3', 'eagle3:4,2,8'): NAME plus --num-spec / --tree."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg == "--method" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--method="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        name, _, params = value.partition(":")
        out += ["--method", name]
        if params:
            spec = MethodSpec.parse(value)  # a ValueError names a bad spec
            if ("--num-spec" in argv or "--tree" in argv) and params:
                raise ValueError(f"--method {value} already sets the drafted tokens; drop --num-spec / --tree")
            out += ["--tree", ",".join(map(str, spec.tree))] if spec.tree else ["--num-spec", str(spec.num_spec)]
            out += ["--auto"] if spec.adaptive else []
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.parser("python -m infer.serve", __doc__)
    common.add_model_args(parser, matmuls="one")
    common.add_method_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=common.NON_NEGATIVE_INT, default=8000)
    server.add_argument("--max-batch", type=common.POSITIVE_INT, default=8, help="slots decoded together")
    server.add_argument("--max-queue", type=common.NON_NEGATIVE_INT, default=64, help="waiting requests before 429")
    server.add_argument("--steps-per-sync", type=common.POSITIVE_INT, default=4, help="decode steps between streamed updates")
    server.add_argument("--default-max-tokens", type=common.POSITIVE_INT, default=256, help="when a request sets none")
    server.add_argument("--schedule", choices=["continuous", "static"], default="continuous",
                        help="static: admit only when the whole batch has finished (a baseline)")
    server.add_argument("--drain-timeout", type=common.NON_NEGATIVE, default=30.0, help="seconds running requests get on shutdown")
    server.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                        help="prefill every prompt whole (default: keep what a free slot's cache holds of it)")
    server.add_argument("--reuse-min-gain", type=common.NON_NEGATIVE_INT, default=64,
                        help="tokens a free slot must keep beyond the least recently used one's to be chosen over it")
    server.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model file's name)")
    args = parser.parse_args(_split_method(list(sys.argv[1:] if argv is None else argv)))
    args.spec = common.method_spec(args)
    return args


def build_engine(args: argparse.Namespace) -> tuple[Engine, Tokenizer, str]:
    config, params, tokenizer = common.load_target(args)
    drafter = common.build_drafter(args.spec, args, config, params)
    engine = Engine(config, params, drafter, max_len=args.max_len, eos_ids=tokenizer.eos_token_ids, matmuls=args.matmuls)
    from specjax import checkpoints

    path = Path(args.model or checkpoints.default_model_path())
    name = path.name if path.is_dir() else path.name.split(".")[0]
    return engine, tokenizer, name


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine, tokenizer, name = build_engine(args)
    options = ServeOptions(
        model_name=args.served_model_name or name, max_batch=args.max_batch, max_queue=args.max_queue,
        steps_per_sync=args.steps_per_sync, default_max_tokens=args.default_max_tokens, schedule=args.schedule,
        drain_timeout_s=args.drain_timeout, prefix_reuse=args.prefix_reuse,
        reuse_min_gain=args.reuse_min_gain,
    )
    log.info("serving %s with %s, %d slots, %s batching, on http://%s:%d", options.model_name, args.spec.label,
             options.max_batch, options.schedule, args.host, args.port)
    uvicorn.run(create_app(engine, tokenizer, options), host=args.host, port=args.port,
                timeout_graceful_shutdown=args.drain_timeout, log_level="info")


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
