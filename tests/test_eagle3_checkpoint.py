"""EAGLE-3 checkpoints: every published layout loads and matches an independent torch reference; exports; refusals.

The reference below is vLLM's LlamaForCausalLMEagle3 draft step written from the published
config.json and state dict alone (no specjax code): the draft's own embedding when it has one,
taps from eagle_config.eagle_aux_hidden_state_layer_ids in SpecForge's and SGLang's convention
(decoder layer outputs: Hugging Face hidden_states[id + 1]), norm_before_residual, and the rope
as transformers reads the config (rope_theta + rope_scaling, or rope_parameters).
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specjax.checkpoints import load_model
from specjax.checkpoints.draft_files import read_safetensors, read_torch_pickle
from specjax.checkpoints.eagle3 import load_eagle3, save_eagle3
from specjax.drafters.base import BuildContext
from specjax.drafters.registry import MethodSpec
from specjax.kv_cache import KVCache
from specjax.models import eagle3, llama
from specjax.models.config import Llama3RopeScaling

HIDDEN, HEADS, KV_HEADS, DIM, INTER, VOCAB, DRAFT_VOCAB, TARGET_LAYERS = 32, 4, 2, 8, 48, 50, 20, 8
TARGET_IDS = np.sort(np.random.default_rng(0).choice(VOCAB, DRAFT_VOCAB, replace=False))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
PUBLISHED = dict(  # the keys of the published config.json files
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=HIDDEN, intermediate_size=INTER,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6, max_position_embeddings=64,
    vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False,
)
# name: (config.json keys over PUBLISHED, weight files, whether the draft ships embed_tokens, d2t/t2d, torch dtype)
VARIANTS = {
    "specforge": ({
        "head_dim": DIM, "rope_theta": 500000.0, "rope_scaling": LLAMA3, "target_hidden_size": HIDDEN,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True},
    }, "model.safetensors", True, True, torch.float32),
    "eagle-reference-bin": ({"rope_theta": 500000.0, "rope_scaling": LLAMA3}, "pytorch_model.bin", False, True, torch.float16),
    "vllm-norm-before-residual": ({
        "architectures": ["Eagle3LlamaForCausalLM"], "head_dim": DIM, "rope_theta": 10000.0, "norm_before_residual": True,
    }, "layers.0.safetensors", False, True, torch.float32),
    "transformers5-rope-parameters-shards": (
        {"head_dim": DIM, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}, "model.safetensors.index.json", False, True, torch.bfloat16,
    ),
    "full-vocab": ({"rope_theta": 10000.0, "draft_vocab_size": VOCAB}, "model.safetensors", True, False, torch.float32),
    "bin-shards": ({"rope_theta": 10000.0}, "pytorch_model.bin.index.json", False, True, torch.float32),
}


def _draft_state(config: dict, own_embedding: bool, vocab_maps: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published torch names."""
    gen = torch.Generator().manual_seed(seed)
    hidden, dim = config["hidden_size"], config.get("head_dim", HIDDEN // HEADS)
    shapes = {
        "fc.weight": (hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": (HEADS * dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, HEADS * dim),
        "midlayer.mlp.gate_proj.weight": (INTER, hidden),
        "midlayer.mlp.up_proj.weight": (INTER, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, INTER),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
        **({"embed_tokens.weight": (VOCAB, hidden)} if own_embedding else {}),
    }
    state = {name: 0.3 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    for name in ["midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"]:
        state[f"{name}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=gen)
    if vocab_maps:
        state["d2t"] = torch.tensor(TARGET_IDS - np.arange(DRAFT_VOCAB), dtype=torch.int64)
        state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
        state["t2d"][torch.tensor(TARGET_IDS)] = True
    return state


def _write(path, config: dict, state: dict, layout: str) -> None:
    """A draft directory in one of the published layouts."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if layout == "layers.0.safetensors":  # vLLM's multi-layer names
        state = {name.replace("midlayer.", "layers.0."): t for name, t in state.items()}
    if layout.endswith(".index.json"):
        stem, suffix = layout.split(".")[0], ".bin" if "bin" in layout else ".safetensors"
        names = sorted(state)
        shards = {f"{stem}-0000{i + 1}-of-00002{suffix}": names[i::2] for i in range(2)}
        for shard, shard_names in shards.items():
            part = {name: state[name].contiguous() for name in shard_names}
            torch.save(part, path / shard) if suffix == ".bin" else save_file(part, str(path / shard))
        weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
        (path / layout).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    elif layout == "pytorch_model.bin":
        torch.save(state, path / layout)
    else:
        save_file({name: t.contiguous() for name, t in state.items()}, str(path / "model.safetensors"))


class Reference:
    """vLLM's EAGLE-3 draft step in torch, from a published config.json and state dict."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor]):
        self.config = config
        self.state = {name.replace("layers.0.", "midlayer."): t.float() for name, t in state.items()}
        llama_keys = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "draft_vocab_size")}
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**llama_keys))
        self.dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    def taps(self, num_target_layers: int) -> list[int]:
        """Indices into Hugging Face hidden_states (index i: the input of layer i)."""
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return [i + 1 for i in ids] if ids else [2, num_target_layers // 2, num_target_layers - 3]

    def target_ids(self) -> np.ndarray:
        d2t = self.state.get("d2t", torch.zeros(self.config["draft_vocab_size"], dtype=torch.int64))
        return (torch.arange(len(d2t)) + d2t).numpy()

    def __call__(self, tokens, hidden_states, target_embedding):
        """tokens [B, T]; hidden_states: the target's HF hidden_states -> (draft logits [B, T, Vd], h_out [B, T, H])."""
        w = lambda name: self.state[name + ".weight"]
        eps = self.config["rms_norm_eps"]
        norm = lambda x, name: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w(name)
        batch, length = tokens.shape
        features = torch.cat([hidden_states[i] for i in self.taps(len(hidden_states) - 1)], -1)
        embeds = (self.state["embed_tokens.weight"] if "embed_tokens.weight" in self.state else target_embedding)[tokens]
        hidden = features @ w("fc").T
        x = torch.cat([norm(embeds, "midlayer.input_layernorm"), norm(hidden, "midlayer.hidden_norm")], -1)
        residual = norm(hidden, "midlayer.hidden_norm") if self.config.get("norm_before_residual") else hidden
        heads = lambda name: (x @ w(f"midlayer.self_attn.{name}").T).view(batch, length, -1, self.dim).transpose(1, 2)
        cos, sin = self.rotary(x, torch.arange(length)[None].expand(batch, length))
        q, k = apply_rotary_pos_emb(heads("q_proj"), heads("k_proj"), cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, heads("v_proj"), is_causal=True, enable_gqa=True)
        hidden = residual + out.transpose(1, 2).reshape(batch, length, -1) @ w("midlayer.self_attn.o_proj").T
        mlp_in = norm(hidden, "midlayer.post_attention_layernorm")
        mlp = torch.nn.functional.silu(mlp_in @ w("midlayer.mlp.gate_proj").T) * (mlp_in @ w("midlayer.mlp.up_proj").T)
        hidden = hidden + mlp @ w("midlayer.mlp.down_proj").T
        return norm(hidden, "norm") @ w("lm_head").T, hidden


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 8-layer Llama target: the HF model and specjax's load of it."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("target")
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM, rms_norm_eps=1e-6,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
    )).eval()
    model.save_pretrained(path)
    config, params = load_model(path)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 9))
    with torch.no_grad():
        hidden_states = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    return model, config, params, tokens, hidden_states


