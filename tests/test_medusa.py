"""Medusa-1 heads: static trees, the drafter's state, exactness at batch 1, vLLM's checkpoint layout.

Greedy equality at batch 4 and the chi-square at temperature 1 / top-p run with every other
method (test_engine.py, test_engine_sampling.py).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from engine_helpers import MEDUSA_TREE, medusa_drafter, medusa_heads, tiny_config, tiny_params
from specjax.checkpoints.draft_files import read_safetensors, write_safetensors
from specjax.checkpoints.medusa import load_medusa, save_medusa
from specjax.drafters.base import BuildContext
from specjax.drafters.medusa import MedusaDrafter, chain_paths, tree_paths
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.models import llama, medusa
from specjax.sampling import SamplingParams
from specjax.tree import causal_mask, from_paths

CONFIG = tiny_config(num_layers=3)
PARAMS = tiny_params(CONFIG, seed=0, scale=30.0)
PROMPTS = [[5, 6, 7, 8, 5, 6], [11, 12, 13], [20, 21, 22, 23, 24, 25, 20], [40]]


def test_tree_paths_keep_the_likeliest_paths_parents_first():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.1]]
    paths = tree_paths(3, 3, 6, accuracy)
    # Scores: (0) .6, (1) .2, (0,0) .3, (0,1) .18, (0,0,0) .12, (2) .1, (1,0) .1, ... ties to the shorter path.
    assert paths == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]
    from_paths(1, paths)  # a tree: every parent is kept and comes first
    head_two_first = [[0.2, 0.7], [0.9, 0.1]]  # the second candidate of head 0 is the likelier one
    assert tree_paths(2, 2, 3, head_two_first)[:2] == [(0,), (1,)] and (1, 0) in tree_paths(2, 2, 3, head_two_first)
    assert tree_paths(2, 2, 3) == [(0,), (1,), (0, 0)]  # the prior without measured rates
    with pytest.raises(ValueError, match="fewer than 7"):
        tree_paths(2, 2, 7)


def test_static_tree_from_paths():
    tree = from_paths(2, MEDUSA_TREE)
    np.testing.assert_array_equal(tree.parents[0], [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(tree.depths[1], [0, 1, 1, 2, 2, 2, 3])
    assert tree.max_depth == 3 and not tree.is_chain
    with pytest.raises(ValueError, match=r"before its parent \(1,\)"):
        from_paths(1, [(0,), (1, 0)])
    with pytest.raises(ValueError, match="more than the draft's 3 heads"):
        medusa_drafter(CONFIG, PARAMS, chain_paths(4))


def _committed_final_hidden(history: np.ndarray, length: int) -> np.ndarray:
    """The target's final-normed hidden state at position length - 1, from scratch."""
    tokens = jnp.asarray(history[None, :length])
    out = llama.forward(PARAMS, CONFIG, tokens, jnp.arange(length)[None], None, causal_mask(length), taps=llama.Taps(final_hidden=True))
    return np.asarray(out.features[0, -1])


@pytest.mark.parametrize("paths", [None, MEDUSA_TREE], ids=["chain", "tree"])
def test_state_is_the_hidden_state_that_sampled_the_pending_token(paths):
    """After prefill and after each step, the heads read the target's hidden state at the last
    committed position (whose LM head sampled the pending token), row by row."""
    engine = Engine(CONFIG, PARAMS, medusa_drafter(CONFIG, PARAMS, paths), max_len=64, eos_ids=())
    state = engine.admit(engine.init_state(3), range(3), PROMPTS[:3], 20)
    sampling = SamplingParams.make(3)
    for _ in range(4):
        history, lengths = np.asarray(state.history), np.asarray(state.cache.lengths)
        for row in range(3):
            expected = _committed_final_hidden(history[row], int(lengths[row]))
            np.testing.assert_allclose(state.drafter_state.hidden[row], expected, atol=2e-5, err_msg=f"row {row}")
        state = engine.decode(state, sampling, 1)
    assert int(state.accepted_hist[:, 1:].sum()) > 0  # some drafts were accepted, so paths were walked


@pytest.mark.parametrize("paths", [None, MEDUSA_TREE], ids=["chain", "tree"])
def test_greedy_batch_of_one_equals_plain_decoding(paths):
    plain = Engine(CONFIG, PARAMS, max_len=64)
    speculative = Engine(CONFIG, PARAMS, medusa_drafter(CONFIG, PARAMS, paths), max_len=64)
    for prompt in PROMPTS:
        assert speculative.generate([prompt], max_new_tokens=24).tokens == plain.generate([prompt], max_new_tokens=24).tokens


def test_vocabulary_and_hidden_size_must_match_the_target():
    drafter = medusa_drafter(CONFIG, PARAMS)
    with pytest.raises(ValueError, match="vocabulary of 96 tokens, the target has 64"):
        drafter.check_target(tiny_config(vocab_size=64))
    with pytest.raises(ValueError, match="hidden size 32 does not match the target's 48"):
        drafter.check_target(tiny_config(hidden_size=48))


