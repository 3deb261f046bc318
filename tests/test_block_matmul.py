"""Streamed block matmuls (models/block_matmul.py): the kernels against float64, where they are used,
the target forward, an EAGLE-3 head and greedy speculative decoding through them, and their errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from engine_helpers import eagle3_drafter, tiny_config, tiny_params
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.ngram_first import NgramFirst
from specjax.engine import Engine
from specjax.models import block_matmul, llama, sharding
from specjax.tree import causal_mask


@pytest.mark.parametrize("rows", range(2, 9))
@pytest.mark.parametrize("width, outputs", [(576, 1536), (13, 37), (300, 1030)])  # tails past 8 lanes, register tiles and row chunks; row parts for two threads
def test_kernels_equal_float64_matmuls(rows, width, outputs):
    rng = np.random.default_rng(rows * width)
    x, w = (rng.normal(size=shape).astype(np.float32) for shape in ((rows, width), (width, outputs)))
    for got in (jax.jit(lambda x, w: block_matmul.dense(x, w, "streamed"))(x, w), jax.jit(lambda x, w: block_matmul.head(x, w, "streamed"))(x, w)):
        want = x.astype(np.float64) @ w
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [*range(1, 9), 13, 64])  # one pass of 1..8 rows; passes of 8 and the rest
@pytest.mark.parametrize("width, outputs", [(576, 1536), (13, 37)])
def test_the_bfloat16_weight_kernel_equals_float64_matmuls_of_the_same_weights(rows, width, outputs):
    rng = np.random.default_rng(rows + width)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(width, outputs)), jnp.bfloat16)
    got = jax.jit(lambda x, w: block_matmul.dense(x, w, "streamed"))(x, w)
    want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)  # the weights widened exactly
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def kernel_calls(fn, *args) -> int:
    """Calls of the kernels in the compiled program (nested jits, e.g. the target's layers, inlined)."""
    return jax.jit(fn).lower(*args).compile().as_text().count('custom_call_target="specjax_')


def test_only_float32_blocks_of_two_to_eight_rows_or_bfloat16_weights_stream():
    w = jnp.ones((16, 24), jnp.float32)
    streamed = lambda x: block_matmul.dense(x, w, "streamed")
    assert kernel_calls(streamed, jnp.ones((1, 4, 16))) == 1  # batch 1, a block of 4
    assert kernel_calls(streamed, jnp.ones((2, 4, 16))) == 1  # 8 rows
    for x in (jnp.ones((1, 1, 16)), jnp.ones((3, 3, 16)), jnp.ones((2, 16), jnp.bfloat16)):  # 1 row, 9 rows, bf16
        assert kernel_calls(streamed, x) == 0
    assert kernel_calls(lambda x: block_matmul.dense(x, w, "xla"), jnp.ones((4, 16))) == 0
    bf16 = w.astype(jnp.bfloat16)  # float32 rows times bfloat16 weights: 1..64 rows, 8 a pass
    for rows, passes in ((1, 1), (8, 1), (13, 2), (64, 8), (65, 0)):
        assert kernel_calls(lambda x: block_matmul.dense(x, bf16, "streamed"), jnp.ones((rows, 16))) == passes
    assert kernel_calls(lambda x: block_matmul.dense(x, bf16, "streamed"), jnp.ones((4, 16), jnp.bfloat16)) == 0
    with pytest.raises(ValueError, match="block_matmul must be one of"):
        block_matmul.dense(jnp.ones((4, 16)), w, "fast")


@pytest.mark.parametrize("tied", [False, True])
def test_the_target_forward_streams_every_weight_matmul_and_agrees(tied):
    config = dataclasses.replace(tiny_config(num_layers=3), tie_word_embeddings=tied)
    params = llama.init_params(config, jax.random.key(0))
    tokens = jnp.asarray([[3, 9, 27, 81 % 96]], jnp.int32)  # [B=1, T=4]
    positions = jnp.arange(4)[None]
    forward = lambda config, matmuls: lambda params: llama.forward(
        params, config, tokens, positions, None, causal_mask(4), matmuls=matmuls
    ).logits
    untied_config, untied_params = llama.with_untied_head(config, params)  # what the engine streams
    assert untied_params["lm_head"].shape == (config.hidden_size, config.vocab_size) and not untied_config.tie_word_embeddings
    streamed = forward(untied_config, "streamed")
    assert kernel_calls(streamed, untied_params) == 7 * config.num_layers + 1  # q k v o gate up down per layer, the head
    np.testing.assert_allclose(streamed(untied_params), forward(config, "xla")(params), rtol=0, atol=1e-5)
    if tied:  # the embedding's [V, H] rows are XLA's to read
        assert kernel_calls(forward(config, "streamed"), params) == 7 * config.num_layers


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_speculative_decoding_through_the_kernels_equals_plain_decoding(tied):
    config = tiny_config(num_layers=4)
    params = tiny_params(config, seed=0, scale=30.0)
    if tied:  # the sharpened head as the embedding too
        config = dataclasses.replace(config, tie_word_embeddings=True)
        params = {name: value for name, value in params.items() if name != "lm_head"} | {"embed_tokens": params["lm_head"].T}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13]]
    plain = [Engine(config, params, max_len=64).generate([p], max_new_tokens=24).tokens[0] for p in prompts]
    for drafter in (eagle3_drafter(config, params, depth=3), NgramDrafter(num_draft=3)):
        stats = Engine(config, params, drafter, max_len=64, matmuls="streamed").generate(prompts, max_new_tokens=24)
        assert stats.tokens == plain and stats.calls.sum() > 0


