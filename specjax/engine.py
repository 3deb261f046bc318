"""Prefill and the jitted decode loop: draft -> verify -> commit, for any drafter.

The contract (DESIGN.md, "The decode step"): per row b the target cache holds the committed
tokens 0 .. lengths[b]-1 and one pending token (the last sampled one) sits outside it. Each step
the drafter proposes a tree below the pending token, the target runs once over the tree, the
verifier picks the accepted path and the next pending token, and the commit is a per-row length
update (plus a gather of the accepted path for trees). Rows never wait for each other.

Compilation: one prefill-chunk function and one decode loop per (batch size, cache length,
method). Prompts are fed in fixed-size chunks and the loop's step limit is a traced value, so
new prompts, lengths or streaming never recompile.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import kv_cache as kv
from specjax import sampling as sampling_lib
from specjax import tree as tree_lib
from specjax import verify
from specjax.drafters.base import Drafter, PrefillChunk, Proposal, StepContext
from specjax.models import llama
from specjax.models.config import ModelConfig


@struct.dataclass
class DecodeState:
    cache: kv.KVCache
    history: jax.Array  # [B, S] prompt + generated tokens; history[b, lengths[b]] is the pending token
    pending: jax.Array  # [B] last sampled token, not yet in the cache
    num_generated: jax.Array  # [B] tokens emitted after the prompt (the pending one included)
    active: jax.Array  # [B] bool
    last_logits: jax.Array  # [B, V] target logits at the last prompt token (prefill only)
    drafter_state: object
    key: jax.Array
    step: jax.Array  # [] decode steps taken
    accepted_hist: jax.Array  # [B, D + 1] verifier calls per accepted-draft count


@dataclasses.dataclass
class Stats:
    """Decode statistics of one generate call; rows that finished early stop counting."""

    accepted_hist: np.ndarray  # [B, D + 1] verifier calls by number of accepted drafts
    prefill_s: float
    decode_s: float
    tokens: list[list[int]]

    @property
    def calls(self) -> np.ndarray:  # [B] verifier calls per row
        return self.accepted_hist.sum(-1)

    @property
    def tau(self) -> float:
        """Tokens emitted per verifier call over the batch (the bonus/residual token included)."""
        counts = np.arange(self.accepted_hist.shape[-1]) + 1
        return float((self.accepted_hist * counts).sum() / max(self.accepted_hist.sum(), 1))

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """[D] P(draft position i accepted | position i reached), over the batch."""
        hist = self.accepted_hist.sum(0)  # [D + 1]
        reached = np.cumsum(hist[::-1])[::-1]  # reached[i] = calls with accepted >= i
        return reached[1:] / np.maximum(reached[:-1], 1)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_generated / max(self.decode_s, 1e-9)


class Engine:
    """Batch generation for one target model and one drafter (None: plain autoregressive)."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        drafter: Drafter | None = None,
        *,
        max_len: int = 1024,
        prefill_chunk: int = 128,
        attention_chunk: int = 256,
        eos_ids: tuple[int, ...] | None = None,
    ):
        if drafter is not None:
            drafter.check_target(config)
        self.config, self.params, self.drafter = config, params, drafter
        self.max_len = max_len
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.attention_chunk = min(attention_chunk, max_len)
        if max_len % self.attention_chunk:
            raise ValueError(f"max_len {max_len} must be a multiple of the attention chunk {self.attention_chunk}")
        self.eos_ids = tuple(config.eos_token_ids if eos_ids is None else eos_ids)
        self.num_nodes = drafter.num_nodes if drafter else 1
        self.max_depth = drafter.max_depth if drafter else 0
        self.feature_layers = drafter.feature_layers if drafter else ()
        self.drafter_params = drafter.params if drafter else ()
        self._prefill_jit = jax.jit(self._prefill_chunk, donate_argnums=2)
        self._start_jit = jax.jit(self._start, donate_argnums=0)
        self._decode_jit = jax.jit(self._decode, donate_argnums=2)

    # ----------------------------------------------------------------- traced pieces

    def _target(self, params, tokens, positions, cache, block_mask):
        return llama.forward(
            params,
            self.config,
            tokens,
            positions,
            cache,
            block_mask,
            taps=llama.Taps(layer_inputs=self.feature_layers),
            chunk_size=self.attention_chunk,
        )

    def _prefill_chunk(self, params, drafter_params, state: DecodeState, chunk: PrefillChunk) -> DecodeState:
        size = chunk.tokens.shape[1]
        out = self._target(params, chunk.tokens, chunk.positions, state.cache, jnp.tril(jnp.ones((size, size), bool)))
        cache = kv.commit(kv.write(state.cache, out.k, out.v), chunk.num_valid)
        ends_here = (chunk.num_valid > 0) & (chunk.start + chunk.num_valid == chunk.prompt_lengths)
        last = jnp.take_along_axis(out.logits, jnp.maximum(chunk.num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        drafter_state = state.drafter_state
        if self.drafter is not None:
            drafter_state = self.drafter.prefill(drafter_params, drafter_state, chunk.replace(features=out.features))
        return state.replace(
            cache=cache,
            last_logits=jnp.where(ends_here[:, None], last, state.last_logits),
            drafter_state=drafter_state,
        )

    def _start(self, state: DecodeState, sampling: sampling_lib.SamplingParams, max_new: jax.Array) -> DecodeState:
        """Sample the first token from the prompt's last logits; it becomes the pending token."""
        key, sample_key = jax.random.split(state.key)
        first = sampling_lib.sample(sample_key, sampling_lib.probs(state.last_logits, sampling))  # [B]
        rows = jnp.arange(first.shape[0])
        return state.replace(
            pending=first,
            history=state.history.at[rows, state.cache.lengths].set(first, mode="drop"),
            num_generated=jnp.ones_like(first),
            active=~self._is_eos(first) & (max_new > 1),
            key=key,
        )

    def _is_eos(self, tokens: jax.Array) -> jax.Array:
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
        return jnp.any(tokens[..., None] == eos, axis=-1)

    def _propose(self, drafter_params, state: DecodeState, key, ctx: StepContext, sampling):
        if self.drafter is None:
            batch = ctx.pending.shape[0]
            return state.drafter_state, Proposal(tree=tree_lib.chain(batch, 0), tokens=ctx.pending[:, None])
        return self.drafter.propose(drafter_params, state.drafter_state, key, ctx, sampling)

    def _verify(self, key, proposal: Proposal, target_probs, sampling) -> verify.Verdict:
        if self.drafter is None:
            batch = target_probs.shape[0]
            return verify.Verdict(
                accepted=jnp.zeros((batch,), jnp.int32),
                next_token=sampling_lib.sample(key, target_probs[:, 0]),
                path=jnp.zeros((batch, 1), jnp.int32),
                accepted_at=jnp.zeros((batch, 0), bool),
            )
        if proposal.draft_probs is not None:
            return verify.chain(key, proposal.tokens[:, 1:], proposal.draft_probs, target_probs, sampling)
        return verify.tree(key, proposal.tree, proposal.tokens, target_probs, sampling)

    def _step(self, params, drafter_params, state: DecodeState, sampling, max_new) -> DecodeState:
        key = jax.random.fold_in(state.key, state.step)
        draft_key, verify_key = jax.random.split(key)
        cache = state.cache
        ctx = StepContext(pending=state.pending, lengths=cache.lengths, history=state.history, active=state.active)

        drafter_state, proposal = self._propose(drafter_params, state, draft_key, ctx, sampling)
        tree = proposal.tree
        positions = cache.lengths[:, None] + tree.depths  # [B, N]
        out = self._target(params, proposal.tokens, positions, cache, tree.ancestor_mask())
        target_probs = sampling_lib.probs(out.logits, sampling)  # [B, N, V]
        verdict = self._verify(verify_key, proposal, target_probs, sampling)

        # Commit: the accepted path's entries into contiguous slots, then the length update.
        accepted = jnp.where(state.active, verdict.accepted, 0)  # [B]
        cache = kv.write(cache, out.k, out.v)
        if not _is_chain(proposal):
            cache = kv.compact(cache, verdict.path)
        cache = kv.commit(cache, jnp.where(state.active, accepted + 1, 0))

        # Emitted tokens: the accepted drafts, then the new pending token.
        emitted = verify.emitted_tokens(verdict, proposal.tokens)  # [B, D + 1], -1 past the end
        offsets = jnp.arange(emitted.shape[1])  # [D + 1]
        valid = (offsets <= accepted[:, None]) & state.active[:, None]  # [B, D + 1]
        slots = jnp.where(valid, ctx.lengths[:, None] + 1 + offsets, self.max_len)  # out of range: dropped
        rows = jnp.arange(emitted.shape[0])[:, None]
        history = state.history.at[rows, slots].set(emitted, mode="drop")

        num_generated = state.num_generated + jnp.where(state.active, accepted + 1, 0)
        hit_eos = jnp.any(self._is_eos(emitted) & valid, axis=1)
        active = state.active & ~hit_eos & (num_generated < max_new)
        hist_update = jax.nn.one_hot(accepted, self.max_depth + 1, dtype=jnp.int32) * state.active[:, None]

        if self.drafter is not None:
            drafter_state = self.drafter.update(drafter_params, drafter_state, ctx, proposal, verdict, out.features)
        return state.replace(
            cache=cache,
            history=history,
            pending=jnp.where(state.active, verdict.next_token, state.pending),
            num_generated=num_generated,
            active=active,
            drafter_state=drafter_state,
            step=state.step + 1,
            accepted_hist=state.accepted_hist + hist_update,
        )

    def _decode(self, params, drafter_params, state: DecodeState, sampling, max_new, stop_step) -> DecodeState:
        """Decode until every row is done or `stop_step` steps were taken (no host sync inside)."""
        return jax.lax.while_loop(
            lambda s: jnp.any(s.active) & (s.step < stop_step),
            lambda s: self._step(params, drafter_params, s, sampling, max_new),
            state,
        )

    # ----------------------------------------------------------------- host driver

    def _initial_state(self, history: np.ndarray, key) -> DecodeState:
        c = self.config
        batch = history.shape[0]
        dtype = jax.tree.leaves(self.params)[0].dtype
        return DecodeState(
            cache=kv.KVCache.init(c.num_layers, batch, self.max_len, c.num_kv_heads, c.head_dim, dtype),
            history=jnp.array(history),  # a copy: the state is donated, never alias host memory
            pending=jnp.zeros((batch,), jnp.int32),
            num_generated=jnp.zeros((batch,), jnp.int32),
            active=jnp.zeros((batch,), bool),
            last_logits=jnp.zeros((batch, c.vocab_size), jnp.float32),
            drafter_state=self.drafter.init_state(batch, self.max_len) if self.drafter else (),
            key=key,
            step=jnp.zeros((), jnp.int32),
            accepted_hist=jnp.zeros((batch, self.max_depth + 1), jnp.int32),
        )

    def _check_prompts(self, prompts: list[list[int]], max_new: np.ndarray) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        for row, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {row} is empty")
            if np.any(np.asarray(prompt) >= self.config.vocab_size) or np.any(np.asarray(prompt) < 0):
                raise ValueError(f"prompt {row} has token ids outside the vocabulary [0, {self.config.vocab_size})")
            need = len(prompt) + int(max_new[row]) + self.num_nodes
            if need > self.max_len:
                raise ValueError(
                    f"prompt {row} has {len(prompt)} tokens; with max_new_tokens={int(max_new[row])} and "
                    f"{self.num_nodes} tree nodes per step it needs {need} cache slots, but the cache has "
                    f"{self.max_len} (raise max_len or shorten the prompt)"
                )

    def validate(self, prompts, sampling, max_new_tokens) -> tuple[sampling_lib.SamplingParams, np.ndarray]:
        """Check prompts and limits against the cache (ValueError naming the problem); fill defaults."""
        batch = len(prompts)
        sampling = sampling or sampling_lib.SamplingParams.make(batch)
        if sampling.batch_size != batch:
            raise ValueError(f"sampling params are for {sampling.batch_size} rows, got {batch} prompts")
        max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,))
        if np.any(max_new < 1):
            raise ValueError("max_new_tokens must be >= 1")
        self._check_prompts(prompts, max_new)
        return sampling, max_new

    def _check_drafter_params(self, drafter_params):
        """The drafter's own weights, or replacements with exactly their structure, shapes and dtypes."""
        if drafter_params is None:
            return self.drafter_params

        def leaves(tree):
            return {jax.tree_util.keystr(path): (x.shape, x.dtype) for path, x in jax.tree_util.tree_leaves_with_path(tree)}

        expected, given = leaves(self.drafter_params), leaves(drafter_params)
        for name in sorted(expected.keys() | given.keys()):
            if expected.get(name) != given.get(name):
                raise ValueError(f"drafter_params{name}: expected {expected.get(name)}, got {given.get(name)} (shape, dtype)")
        return drafter_params

    def _prefill(self, prompts, sampling, max_new: np.ndarray, seed: int, drafter_params) -> DecodeState:
        """Run the prompts through the target (and drafter) in fixed-size chunks; sample token 1."""
        batch = len(prompts)
        prompt_lengths = np.array([len(p) for p in prompts], np.int32)
        tokens_np = np.zeros((batch, self.max_len), np.int32)  # [B, S] the prompts, zero-padded
        for row, prompt in enumerate(prompts):
            tokens_np[row, : len(prompt)] = prompt
        state = self._initial_state(tokens_np, jax.random.key(seed))
        chunk = self.prefill_chunk
        for start in range(0, int(prompt_lengths.max()), chunk):
            window = np.zeros((batch, chunk + 1), np.int32)
            end = min(start + chunk + 1, self.max_len)
            window[:, : end - start] = tokens_np[:, start:end]
            state = self._prefill_jit(
                self.params,
                drafter_params,
                state,
                PrefillChunk(
                    tokens=jnp.asarray(window[:, :-1]),
                    next_tokens=jnp.asarray(window[:, 1:]),
                    positions=jnp.asarray(start + np.arange(chunk)[None, :].repeat(batch, 0)),
                    start=jnp.asarray(np.minimum(prompt_lengths, start)),
                    num_valid=jnp.asarray(np.clip(prompt_lengths - start, 0, chunk).astype(np.int32)),
                    prompt_lengths=jnp.asarray(prompt_lengths),
                ),
            )
        state = self._start_jit(state, sampling, jnp.asarray(max_new))
        state.pending.block_until_ready()
        return state

    def generate(
        self,
        prompts: list[list[int]],
        sampling: sampling_lib.SamplingParams | None = None,
        max_new_tokens: int | list[int] = 64,
        seed: int = 0,
        on_step: Callable[[list[list[int]]], None] | None = None,
        steps_per_sync: int | None = None,
        drafter_params=None,
    ) -> Stats:
        """Generate for a batch of token-id prompts; returns tokens (EOS included) and statistics.

        on_step, when given, is called with every row's tokens so far after each chunk of
        `steps_per_sync` decode steps (streaming); otherwise the whole loop runs on device.
        drafter_params replaces the drafter's own weights (same structure, shapes and dtypes, so
        nothing recompiles): a draft being trained is evaluated this way.
        """
        sampling, max_new = self.validate(prompts, sampling, max_new_tokens)
        drafter_params = self._check_drafter_params(drafter_params)
        prompt_lengths = np.array([len(p) for p in prompts], np.int32)
        t0 = time.perf_counter()
        state = self._prefill(prompts, sampling, max_new, seed, drafter_params)
        t1 = time.perf_counter()

        max_new_dev = jnp.asarray(max_new)
        stop = 0
        max_steps = int(max_new.max())  # every step emits at least one token
        while True:
            stop = min(stop + (steps_per_sync or max_steps), max_steps)
            state = self._decode_jit(self.params, drafter_params, state, sampling, max_new_dev, jnp.asarray(stop, jnp.int32))
            if on_step is not None:
                on_step(self._outputs(state, prompt_lengths, max_new))
            if stop >= max_steps or not bool(jnp.any(state.active)):
                break
        tokens = self._outputs(state, prompt_lengths, max_new)
        t2 = time.perf_counter()
        return Stats(
            accepted_hist=np.asarray(state.accepted_hist),
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            tokens=tokens,
        )

    def profile_step(
        self, prompts: list[list[int]], sampling=None, repeats: int = 20, seed: int = 0
    ) -> dict[str, float]:
        """Median seconds of the pieces of one decode step, after prefilling `prompts` (warm).

        decode: a 1-token target forward; verify: the target over this method's N nodes;
        draft: one `propose`; step: one whole decode step (draft, verify, commit, update).
        The pieces are timed round-robin, so a drifting machine load shifts them alike and
        their ratios (c, T_verify / T_decode) stay stable.
        """
        sampling, max_new = self.validate(prompts, sampling, self.max_len - max(map(len, prompts)) - self.num_nodes)
        state = self._prefill(prompts, sampling, max_new, seed, self.drafter_params)
        batch = len(prompts)

        def target_over(params, state, num_nodes):
            chain = tree_lib.chain(batch, num_nodes - 1)
            tokens = jnp.broadcast_to(state.pending[:, None], (batch, num_nodes))
            positions = state.cache.lengths[:, None] + chain.depths
            return self._target(params, tokens, positions, state.cache, chain.ancestor_mask()).logits

        def draft(params, drafter_params, state):
            ctx = StepContext(state.pending, state.cache.lengths, state.history, state.active)
            return self._propose(drafter_params, state, jax.random.key(0), ctx, sampling)[1].tokens

        pieces = {
            "decode": (jax.jit(target_over, static_argnums=2), (self.params, state, 1)),
            "verify": (jax.jit(target_over, static_argnums=2), (self.params, state, self.num_nodes)),
            "draft": (jax.jit(draft), (self.params, self.drafter_params, state)),
            "step": (jax.jit(self._step), (self.params, self.drafter_params, state, sampling, jnp.asarray(max_new))),
        }
        for fn, args in pieces.values():
            jax.block_until_ready(fn(*args))  # compile
        samples: dict[str, list[float]] = {name: [] for name in pieces}
        for _ in range(repeats):
            for name, (fn, args) in pieces.items():
                begin = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples[name].append(time.perf_counter() - begin)
        return {name: float(np.median(times)) for name, times in samples.items()}

    def warmup(self, batch_size: int) -> float:
        """Compile every function for this batch size; returns the seconds it took."""
        start = time.perf_counter()
        self.generate([[0]] * batch_size, max_new_tokens=2)
        return time.perf_counter() - start

    def _outputs(self, state: DecodeState, prompt_lengths, max_new) -> list[list[int]]:
        history = np.array(state.history)  # a copy: the state's buffers are donated to the next call
        generated = np.array(state.num_generated)
        rows = []
        for row, start in enumerate(prompt_lengths):
            count = min(int(generated[row]), int(max_new[row]))
            tokens = history[row, start : start + count].tolist()
            for i, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens = tokens[: i + 1]
                    break
            rows.append(tokens)
        return rows


def _is_chain(proposal: Proposal) -> bool:
    """Static: a chain's accepted path is already contiguous, so it needs no compaction."""
    return proposal.tree.max_depth == proposal.tree.num_nodes - 1