def _specjax_step(target, path):
    """The drafter `--method eagle3 --draft path` builds, run on the target's taps: (drafter, logits, h_out)."""
    _, config, params, tokens, _ = target
    spec = MethodSpec.parse("eagle3:3")
    drafter = spec.info.build(spec, BuildContext(config, params, str(path), jnp.float32))
    batch, length = tokens.shape
    positions, causal = jnp.broadcast_to(jnp.arange(length), (batch, length)), jnp.tril(jnp.ones((length, length), bool))
    features = llama.forward(params, config, jnp.asarray(tokens), positions, None, causal, taps=drafter.taps).features
    head, head_config = drafter.params["head"], drafter.head_config
    out = eagle3.forward(
        head, head_config, drafter.params["embed_tokens"][tokens], eagle3.project_features(head, features), positions,
        KVCache.init(1, batch, 16, head_config.num_kv_heads, head_config.head_dim), causal,
    )
    return drafter, out.logits, out.hidden


@pytest.mark.parametrize("variant", VARIANTS)
def test_published_layout_matches_reference(tmp_path, target, variant):
    overrides, layout, own_embedding, vocab_maps, dtype = VARIANTS[variant]
    config = {**PUBLISHED, **overrides}
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _draft_state(config, own_embedding, vocab_maps).items()}
    _write(tmp_path, config, state, layout)
    reference = Reference(config, state)
    model, _, _, tokens, hidden_states = target
    with torch.no_grad():
        ref_logits, ref_hidden = reference(torch.tensor(tokens), hidden_states, model.model.embed_tokens.weight)
    drafter, logits, hidden = _specjax_step(target, tmp_path)
    assert drafter.taps.layer_inputs == tuple(reference.taps(TARGET_LAYERS))
    np.testing.assert_array_equal(eagle3.draft_to_target(jnp.arange(len(drafter.params["d2t"])), drafter.params["d2t"]), reference.target_ids())
    np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hidden, ref_hidden.numpy(), rtol=1e-4, atol=1e-4)


