"""Parity of the Llama-family target with transformers on tiny random models, and the forward contract."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax import kv_cache, tree
from specjax.checkpoints import hf
from specjax.kv_cache import KVCache
from specjax.models import eagle3, llama
from specjax.models.attention import attention, dividing_chunk, row_counts
from specjax.models.config import ModelConfig
from specjax.models.dense import dense

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **TINY,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
}
CACHE_LEN = 64
PREFILL_LEN = 16  # every prompt is right-padded to this, so each shape compiles once per family
FEATURE_LAYERS = (2, 1, 0)  # any order; the configured (2, N//2, N-3) repeats layers for N = 3
TAPS = llama.Taps(layer_inputs=FEATURE_LAYERS, final_hidden=True)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every weight random (biases and norms too, so each code path matters)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)


def build(name: str, path) -> tuple[torch.nn.Module, ModelConfig, dict]:
    """A random transformers model of one family, saved and loaded back through our loader."""
    hf_config = FAMILIES[name]()
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    randomize_(model)
    model.save_pretrained(path)
    config, params = hf.load(path)
    return model, config, params


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(torch model, config, float32 params) for each family."""
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama_family(tmp_path_factory):
    """The llama family alone, for the family-independent mechanics."""
    return build("llama", tmp_path_factory.mktemp("llama_only"))


def causal(num_tokens: int) -> np.ndarray:
    return np.tril(np.ones((num_tokens, num_tokens), bool))


# Compile time dominates these tiny models: skip LLVM optimisation (numerics are unaffected).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@partial(jax.jit, static_argnames=("config", "chunk_size"), compiler_options=FAST_COMPILE)
def extend(params, config, tokens, positions, cache, block_mask, num_new, chunk_size=256):
    """Forward a block, write its entries at each row's offset and commit num_new [B] of them."""
    out = llama.forward(
        params, config, tokens, positions, cache, block_mask, taps=TAPS, chunk_size=chunk_size
    )
    return out, kv_cache.append(cache, out.k, out.v, num_new)


def prefill(params, config, tokens: np.ndarray, lengths: np.ndarray):
    """Prompts [B, T <= PREFILL_LEN] (row b valid up to lengths[b]) -> (ForwardOutput over PREFILL_LEN, cache)."""
    batch, num_tokens = tokens.shape
    padded = np.zeros((batch, PREFILL_LEN), np.int32)
    padded[:, :num_tokens] = tokens
    positions = np.broadcast_to(np.arange(PREFILL_LEN, dtype=np.int32), (batch, PREFILL_LEN))
    cache = KVCache.init(config.num_layers, batch, CACHE_LEN, config.num_kv_heads, config.head_dim)
    return extend(params, config, padded, positions, cache, causal(PREFILL_LEN), lengths.astype(np.int32))


def decode(params, config, cache: KVCache, tokens: np.ndarray, chunk_size: int = 256):
    """One token per row at position lengths[b] -> (logits [B, V], cache advanced by one)."""
    tokens = np.asarray(tokens, np.int32)[:, None]
    positions = np.asarray(cache.lengths)[:, None]
    num_new = np.ones(len(tokens), np.int32)
    out, cache = extend(params, config, tokens, positions, cache, causal(1), num_new, chunk_size=chunk_size)
    return np.asarray(out.logits)[:, 0], cache


def random_tokens(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape, dtype=np.int32)


def test_prefill_logits_and_features_match_transformers(family):
    model, config, params = family
    tokens = random_tokens(1, 1, PREFILL_LEN)
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    out, _ = prefill(params, config, tokens, np.array([PREFILL_LEN]))
    np.testing.assert_allclose(out.logits, expected.logits.numpy(), atol=1e-4, rtol=0)
    # The layer-input taps, then the final-normed hidden state (HF's last hidden_states entry).
    hidden = np.concatenate([expected.hidden_states[i].numpy() for i in FEATURE_LAYERS + (-1,)], axis=-1)
    np.testing.assert_allclose(out.features, hidden, atol=1e-4, rtol=0)
    assert out.k.shape == (config.num_layers, 1, PREFILL_LEN, config.num_kv_heads, config.head_dim)


def test_cached_decode_equals_full_forward(family):
    _, config, params = family
    tokens = random_tokens(2, 1, PREFILL_LEN)
    full, _ = prefill(params, config, tokens, np.array([PREFILL_LEN]))
    full_logits = np.asarray(full.logits)
    _, cache = prefill(params, config, tokens[:, :8], np.array([8]))
    for t in range(8, PREFILL_LEN):
        logits, cache = decode(params, config, cache, tokens[:, t])
        np.testing.assert_allclose(logits, full_logits[:, t], atol=1e-5, rtol=0)
    assert int(cache.lengths[0]) == PREFILL_LEN


