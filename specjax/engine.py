"""Prefill and the jitted decode loop: draft -> verify -> commit, for any drafter.

The contract (docs/architecture.md, "The decode step"): per row b the target cache holds the
committed tokens 0 .. lengths[b]-1 and one pending token sits outside it. The prefill commits
every prompt token but the last, which is the first pending token. Each step the drafter
proposes a tree below the pending token, the target runs once over the tree, the proposal's
rule picks the accepted path and the next pending token, and the commit is a per-row length
update (plus a gather of the accepted path for trees). Rows never wait for each other.

The state and its transitions are public: `init_state`, `admit` (reset rows of a running batch
and prefill new prompts into them) and `decode` (up to k steps on device); `generate` is the host
driver for a fixed batch. Compilation: one prefill-chunk function and one decode loop per
(batch size, cache length, method); prompts are fed in fixed-size chunks and the loop's step
limit is a traced value, so new prompts, lengths, slots or streaming never recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import kv_cache as kv
from specjax import sampling as sampling_lib
from specjax import tree as tree_lib
from specjax import verify
from specjax.drafters import adaptive
from specjax.drafters.autoregressive import Autoregressive
from specjax.drafters.base import Commit, Drafter, PrefillChunk, Proposal, StepContext, run_or_zeros
from specjax.models import block_matmul, llama
from specjax.models.config import ModelConfig


#: Warn when a process holds this share of the memory maps Linux allows it.
MEMORY_MAPS_WARNING = 0.75


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's cap vm.max_map_count), or None off Linux.

    Every compiled executable keeps its kernels in maps (an adaptive SmolLM2 engine adds some
    4-6k per batch size on XLA:CPU), and a compilation past the cap crashes the process."""
    try:
        held = sum(1 for _ in open("/proc/self/maps"))
        return held, int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def _warn_if_short_of_memory_maps() -> None:
    usage = memory_maps()
    if usage and usage[0] > MEMORY_MAPS_WARNING * usage[1]:
        warnings.warn(
            f"this process holds {usage[0]} of the {usage[1]} memory maps Linux allows it (vm.max_map_count); "
            "every compiled engine adds thousands and a compilation past the cap crashes the process: drop "
            "engines no longer used and call jax.clear_caches(), or raise vm.max_map_count",
            ResourceWarning,
            stacklevel=3,
        )


@struct.dataclass
class DecodeState:
    cache: kv.KVCache
    history: jax.Array  # [B, S] prompt + generated tokens; history[b, lengths[b]] is the pending token
    pending: jax.Array  # [B] last sampled token, not yet in the cache
    prompt_lengths: jax.Array  # [B] the row's prompt tokens (its output starts at this position)
    num_generated: jax.Array  # [B] tokens emitted after the prompt
    max_new: jax.Array  # [B] the row's limit of new tokens
    active: jax.Array  # [B] bool, rows still generating
    drafter_state: object
    keys: jax.Array  # [B] each row's random stream; step k of row b uses fold_in(keys[b], k)
    step: jax.Array  # [] decode steps taken
    accepted_hist: jax.Array  # [B, D + 1] verifier calls per accepted-draft count
    reached: jax.Array  # [B, D] verifier calls that verified draft position i
    accept_stats: jax.Array  # [B, C, D, 2] decayed (accepted, tried) per guess class and position (adaptive depth)
    depth: jax.Array  # [] the next step's draft depth, chosen at the end of the step before (-1: choose then)
    steps_by_depth: jax.Array  # [D + 1] the batch's decode steps at each draft depth
    guess: jax.Array  # [B] the drafter's first guess for the next step (`Drafter.first_guess`, adaptive depth)
    guess_class: jax.Array  # [B] its class, 0: no guess


def tokens_per_call(accepted_hist: np.ndarray) -> float:
    """accepted_hist [R, D + 1] verifier calls by drafts accepted -> tokens emitted per call (tau)."""
    counts = np.arange(accepted_hist.shape[-1]) + 1
    return float((accepted_hist * counts).sum() / max(accepted_hist.sum(), 1))


def acceptance_by_position(accepted_hist: np.ndarray, reached: np.ndarray) -> np.ndarray:
    """accepted_hist [R, D + 1], reached [R, D] (calls that verified position i) -> [D]
    P(draft position i accepted | position i verified), pooled over the rows."""
    hist = accepted_hist.sum(0)  # [D + 1]
    accepted = np.cumsum(hist[::-1])[::-1][1:]  # [D] calls with accepted > i
    return accepted / np.maximum(reached.sum(0), 1)