def _random_draft(tap_layers=(1, 4, 7)):
    config = eagle3.Eagle3Config(
        hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, intermediate_size=INTER,
        draft_vocab_size=DRAFT_VOCAB, target_vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
        max_position_embeddings=64, tap_layers=tap_layers,
    )
    params = jax.tree.map(lambda p: 3 * p, eagle3.init_params(config, jax.random.key(3)))
    return config, params, eagle3.DraftVocab.from_target_ids(jnp.asarray(TARGET_IDS), VOCAB)


def test_export_is_read_alike_by_the_field(tmp_path, target):
    """What save_eagle3 writes, the reference (vLLM's semantics, SGLang's taps) runs to specjax's numbers."""
    config, params, vocab = _random_draft()
    save_eagle3(tmp_path, config, params, vocab, target={"name_or_path": "tiny-llama"})
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "target_hidden_size" not in raw  # else the EAGLE reference skips loading the target's embedding
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6] and raw["target_model"] == {"name_or_path": "tiny-llama"}
    assert raw["draft_vocab_size"] == DRAFT_VOCAB and raw["norm_before_residual"] is False
    reference = Reference(raw, load_file(str(tmp_path / "model.safetensors")))
    model, _, _, tokens, hidden_states = target
    with torch.no_grad():
        ref_logits, _ = reference(torch.tensor(tokens), hidden_states, model.model.embed_tokens.weight)
    drafter, logits, _ = _specjax_step(target, tmp_path)
    assert drafter.taps.layer_inputs == (1, 4, 7)
    np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=1e-4, atol=1e-4)
    assert load_eagle3(tmp_path)[0] == config


def test_round_trip(tmp_path):
    config, params, vocab = _random_draft(tap_layers=None)
    save_eagle3(tmp_path, config, params, vocab)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and "eagle_config" not in raw
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # torch [out, in]
    loaded_config, loaded, loaded_vocab = load_eagle3(tmp_path)
    assert loaded_config == config
    jax.tree.map(np.testing.assert_array_equal, (params, vocab), (loaded, loaded_vocab))


def test_bfloat16_export(tmp_path):
    config, params, vocab = _random_draft()
    save_eagle3(tmp_path, config, params, vocab, dtype=ml_dtypes.bfloat16)
    assert read_safetensors(tmp_path / "model.safetensors")["fc.weight"].dtype == ml_dtypes.bfloat16
    _, loaded, _ = load_eagle3(tmp_path, dtype=jnp.bfloat16)
    assert loaded["q_proj"].dtype == jnp.bfloat16
    np.testing.assert_allclose(loaded["fc"].astype(jnp.float32), params["fc"], rtol=1e-2, atol=1e-2)


def test_export_refuses_an_embedding_tap(tmp_path):
    with pytest.raises(ValueError, match="layer 0's input"):
        save_eagle3(tmp_path, *_random_draft(tap_layers=(0, 4, 7)))


