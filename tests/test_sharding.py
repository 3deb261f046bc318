"""Tensor-parallel params and a batch/head-sharded cache give the single-device logits."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from specjax import kv_cache
from specjax.kv_cache import KVCache
from specjax.models import llama, sharding
from specjax.models.config import ModelConfig
from specjax.tree import causal_mask

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (conftest forces 4 CPU devices)")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (sharding.DATA, sharding.MODEL))


def prefill_then_decode(params, cache: KVCache, prompt: jax.Array, next_tokens: jax.Array):
    """Jitted prefill of [B, T] then one decode step; returns both logits."""

    @partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})  # tiny model: compile time dominates
    def run(params, cache):
        num_tokens = prompt.shape[1]
        positions = jnp.broadcast_to(jnp.arange(num_tokens), prompt.shape)
        out = llama.forward(params, CONFIG, prompt, positions, cache, causal_mask(num_tokens))
        cache = kv_cache.append(cache, out.k, out.v, jnp.full((2,), num_tokens))
        step = llama.forward(params, CONFIG, next_tokens, cache.lengths[:, None], cache, jnp.ones((1, 1), bool), chunk_size=8)
        return out.logits, step.logits

    return run(params, cache)


def test_sharded_logits_equal_single_device(mesh):
    params = llama.init_params(CONFIG, jax.random.key(0))
    cache = KVCache.init(CONFIG.num_layers, 2, 32, CONFIG.num_kv_heads, CONFIG.head_dim)
    prompt = jax.random.randint(jax.random.key(1), (2, 12), 0, CONFIG.vocab_size)
    next_tokens = jax.random.randint(jax.random.key(2), (2, 1), 0, CONFIG.vocab_size)

    expected = prefill_then_decode(params, cache, prompt, next_tokens)
    sharded_params = sharding.shard_params(params, CONFIG, mesh)
    sharded_cache = sharding.shard_cache(cache, CONFIG, mesh)
    assert sharded_params["layers"][0]["q_proj"].sharding.spec == P(None, "model")
    assert sharded_params["layers"][0]["o_proj"].sharding.spec == P("model", None)
    assert sharded_cache.k.sharding.spec == P(None, "data", "model", None, None)
    actual = prefill_then_decode(sharded_params, sharded_cache, prompt, next_tokens)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_indivisible_dimensions_stay_replicated(mesh):
    odd = ModelConfig(vocab_size=131, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=3, num_kv_heads=1, head_dim=16)
    specs = sharding.param_specs(odd, mesh)
    assert specs["embed_tokens"] == P(None, None)
    assert specs["layers"][0]["q_proj"] == P(None, None)
    assert specs["layers"][0]["gate_proj"] == P(None, "model")
    assert sharding.cache_specs(odd, mesh).k == P(None, "data", None, None, None)
