"""EAGLE-1: the drafter's state, its static tree, exactness at batch 1, the checkpoint layout.

Greedy equality at batch 4 (chain, EAGLE-2 tree, static tree, :auto) and the chi-square at
temperature 1 / top-p run with every other method (test_engine.py, test_engine_sampling.py).
The layout test compares with an independent torch reference: Hugging Face's LlamaDecoderLayer
with its input norm removed (EAGLE's first layer, as vLLM's EagleLlamaForCausalLM builds it).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from engine_helpers import EAGLE1_STATIC_TREE, eagle1_drafter, tiny_config, tiny_params
from specjax.checkpoints import load_model
from specjax.checkpoints.draft_files import read_safetensors, write_safetensors
from specjax.checkpoints.eagle1 import load_eagle1, save_eagle1
from specjax.drafters.base import BuildContext, StepContext
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.kv_cache import KVCache
from specjax.models import eagle1, llama
from specjax.sampling import SamplingParams
from specjax.tree import causal_mask

CONFIG = tiny_config(num_layers=3)
PARAMS = tiny_params(CONFIG, seed=0, scale=30.0)
PROMPTS = [[5, 6, 7, 8, 5, 6], [11, 12, 13], [20, 21, 22, 23, 24, 25, 20], [40]]
TREES = {"chain": dict(depth=3), "eagle2-tree": dict(depth=3, top_k=2, tree_nodes=6), "static-tree": dict(paths=EAGLE1_STATIC_TREE)}


def _layer_over_history(drafter, history: np.ndarray, length: int) -> np.ndarray:
    """From scratch: entry t reads (the target's feature f_t, token t + 1) for t < length; the last output."""
    tokens = jnp.asarray(history[None, : length + 1])
    positions = jnp.arange(length)[None]
    features = llama.forward(PARAMS, CONFIG, tokens[:, :length], positions, None, causal_mask(length), taps=drafter.taps).features
    c = drafter.config
    empty = KVCache.init(1, 1, 64, c.num_kv_heads, c.head_dim)
    out = eagle1.forward(drafter.params["head"], c, PARAMS["embed_tokens"][tokens[:, 1:]], features, positions, empty, causal_mask(length))
    return np.asarray(out.hidden[0, -1])


@pytest.mark.parametrize("tree", sorted(TREES))
def test_state_is_the_layer_run_over_the_committed_history(tree):
    """After prefill and after each step the draft's newest output is what the layer computes
    over the whole committed history with the target's true features (row by row)."""
    drafter = eagle1_drafter(CONFIG, PARAMS, fc_bias=True, **TREES[tree])
    engine = Engine(CONFIG, PARAMS, drafter, max_len=64, eos_ids=())
    state = engine.admit(engine.init_state(3), range(3), PROMPTS[:3], 20)
    sampling = SamplingParams.make(3)
    for _ in range(5):
        history, lengths = np.asarray(state.history), np.asarray(state.cache.lengths)
        for row in range(3):
            expected = _layer_over_history(drafter, history[row], int(lengths[row]))
            np.testing.assert_allclose(state.drafter_state.hidden[row], expected, atol=5e-5, err_msg=f"row {row}")
        state = engine.decode(state, sampling, 1)
    assert int(state.accepted_hist[:, 1:].sum()) > 0  # some drafts were accepted, so paths were read


def _proposal(drafter, seed=3):
    engine = Engine(CONFIG, PARAMS, drafter, max_len=64, eos_ids=())
    state = engine.admit(engine.init_state(2), range(2), PROMPTS[:2], 20)
    ctx = StepContext(pending=state.pending, lengths=state.cache.lengths, history=state.history, active=state.active)
    _, proposal = drafter.propose(drafter.params, state.drafter_state, jax.random.split(jax.random.key(seed), 2), ctx, SamplingParams.make(2))
    return proposal


def test_static_tree_expands_every_rank_path_as_the_dynamic_tree_does():
    """Greedy, two levels of two ranks: the static tree of all six paths is the EAGLE-2 pool of
    depth 2, top-k 2 kept whole (both level-1 nodes expanded), so tokens and topology agree."""
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    static = _proposal(eagle1_drafter(CONFIG, PARAMS, paths=paths))
    dynamic = _proposal(eagle1_drafter(CONFIG, PARAMS, depth=2, top_k=2, tree_nodes=6))
    np.testing.assert_array_equal(static.tokens, dynamic.tokens)
    np.testing.assert_array_equal(static.tree.parents, dynamic.tree.parents)
    chain = _proposal(eagle1_drafter(CONFIG, PARAMS, paths=[(0,), (0, 0), (0, 0, 0)]))
    np.testing.assert_array_equal(chain.tokens, _proposal(eagle1_drafter(CONFIG, PARAMS, depth=3)).tokens)
    assert len({int(t) for t in static.tokens[0, 1:3]}) == 2  # rank 0 and rank 1 differ


@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_batch_of_one_equals_plain_decoding(tree):
    plain = Engine(CONFIG, PARAMS, max_len=64)
    speculative = Engine(CONFIG, PARAMS, eagle1_drafter(CONFIG, PARAMS, **TREES[tree]), max_len=64)
    for prompt in PROMPTS:
        assert speculative.generate([prompt], max_new_tokens=24).tokens == plain.generate([prompt], max_new_tokens=24).tokens


def test_a_static_tree_has_no_adaptive_depth_and_sizes_must_match():
    with pytest.raises(ValueError, match="static EAGLE-1 tree has no adaptive depth"):
        eagle1_drafter(CONFIG, PARAMS, paths=EAGLE1_STATIC_TREE).at_depth(2)
    drafter = eagle1_drafter(CONFIG, PARAMS)
    with pytest.raises(ValueError, match="vocabulary of 96 tokens, the target has 64"):
        drafter.check_target(tiny_config(vocab_size=64))
    with pytest.raises(ValueError, match="hidden size 32 does not match the target's 48"):
        drafter.check_target(tiny_config(hidden_size=48))


# --- checkpoints -----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, DIM, INTER, VOCAB = 32, 4, 2, 8, 48, 50
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    head_dim=DIM, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 4-layer Llama target: the HF model and specjax's load of it."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("target")
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, initializer_range=0.2, **LLAMA)).eval()
    model.save_pretrained(path)
    config, params = load_model(path)
    return model, config, params