class _Payload:
    def __reduce__(self):
        return os.system, ("touch pwned",)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"epoch": 3}, "non-tensor payload: 'epoch' is of type int"),
        ({"args": argparse.Namespace(lr=1)}, "argparse.Namespace"),
        ({"evil": _Payload()}, "system, which is not a tensor"),
    ],
    ids=["int", "object", "code"],
)
def test_pickle_with_a_non_tensor_payload_is_refused(tmp_path, monkeypatch, payload, message):
    monkeypatch.chdir(tmp_path)
    torch.save({"fc.weight": torch.ones(2, 2), **payload}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=message):
        read_torch_pickle(tmp_path / "pytorch_model.bin")
    assert not (tmp_path / "pwned").exists()


def test_pickle_reader_keeps_views_and_dtypes(tmp_path):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    state = {"t": base.T, "row": base[2], "half": base.half(), "bf16": base.bfloat16(), "flag": base > 3, "id": torch.arange(5)}
    torch.save(state, tmp_path / "x.bin")
    read = read_torch_pickle(tmp_path / "x.bin")
    for name, tensor in state.items():
        np.testing.assert_array_equal(read[name].astype(np.float64), tensor.float().numpy())
    assert read["bf16"].dtype == ml_dtypes.bfloat16 and read["id"].dtype == np.int64 and read["flag"].dtype == np.bool_


def test_pickle_tensor_larger_than_its_storage_is_refused(tmp_path):
    torch.save({"x": torch.zeros(1).expand(10**6)}, tmp_path / "x.bin")  # stride 0: a crafted size could fill memory
    with pytest.raises(ValueError, match="does not fit its storage"):
        read_torch_pickle(tmp_path / "x.bin")


def _edit_checkpoint(path, edit=lambda tensors: None, edit_config=lambda raw: None):
    save_eagle3(path, *_random_draft())
    tensors = read_safetensors(path / "model.safetensors")
    edit(tensors)
    save_file({k: torch.from_numpy(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    edit_config(raw)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), "extra"),
        (lambda t: t.update({"fc.weight": np.zeros((32, 64), np.float32)}), "fc.weight"),
        (lambda t: t.update(t2d=np.zeros(50, np.bool_)), "d2t and t2d"),
        (lambda t: t.pop("d2t"), r"missing tensors \['d2t'\]"),
        (lambda t: t["d2t"].__setitem__(0, TARGET_IDS[1]), "two onto one"),
        (lambda t: t.update({"fc.bias": np.zeros(32, np.float32)}), "fc.bias"),
        (lambda t: t["midlayer.mlp.up_proj.weight"].__setitem__((3, 1), np.inf), "'midlayer.mlp.up_proj.weight' holds non-finite"),
    ],
    ids=["missing", "unexpected", "misshaped", "inconsistent-vocab", "no-d2t", "d2t-collision", "fc-bias", "non-finite"],
)
def test_bad_tensors_are_named(tmp_path, edit, message):
    _edit_checkpoint(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_eagle3(tmp_path)


@pytest.mark.parametrize(
    "edit_config, message",
    [
        (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers=2 is not implemented"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda c: c.update(bias=True), "bias=True"),
        (lambda c: c.update(logit_scale=2.0), "logit_scale=2.0"),
        (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state=False"),
        (lambda c: c["eagle_config"].update(parallel_draft_step=2), r"eagle_config keys \['parallel_draft_step'\]"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "top-level eagle_aux_hidden_state_layer_ids"),
        (lambda c: c.update(target_hidden_size=64), "target_hidden_size 64"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (lambda c: c.update(speculators_config={}), "speculators format"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "name no EAGLE-3 draft"),
        (lambda c: c.pop("hidden_size"), "missing key 'hidden_size'"),
    ],
    ids=["layers", "act", "fc-bias", "logit-scale", "no-aux", "eagle-key", "vllm-taps", "target-hidden", "yarn", "speculators", "arch", "missing"],
)
def test_config_keys_that_change_the_forward_are_refused(tmp_path, edit_config, message):
    _edit_checkpoint(tmp_path, edit_config=edit_config)
    with pytest.raises(ValueError, match=message):
        load_eagle3(tmp_path)


def test_missing_weights_and_target_vocab_mismatch(tmp_path):
    _edit_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="49152"):
        load_eagle3(tmp_path, target_vocab_size=49152)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_eagle3(tmp_path)
