"""EAGLE-3 draft head: cached forward equals one causal block; draft/target vocabulary maps; taps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache
from specjax.kv_cache import KVCache
from specjax.models import eagle3
from specjax.models.config import Llama3RopeScaling
from specjax.tree import causal_mask

CONFIG = eagle3.Eagle3Config(
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    draft_vocab_size=20,
    target_vocab_size=50,
    rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    ),
)


FORWARD = jax.jit(eagle3.forward, static_argnums=1, static_argnames="chunk_size")


def _inputs(batch, length, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    embeddings = jax.random.normal(keys[0], (batch, length, CONFIG.hidden_size))  # [B, T, H]
    features = jax.random.normal(keys[1], (batch, length, 3 * CONFIG.hidden_size))  # [B, T, 3H]
    return embeddings, features


def _empty_cache(batch, max_len):
    return KVCache.init(1, batch, max_len, CONFIG.num_kv_heads, CONFIG.head_dim)


def test_param_shapes_and_projection():
    params = eagle3.init_params(CONFIG, jax.random.key(0))
    assert {k: v.shape for k, v in params.items()} == CONFIG.param_shapes()
    _, features = _inputs(2, 5)
    assert eagle3.project_features(params, features).shape == (2, 5, CONFIG.hidden_size)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_incremental_decode_matches_block(chunk_size):
    """Prefill 7 tokens, then 3 one-token steps through the cache == one causal block of 10."""
    params = eagle3.init_params(CONFIG, jax.random.key(1))
    batch, length, prefix = 2, 10, 7
    embeddings, features = _inputs(batch, length)
    hidden = eagle3.project_features(params, features)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    causal = causal_mask(length)
    full = FORWARD(
        params, CONFIG, embeddings, hidden, positions, _empty_cache(batch, 16), causal
    )

    cache = _empty_cache(batch, 16)
    out = FORWARD(
        params,
        CONFIG,
        embeddings[:, :prefix],
        hidden[:, :prefix],
        positions[:, :prefix],
        cache,
        causal[:prefix, :prefix],
        chunk_size=chunk_size,
    )
    cache = kv_cache.append(cache, out.k, out.v, jnp.full((batch,), prefix))
    logits = [out.logits]
    for t in range(prefix, length):
        step = FORWARD(
            params,
            CONFIG,
            embeddings[:, t : t + 1],
            hidden[:, t : t + 1],
            positions[:, t : t + 1],
            cache,
            jnp.ones((1, 1), bool),
            chunk_size=chunk_size,
        )
        cache = kv_cache.append(cache, step.k, step.v, jnp.ones((batch,), jnp.int32))
        logits.append(step.logits)
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full.logits, atol=1e-5)
    assert full.logits.shape == (batch, length, CONFIG.draft_vocab_size)
    assert full.hidden.shape == (batch, length, CONFIG.hidden_size)
    assert full.k.shape == (1, batch, length, CONFIG.num_kv_heads, CONFIG.head_dim)


def test_cache_rows_of_different_lengths_ignore_stale_slots():
    """Row 1 has a shorter prefix; garbage past its length must not change its output."""
    params = eagle3.init_params(CONFIG, jax.random.key(2))
    embeddings, features = _inputs(2, 6)
    hidden = eagle3.project_features(params, features)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    cache = _empty_cache(2, 8)
    out = FORWARD(
        params, CONFIG, embeddings[:, :5], hidden[:, :5], positions[:, :5], cache,
        causal_mask(5),
    )
    cache = kv_cache.write(cache, out.k, out.v).replace(lengths=jnp.array([5, 3]))
    noisy = cache.replace(k=cache.k.at[:, 1, :, 3:].set(100.0), v=cache.v.at[:, 1, :, 3:].set(-100.0))  # row 1's stale slots
    query = lambda c: FORWARD(
        params, CONFIG, embeddings[:, 5:], hidden[:, 5:], positions[:, 5:], c, jnp.ones((1, 1), bool),
        chunk_size=4,
    ).logits
    np.testing.assert_allclose(query(cache), query(noisy), atol=1e-6)


def test_draft_vocab_maps():
    target_ids = jnp.array([0, 3, 4, 9, 17])
    vocab = eagle3.DraftVocab.from_target_ids(target_ids, 20)
    np.testing.assert_array_equal(vocab.d2t, [0, 2, 2, 6, 13])
    np.testing.assert_array_equal(jnp.flatnonzero(vocab.t2d), target_ids)
    np.testing.assert_array_equal(vocab.target_ids, target_ids)
    draft_ids = jnp.array([[4, 0], [1, 3]])
    np.testing.assert_array_equal(eagle3.draft_to_target(draft_ids, vocab.d2t), [[17, 0], [3, 9]])


def test_taps_are_the_configs_else_eagle3s_default():
    assert CONFIG.target_taps(30) == (2, 15, 27)
    assert dataclasses.replace(CONFIG, tap_layers=(1, 4, 7)).target_taps(30) == (1, 4, 7)
    with pytest.raises(ValueError, match="three target layers"):
        dataclasses.replace(CONFIG, tap_layers=(1, 4))