def test_tree_block_equals_each_root_to_leaf_path(family):
    _, config, params = family
    _, cache = prefill(params, config, random_tokens(3, 1, 6), np.array([6]))
    draft_tree = tree.from_branching(1, [2, 2])  # 7 nodes, 4 leaves, every path 3 nodes long
    num_nodes = draft_tree.num_nodes
    node_tokens = random_tokens(4, 1, num_nodes)
    offset = np.asarray(cache.lengths)[:, None]
    no_commit = np.zeros(1, np.int32)
    tree_out, _ = extend(
        params, config, node_tokens, offset + draft_tree.depths, cache, draft_tree.ancestor_mask(), no_commit
    )
    tree_logits = np.asarray(tree_out.logits)

    # Each path runs as a chain in a block of the same size (one compile): the chain first, then
    # filler entries that see only themselves and are ignored.
    parents = np.asarray(draft_tree.parents[0])
    leaves = sorted(set(range(num_nodes)) - set(parents.tolist()))
    chain_mask = np.eye(num_nodes, dtype=bool)
    chain_mask[:3, :3] = causal(3)
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        chain_tokens = np.concatenate([node_tokens[:, path], node_tokens[:, : num_nodes - 3]], axis=1)
        chain_positions = offset + np.arange(num_nodes)
        chain_out, _ = extend(params, config, chain_tokens, chain_positions, cache, chain_mask, no_commit)
        np.testing.assert_allclose(tree_logits[:, path], np.asarray(chain_out.logits)[:, :3], atol=1e-5, rtol=0)


def test_greedy_32_tokens_equal_transformers_generate(family):
    model, config, params = family
    prompt = random_tokens(5, 1, 7)
    with torch.no_grad():
        expected = model.generate(
            torch.from_numpy(prompt).long(), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 7:].tolist()
    out, cache = prefill(params, config, prompt, np.array([7]))
    generated = [int(np.argmax(out.logits[0, 6]))]
    while len(generated) < 32:
        logits, cache = decode(params, config, cache, np.array([generated[-1]]))
        generated.append(int(np.argmax(logits[0])))
    assert generated == expected


def test_batch_rows_of_different_lengths_equal_each_row_alone(llama_family):
    _, config, params = llama_family
    lengths = np.array([5, 9])
    tokens = random_tokens(6, 2, 9)
    next_tokens = random_tokens(7, 2, 3)
    batch_out, cache = prefill(params, config, tokens, lengths)  # row 0 padded past 5: stale, then overwritten
    batch_steps = [np.asarray(batch_out.logits)[np.arange(2), lengths - 1]]
    for step in range(3):
        logits, cache = decode(params, config, cache, next_tokens[:, step])
        batch_steps.append(logits)
    for row in range(2):
        row_out, row_cache = prefill(params, config, tokens[row : row + 1, : lengths[row]], lengths[row : row + 1])
        np.testing.assert_allclose(batch_steps[0][row], row_out.logits[0, lengths[row] - 1], atol=1e-5, rtol=0)
        for step in range(3):
            logits, row_cache = decode(params, config, row_cache, next_tokens[row : row + 1, step])
            np.testing.assert_allclose(batch_steps[step + 1][row], logits[0], atol=1e-5, rtol=0)


def test_chunked_prefix_equals_whole_buffer_attention(llama_family):
    _, config, params = llama_family
    _, cache = prefill(params, config, random_tokens(8, 2, PREFILL_LEN), np.array([PREFILL_LEN, 11]))
    for step in range(30):  # grow the prefix to 46 and 41 slots: several 8-slot chunks per row
        _, cache = decode(params, config, cache, random_tokens(step, 2))
    block = random_tokens(99, 2)
    chunked, _ = decode(params, config, cache, block, chunk_size=8)
    whole, _ = decode(params, config, cache, block)  # default 256, clipped to the 64-slot buffer
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=0)
    assert dividing_chunk(24, 64) == 16  # a chunk that does not divide the buffer: the widest below it that does
    narrower, _ = decode(params, config, cache, block, chunk_size=24)
    np.testing.assert_allclose(narrower, whole, atol=1e-5, rtol=0)
    _, batch, kv_heads, _, head_dim = cache.k.shape
    q, k_new = jnp.zeros((batch, 1, kv_heads, 1, head_dim)), jnp.zeros((batch, 1, kv_heads, head_dim))
    with pytest.raises(ValueError, match="multiple of chunk_size"):  # attention itself takes only a dividing chunk
        attention(q, k_new, k_new, cache.k, cache.v, 0, cache.lengths, causal(1), 24)


