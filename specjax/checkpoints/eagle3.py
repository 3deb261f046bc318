"""EAGLE-3 drafts in the Hugging Face layout that vLLM, SGLang and SpecForge read and write.

A draft directory holds `model.safetensors` (torch names, [out, in] matrices, `d2t` int64,
`t2d` bool) and a Llama-style `config.json` with `draft_vocab_size` and
`architectures: ["LlamaForCausalLMEagle3"]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct as binary
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.models.config import Llama3RopeScaling
from specjax.models.eagle3 import DraftVocab, Eagle3Config, Params

TORCH_NAMES = {
    "fc": "fc.weight",
    "q_proj": "midlayer.self_attn.q_proj.weight",
    "k_proj": "midlayer.self_attn.k_proj.weight",
    "v_proj": "midlayer.self_attn.v_proj.weight",
    "o_proj": "midlayer.self_attn.o_proj.weight",
    "gate_proj": "midlayer.mlp.gate_proj.weight",
    "up_proj": "midlayer.mlp.up_proj.weight",
    "down_proj": "midlayer.mlp.down_proj.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}
ARCHITECTURE = "LlamaForCausalLMEagle3"
FILES = ("model.safetensors", "config.json")

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bfloat16 via ml_dtypes)."""
    data = Path(path).read_bytes()
    (header_size,) = binary.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    body = memoryview(data)[8 + header_size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]])
        tensors[name] = array.reshape(info["shape"]).copy()
    return tensors


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write numpy arrays (any dtype in the safetensors table, bfloat16 included)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": _DTYPE_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as file:
        file.write(binary.pack("<Q", len(header_bytes)) + header_bytes)
        for blob in blobs:
            file.write(blob)


def _rope_scaling_to_json(scaling: Llama3RopeScaling | None) -> dict | None:
    return None if scaling is None else {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def _rope_scaling_from_json(raw: dict | None) -> Llama3RopeScaling | None:
    kind = (raw or {}).get("rope_type", (raw or {}).get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3")
    fields = [field.name for field in dataclasses.fields(Llama3RopeScaling)]
    return Llama3RopeScaling(**{name: raw[name] for name in fields})


def config_to_json(config: Eagle3Config, dtype: str) -> dict:
    """The Llama-style config.json of a draft."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": _rope_scaling_to_json(config.rope_scaling),
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def config_from_json(raw: dict) -> Eagle3Config:
    """Eagle3Config from a draft's config.json (missing draft_vocab_size means the full vocab)."""
    num_heads = raw["num_attention_heads"]
    return Eagle3Config(
        hidden_size=raw["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        intermediate_size=raw["intermediate_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_vocab_size=raw["vocab_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", 10000.0),
        rope_scaling=_rope_scaling_from_json(raw.get("rope_scaling")),
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
    )


def _is_eagle3_export(path: Path) -> bool:
    """path is absent, an empty directory, or a directory whose config.json names the EAGLE-3 architecture."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return True
    try:
        return ARCHITECTURE in json.loads((path / "config.json").read_text())["architectures"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def save_eagle3(
    path: str | Path, config: Eagle3Config, params: Params, vocab: DraftVocab, dtype=np.float32, *, overwrite: bool = False
) -> None:
    """Write `path/model.safetensors` and `path/config.json`; weights stored as `dtype`.

    Written into a directory beside `path` (other files of `path` hard-linked in), renamed into
    place: a failed or killed write leaves the previous export. Non-finite weights are a ValueError
    naming the tensor; a `path` holding anything but an EAGLE-3 draft is refused unless `overwrite`.
    """
    path = Path(path)
    if not overwrite and not _is_eagle3_export(path):
        raise FileExistsError(f"{path} holds something other than an EAGLE-3 draft; pass overwrite=True to replace it")
    tensors = {}
    for name, torch_name in TORCH_NAMES.items():
        array = np.asarray(params[name], np.float32)
        tensors[torch_name] = (array.T if array.ndim == 2 else array).astype(dtype)
        if not np.isfinite(tensors[torch_name].astype(np.float32)).all():
            raise ValueError(f"{path}: refusing to save tensor {torch_name!r}: it holds non-finite values")
    tensors["d2t"] = np.asarray(vocab.d2t, np.int64)
    tensors["t2d"] = np.asarray(vocab.t2d, np.bool_)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.partial")
    previous = staging.with_suffix(".previous")
    try:
        if path.is_dir():  # files other than ours stay, hard-linked
            top_level_files = lambda directory, names: FILES if Path(directory) == path else ()
            shutil.copytree(path, staging, symlinks=True, ignore=top_level_files, copy_function=os.link)
        else:
            staging.mkdir()
        write_safetensors(staging / "model.safetensors", tensors)
        dtype_name = "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name
        (staging / "config.json").write_text(json.dumps(config_to_json(config, dtype_name), indent=2) + "\n")
        if path.exists():
            path.rename(previous)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(previous) if previous.is_dir() else previous.unlink(missing_ok=True)


def load_eagle3(
    path: str | Path, *, target_vocab_size: int | None = None, dtype=jnp.float32
) -> tuple[Eagle3Config, Params, DraftVocab]:
    """Read a draft directory; params in [in, out] layout as `dtype`.

    Raises ValueError naming any missing, unexpected, mis-shaped or non-finite tensor, an
    inconsistent d2t/t2d pair, or a target vocabulary other than `target_vocab_size` (when given).
    """
    path = Path(path)
    config = config_from_json(json.loads((path / "config.json").read_text()))
    if target_vocab_size is not None and config.target_vocab_size != target_vocab_size:
        raise ValueError(
            f"{path}: draft was trained for a target vocabulary of {config.target_vocab_size} "
            f"tokens, the target has {target_vocab_size}"
        )
    tensors = read_safetensors(path / "model.safetensors")
    expected = {
        torch_name: (shape[::-1] if len(shape) == 2 else shape)
        for name, shape in config.param_shapes().items()
        for torch_name in [TORCH_NAMES[name]]
    }
    expected["d2t"] = (config.draft_vocab_size,)
    expected["t2d"] = (config.target_vocab_size,)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, expected {shape}")
    d2t, t2d = tensors["d2t"].astype(np.int64), tensors["t2d"].astype(np.bool_)
    target_ids = np.arange(config.draft_vocab_size) + d2t
    if not np.array_equal(np.flatnonzero(t2d), np.sort(target_ids)):
        raise ValueError(f"{path}: d2t and t2d describe different draft vocabularies")
    params = {}
    for name, torch_name in TORCH_NAMES.items():
        array = tensors[torch_name].astype(np.float32)
        if not np.isfinite(array).all():
            raise ValueError(f"{path}: tensor {torch_name!r} holds non-finite values")
        params[name] = jnp.asarray(array.T if array.ndim == 2 else array, dtype)
    vocab = DraftVocab(d2t=jnp.asarray(d2t, jnp.int32), t2d=jnp.asarray(t2d))
    return config, params, vocab