@dataclasses.dataclass
class Stats:
    """Decode statistics of one generate call; rows that finished early stop counting."""

    accepted_hist: np.ndarray  # [B, D + 1] verifier calls by number of accepted drafts
    reached: np.ndarray  # [B, D] verifier calls that verified draft position i
    steps_by_depth: np.ndarray  # [D + 1] the batch's decode steps at each draft depth
    prefill_s: float
    decode_s: float
    tokens: list[list[int]]

    @property
    def calls(self) -> np.ndarray:  # [B] verifier calls per row
        return self.accepted_hist.sum(-1)

    @property
    def tau(self) -> float:
        """Tokens emitted per verifier call over the batch (the bonus/residual token included)."""
        return tokens_per_call(self.accepted_hist)

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """[D] P(draft position i accepted | position i verified), over the batch."""
        return acceptance_by_position(self.accepted_hist, self.reached)

    @property
    def drafting_share(self) -> float:
        """Share of verifier calls that verified any draft (below 1 only for adaptive depth)."""
        return float(self.reached[:, 0].sum() / max(self.accepted_hist.sum(), 1)) if self.reached.size else 0.0

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_generated / max(self.decode_s, 1e-9)


class Engine:
    """Generation for one target model and one drafter (default: plain autoregressive).

    matmuls: how the target's weight matmuls run (`models.block_matmul`): "xla", or "streamed"
    (on XLA:CPU, through a kernel that reads each packed weight once for all rows of a block;
    the drafter's own matmuls follow, `Drafter.with_matmuls`: an EAGLE-3 head's in bfloat16).
    """

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
        matmuls: str = "xla",
    ):
        _warn_if_short_of_memory_maps()  # before this engine compiles anything
        self.drafter = drafter or Autoregressive()
        self.drafter.check_target(config)
        self.config, self.params = config, params
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.attention_chunk = min(attention_chunk, max_len)
        if max_len % self.attention_chunk:
            raise ValueError(f"max_len {max_len} must be a multiple of the attention chunk {self.attention_chunk}")
        self.eos_ids = tuple(config.eos_token_ids if eos_ids is None else eos_ids)
        block_matmul.check(matmuls, params)
        if matmuls == "streamed":  # the kernels read packed weights, the head untied
            self.config, self.params = llama.streamed(config, params)
        self.drafter = self.drafter.with_matmuls(matmuls)
        self.matmuls = matmuls
        self.num_nodes, self.max_depth = self.drafter.num_nodes, self.drafter.max_depth
        self.drafter_params = self.drafter.params
        self._depth_costs: dict[int, jax.Array] = {}  # per batch size, for `decode`
        self._row_axes = self._find_row_axes()
        self._fresh_jit = jax.jit(self._fresh)
        self._prefill_jit = jax.jit(self._prefill_chunk, donate_argnums=2)
        self._place_jit = jax.jit(self._place, donate_argnums=0)
        self._keep_prefix_jit = jax.jit(self._keep_prefix, donate_argnums=0)
        self._reusable_jit = jax.jit(lambda drafter_state: self.drafter.reusable(drafter_state))
        self._decode_jit = jax.jit(self._decode, donate_argnums=2)

    # ----------------------------------------------------------------- traced pieces

    def _target(self, params, tokens, positions, cache, block_mask):
        return llama.forward(
            params, self.config, tokens, positions, cache, block_mask,
            taps=self.drafter.taps, chunk_size=self.attention_chunk, matmuls=self.matmuls,
        )

    def _find_row_axes(self) -> list[int | None]:
        """Per leaf of DecodeState, the axis that holds the batch (None: the shared step counter and depth).

        Found by comparing the shapes of two batch sizes; a drafter state leaf without exactly
        one such axis is refused, since `admit` copies new rows in along it.
        """
        two, three = (jax.eval_shape(lambda b=batch: self.init_state(b)) for batch in (2, 3))
        axes = []
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(two), jax.tree.leaves(three)):
            differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
            name = jax.tree_util.keystr(path)
            if name in (".step", ".depth", ".steps_by_depth"):
                axes.append(None)
            elif len(differ) == 1 and a.ndim == b.ndim:
                axes.append(differ[0])
            else:
                raise ValueError(f"state leaf {name} of shape {a.shape} has no single batch axis (every row's state must be its own)")
        return axes

    def _fresh(self, history, prompt_lengths, max_new, seed) -> DecodeState:
        """A state of R new rows (history [R, S], lengths and limits [R]), active, to be prefilled.

        Their pending token is the prompt's last; row i's random stream is fold_in(key(seed), i).
        """
        state = self.init_state(history.shape[0])
        last = jnp.take_along_axis(history, jnp.maximum(prompt_lengths - 1, 0)[:, None], 1)[:, 0]
        streams = jnp.arange(history.shape[0])
        active = jnp.ones_like(state.active)
        guess, guess_class = state.guess, state.guess_class
        if self.drafter.variants is not None:  # the guess reads the prompt, not the cache
            ctx = StepContext(pending=last, lengths=prompt_lengths - 1, history=history, active=active)
            guess, guess_class = self.drafter.first_guess(ctx)
        return state.replace(
            history=history,
            pending=last,
            prompt_lengths=prompt_lengths,
            max_new=max_new,
            active=active,
            keys=jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), streams),
            guess=guess,
            guess_class=guess_class,
        )

    def _place(self, state: DecodeState, new: DecodeState, rows) -> DecodeState:
        """`state` with its rows [R] replaced by the R rows of `new` (every leaf, along its batch axis)."""
        leaves, treedef = jax.tree.flatten(state)
        placed = [
            old if axis is None else old.at[(slice(None),) * axis + (rows,)].set(row)
            for old, row, axis in zip(leaves, jax.tree.leaves(new), self._row_axes)
        ]
        return jax.tree.unflatten(treedef, placed)

    def _take(self, state: DecodeState, rows) -> DecodeState:
        """The rows [R] of `state` (every leaf along its batch axis)."""
        leaves, treedef = jax.tree.flatten(state)
        taken = [leaf if axis is None else jnp.take(leaf, rows, axis) for leaf, axis in zip(leaves, self._row_axes)]
        return jax.tree.unflatten(treedef, taken)

    def _keep_prefix(self, new: DecodeState, state: DecodeState, rows, kept) -> DecodeState:
        """`new` (R rows) with the caches of `state`'s rows [R] cut back to their first kept [R]
        slots, and what the drafter keeps of those rows' state (`Drafter.keep_prefix`)."""
        held = self._take(state, rows)
        return new.replace(
            cache=held.cache.replace(lengths=kept),
            drafter_state=self.drafter.keep_prefix(new.drafter_state, held.drafter_state, kept),
        )

    def _prefill_chunk(self, params, drafter_params, state: DecodeState, chunk: PrefillChunk) -> DecodeState:
        out = self._target(params, chunk.tokens, chunk.positions, state.cache, tree_lib.causal_mask(chunk.tokens.shape[1]))
        return state.replace(
            cache=kv.append(state.cache, out.k, out.v, chunk.num_valid),
            drafter_state=self.drafter.prefill(drafter_params, state.drafter_state, chunk.replace(features=out.features)),
        )

    def _is_eos(self, tokens: jax.Array) -> jax.Array:
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
        return jnp.any(tokens[..., None] == eos, axis=-1)

    def _verify(self, key, proposal: Proposal, logits, sampling) -> verify.Verdict:
        """The verdict on `proposal` from the target's logits at its nodes [B, N, V]. An all-greedy
        batch needs only each node's argmax (`verify.greedy`, the verdict of every rule's greedy
        rows), so it computes no distribution over the vocabulary."""
        if proposal.rule not in ("rejection", "point_mass"):
            raise ValueError(f"unknown verification rule {proposal.rule!r}")

        def by_rule():
            target_probs = sampling_lib.probs(logits, sampling)  # [B, N, V]
            if proposal.rule == "point_mass":
                return verify.tree(key, proposal.tree, proposal.tokens, target_probs, sampling)
            if proposal.tree.is_chain:
                return verify.chain(key, proposal.tokens[:, 1:], proposal.draft_probs, target_probs, sampling)
            return verify.sampled_tree(key, proposal.tree, proposal.tokens, proposal.draft_probs, target_probs, sampling)

        greedy = lambda: verify.greedy(proposal.tree, proposal.tokens, sampling_lib.argmax(logits))
        return jax.lax.cond(jnp.all(sampling.greedy), greedy, by_rule)

    def _target_over(self, params, cache: kv.KVCache, proposal: Proposal) -> tuple[llama.ForwardOutput, dict]:
        """The target over the proposal's tree (and auxiliary nodes): outputs at the tree's N nodes,
        and {"aux_logits": [B, A, V]} when there are auxiliary nodes."""
        tree = proposal.tree
        tokens, positions = proposal.tokens, cache.lengths[:, None] + tree.depths  # [B, N]
        mask = tree.ancestor_mask()  # [B, N, N]
        if proposal.aux_tokens is None:
            return self._target(params, tokens, positions, cache, mask), {}
        num_nodes, num_aux = tokens.shape[1], proposal.aux_tokens.shape[1]
        tokens = jnp.concatenate([tokens, proposal.aux_tokens], 1)  # [B, N + A]
        positions = jnp.concatenate([positions, cache.lengths[:, None] + proposal.aux_offsets], 1)
        tree_rows = jnp.pad(mask, ((0, 0), (0, 0), (0, num_aux)))  # tree nodes never see auxiliary ones
        out = self._target(params, tokens, positions, cache, jnp.concatenate([tree_rows, proposal.aux_mask], 1))
        features = None if out.features is None else out.features[:, :num_nodes]
        tree_out = llama.ForwardOutput(
            logits=out.logits[:, :num_nodes], k=out.k[:, :, :num_nodes], v=out.v[:, :, :num_nodes], features=features
        )
        return tree_out, {"aux_logits": out.logits[:, num_nodes:]}

    def _draft_and_verify(self, drafter: Drafter, params, drafter_params, state: DecodeState, keys, ctx, sampling):
        """Propose with `drafter`, run the target over the proposal, verify: (drafter state,
        proposal, target outputs at the proposal's nodes, auxiliary outputs, verdict)."""
        draft_key, verify_key = keys
        drafter_state, proposal = drafter.propose(drafter_params, state.drafter_state, draft_key, ctx, sampling)
        out, aux = self._target_over(params, state.cache, proposal)
        verdict = self._verify(verify_key, proposal, out.logits, sampling)
        return drafter_state, proposal, out, aux, verdict

    def _fixed_draft_and_verify(self, params, drafter_params, state: DecodeState, keys, ctx, sampling):
        """`_draft_and_verify` with the drafter itself, under a conditional on any row being active.

        The loop only runs while some row is active, so the zeros branch never runs. The conditional
        confines the step's reads of the cache (the attention loops) to a branch: without it
        XLA:CPU copies the whole cache twice per step before writing it in place
        (docs/architecture.md, "Two XLA:CPU pitfalls"; `scripts/xla_cpu_pitfalls.py`)."""
        run = lambda: self._draft_and_verify(self.drafter, params, drafter_params, state, keys, ctx, sampling)
        return run_or_zeros(jnp.any(state.active), run)

    def _adaptive_draft_and_verify(self, params, drafter_params, state: DecodeState, keys, ctx, sampling, depth):
        """`_draft_and_verify` at `depth`: one `lax.switch` branch per depth, each returning only
        its chain padded to the deepest (tokens, K/V, taps, verdict), so the caches are read inside
        the switch but never carried through it (no copies)."""
        width = self.max_depth + 1

        def branch(variant: Drafter):
            def run():
                _, proposal, out, _, verdict = self._draft_and_verify(variant, params, drafter_params, state, keys, ctx, sampling)
                pad = width - proposal.tokens.shape[1]
                grow = lambda x, axis: None if x is None else jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])
                out = out.replace(logits=None, k=grow(out.k, 2), v=grow(out.v, 2), features=grow(out.features, 1))
                return grow(proposal.tokens, 1), out, verdict.accepted, verdict.next_token
            return run

        tokens, out, accepted, next_token = jax.lax.switch(depth, [branch(v) for v in self.drafter.variants])
        positions = jnp.arange(width)  # a chain's path runs down to the accepted draft
        verdict = verify.Verdict(
            accepted=accepted, next_token=next_token,
            path=jnp.minimum(positions[None, :], accepted[:, None]), accepted_at=positions[None, :-1] < accepted[:, None],
        )
        proposal = Proposal(tree=tree_lib.chain(tokens.shape[0], self.max_depth), tokens=tokens)
        return state.drafter_state, proposal, out, {}, verdict

    def _step(self, params, drafter_params, state: DecodeState, sampling, depth_costs, refills) -> DecodeState:
        # Per-row keys, advanced by the row's own verifier calls: a row's draws do not depend on
        # its slot, its batch or the step at which it was admitted.
        keys = jax.vmap(jax.random.fold_in)(state.keys, state.accepted_hist.sum(-1))  # [B]
        keys = jax.vmap(jax.random.split, out_axes=1)(keys)  # [2, B]: drafting, verifying
        cache = state.cache
        ctx = StepContext(pending=state.pending, lengths=cache.lengths, history=state.history, active=state.active)
        adaptive_depth = self.drafter.variants is not None
        if adaptive_depth:
            guess, guess_class = state.guess, state.guess_class  # [B], [B] found at the end of the step before
            # Chosen at the end of the step before; only a fresh batch (-1) chooses here.
            depth = jax.lax.cond(
                state.depth >= 0,
                lambda: state.depth,
                lambda: self._choose_depth(
                    state.accept_stats, guess_class, state.active, state.max_new - state.num_generated, depth_costs, refills
                ),
            )
            drafter_state, proposal, out, aux, verdict = self._adaptive_draft_and_verify(
                params, drafter_params, state, keys, ctx, sampling, depth
            )
        else:
            depth = self.max_depth
            drafter_state, proposal, out, aux, verdict = self._fixed_draft_and_verify(
                params, drafter_params, state, keys, ctx, sampling
            )

        accepted = jnp.where(state.active, verdict.accepted, 0)  # [B]
        emitted = verify.emitted_tokens(verdict, proposal.tokens)  # [B, D + 1], -1 past the end
        emitted = jnp.where(state.active[:, None], emitted, -1)
        num_committed = jnp.where(state.active, accepted + 1, 0)
        valid = emitted >= 0  # [B, D + 1]
        num_generated = state.num_generated + num_committed
        hit_eos = jnp.any(self._is_eos(emitted) & valid, axis=1)
        active = state.active & ~hit_eos & (num_generated < state.max_new)
        pending = jnp.where(state.active, verdict.next_token, state.pending)
        offsets = jnp.arange(emitted.shape[1])  # [D + 1]
        slots = jnp.where(valid, ctx.lengths[:, None] + 1 + offsets, self.max_len)  # out of range: dropped
        history = state.history.at[jnp.arange(emitted.shape[0])[:, None], slots].set(emitted, mode="drop")
        accept_stats, next_depth, next_guess, next_class = state.accept_stats, state.depth, state.guess, state.guess_class
        if adaptive_depth:
            accept_stats = adaptive.observe(accept_stats, guess_class, accepted, depth, state.active, guess == verdict.next_token)
            # The next step's depth is chosen now, so that the drafter knows whether it will draft.
            next_ctx = StepContext(pending=pending, lengths=ctx.lengths + num_committed, history=history, active=active)
            next_guess, next_class = self.drafter.first_guess(next_ctx)
            next_depth = self._choose_depth(accept_stats, next_class, active, state.max_new - num_generated, depth_costs, refills)
        commit = Commit(
            accepted=accepted,
            num_committed=num_committed,
            path=verdict.path,
            next_token=verdict.next_token,
            emitted=emitted,
            drafts_next=next_depth > 0,
        )
        # The accepted path's entries into contiguous slots (a chain's already are), then the length update.
        cache = kv.write(cache, out.k, out.v)
        if not proposal.tree.is_chain:
            cache = kv.compact(cache, commit.path)
        cache = kv.commit(cache, commit.num_committed)

        hist_update = jax.nn.one_hot(accepted, self.max_depth + 1, dtype=jnp.int32) * state.active[:, None]
        position = jnp.arange(self.max_depth)  # [D]
        reached = state.active[:, None] & (position < depth) & (position <= accepted[:, None])
        return state.replace(
            cache=cache,
            history=history,
            pending=pending,
            num_generated=num_generated,
            active=active,
            drafter_state=self.drafter.update(drafter_params, drafter_state, ctx, proposal, commit, out.features, **aux),
            step=state.step + 1,
            steps_by_depth=state.steps_by_depth.at[depth].add(1),
            accepted_hist=state.accepted_hist + hist_update,
            reached=state.reached + reached,
            accept_stats=accept_stats,
            depth=next_depth,
            guess=next_guess,
            guess_class=next_class,
        )

    def _choose_depth(self, accept_stats, guess_class, active, remaining, depth_costs, refills) -> jax.Array:
        return adaptive.choose_depth(
            accept_stats, guess_class, active, remaining, depth_costs, refills, self.drafter.drafts_without_guess
        )

    def _decode(self, params, drafter_params, state: DecodeState, sampling, stop_step, depth_costs, refills) -> DecodeState:
        """Decode until every row is done or `stop_step` steps were taken (no host sync inside).

        An adaptive drafter's step runs at the depth `adaptive.choose_depth` picked at the end of
        the step before, from the rows' acceptance so far, depth_costs [D + 1] and whether the
        caller refills finished rows (refills [], traced: both schedules share one compilation)."""
        return jax.lax.while_loop(
            lambda s: jnp.any(s.active) & (s.step < stop_step),
            lambda s: self._step(params, drafter_params, s, sampling, depth_costs, refills),
            state,
        )

    # ----------------------------------------------------------------- state API

    def init_state(self, batch_size: int) -> DecodeState:
        """An empty batch of `batch_size` slots, every row inactive."""
        c = self.config
        dtype = jax.tree.leaves(self.params)[0].dtype
        zeros = lambda: jnp.zeros((batch_size,), jnp.int32)  # distinct buffers: the state is donated
        return DecodeState(
            cache=kv.KVCache.init(c.num_layers, batch_size, self.max_len, c.num_kv_heads, c.head_dim, dtype),
            history=jnp.zeros((batch_size, self.max_len), jnp.int32),
            pending=zeros(),
            prompt_lengths=zeros(),
            num_generated=zeros(),
            max_new=zeros(),
            active=jnp.zeros((batch_size,), bool),
            drafter_state=self.drafter.init_state(batch_size, self.max_len),
            keys=jax.random.split(jax.random.key(0), batch_size),  # replaced by `admit`
            step=jnp.zeros((), jnp.int32),
            accepted_hist=jnp.zeros((batch_size, self.max_depth + 1), jnp.int32),
            reached=jnp.zeros((batch_size, self.max_depth), jnp.int32),
            accept_stats=adaptive.init_stats(batch_size, self.drafter),
            depth=jnp.full((), -1 if self.drafter.variants is not None else self.max_depth, jnp.int32),
            steps_by_depth=jnp.zeros((self.max_depth + 1,), jnp.int32),
            guess=zeros(),
            guess_class=zeros(),
        )

    def admit(
        self,
        state: DecodeState,
        rows: Sequence[int],
        prompts: list[list[int]],
        max_new_tokens,
        seed: int = 0,
        drafter_params=None,
        *,
        reuse_prefix: bool = False,
    ) -> DecodeState:
        """Put `prompts` into the slots `rows` of a (possibly running) batch and prefill them.

        The new rows are prefilled as a batch of their own and copied into their slots (`state` is
        donated); the other rows keep their state and resume with the next `decode`. Prompt i draws
        from the random stream (seed, i), wherever it sits: admitted alone with seed s, a prompt
        samples what `generate([prompt], seed=s)` samples. Prompts and limits are checked first
        (ValueError naming the problem). Each number of rows admitted at once compiles once.

        reuse_prefix: a row keeps the longest prefix of its new prompt that its cache already
        holds (a finished turn's context when the prompt is the conversation's next turn) and only
        the rest is prefilled; the cache is cut back to it by its logical length. A drafter with
        state keeps its own entries of those positions (`Drafter.keep_prefix`) and reads the last
        one again, so a row keeps one position fewer with it. Needs `reuses_prefixes`.
        """
        batch = state.pending.shape[0]
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (len(prompts),))
        self._check_prompts(prompts, max_new)
        rows = list(rows)
        if len(rows) != len(prompts) or len(set(rows)) != len(rows) or not all(0 <= r < batch for r in rows):
            raise ValueError(f"rows {rows} must be {len(prompts)} distinct slots in [0, {batch})")
        drafter_params = self._check_drafter_params(drafter_params)
        if reuse_prefix and not self.reuses_prefixes:
            raise ValueError(
                f"reuse_prefix: the {type(self.drafter).__name__} drafter keeps state of the prompt and cannot keep "
                "a cached prefix of it (Drafter.keeps_prefixes); admit without reuse_prefix"
            )
        count = len(prompts)
        history = np.zeros((count, self.max_len), np.int32)  # [R, S] the new prompts, zero-padded
        lengths = np.array([len(p) for p in prompts], np.int32)  # [R]
        for i, prompt in enumerate(prompts):
            history[i, : len(prompt)] = prompt
        new = self._fresh_jit(*map(jnp.asarray, (history, lengths, max_new)), jnp.uint32(seed))
        prefill_lengths = lengths - 1  # the last prompt token is pending
        kept = self._kept_prefixes(state, rows, history, prefill_lengths) if reuse_prefix else np.zeros(count, np.int32)
        if kept.any():
            new = self._keep_prefix_jit(new, state, jnp.asarray(rows, jnp.int32), jnp.asarray(kept))
        history_dev = jnp.asarray(history)
        for start, chunk in self._prefill_windows(int((prefill_lengths - kept).max())):
            window = np.zeros((count, chunk), np.int32)
            for i, first in enumerate(kept + start):  # row i's window starts past its kept prefix
                tokens = history[i, first : first + chunk]
                window[i, : len(tokens)] = tokens
            new = self._prefill_jit(
                self.params,
                drafter_params,
                new,
                PrefillChunk(
                    tokens=jnp.asarray(window),
                    positions=jnp.asarray(kept[:, None] + start + np.arange(chunk)[None, :]),
                    num_valid=jnp.asarray(np.clip(prefill_lengths - kept - start, 0, chunk).astype(np.int32)),
                    history=history_dev,
                ),
            )
        if rows == list(range(batch)):  # the whole batch: nothing of `state` is kept but its step counts
            return new.replace(step=state.step, steps_by_depth=state.steps_by_depth)
        return self._place_jit(state, new, jnp.asarray(rows, jnp.int32))

    @functools.cached_property
    def _drafter_has_state(self) -> bool:
        return bool(jax.tree.leaves(jax.eval_shape(lambda: self.drafter.init_state(1, self.max_len))))

    @property
    def reuses_prefixes(self) -> bool:
        """Whether `admit` may keep a cached prefix (`reuse_prefix`): the drafter holds no state (n-gram
        lookup and plain decoding read the history alone) or can keep its own (`Drafter.keeps_prefixes`)."""
        return not self._drafter_has_state or self.drafter.keeps_prefixes

    def kept_prefixes(self, state: DecodeState, prompt: list[int]) -> np.ndarray:
        """[B] how many of `prompt`'s first tokens each row would keep, admitted with `reuse_prefix`
        (a scheduler's choice of row for a conversation's next turn)."""
        if not self.reuses_prefixes:
            return np.zeros(state.pending.shape[0], np.int32)
        history = np.zeros((1, self.max_len), np.int32)
        history[0, : len(prompt)] = prompt[: self.max_len]
        rows = np.arange(state.pending.shape[0])
        return self._kept_prefixes(state, rows, history, np.full(len(rows), len(prompt) - 1))

    def _kept_prefixes(self, state: DecodeState, rows, history: np.ndarray, prefill_lengths: np.ndarray) -> np.ndarray:
        """[R] how many of each new prompt's first tokens (history [R or 1, S], up to those it prefills)
        row rows[i] keeps: the common prefix with the row's committed tokens; with a drafter that has
        state one fewer (it reads that position's taps again) and no more than the state holds exactly."""
        rows = np.asarray(rows)
        committed = np.asarray(state.cache.lengths)[rows]  # [R]
        held = np.asarray(state.history)[rows]  # [R, S]
        limit = np.minimum(committed, prefill_lengths)  # [R]
        differs = (held != history) | (np.arange(self.max_len)[None, :] >= limit[:, None])  # [R, S]
        kept = np.argmax(np.pad(differs, ((0, 0), (0, 1)), constant_values=True), axis=1)
        if self._drafter_has_state and kept.any():
            kept = np.maximum(kept - 1, 0)
            reusable = self._reusable_jit(state.drafter_state)  # [B] or None
            kept = kept if reusable is None else np.minimum(kept, np.asarray(reusable)[rows])
        return kept.astype(np.int32)

    def _prefill_windows(self, length: int) -> list[tuple[int, int]]:
        """(start, width) of the prefill chunks over `length` tokens: prefill_chunk wide, but the
        last one only as wide as the smallest power of two (>= 16) that holds the rest, so a short
        prompt or tail does not pay for a full chunk of padding (each width compiles once)."""
        return [(start, self._window_width(length - start)) for start in range(0, length, self.prefill_chunk)]

    def _window_width(self, remaining: int) -> int:
        return min(self.prefill_chunk, max(16, 1 << (remaining - 1).bit_length()))

    def decode(
        self, state: DecodeState, sampling: sampling_lib.SamplingParams, num_steps: int, drafter_params=None, *, refills: bool = False
    ) -> DecodeState:
        """Up to `num_steps` decode steps on device (fewer when every row finishes); donates `state`.

        refills: whether the caller puts a new request into a row's slot as soon as it finishes
        (continuous batching) rather than waiting for the whole batch (static); an adaptive
        drafter prices its draft depth accordingly (`adaptive.choose_depth`)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        drafter_params = self._check_drafter_params(drafter_params)
        batch_size = state.pending.shape[0]
        if batch_size not in self._depth_costs:  # once per batch size: no transfer per decode call
            if self.drafter.variants is None:
                costs = np.ones(1)  # unused
            elif self.drafter.costs is not None:
                costs = self.drafter.costs
            else:
                costs = self.measure_depth_costs(state, sampling, drafter_params)
            self._depth_costs[batch_size] = jnp.asarray(costs, jnp.float32)
        costs = self._depth_costs[batch_size]
        return self._decode_jit(self.params, drafter_params, state, sampling, state.step + num_steps, costs, jnp.asarray(refills))

    def depth_costs(self, batch_size: int) -> jax.Array:
        """[D + 1] step time at each depth relative to depth 0 that an adaptive drafter's steps were
        priced with at this batch size: its own fixed costs, else measured by the first `decode`
        of a batch of this size (`measure_depth_costs`)."""
        if batch_size not in self._depth_costs:
            raise ValueError(f"no depth costs for batch size {batch_size} yet: they are measured by its first decode")
        return self._depth_costs[batch_size]

    def measure_depth_costs(
        self, state: DecodeState, sampling: sampling_lib.SamplingParams, drafter_params=None, steps: int = 6, rounds: int = 5
    ) -> np.ndarray:
        """Whole decode steps (draft, verify, commit, update) of the batch `state` timed at each
        forced depth of an adaptive drafter: [D + 1] seconds per step relative to depth 0.

        Each timing decodes `steps` steps of a copy of `state` (its rows, their contexts and
        sampling: what the engine is about to decode, so what it will pay), with the rows' limits
        lifted so that no row stops for its limit; `state` itself is left as it was. Each round
        times depths 0 .. D and then D .. 0 and divides each depth's time by depth 0's, so a
        machine that speeds up or slows down steadily during the round moves every depth alike;
        the cost is the median over rounds, so one disturbed round does not steer it, made
        non-decreasing in depth (a deeper chain does strictly more work; an inversion is noise).
        Uses the compiled decode loop itself (nothing new compiles)."""
        drafter_params = self._check_drafter_params(drafter_params)
        depths = self.max_depth + 1
        room = self.max_len - int(jnp.max(jnp.where(state.active, state.cache.lengths, 0))) - self.num_nodes
        steps = min(steps, room // depths)
        if steps < 1 or not bool(jnp.any(state.active)):
            raise ValueError(f"cannot time draft depths on this batch: it needs an active row and {depths} free cache slots per step")
        forced = [jnp.asarray(adaptive.forcing_costs(d, self.max_depth)) for d in range(depths)]
        unlimited = state.num_generated + steps * depths  # [B] no row stops for its limit

        def seconds(depth):
            copy = jax.tree.map(jnp.copy, state.replace(max_new=unlimited, depth=jnp.int32(depth)))  # decode donates it
            jax.block_until_ready(copy)
            start = time.perf_counter()
            copy = self._decode_jit(self.params, drafter_params, copy, sampling, copy.step + steps, forced[depth], jnp.asarray(False))
            taken = int(copy.step) - int(state.step)  # fewer where every row met an EOS
            return (time.perf_counter() - start) / taken

        seconds(0)  # compiles the loop for this batch, if nothing has yet
        ratios = []  # [rounds, D + 1]
        for _ in range(rounds):
            forth = [seconds(d) for d in range(depths)]
            back = [seconds(d) for d in reversed(range(depths))][::-1]
            ratios.append([(forth[d] + back[d]) / (forth[0] + back[0]) for d in range(depths)])
        return np.maximum.accumulate(np.median(np.array(ratios), axis=0))

    # ----------------------------------------------------------------- host driver

    def _check_prompts(self, prompts: list[list[int]], max_new: np.ndarray) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if np.any(max_new < 1):
            raise ValueError("max_new_tokens must be >= 1")
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
        sampling.check()
        max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,))
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
        if steps_per_sync is not None and steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {steps_per_sync}")
        t0 = time.perf_counter()
        state = self.admit(self.init_state(len(prompts)), range(len(prompts)), prompts, max_new, seed, drafter_params)
        state.pending.block_until_ready()
        t1 = time.perf_counter()
        max_steps = int(max_new.max())  # every step emits at least one token
        for _ in range(0, max_steps, steps_per_sync or max_steps):
            state = self.decode(state, sampling, steps_per_sync or max_steps, drafter_params)
            if on_step is not None:
                on_step(self.outputs(state))
            if not bool(jnp.any(state.active)):
                break
        tokens = self.outputs(state)
        t2 = time.perf_counter()
        return Stats(
            accepted_hist=np.asarray(state.accepted_hist), reached=np.asarray(state.reached),
            steps_by_depth=np.asarray(state.steps_by_depth),
            prefill_s=t1 - t0, decode_s=t2 - t1, tokens=tokens,
        )

    def profile_step(
        self, prompts: list[list[int]], sampling=None, repeats: int = 20, seed: int = 0
    ) -> dict[str, float]:
        """Median seconds of the pieces of one decode step, after prefilling `prompts` (warm).

        decode: a 1-token target forward; verify: the target over this method's N nodes (and
        auxiliary nodes); draft: one `propose`.
        The pieces are timed round-robin, so a drifting machine load shifts them alike and
        their ratios (c, T_verify / T_decode) stay stable.
        """
        sampling, max_new = self.validate(prompts, sampling, self.max_len - max(map(len, prompts)) - self.num_nodes)
        batch = len(prompts)
        state = self.admit(self.init_state(batch), range(batch), prompts, max_new, seed)

        def target_over(params, state, num_nodes):
            chain = tree_lib.chain(batch, num_nodes - 1)
            tokens = jnp.broadcast_to(state.pending[:, None], (batch, num_nodes))
            positions = state.cache.lengths[:, None] + chain.depths
            return self._target(params, tokens, positions, state.cache, chain.ancestor_mask()).logits

        def draft(params, drafter_params, state):
            ctx = StepContext(state.pending, state.cache.lengths, state.history, state.active)
            keys = jax.random.split(jax.random.key(0), batch)
            return self.drafter.propose(drafter_params, state.drafter_state, keys, ctx, sampling)[1].tokens

        pieces = {
            "decode": (jax.jit(target_over, static_argnums=2), (self.params, state, 1)),
            "verify": (jax.jit(target_over, static_argnums=2), (self.params, state, self.num_nodes + self.drafter.num_aux)),
            "draft": (jax.jit(draft), (self.params, self.drafter_params, state)),
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

    def warmup(self, batch_size: int, *, refills: bool = False) -> float:
        """Compile every function for this batch size, each prefill width included; returns the
        seconds it took. refills: also admitting one row into a running batch (continuous batching),
        keeping a cached prefix where the drafter can (`reuse_prefix`)."""
        start = time.perf_counter()
        self.generate([[0, 0]] * batch_size, max_new_tokens=2)  # two tokens: one to prefill
        shortest = {}  # prefill width -> the fewest prefilled tokens that use it
        for remaining in range(self.prefill_chunk, 0, -1):
            shortest[self._window_width(remaining)] = remaining
        for prefilled in shortest.values():
            if prefilled + 2 + self.num_nodes > self.max_len:
                continue  # no prompt that fits the cache prefills this width
            prompt = [0] * (prefilled + 1)
            state = self.admit(self.init_state(batch_size), range(batch_size), [prompt] * batch_size, 1)
            if refills and batch_size > 1:
                self.admit(self.init_state(batch_size), [0], [prompt], 1)
            if refills and self.reuses_prefixes:  # a row keeping its cached prompt
                self.admit(state, [0], [prompt], 1, reuse_prefix=True)
        return time.perf_counter() - start

    def warmup_prompts(self, prompts: list[list[int]], sampling: sampling_lib.SamplingParams | None = None) -> float:
        """Compile only what `generate(prompts, sampling)` runs (the prefill widths these prompts
        use, the decode step), for a one-shot run; returns the seconds it took."""
        start = time.perf_counter()
        self.generate(prompts, sampling, max_new_tokens=1)  # a prompt may fill the cache but for one token
        return time.perf_counter() - start

    def outputs(self, state: DecodeState) -> list[list[int]]:
        """Every row's generated tokens so far (at most its max_new_tokens, cut after an EOS)."""
        history = np.array(state.history)  # a copy: the state's buffers are donated to the next call
        starts, generated, limits = (np.array(x) for x in (state.prompt_lengths, state.num_generated, state.max_new))
        rows = []
        for row, start in enumerate(starts):
            tokens = history[row, start : start + min(generated[row], limits[row])].tolist()
            for i, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens = tokens[: i + 1]
                    break
            rows.append(tokens)
        return rows
