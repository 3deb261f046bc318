"""Hugging Face checkpoints: a directory with config.json and safetensors weights.

Weights come from `model.safetensors`, or from the shards listed in
`model.safetensors.index.json`. `assemble_params` turns any torch-layout tensor collection
into the params pytree of `specjax.models.llama`, validating every name and shape; the GGUF
loader reuses it with its own names.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from specjax.models import llama
from specjax.models.config import ModelConfig

# Keys stored as torch nn.Linear weights [out, in]; params keep them [in, out].
LINEAR_KEYS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})

# Params key -> tensor name ({i} is the layer index).
HF_NAMES = {
    "embed_tokens": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}


def assemble_params(
    config: ModelConfig,
    tensors: Mapping[str, Any],
    names: Mapping[str, str],
    dtype=jnp.float32,
    ignored: frozenset[str] = frozenset(),
) -> llama.Params:
    """Build params from torch-layout tensors (linear weights [out, in]) named by `names`.

    Every expected tensor must be present with its exact shape and every tensor in `tensors`
    must be used (or listed in `ignored`); otherwise ValueError naming the tensor.
    """
    shapes = llama.param_shapes(config)
    expected = {names[key]: key for key in shapes if key != "layers"}
    expected |= {names[key].format(i=i): key for key in shapes["layers"] for i in range(config.num_layers)}
    unexpected = sorted(set(tensors) - set(expected) - ignored)
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint: {', '.join(unexpected)}")
    np_dtype = jnp.dtype(dtype)

    def take(key: str, shape: tuple[int, ...], layer: int | None = None) -> np.ndarray:
        name = names[key].format(i=layer)
        stored_shape = shape[::-1] if key in LINEAR_KEYS else shape
        if name not in tensors:
            raise ValueError(f"missing tensor {name} (expected shape {stored_shape})")
        array = np.asarray(tensors[name])
        if array.shape != stored_shape:
            raise ValueError(f"tensor {name} has shape {array.shape}, expected {stored_shape}")
        array = array.astype(np_dtype)
        return array.T if key in LINEAR_KEYS else array

    params = {key: jnp.asarray(take(key, shape)) for key, shape in shapes.items() if key != "layers"}
    params["layers"] = {
        key: jnp.asarray(np.stack([take(key, shape[1:], i) for i in range(config.num_layers)]))
        for key, shape in shapes["layers"].items()
    }
    return params


class _SafetensorsFiles(Mapping):
    """Lazy name -> host array view over safetensors files opened with framework="flax"."""

    def __init__(self, handles: list[Any]):
        self._handle_of = {name: handle for handle in handles for name in handle.keys()}

    def __getitem__(self, name: str) -> np.ndarray:
        # The flax framework reads bfloat16 (numpy's cannot); keep the copy on the host.
        with jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(self._handle_of[name].get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._handle_of)

    def __len__(self) -> int:
        return len(self._handle_of)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards of an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from `path/config.json`."""
    return ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))


def load(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, llama.Params]:
    """Load a Hugging Face checkpoint directory into (config, params) of the given dtype."""
    config = load_config(path)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="flax")) for f in weight_files(path)]
        tensors = _SafetensorsFiles(handles)
        ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            ignored.add(HF_NAMES["lm_head"])  # some tied checkpoints still store the copy
        params = assemble_params(config, tensors, HF_NAMES, dtype, frozenset(ignored))
    return config, params
