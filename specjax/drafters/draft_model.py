"""An independent small draft model that shares the target's tokenizer.

Drafts are *sampled* from the draft's processed distribution p (the same SamplingParams as the
target), so verification uses the rejection rule with exactly that p. The draft keeps its own KV
cache in step with the target: after every commit both hold the same committed tokens.

Invariant at `propose`: the draft cache has valid entries for positions `0 .. lengths-2`. The
entry at `lengths-1` may be missing (the last drafted token is never fed to the draft when
every draft is accepted), so each proposal starts by feeding the 2-token block
[last committed, pending]; recomputing an entry that already exists writes the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import checkpoints
from specjax import kv_cache as kv
from specjax import sampling as sampling_lib
from specjax import tree as tree_lib
from specjax.drafters.base import ChainDrafter, Method, PrefillChunk, Priors, Proposal, StepContext
from specjax.models import llama
from specjax.models.config import ModelConfig


class DraftModelDrafter(ChainDrafter):
    """Chain of `num_draft` tokens sampled from a small Llama-family model."""

    propose_changes_state = True  # the drafted entries are written while drafting

    def __init__(self, config: ModelConfig, params, num_draft: int = 4, chunk_size: int = 256):
        super().__init__(num_draft)
        self.config, self.params, self.chunk_size = config, params, chunk_size

    def check_target(self, target_config: ModelConfig) -> None:
        if target_config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({self.config.vocab_size} tokens) does not match the "
                f"target's ({target_config.vocab_size}); a draft model must share the target tokenizer"
            )

    def init_state(self, batch_size: int, max_len: int) -> kv.KVCache:
        c = self.config
        return kv.KVCache.init(
            c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim, self.params["embed_tokens"].dtype
        )

    def _forward(self, params, cache: kv.KVCache, tokens, positions, block_mask):
        out = llama.forward(params, self.config, tokens, positions, cache, block_mask, chunk_size=self.chunk_size)
        return out.logits, out.k, out.v

    def prefill(self, params, cache: kv.KVCache, chunk: PrefillChunk) -> kv.KVCache:
        causal = tree_lib.causal_mask(chunk.tokens.shape[1])
        _, k, v = self._forward(params, cache, chunk.tokens, chunk.positions, causal)
        return kv.append(cache, k, v, chunk.num_valid)

    keeps_prefixes = True

    def reusable(self, held: kv.KVCache) -> jax.Array:
        return jnp.maximum(held.lengths - 1, 0)  # the invariant above: entry lengths - 1 may be missing

    def keep_prefix(self, fresh: kv.KVCache, held: kv.KVCache, kept: jax.Array) -> kv.KVCache:
        return held.replace(lengths=kept)

    def propose(self, params, cache: kv.KVCache, key, ctx: StepContext, sampling):
        batch = ctx.pending.shape[0]
        start = jnp.maximum(ctx.lengths - 1, 0)  # [B]
        last_committed = ctx.history[jnp.arange(batch), start]
        block = jnp.stack([last_committed, ctx.pending], axis=1)  # [B, 2]
        # [B, 2, 2] causal; with an empty cache (a one-token prompt) block[0] is the pending token
        # itself, which block[1] must not see a second time.
        block_mask = jnp.where((ctx.lengths > 0)[:, None, None], tree_lib.causal_mask(2), jnp.eye(2, dtype=bool))
        positions = start[:, None] + jnp.arange(2)[None, :]
        logits, k, v = self._forward(params, cache.replace(lengths=start), block, positions, block_mask)
        cache = kv.append(cache.replace(lengths=start), k, v, ctx.lengths + 1 - start)  # through the pending token

        def draft_one(carry, step_key):
            cache, logits = carry  # [B, V] at the newest token
            token, probs = sampling_lib.pick(step_key, logits, sampling)  # [B], [B, V]
            logits, k, v = self._forward(params, cache, token[:, None], cache.lengths[:, None], tree_lib.causal_mask(1))
            cache = kv.append(cache, k, v, jnp.ones_like(cache.lengths))
            return (cache, logits[:, 0]), (token, probs)

        keys = jax.vmap(jax.random.split, (0, None), 1)(key, self.num_draft)  # [N, B]: per-row keys
        # The last draft needs no forward of its own; scan over num_draft - 1 and sample it after.
        (cache, last_logits), (tokens, probs_seq) = jax.lax.scan(draft_one, (cache, logits[:, -1]), keys[:-1])
        last_token, last_probs = sampling_lib.pick(keys[-1], last_logits, sampling)
        drafts = jnp.concatenate([tokens.T, last_token[:, None]], axis=1)  # [B, N]
        draft_probs = jnp.concatenate([jnp.swapaxes(probs_seq, 0, 1), last_probs[:, None]], axis=1)  # [B, N, V]
        proposal = Proposal(
            tree=tree_lib.chain(batch, self.num_draft),
            tokens=jnp.concatenate([ctx.pending[:, None], drafts], axis=1),
            draft_probs=draft_probs,
            rule="rejection",
        )
        return cache.replace(lengths=ctx.lengths), proposal

    def update(self, params, cache: kv.KVCache, ctx, proposal, commit, features) -> kv.KVCache:
        # The pending token's and the accepted drafts' entries were written while drafting.
        return kv.commit(cache, commit.num_committed)


def _build(spec, context) -> DraftModelDrafter:
    if context.draft_path is None:
        raise ValueError("--method draft needs --draft PATH (a small model sharing the target's tokenizer)")
    config, params = checkpoints.load_model(context.draft_path, context.dtype)
    return DraftModelDrafter(config, params, num_draft=spec.num_spec)


METHOD = Method(
    "draft",
    "a small draft model sampling a chain (vanilla speculative decoding)",
    build=_build,
    num_spec=4,
    draft="a small model sharing the target's tokenizer (HF directory or .gguf)",
    priors=Priors(
        alpha={"chat": 0.6, "code": 0.65, "structured": 0.65, "long-form": 0.55, "creative": 0.45},
        temperature_decay=0.3,
        draft_cost=0.25,
    ),
    adaptive=False,  # it writes its cache while drafting
)