def _save(tmp_path, dtype=np.float32, **kwargs):
    config, params, token_map = medusa_heads(CONFIG, PARAMS)
    save_medusa(tmp_path / "heads", config, params, token_map, dtype=dtype, **kwargs)
    return config, params, token_map, tmp_path / "heads"


def test_export_and_import_round_trip_to_identical_logits(tmp_path):
    config, params, token_map, path = _save(tmp_path, topk_accuracy=[[0.5, 0.2], [0.4, 0.1], [0.3, 0.1]])
    loaded_config, loaded, loaded_map, accuracy = load_medusa(path, target_vocab_size=CONFIG.vocab_size)
    assert loaded_config == config and accuracy == [[0.5, 0.2], [0.4, 0.1], [0.3, 0.1]]
    np.testing.assert_array_equal(loaded_map, token_map)
    hidden = jax.random.normal(jax.random.key(0), (5, CONFIG.hidden_size))
    np.testing.assert_array_equal(medusa.forward(loaded, hidden), medusa.forward(params, hidden))
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["MedusaModel"] and raw["num_heads"] == 3 and raw["truncated_vocab_size"] == 48
    names = set(read_safetensors(path / "model.safetensors"))
    assert {"blocks.2.layers.0.weight", "blocks.0.layers.0.bias", "lm_heads.1.weight", "token_map"} <= names


def test_bfloat16_export_is_close(tmp_path):
    _, params, _, path = _save(tmp_path, dtype=ml_dtypes.bfloat16)
    assert read_safetensors(path / "model.safetensors")["lm_heads.0.weight"].dtype == ml_dtypes.bfloat16
    _, loaded, _, _ = load_medusa(path)
    hidden = jax.random.normal(jax.random.key(0), (5, CONFIG.hidden_size))
    np.testing.assert_allclose(medusa.forward(loaded, hidden), medusa.forward(params, hidden), atol=0.05)


def _rewrite(path, change):
    tensors = read_safetensors(path / "model.safetensors")
    change(tensors)
    write_safetensors(path / "model.safetensors", tensors)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("lm_heads.2.weight"), r"missing tensors \['lm_heads.2.weight'\]"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), r"unexpected tensors \['extra'\]"),
        (lambda t: t.update({"blocks.1.layers.0.weight": np.zeros((32, 31), np.float32)}), r"'blocks.1.layers.0.weight' has shape \(32, 31\), expected \(32, 32\)"),
        (lambda t: t.update(token_map=np.zeros(48, np.int64)), "token_map holds ids outside the vocabulary .* or repeats one"),
        (lambda t: t["lm_heads.0.weight"].__setitem__((0, 0), np.nan), "'lm_heads.0.weight' holds non-finite values"),
    ],
    ids=["missing", "unexpected", "shape", "token-map", "nan"],
)
def test_bad_checkpoints_are_named(tmp_path, change, message):
    *_, path = _save(tmp_path)
    _rewrite(path, change)
    with pytest.raises(ValueError, match=message):
        load_medusa(path)


def test_vllm_variants_load(tmp_path):
    """A `medusa_heads.` prefix, no fc bias (vLLM's default) and the original repository's key names."""
    config, params, token_map, path = _save(tmp_path)
    def strip_biases(tensors):
        for name in [n for n in tensors if n.endswith(".bias")]:
            tensors.pop(name)
        for name in list(tensors):
            tensors["medusa_heads." + name] = tensors.pop(name)
    _rewrite(path, strip_biases)
    raw = json.loads((path / "config.json").read_text())
    raw["medusa_num_heads"], raw["medusa_num_layers"] = raw.pop("num_heads"), raw.pop("num_hidden_layers")
    raw["medusa_fc_bias"] = False
    (path / "config.json").write_text(json.dumps(raw))
    loaded_config, loaded, _, _ = load_medusa(path)
    assert loaded_config == config
    assert all(np.all(layer["bias"] == 0) for head in loaded["heads"] for layer in head["layers"])
    with pytest.raises(ValueError, match="a vocabulary of 96 tokens, the target has 64"):
        load_medusa(path, target_vocab_size=64)


def test_registry_builds_chains_and_trees_from_a_draft(tmp_path):
    *_, path = _save(tmp_path, topk_accuracy=[[0.6, 0.3], [0.5, 0.2], [0.4, 0.1]])
    context = BuildContext(CONFIG, PARAMS, str(path), jnp.float32)
    assert MethodSpec.parse("medusa:2").build(context).paths == [(0,), (0, 0)]
    assert MethodSpec.parse("medusa:3,2,4").build(context).paths == [(0,), (1,), (0, 0), (1, 0)]  # (1, 0) .15 > (0, 0, 0) .12
    adaptive = MethodSpec.parse("medusa:auto3").build(context)
    assert [v.paths for v in adaptive.variants] == [[], [(0,)], [(0,), (0, 0)], chain_paths(3)]
    assert isinstance(MethodSpec.parse("medusa").build(context), MedusaDrafter)
