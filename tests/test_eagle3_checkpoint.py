"""EAGLE-3 checkpoints: round trip, a torch-written draft gives the torch logits, load errors."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specjax.checkpoints.eagle3 import config_to_json, load_eagle3, read_safetensors, save_eagle3
from specjax.kv_cache import KVCache
from specjax.models import eagle3
from specjax.models.config import Llama3RopeScaling

CONFIG = eagle3.Eagle3Config(
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    draft_vocab_size=20,
    target_vocab_size=50,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    ),
)
TARGET_IDS = np.sort(np.random.default_rng(0).choice(50, 20, replace=False))


class TorchEagle3(torch.nn.Module):
    """A reference EAGLE-3 draft written against the published PyTorch layout."""

    def __init__(self, config: LlamaConfig, draft_vocab_size: int):
        super().__init__()
        hidden, heads, kv_heads, dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = torch.nn.Module()
        attn = self.midlayer.self_attn = torch.nn.Module()
        attn.q_proj = torch.nn.Linear(2 * hidden, heads * dim, bias=False)
        attn.k_proj = torch.nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        attn.v_proj = torch.nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        attn.o_proj = torch.nn.Linear(heads * dim, hidden, bias=False)
        self.midlayer.mlp = LlamaMLP(config)
        for name in ["input_layernorm", "hidden_norm", "post_attention_layernorm"]:
            setattr(self.midlayer, name, LlamaRMSNorm(hidden, config.rms_norm_eps))
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        for parameter in self.parameters():
            torch.nn.init.normal_(parameter, std=0.3)

    def forward(self, embeddings, features):
        layer, attn = self.midlayer, self.midlayer.self_attn
        batch, length, _ = embeddings.shape
        residual = self.fc(features)
        x = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(residual)], -1)
        shape = lambda t, n: t.view(batch, length, n, self.dim).transpose(1, 2)
        q = shape(attn.q_proj(x), self.heads)
        k = shape(attn.k_proj(x), self.kv_heads)
        v = shape(attn.v_proj(x), self.kv_heads)
        positions = torch.arange(length)[None].expand(batch, length)
        cos, sin = self.rotary(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.norm(hidden)), hidden


def _torch_checkpoint(path, dtype=torch.float32):
    """Write a torch draft the way SpecForge does; return it and its llama config."""
    torch.manual_seed(0)
    llama = LlamaConfig(**{**config_to_json(CONFIG, "float32"), "architectures": None})
    model = TorchEagle3(llama, CONFIG.draft_vocab_size)
    state = {name: t.to(dtype) for name, t in model.state_dict().items() if not name.startswith("rotary")}
    state["d2t"] = torch.tensor(TARGET_IDS - np.arange(20), dtype=torch.int64)
    state["t2d"] = torch.zeros(50, dtype=torch.bool)
    state["t2d"][torch.tensor(TARGET_IDS)] = True
    path.mkdir(exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config_to_json(CONFIG, "float32")))
    return model


def _jax_logits(params, embeddings, features):
    batch, length, _ = embeddings.shape
    out = eagle3.forward(
        params,
        CONFIG,
        jnp.asarray(embeddings),
        eagle3.project_features(params, jnp.asarray(features)),
        jnp.broadcast_to(jnp.arange(length), (batch, length)),
        KVCache.init(1, batch, 16, CONFIG.num_kv_heads, CONFIG.head_dim),
        jnp.tril(jnp.ones((length, length), bool)),
    )
    return out


def test_torch_written_checkpoint_gives_torch_logits(tmp_path):
    model = _torch_checkpoint(tmp_path)
    rng = np.random.default_rng(1)
    embeddings = rng.normal(size=(2, 9, 32)).astype(np.float32)
    features = rng.normal(size=(2, 9, 96)).astype(np.float32)
    with torch.no_grad():
        torch_logits, torch_hidden = model(torch.tensor(embeddings), torch.tensor(features))
    config, params, vocab = load_eagle3(tmp_path, target_vocab_size=50)
    assert config == CONFIG
    out = _jax_logits(params, embeddings, features)
    np.testing.assert_allclose(out.logits, torch_logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.hidden, torch_hidden.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(vocab.target_ids, TARGET_IDS)


def test_bfloat16_torch_checkpoint_loads(tmp_path):
    _torch_checkpoint(tmp_path, torch.bfloat16)
    _, params, _ = load_eagle3(tmp_path, dtype=jnp.bfloat16)
    assert params["q_proj"].dtype == jnp.bfloat16 and params["q_proj"].shape == (64, 32)


def test_round_trip(tmp_path):
    params = eagle3.init_params(CONFIG, jax.random.key(3))
    vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(TARGET_IDS), 50)
    save_eagle3(tmp_path, CONFIG, params, vocab)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 20
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # torch [out, in]
    config, loaded, loaded_vocab = load_eagle3(tmp_path)
    assert config == CONFIG
    jax.tree.map(np.testing.assert_array_equal, (params, vocab), (loaded, loaded_vocab))


def test_bfloat16_export(tmp_path):
    params = eagle3.init_params(CONFIG, jax.random.key(3))
    vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(TARGET_IDS), 50)
    save_eagle3(tmp_path, CONFIG, params, vocab, dtype=ml_dtypes.bfloat16)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert tensors["fc.weight"].dtype == ml_dtypes.bfloat16
    _, loaded, _ = load_eagle3(tmp_path)
    np.testing.assert_allclose(loaded["fc"], params["fc"], rtol=1e-2, atol=1e-3)


def _edit_checkpoint(path, edit):
    params = eagle3.init_params(CONFIG, jax.random.key(3))
    save_eagle3(path, CONFIG, params, eagle3.DraftVocab.from_target_ids(jnp.asarray(TARGET_IDS), 50))
    tensors = read_safetensors(path / "model.safetensors")
    edit(tensors)
    save_file({k: torch.from_numpy(v) for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), "extra"),
        (lambda t: t.update({"fc.weight": np.zeros((32, 64), np.float32)}), "fc.weight"),
        (lambda t: t.update(t2d=np.zeros(50, np.bool_)), "d2t and t2d"),
        (lambda t: t["midlayer.mlp.up_proj.weight"].__setitem__((3, 1), np.inf), "'midlayer.mlp.up_proj.weight' holds non-finite"),
    ],
    ids=["missing", "unexpected", "misshaped", "inconsistent-vocab", "non-finite"],
)
def test_bad_tensors_are_named(tmp_path, edit, message):
    _edit_checkpoint(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_eagle3(tmp_path)


def test_target_vocab_mismatch(tmp_path):
    _edit_checkpoint(tmp_path, lambda t: None)
    with pytest.raises(ValueError, match="49152"):
        load_eagle3(tmp_path, target_vocab_size=49152)