def _reference_draft(path, model, seed=0):
    """An EAGLE-reference checkpoint (architecture LlamaForCausalLM, fc with bias, the unused
    input norm and embedding) and the torch layer that serves it."""
    config = LlamaConfig(num_hidden_layers=1, attn_implementation="sdpa", **LLAMA)
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer reads fc's output unnormed
    fc = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=True)
    state = {f"layers.0.{name}": t.detach() for name, t in layer.state_dict().items()}
    state |= {"fc.weight": fc.weight.detach(), "fc.bias": fc.bias.detach(), "layers.0.input_layernorm.weight": torch.ones(HIDDEN)}
    state["embed_tokens.weight"] = model.model.embed_tokens.weight.detach()
    path.mkdir()
    save_file({name: t.contiguous() for name, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, **LLAMA}))
    return layer, fc, LlamaRotaryEmbedding(config)


def test_reference_layout_matches_the_torch_layer(tmp_path, target):
    model, config, params = target
    layer, fc, rotary = _reference_draft(tmp_path / "draft", model)
    tokens = torch.tensor(np.random.default_rng(2).integers(0, VOCAB, (2, 9)))
    with torch.no_grad():
        features = model.model(tokens).last_hidden_state  # after the final norm
        x = fc(torch.cat([model.model.embed_tokens(tokens[:, 1:]), features[:, :-1]], -1))
        positions = torch.arange(8)[None].expand(2, 8)
        predicted = layer(x, position_embeddings=rotary(x, positions), position_ids=positions)
        predicted = predicted[0] if isinstance(predicted, tuple) else predicted
        reference_logits = model.lm_head(predicted)

    spec = MethodSpec.parse("eagle1:3")
    drafter = spec.info.build(spec, BuildContext(config, params, str(tmp_path / "draft"), jnp.float32))
    assert drafter.config.fc_bias and drafter.taps == llama.Taps(final_hidden=True)
    ours = jnp.asarray(features[:, :-1].numpy())
    out = eagle1.forward(
        drafter.params["head"], drafter.config, params["embed_tokens"][tokens[:, 1:].numpy()], ours,
        jnp.broadcast_to(jnp.arange(8), (2, 8)), KVCache.init(1, 2, 16, KV_HEADS, DIM), causal_mask(8),
    )
    np.testing.assert_allclose(out.hidden, predicted.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(drafter._logits(drafter.params, out.hidden), reference_logits.numpy(), rtol=1e-4, atol=1e-4)
    specjax_features = llama.forward(params, config, jnp.asarray(tokens.numpy()), jnp.broadcast_to(jnp.arange(9), (2, 9)), None, causal_mask(9), taps=drafter.taps).features
    np.testing.assert_allclose(specjax_features, features.numpy(), rtol=1e-4, atol=1e-4)  # the tap is the reference's feature


def _saved(tmp_path, dtype=np.float32):
    drafter = eagle1_drafter(CONFIG, PARAMS, fc_bias=False)
    save_eagle1(tmp_path / "draft", drafter.config, drafter.params["head"], dtype=dtype)
    return drafter, tmp_path / "draft"


def test_export_and_import_round_trip_to_identical_logits(tmp_path):
    drafter, path = _saved(tmp_path)
    config, params = load_eagle1(path, target_config=CONFIG)
    assert config == drafter.config
    assert params.keys() == drafter.params["head"].keys()
    for name in params:  # float32 export: bit-identical weights, hence identical logits
        np.testing.assert_array_equal(params[name], drafter.params["head"][name])
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["EagleLlamaForCausalLM"] and raw["num_hidden_layers"] == 1
    assert "fc.bias" not in read_safetensors(path / "model.safetensors")  # vLLM's draft has none


def _rewrite(path, change):
    tensors = read_safetensors(path / "model.safetensors")
    change(tensors)
    write_safetensors(path / "model.safetensors", tensors)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), r"missing tensors \['layers.0.mlp.up_proj.weight'\]"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), r"unexpected tensors \['extra'\]"),
        (lambda t: t.update({"fc.weight": np.zeros((32, 63), np.float32)}), r"'fc.weight' has shape \(32, 63\), expected \(32, 64\)"),
        (lambda t: t.update({"embed_tokens.weight": np.zeros((95, 32), np.float32)}), r"'embed_tokens.weight' has shape \(95, 32\)"),
        (lambda t: t["layers.0.self_attn.q_proj.weight"].__setitem__((0, 0), np.nan), "'layers.0.self_attn.q_proj.weight' holds non-finite values"),
    ],
    ids=["missing", "unexpected", "shape", "embedding-shape", "nan"],
)
def test_bad_checkpoints_are_named(tmp_path, change, message):
    _, path = _saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(ValueError, match=message):
        load_eagle1(path, target_config=CONFIG)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_hidden_layers", 2, "num_hidden_layers=2 is not implemented"),
        ("architectures", ["LlamaForCausalLMEagle3"], "name no EAGLE-1 draft"),
        ("vocab_size", 64, "vocabulary of 64 tokens, the target has 96"),
        ("add_para_norm", True, "add_para_norm=True is not implemented"),
    ],
)
def test_bad_configs_are_named(tmp_path, key, value, message):
    _, path = _saved(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError, match=message):
        load_eagle1(path, target_config=CONFIG)


def test_registry_builds_chains_and_trees_from_a_draft(tmp_path):
    _, path = _saved(tmp_path)
    context = BuildContext(CONFIG, PARAMS, str(path), jnp.float32)
    for text, nodes, depth in [("eagle1:4", 5, 4), ("eagle1:3,2,5", 6, 3), ("eagle1-static:3,2,5", 6, 3), ("eagle1-static", 13, 4)]:
        spec = MethodSpec.parse(text)
        drafter = spec.build(context)
        assert (drafter.num_nodes, drafter.max_depth) == (nodes, depth), text
    with pytest.raises(ValueError, match="only chain methods"):
        MethodSpec.parse("eagle1-static:auto")