@pytest.mark.parametrize("lengths", [[3, 40, 0, 17, 64, 9, 33, 51, 26], [64] * 9, [0, 0, 5, 0, 0, 0, 0, 0, 0]])
def test_rows_of_different_lengths_attend_like_dense_softmax(lengths):
    """Rows of a batch read only the prefix chunks they reach (quarters of the batch at a time):
    each row equals a dense softmax over its own committed slots and block."""
    batch, num_queries, heads, groups, dim, slots, layer = len(lengths), 3, 2, 2, 4, 64, 1
    rng = np.random.default_rng(sum(lengths))
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k_new, v_new = normal(batch, num_queries, heads, groups, dim), normal(batch, num_queries, heads, dim), normal(batch, num_queries, heads, dim)
    k_cache, v_cache = normal(2, batch, heads, slots, dim), normal(2, batch, heads, slots, dim)
    block_mask = np.tril(np.ones((num_queries, num_queries), bool))
    out = np.asarray(jax.jit(attention, static_argnums=(5, 8))(q, k_new, v_new, k_cache, v_cache, layer, jnp.asarray(lengths), block_mask, 8))
    for b, length in enumerate(lengths):
        keys = np.concatenate([k_cache[layer, b, :, :length], k_new[b].transpose(1, 0, 2)], 1)  # [Hkv, S + T, D]
        values = np.concatenate([v_cache[layer, b, :, :length], v_new[b].transpose(1, 0, 2)], 1)
        scores = np.einsum("thgd,hsd->thgs", q[b], keys) / np.sqrt(dim)  # [T, Hkv, G, S + T]
        visible = np.concatenate([np.ones((num_queries, length), bool), block_mask], 1)[:, None, None, :]
        weights = np.where(visible, np.exp(scores - scores.max(-1, keepdims=True)), 0.0)
        expected = np.einsum("thgs,hsd->thgd", weights / weights.sum(-1, keepdims=True), values)
        np.testing.assert_allclose(out[b], expected, atol=1e-5, rtol=0)
    assert row_counts(batch) == (3, 5, 7, 9) and row_counts(7) == (7,)


def test_prefix_loop_runs_only_over_live_chunks():
    """The prefix loop is a while loop bounded by the lengths, not a loop over the buffer."""
    config = ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    params = jax.eval_shape(partial(llama.init_params, config), jax.random.key(0))
    cache = jax.eval_shape(lambda: KVCache.init(1, 1, 4096, 1, 8))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    forward = partial(llama.forward, config=config, block_mask=causal(1))
    assert "while" in str(jax.make_jaxpr(forward)(params, tokens=tokens, positions=tokens, cache=cache))


def test_bfloat16_runs_and_is_close(llama_family, tmp_path):
    model, config, params32 = llama_family
    model.save_pretrained(tmp_path)
    _, params16 = hf.load(tmp_path, jnp.bfloat16)
    assert params16["layers"][0]["q_proj"].dtype == jnp.bfloat16
    tokens = random_tokens(10, 1, PREFILL_LEN)
    out32, _ = prefill(params32, config, tokens, np.array([PREFILL_LEN]))
    out16, _ = prefill(params16, config, tokens, np.array([PREFILL_LEN]))
    assert out16.logits.dtype == jnp.float32
    logits32, logits16 = np.asarray(out32.logits), np.asarray(out16.logits)
    assert np.max(np.abs(logits16 - logits32)) < 0.05 * np.max(np.abs(logits32))


def test_config_from_hf_reads_families_and_rejects_unsupported():
    llama3 = ModelConfig.from_hf(FAMILIES["llama"]().to_dict())
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 8.0
    assert llama3.rope_theta == 500000.0 and not llama3.attention_bias
    assert ModelConfig.from_hf(FAMILIES["qwen2"]().to_dict()).attention_bias
    qwen3 = ModelConfig.from_hf(FAMILIES["qwen3"]().to_dict())
    assert qwen3.qk_norm and qwen3.tie_word_embeddings
    windowed = ModelConfig.from_hf(transformers.MistralConfig(**TINY, sliding_window=128).to_dict())
    assert windowed.max_position_embeddings == 128
    # The transformers-4 format: rope_theta and rope_scaling at the top level.
    old = {**TINY, "model_type": "llama", "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(ValueError, match="linear"):
        ModelConfig.from_hf(old)
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf({**TINY, "model_type": "gpt2"})
    assert eagle3.feature_layers(30) == (2, 15, 27)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_dense_has_the_values_and_gradients_of_a_matmul(dtype, atol):
    x = jax.random.normal(jax.random.key(0), (2, 5, 6), dtype)
    w = jax.random.normal(jax.random.key(1), (6, 3), dtype)
    loss = lambda matmul: lambda x, w: jnp.sum(jnp.sin(matmul(x, w).astype(jnp.float32)))
    np.testing.assert_allclose(dense(x, w).astype(np.float32), (x @ w).astype(np.float32), atol=atol)
    got, want = (jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w) for f in (dense, jnp.matmul))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=atol)
