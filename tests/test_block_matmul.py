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


streamed = jax.jit(lambda x, w: block_matmul.dense(x, w, "streamed"))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 21])  # one group of rows a pass over a panel, several, and a rest
@pytest.mark.parametrize("width, outputs", [(576, 1536), (13, 37), (300, 1030), (7, 32)])  # a partial last panel; one panel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_equals_float64_matmuls_of_the_same_weights(rows, width, outputs, dtype):
    rng = np.random.default_rng(rows * width)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(width, outputs)), dtype)
    want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)  # bfloat16 weights widened exactly
    packed = block_matmul.pack(w)
    assert packed.shape == (width, outputs) and packed.dtype == dtype
    for got in (streamed(x, packed), jax.jit(lambda x, w: block_matmul.head(x, w, "streamed"))(x, packed)):
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_row_gets_the_same_bits_alone_or_in_a_block():
    """Each sum adds the K products in order whatever the number of rows: what greedy speculative
    decoding verifies in a block is bit for bit what plain decoding computes one row at a time."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(21, 300)).astype(np.float32)
    w = block_matmul.pack(jnp.asarray(rng.normal(size=(300, 1030)), jnp.float32))
    block = np.asarray(streamed(x, w))
    for row in (0, 7, 8, 20):
        np.testing.assert_array_equal(np.asarray(streamed(x[row : row + 1], w))[0], block[row])
    np.testing.assert_array_equal(np.asarray(streamed(x[3:7], w)), block[3:7])


def test_packing_keeps_every_weight_in_its_panel():
    w = jnp.arange(7 * 40, dtype=jnp.float32).reshape(7, 40)
    packed = block_matmul.pack(w)
    assert packed.panels.shape == (2, 7, 32)  # ceil(40 / 32) panels of 32 columns
    np.testing.assert_array_equal(packed.panels[0], w[:, :32])
    np.testing.assert_array_equal(packed.panels[1, :, :8], w[:, 32:])
    assert not packed.panels[1, :, 8:].any()  # zero past N
    tree = block_matmul.pack_matrices({"w": w, "scale": jnp.ones(7), "again": packed})
    assert tree["scale"].shape == (7,) and tree["again"] is packed and isinstance(tree["w"], block_matmul.Packed)
    with pytest.raises(ValueError, match="takes a matrix"):
        block_matmul.pack(jnp.ones(3))


def kernel_calls(fn, *args) -> int:
    """Calls of the kernels in the compiled program (nested jits, e.g. the target's layers, inlined)."""
    return jax.jit(fn).lower(*args).compile().as_text().count('custom_call_target="specjax_')


def test_the_weight_layout_must_suit_the_mode():
    w = jnp.ones((16, 24), jnp.float32)
    packed = block_matmul.pack(w)
    for rows in ((1, 1, 16), (1, 4, 16), (3, 3, 16), (64, 16)):  # one row, a block, several rows of a batch
        assert kernel_calls(lambda x: block_matmul.dense(x, packed, "streamed"), jnp.ones(rows)) == 1
    assert kernel_calls(lambda x: block_matmul.dense(x, w, "xla"), jnp.ones((4, 16))) == 0
    with pytest.raises(ValueError, match="takes packed weights"):
        block_matmul.dense(jnp.ones((4, 16)), w, "streamed")
    with pytest.raises(ValueError, match="a packed weight is for block_matmul='streamed'"):
        block_matmul.dense(jnp.ones((4, 16)), packed, "xla")
    with pytest.raises(ValueError, match="float32 rows"):
        block_matmul.dense(jnp.ones((4, 16), jnp.bfloat16), packed, "streamed")
    with pytest.raises(ValueError, match="inner sizes differ"):
        block_matmul.dense(jnp.ones((4, 15)), packed, "streamed")
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
    streamed_config, streamed_params = llama.streamed(config, params)  # what the engine streams
    assert streamed_params["lm_head"].shape == (config.hidden_size, config.vocab_size) and not streamed_config.tie_word_embeddings
    assert streamed_params["embed_tokens"] is params["embed_tokens"]  # a lookup table, as it was
    assert llama.streamed(streamed_config, streamed_params)[1]["lm_head"] is streamed_params["lm_head"]  # packed once
    streamed = forward(streamed_config, "streamed")
    assert kernel_calls(streamed, streamed_params) == 7 * config.num_layers + 1  # q k v o gate up down per layer, the head
    np.testing.assert_allclose(streamed(streamed_params), forward(config, "xla")(params), rtol=0, atol=1e-5)


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
    matrices = {name: w for name, w in head.items() if isinstance(w, block_matmul.Packed)}
    assert {w.dtype for w in matrices.values()} == {jnp.dtype(jnp.bfloat16)} and "fc" in matrices and "lm_head" in matrices
    assert {w.dtype for name, w in head.items() if name not in matrices} == {jnp.dtype(jnp.float32)}  # norms: the activations' dtype
    np.testing.assert_array_equal(head["fc"].panels, block_matmul.pack(drafter.params["head"]["fc"].astype(jnp.bfloat16)).panels)
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


def test_the_commands_make_each_modes_target_once_for_all_their_engines():
    from infer import common

    config = dataclasses.replace(tiny_config(num_layers=2), tie_word_embeddings=True)
    params = llama.init_params(config, jax.random.key(0))
    targets = common.engine_targets(config, params, ["xla", "streamed"])
    assert targets["xla"] == (config, params)  # XLA's engines take the params as loaded
    streamed_config, streamed_params = targets["streamed"]
    assert isinstance(streamed_params["lm_head"], block_matmul.Packed) and not streamed_config.tie_word_embeddings
    engines = [Engine(*targets["streamed"], max_len=64, matmuls="streamed") for _ in range(2)]
    assert all(engine.params["lm_head"] is streamed_params["lm_head"] for engine in engines)  # shared, not packed again
