"""The EAGLE-3 training-time-test (TTT) loss: the draft unrolled K steps on its own outputs.

Index t of step k stands for the draft's k-th speculative step after the target produced
features f_0..f_t. Step 0 reads (f_t, embed(x_{t+1})) at position t; step k reads (h_{k-1,t},
embed(x_{t+1+k})) at position t + k, where h_{k-1,t} is step k-1's pre-norm output. Every step
predicts the target's distribution at position t + 1 + k (the next token x_{t+2+k}).

Attention at step k: causal over the step-0 keys (u <= t), plus the key that each of the steps
1..k produced at index t -- exactly the cache a chain drafter holds at inference time.

Loss per step: soft cross-entropy against the target distribution restricted to the draft
vocabulary, averaged over positions whose predicted token is a response token and whose target
argmax is in the draft vocabulary; total = sum_k decay^k loss_k.
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


def ttt_attention(
    q: jax.Array, k0: jax.Array, v0: jax.Array, k_diag: list[jax.Array], v_diag: list[jax.Array]
) -> jax.Array:
    """Causal attention over step-0 keys plus, per query, its own index's keys of later steps.

    q: [B, T, Hq, D]; k0, v0 and each of k_diag, v_diag: [B, T, Hkv, D]. Returns [B, T, Hq, D].
    """
    batch, length, num_heads, dim = q.shape
    num_kv_heads = k0.shape[2]
    qg = q.astype(jnp.float32).reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, dim)
    qg = qg * dim**-0.5  # [B, T, Hkv, G, D]
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.einsum("btkgd,bukd->btkgu", qg, k0.astype(jnp.float32))  # [B, T, Hkv, G, T]
    scores = jnp.where(causal[None, :, None, None, :], scores, -jnp.inf)
    if k_diag:
        keys = jnp.stack(k_diag, axis=3).astype(jnp.float32)  # [B, T, Hkv, K, D]
        scores = jnp.concatenate([scores, jnp.einsum("btkgd,btkjd->btkgj", qg, keys)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("btkgu,bukd->btkgd", probs[..., :length], v0.astype(jnp.float32))
    if v_diag:
        values = jnp.stack(v_diag, axis=3).astype(jnp.float32)  # [B, T, Hkv, K, D]
        out = out + jnp.einsum("btkgj,btkjd->btkgd", probs[..., length:], values)
    return out.reshape(batch, length, num_heads, dim).astype(q.dtype)


def ttt_logits(
    params: eagle3.Params,
    config: eagle3.Eagle3Config,
    embeddings: jax.Array,
    features: jax.Array,
    num_steps: int,
) -> list[jax.Array]:
    """Draft logits of every TTT step: num_steps arrays [B, T, Vd] float32.

    embeddings: [B, T, H] target embeddings of the tokens x_0..x_{T-1}.
    features:   [B, T, 3H] target features f_0..f_{T-1}.
    """
    batch, length, _ = embeddings.shape
    hidden = eagle3.project_features(params, features)  # [B, T, H]
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    k_diag, v_diag, all_logits = [], [], []
    for step in range(num_steps):
        inputs = shift_left(embeddings, 1 + step)  # [B, T, H] embed(x_{t+1+k})
        q, k, v = eagle3.midlayer_qkv(params, config, inputs, hidden, positions + step)
        if step == 0:
            k0, v0 = k, v
        else:
            k_diag.append(k)
            v_diag.append(v)
        attention = ttt_attention(q, k0, v0, k_diag, v_diag)
        logits, hidden = eagle3.midlayer_output(params, config, hidden, attention)
        all_logits.append(logits)
    return all_logits


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
    for step, logits in enumerate(ttt_logits(params, config, embeddings, features, num_steps)):
        target = shift_left(target_logits, 1 + step).astype(jnp.float32)  # [B, T, Vd]
        response = shift_left(loss_mask, 2 + step)  # [B, T] predicted token is a response token
        weight = response & shift_left(in_vocab, 1 + step)
        cross_entropy = -jnp.sum(jax.nn.softmax(target) * jax.nn.log_softmax(logits), axis=-1)  # [B, T]
        loss_sum = jnp.sum(jnp.where(weight, cross_entropy, 0.0))
        count = jnp.sum(weight)
        step_loss = loss_sum / jnp.maximum(count, 1)
        total = total + decay**step * step_loss
        correct = weight & (jnp.argmax(logits, -1) == jnp.argmax(target, -1))
        for name, value in [
            ("loss", step_loss),
            ("loss_sum", loss_sum),
            ("correct", jnp.sum(correct)),
            ("weight", count),
            ("response", jnp.sum(response)),
        ]:
            stats[name].append(value.astype(jnp.float32))
    return total, {name: jnp.stack(values) for name, values in stats.items()}


def acceptance_length(acc: jax.Array) -> jax.Array:
    """Simulated greedy acceptance length 1 + sum_k prod_{i<=k} acc_i from acc [K]."""
    return 1.0 + jnp.sum(jnp.cumprod(acc))
