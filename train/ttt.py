"""The EAGLE-3 training-time-test (TTT) loss: the draft unrolled K steps on its own outputs.

Index t of step k stands for the draft's k-th speculative step after the target produced
features f_0..f_t. Step 0 reads (f_t, embed(x_{t+1})) at position t; step k reads (h_{k-1,t},
embed(x_{t+1+k})) at position t + k, where h_{k-1,t} is step k-1's pre-norm output. Every step
predicts the target's distribution at position t + 1 + k (the next token x_{t+2+k}).

Attention at step k: causal over the step-0 keys (u <= t), plus the key that each of the steps
1..k produced at index t -- exactly the cache a chain drafter holds at inference time.

Loss per step: soft cross-entropy against the target distribution restricted to the draft
vocabulary, averaged over positions whose predicted token is a response token and whose target
argmax is in the draft vocabulary; total = sum_k decay^k loss_k. The draft's LM head runs only
on blocks of positions that are in the loss (`masked_head_loss`): on chat data most positions of
a row are prompt, and the head is most of the step's work.
acc_k: fraction of response positions where draft argmax == target argmax (target argmax outside
the draft vocabulary counts as a miss), so prod_{i<=k} acc_i estimates greedy acceptance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import eagle3


def shift_left(x: jax.Array, amount: int) -> jax.Array:
    """x[:, t] <- x[:, t + amount], zero-filled at the end (axis 1)."""
    pad = jnp.zeros((x.shape[0], amount) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, amount:], pad], axis=1)


#: Queries per block of the TTT attention: a block reads only the step-0 keys up to its last query.
ATTENTION_BLOCK = 128


def ttt_attention(
    q: jax.Array, k0: jax.Array, v0: jax.Array, k_diag: list[jax.Array], v_diag: list[jax.Array],
    block: int = ATTENTION_BLOCK,
) -> jax.Array:
    """Causal attention over step-0 keys plus, per query, its own index's keys of later steps.

    q: [B, T, Hq, D]; k0, v0 and each of k_diag, v_diag: [B, T, Hkv, D]. Returns [B, T, Hq, D].
    Head-major inside, query block by query block (the masked upper triangle is mostly never
    computed), with one softmax over the causal and diagonal scores that never concatenates them.
    The causal dots take q, k, v and the softmax weights in q's dtype and accumulate in float32
    (with bfloat16 that is the fast dot of `specjax.models.dense`); the diagonal's few keys per query
    and the softmax run in float32 (XLA:CPU has no bf16 x bf16 -> f32 kernel for the diagonal's
    batched shapes' gradients: it fails at run time).
    """
    batch, length, num_heads, dim = q.shape
    num_kv_heads, dtype = k0.shape[2], q.dtype
    group = num_heads // num_kv_heads
    dot = lambda spec, a, b: jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    heads_major = lambda x: x.astype(dtype).transpose(0, 2, 1, 3)  # [B, T, Hkv, D] -> [B, Hkv, T, D]
    q = (q * dim**-0.5).astype(dtype).reshape(batch, length, num_kv_heads, group, dim)
    q = q.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    k0, v0 = heads_major(k0), heads_major(v0)
    if k_diag:
        keys = jnp.stack([heads_major(k) for k in k_diag], axis=3).astype(jnp.float32)  # [B, Hkv, T, K, D]
        values = jnp.stack([heads_major(v) for v in v_diag], axis=3).astype(jnp.float32)
        diag_scores = jnp.einsum("bkgtd,bktjd->bkgtj", q.astype(jnp.float32), keys)  # [B, Hkv, G, T, K]
    outputs = []
    for start in range(0, length, block):
        stop = min(start + block, length)
        scores = dot("bkgcd,bkud->bkgcu", q[:, :, :, start:stop], k0[:, :, :stop])  # [B, Hkv, G, C, stop]
        causal = jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :]
        scores = jnp.where(causal, scores, -jnp.inf)
        top = scores.max(-1)
        if k_diag:
            top = jnp.maximum(top, diag_scores[:, :, :, start:stop].max(-1))
        top = jax.lax.stop_gradient(top)[..., None]  # any shift gives the same softmax
        weights = jnp.exp(scores - top)
        numerator = dot("bkgcu,bkud->bkgcd", weights, v0[:, :, :stop])  # [B, Hkv, G, C, D]
        denominator = weights.sum(-1)
        if k_diag:
            diag_weights = jnp.exp(diag_scores[:, :, :, start:stop] - top)
            numerator = numerator + jnp.einsum("bkgcj,bkcjd->bkgcd", diag_weights, values[:, :, start:stop])
            denominator = denominator + diag_weights.sum(-1)
        outputs.append(numerator / denominator[..., None])
    out = jnp.concatenate(outputs, axis=3)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, dim).astype(dtype)


def ttt_hidden(
    params: eagle3.Params,
    config: eagle3.Eagle3Config,
    embeddings: jax.Array,
    features: jax.Array,
    num_steps: int,
) -> list[jax.Array]:
    """The draft's output h_out of every TTT step (before its LM head): num_steps arrays [B, T, H].

    embeddings: [B, T, H] target embeddings of the tokens x_0..x_{T-1}.
    features:   [B, T, 3H] target features f_0..f_{T-1}.
    """
    batch, length, _ = embeddings.shape
    hidden = eagle3.project_features(params, features)  # [B, T, H]
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    k_diag, v_diag, outputs = [], [], []
    for step in range(num_steps):
        inputs = shift_left(embeddings, 1 + step)  # [B, T, H] embed(x_{t+1+k})
        q, k, v = eagle3.midlayer_qkv(params, config, inputs, hidden, positions + step)
        if step == 0:
            k0, v0 = k, v
        else:
            k_diag.append(k)
            v_diag.append(v)
        attention = ttt_attention(q, k0, v0, k_diag, v_diag)
        hidden = eagle3.midlayer_hidden(params, config, hidden, attention)
        outputs.append(hidden)
    return outputs


def ttt_logits(params, config, embeddings, features, num_steps: int) -> list[jax.Array]:
    """Draft logits of every TTT step: num_steps arrays [B, T, Vd] float32 (see `ttt_hidden`)."""
    return [eagle3.head_logits(params, config, h) for h in ttt_hidden(params, config, embeddings, features, num_steps)]


#: Positions per block of the draft's LM head in the loss (`masked_head_loss`): fewer scan iterations,
#: each carrying its own residuals, than with blocks of 256 (timed alone on the 2-core Xeon, one step's
#: head loss and gradient took 0.6x the time in bf16 and 0.8x in f32), while skipped blocks still
#: follow the mask.
HEAD_BLOCK = 1024


def masked_head_loss(
    params: eagle3.Params,
    config: eagle3.Eagle3Config,
    hidden: jax.Array,
    target_probs: jax.Array,
    target_top: jax.Array,
    weight: jax.Array,
    offset: int,
    block: int = HEAD_BLOCK,
) -> tuple[jax.Array, jax.Array]:
    """Soft cross-entropy summed, and argmax agreements counted, over the positions where weight holds.

    hidden [B, T, H] draft outputs; target_probs [B, T, Vd] float32 and target_top [B, T] (its
    argmax), computed once for every step (`ttt_loss`); weight [B, T] bool. Position (b, t) is
    scored against the target at (b, t + offset) (weight must be False where t + offset >= T).
    The LM head and the softmax run block by block over the positions sorted loss-first, and a
    block holding none of them is skipped (`lax.cond`, gradients included): their cost follows the
    positions in the loss, not B * T. Returns (f32 sum of cross-entropies, int32 agreements).
    """
    batch, length, width = hidden.shape
    flat = batch * length
    block = min(block, flat)
    num_blocks = -(-flat // block)
    padding = num_blocks * block - flat
    order = jnp.argsort(~weight.reshape(flat), stable=True)  # [B * T] loss positions first
    in_loss = jnp.pad(weight.reshape(flat)[order], (0, padding)).reshape(num_blocks, block)
    order = jnp.pad(order, (0, padding)).reshape(num_blocks, block)
    hidden, target_probs, target_top = hidden.reshape(flat, width), target_probs.reshape(flat, -1), target_top.reshape(flat)

    def scored(index, in_block):
        logits = eagle3.head_logits(params, config, hidden[index])  # [block, Vd]
        target = jnp.minimum(index + offset, flat - 1)  # [block]
        cross_entropy = -jnp.sum(target_probs[target] * jax.nn.log_softmax(logits), axis=-1)  # [block]
        agree = in_block & (jnp.argmax(logits, -1) == target_top[target])
        return jnp.sum(jnp.where(in_block, cross_entropy, 0.0)), jnp.sum(agree, dtype=jnp.int32)

    def one_block(_, xs):
        index, in_block = xs
        skipped = lambda: (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        return None, jax.lax.cond(jnp.any(in_block), lambda: scored(index, in_block), skipped)

    _, (cross_entropy, agree) = jax.lax.scan(one_block, None, (order, in_loss))
    return jnp.sum(cross_entropy), jnp.sum(agree)


def ttt_loss(
    params: eagle3.Params,
    config: eagle3.Eagle3Config,
    embeddings: jax.Array,
    features: jax.Array,
    target_logits: jax.Array,
    in_vocab: jax.Array,
    loss_mask: jax.Array,
    *,
    num_steps: int = 7,
    decay: float = 0.8,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted TTT loss and per-step statistics.

    target_logits: [B, T, Vd] target logits at each position, restricted to the draft vocab.
    in_vocab:      [B, T] bool, the target's (full-vocab) argmax at the position is drafted.
    loss_mask:     [B, T] bool, the token at the position is a response token.
    Returns (loss, stats) with stats of shape [K]: loss (per-step mean CE), and the sums
    loss_sum, correct, weight (positions in the loss), response (positions in acc) for
    accumulating exact averages across batches.
    """
    stats = {name: [] for name in ("loss", "loss_sum", "correct", "weight", "response")}
    total = 0.0
    target_probs = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)  # [B, T, Vd], shared by the steps
    target_top = jnp.argmax(target_logits, axis=-1)  # [B, T]
    for step, hidden in enumerate(ttt_hidden(params, config, embeddings, features, num_steps)):
        response = shift_left(loss_mask, 2 + step)  # [B, T] predicted token is a response token
        weight = response & shift_left(in_vocab, 1 + step)
        loss_sum, correct = masked_head_loss(params, config, hidden, target_probs, target_top, weight, offset=1 + step)
        count = jnp.sum(weight)
        step_loss = loss_sum / jnp.maximum(count, 1)
        total = total + decay**step * step_loss
        for name, value in [
            ("loss", step_loss),
            ("loss_sum", loss_sum),
            ("correct", correct),
            ("weight", count),
            ("response", jnp.sum(response)),
        ]:
            stats[name].append(value.astype(jnp.float32))
    return total, {name: jnp.stack(values) for name, values in stats.items()}


def acceptance_length(acc: jax.Array) -> jax.Array:
    """Simulated greedy acceptance length 1 + sum_k prod_{i<=k} acc_i from acc [K]."""
    return 1.0 + jnp.sum(jnp.cumprod(acc))
