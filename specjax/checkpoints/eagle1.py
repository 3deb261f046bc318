"""EAGLE-1 drafts in the layout of the EAGLE reference and vLLM's `EagleLlamaForCausalLM`.

config.json: a Llama config of one layer (`num_hidden_layers: 1`, `hidden_size`,
`intermediate_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rms_norm_eps`,
`rope_theta`, `rope_scaling`, `max_position_embeddings`, `vocab_size` = the target's), with
`architectures: ["EagleLlamaForCausalLM"]` (vLLM's name; the reference's `LlamaForCausalLM` is
read too). Tensors, torch [out, in]: `fc.weight` [H, 2H] over concat(embedding, feature),
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`; optional `fc.bias` [H] (the reference has one, vLLM
drops it: specjax applies it when present and writes none), and optional
`layers.0.input_layernorm.weight` and `embed_tokens.weight` [V, H], both checked and unused
(EAGLE's first layer has no input norm; the draft embeds with the target's embedding, as vLLM
does). The target's LM head is not in the draft. A `model.` prefix is accepted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checkpoints.draft_files import layer_config_fields, layer_config_json, read_weights, write_draft
from specjax.checkpoints.hf import read_json
from specjax.models.config import ModelConfig
from specjax.models.eagle1 import Eagle1Config, Params

ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLM")  # vLLM, the EAGLE reference
TORCH_NAMES = {
    "fc": "fc.weight",
    "fc_bias": "fc.bias",
    "q_proj": "layers.0.self_attn.q_proj.weight",
    "k_proj": "layers.0.self_attn.k_proj.weight",
    "v_proj": "layers.0.self_attn.v_proj.weight",
    "o_proj": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj": "layers.0.mlp.gate_proj.weight",
    "up_proj": "layers.0.mlp.up_proj.weight",
    "down_proj": "layers.0.mlp.down_proj.weight",
}
# Config keys that change the forward, with the one value implemented here (an absent key has it).
FIXED_KEYS = {
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "logit_scale": 1.0,
    "add_para_norm": False,  # vLLM's HASS variant: norms on both fc inputs
    "quantization_config": None,
}


def config_to_json(config: Eagle1Config, dtype: str) -> dict:
    return {"architectures": [ARCHITECTURES[0]], **layer_config_json(config), "vocab_size": config.vocab_size, "torch_dtype": dtype}


def config_from_json(raw: dict) -> Eagle1Config:
    """Eagle1Config from config.json; ValueError naming any key whose value this forward does not implement."""
    if not set(ARCHITECTURES) & set(raw.get("architectures") or ()):
        raise ValueError(f"architectures {raw.get('architectures')} name no EAGLE-1 draft ({', '.join(ARCHITECTURES)})")
    for key, value in FIXED_KEYS.items():
        if raw.get(key, value) != value:
            raise ValueError(f"{key}={raw[key]!r} is not implemented (only {value!r})")
    return Eagle1Config(**layer_config_fields(raw), vocab_size=raw["vocab_size"])


def save_eagle1(path: str | Path, config: Eagle1Config, params: Params, dtype=np.float32, *, overwrite: bool = False) -> None:
    """Write `path/model.safetensors` and `path/config.json`, weights as `dtype` (atomic; `draft_files.write_draft`)."""
    dtype_name = "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name
    tensors = {}
    for name in config.param_shapes():
        array = np.asarray(params[name], np.float32)
        tensors[TORCH_NAMES[name]] = (array.T if array.ndim == 2 else array).astype(dtype)
    write_draft(path, tensors, config_to_json(config, dtype_name), ARCHITECTURES, "an EAGLE-1 draft", overwrite=overwrite)


def load_eagle1(path: str | Path, *, target_config: ModelConfig | None = None, dtype=jnp.float32) -> tuple[Eagle1Config, Params]:
    """Read a draft directory: (config, params in [in, out] layout as `dtype`).

    ValueError naming a config key this forward does not implement, a missing, unexpected,
    mis-shaped or non-finite tensor, or a draft whose vocabulary or hidden size is not the
    target's (when `target_config` is given).
    """
    path = Path(path)
    raw = read_json(path / "config.json", "EAGLE-1 draft config")
    try:
        config = config_from_json(raw)
    except KeyError as error:
        raise ValueError(f"{path / 'config.json'}: missing key {error}") from None
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path / 'config.json'}: {error}") from None
    if target_config is not None:
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(f"{path}: EAGLE-1 draft was trained for a vocabulary of {config.vocab_size} tokens, the target has {target_config.vocab_size}")
        if config.hidden_size != target_config.hidden_size:
            raise ValueError(f"{path}: EAGLE-1 draft hidden size {config.hidden_size} does not match the target's {target_config.hidden_size}")
    tensors = {name.removeprefix("model."): array for name, array in read_weights(path).items()}
    if "fc.bias" in tensors:
        config = dataclasses.replace(config, fc_bias=True)
    torch_shape = lambda shape: shape[::-1] if len(shape) == 2 else shape
    required = {TORCH_NAMES[name]: torch_shape(shape) for name, shape in config.param_shapes().items()}
    unused = {"layers.0.input_layernorm.weight": (config.hidden_size,), "embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    missing = sorted(set(required) - set(tensors))
    unexpected = sorted(set(tensors) - set(required) - set(unused))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, array in tensors.items():
        shape = (required | unused)[name]
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if not np.isfinite(array.astype(np.float32)).all():
            raise ValueError(f"{path}: tensor {name!r} holds non-finite values")
    params = {}
    for name in config.param_shapes():
        array = tensors[TORCH_NAMES[name]].astype(np.float32)
        params[name] = jnp.asarray(array.T if array.ndim == 2 else array, dtype)
    return config, params
