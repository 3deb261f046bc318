"""Hugging Face checkpoints: a directory with config.json and safetensors weights.

Weights come from `model.safetensors`, or from the shards listed in
`model.safetensors.index.json`. `assemble_params` turns any torch-layout tensor collection
into the params pytree of `specjax.models.llama`, validating every name, shape and value
(NaN or inf is an error); the GGUF loader reuses it with its own names.

A bad file is a ValueError that names it and the problem, raised while loading (before any
compilation): no or invalid config.json, a safetensors file shorter than its header says
(truncated) or with an unreadable header, a missing shard, a missing, unexpected, mis-shaped or
non-finite tensor.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
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


def _float_info(dtype: np.dtype) -> Any:
    """finfo of a floating dtype, numpy's or ml_dtypes' (bfloat16, float8), else None."""
    try:
        return ml_dtypes.finfo(dtype)
    except (ValueError, TypeError, KeyError):
        return None


def first_nonfinite(array: np.ndarray, chunk: int = 1 << 24) -> int | None:
    """Flat index of the first NaN or inf in a floating-point array, or None (integers: None).

    Cheap enough to run on every weight at load: float16/32/64 cost one min and one max
    reduction (NaN propagates through both, inf lands in one); only an array that fails is
    searched for the position. Other floating types (bfloat16 via ml_dtypes) take np.isfinite in
    chunks, so the temporary stays small for multi-GB tensors.
    """
    array = np.asarray(array)
    if array.size == 0 or _float_info(array.dtype) is None:
        return None
    flat = array.reshape(-1)
    if array.dtype in (np.float16, np.float32, np.float64):
        if np.isfinite(flat.min()) and np.isfinite(flat.max()):
            return None
        return int(np.argmin(np.isfinite(flat)))
    for start in range(0, flat.size, chunk):
        finite = np.isfinite(flat[start : start + chunk])
        if not finite.all():
            return start + int(np.argmin(finite))
    return None


def assemble_params(
    config: ModelConfig,
    tensors: Mapping[str, Any],
    names: Mapping[str, str],
    dtype=jnp.float32,
    ignored: frozenset[str] = frozenset(),
    source: str | Path | Callable[[str], str | Path] = "checkpoint",
) -> llama.Params:
    """Build params from torch-layout tensors (linear weights [out, in]) named by `names`.

    Every expected tensor must be present with its exact shape and finite values (checked before
    the cast to `dtype`, and after it when `dtype` has a smaller exponent range), and every
    tensor in `tensors` must be used (or listed in `ignored`); otherwise ValueError naming the
    tensor. `source` names the
    checkpoint in those errors: a path, or a function of the tensor name (the shard holding it).
    """
    where = source if callable(source) else (lambda _name: source)
    shapes = llama.param_shapes(config)
    expected = {names[key]: key for key in shapes if key != "layers"}
    expected |= {names[key].format(i=i): key for i, layer in enumerate(shapes["layers"]) for key in layer}
    unexpected = sorted(set(tensors) - set(expected) - ignored)
    if unexpected:
        raise ValueError(f"{where(unexpected[0])}: unexpected tensor(s) in checkpoint: {', '.join(unexpected)}")
    np_dtype = jnp.dtype(dtype)

    def take(key: str, shape: tuple[int, ...], layer: int | None = None) -> np.ndarray:
        name = names[key].format(i=layer)
        stored_shape = shape[::-1] if key in LINEAR_KEYS else shape
        if name not in tensors:
            raise ValueError(f"{where(name)}: missing tensor {name} (expected shape {stored_shape})")
        array = np.asarray(tensors[name])
        if array.shape != stored_shape:
            raise ValueError(f"{where(name)}: tensor {name} has shape {array.shape}, expected {stored_shape}")
        bad = first_nonfinite(array)
        if bad is not None:
            value = array.reshape(-1)[bad]
            raise ValueError(
                f"{where(name)}: tensor {name} holds a non-finite value ({value} at index "
                f"{tuple(int(i) for i in np.unravel_index(bad, array.shape))}): the file is corrupt"
            )
        with np.errstate(over="ignore"):  # an overflow is reported below, by name
            cast = array.astype(np_dtype)
        source_info, target_info = _float_info(array.dtype), _float_info(np_dtype)
        narrower = source_info is not None and target_info is not None and target_info.maxexp < source_info.maxexp
        if narrower and first_nonfinite(cast) is not None:  # e.g. float32 -> float16 (bfloat16 keeps the range)
            raise ValueError(f"{where(name)}: tensor {name} overflows {np_dtype.name}; load it in a wider dtype")
        return cast.T if key in LINEAR_KEYS else cast

    params = {key: jnp.asarray(take(key, shape)) for key, shape in shapes.items() if key != "layers"}
    params["layers"] = [
        {key: jnp.asarray(take(key, shape, i)) for key, shape in layer.items()} for i, layer in enumerate(shapes["layers"])
    ]
    return params


class _SafetensorsFiles(Mapping):
    """Lazy name -> host array view over safetensors files opened with framework="flax"."""

    def __init__(self, directory: Path, handles: dict[Path, Any]):
        self._file_of = {name: file for file, handle in handles.items() for name in handle.keys()}
        self._handles = handles
        self._directory = directory

    def file_of(self, name: str) -> Path:
        """The shard holding tensor `name` (the checkpoint directory for a tensor it lacks)."""
        return self._file_of.get(name, self._directory)

    def __getitem__(self, name: str) -> np.ndarray:
        file = self._file_of[name]
        try:
            # The flax framework reads bfloat16 (numpy's cannot); keep the copy on the host.
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(self._handles[file].get_tensor(name))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ValueError(f"{file}: cannot read tensor {name} ({exc})") from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def read_json(file: Path, what: str) -> Any:
    """A JSON file, or ValueError naming it (missing, unreadable, or not valid JSON)."""
    if not file.is_file():
        raise ValueError(f"{file}: no such file ({what})")
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}); the {what} is damaged or cut short") from exc


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards of an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        index_json = read_json(index, "shard index")
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map (tensor name -> shard file)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ValueError(f"{index}: lists shard(s) that are not in {path}: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def check_safetensors(file: Path) -> None:
    """ValueError naming `file` if its header is unreadable or its tensor data is cut short.

    Reads only the header: an 8-byte little-endian length, then that many bytes of JSON whose
    `data_offsets` say how long the data section after it must be.
    """
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file}: truncated safetensors file ({size} bytes, shorter than the 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise ValueError(
                f"{file}: truncated or corrupt safetensors file (header of {header_len} bytes, file of {size} bytes)"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{file}: corrupt safetensors header ({exc})") from exc
    data_len, have = max(ends, default=0), size - 8 - header_len
    if have < data_len:
        raise ValueError(
            f"{file}: truncated safetensors file: its header describes {data_len} bytes of tensor data, "
            f"the file holds {have}"
        )


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from `path/config.json` (ValueError naming the file if missing or invalid)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json; a Hugging Face checkpoint directory needs one")
    raw = read_json(file, "model config")
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(raw).__name__}")
    try:
        return ModelConfig.from_hf(raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{file}: {exc}") from exc


def load(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, llama.Params]:
    """Load a Hugging Face checkpoint directory into (config, params) of the given dtype."""
    path = Path(path)
    config = load_config(path)
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in weight_files(path):
            check_safetensors(file)
            try:
                handles[file] = stack.enter_context(safe_open(file, framework="flax"))
            except Exception as exc:  # SafetensorError: the header passed our check but not theirs
                raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
        tensors = _SafetensorsFiles(path, handles)
        ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            ignored.add(HF_NAMES["lm_head"])  # some tied checkpoints still store the copy
        params = assemble_params(config, tensors, HF_NAMES, dtype, frozenset(ignored), source=tensors.file_of)
    return config, params