def test_a_streamed_engine_runs_an_eagle3_head_in_bfloat16_through_the_kernel():
    config = tiny_config(num_layers=4)
    params = tiny_params(config, seed=0, scale=30.0)
    drafter = AdaptiveDepth(NgramFirst(eagle3_drafter(config, params, depth=3)))  # eagle3+ngram:auto3
    engine = Engine(config, params, drafter, max_len=64, matmuls="streamed")
    head = engine.drafter_params["head"]
    assert {w.dtype for w in head.values() if w.ndim == 2} == {jnp.dtype(jnp.bfloat16)}
    assert {w.dtype for w in head.values() if w.ndim == 1} == {jnp.dtype(jnp.float32)}  # norms: the activations' dtype
    np.testing.assert_array_equal(head["fc"], drafter.params["head"]["fc"].astype(jnp.bfloat16))
    assert drafter.params["head"]["fc"].dtype == jnp.float32  # the drafter passed in is left as it was
    assert {v.inner.matmuls for v in engine.drafter.variants} == {"streamed"}  # every depth's n-gram-first variant
    heads = engine.drafter.inner.inner
    features = jnp.ones((1, 1, 3 * config.hidden_size))
    assert kernel_calls(lambda f: heads._logits(engine.drafter_params, heads._project(engine.drafter_params, f)), features) == 2
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13]]
    plain = Engine(config, params, max_len=64).generate(prompts, max_new_tokens=24).tokens
    assert engine.generate(prompts, max_new_tokens=24).tokens == plain


def test_what_cannot_stream_is_named():
    config = tiny_config()
    params = tiny_params(config, seed=0)
    with pytest.raises(ValueError, match="must be one of"):
        Engine(config, params, matmuls="library")
    with pytest.raises(ValueError, match="takes float32 weights here; these are bfloat16"):
        Engine(config, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), matmuls="streamed")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (sharding.DATA, sharding.MODEL))
    sharded = sharding.shard_params(params, config, mesh)
    with pytest.raises(ValueError, match="runs on one device"):
        Engine(config, sharded, matmuls="streamed")


def test_a_missing_compiler_or_a_failed_build_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="'no-such-compiler' is not on PATH"):
        block_matmul.build()
    monkeypatch.delenv("CXX")
    broken = tmp_path / "block_matmul.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(block_matmul, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="building block_matmul.cc failed"):
        block_matmul.build()
    assert [p.name for p in tmp_path.iterdir()] == ["block_matmul.cc"]  # nothing half-built left behind
