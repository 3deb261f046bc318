"""Draft checkpoint files shared by every draft format: safetensors and torch pickles read
without torch (or running pickle code), an atomic, validated export of a draft directory, the
Llama keys of a one-layer draft's config.json (EAGLE-1, EAGLE-3), and a whole draft model written
as a Hugging Face checkpoint (vanilla speculative decoding)."""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import shutil
import struct as binary
import time
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from specjax.checkpoints.hf import HF_NAMES, LINEAR_KEYS, check_safetensors, read_json
from specjax.models.config import ModelConfig, _rope, rope_scaling_json

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
_TORCH_STORAGES = {  # torch.save's storage classes -> element dtype
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bfloat16 via ml_dtypes)."""
    check_safetensors(Path(path))
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


def read_safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` strings of a .safetensors file's header ({} if it has none)."""
    check_safetensors(Path(path))
    with open(path, "rb") as file:
        (header_size,) = binary.unpack("<Q", file.read(8))
        return json.loads(file.read(header_size)).get("__metadata__", {})


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (any dtype in the safetensors table, bfloat16 included) and optional
    `__metadata__` strings."""
    header, offset, blobs = ({"__metadata__": metadata} if metadata else {}), 0, []
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


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2 over a numpy storage: a bounds-checked strided copy."""
    size, stride = tuple(map(int, size)), tuple(map(int, stride))
    reach = int(offset) + sum((n - 1) * s for n, s in zip(size, stride))
    count = math.prod(size)
    if len(size) != len(stride) or min((offset, *size, *stride)) < 0 or count > storage.size or (count and reach >= storage.size):
        raise pickle.UnpicklingError(f"a tensor of size {size}, stride {stride} at {offset} does not fit its storage")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride])
    return view.copy()


class _TensorUnpickler(pickle.Unpickler):
    """Builds only dicts, tensors (as numpy arrays) and their storages; any other global is refused."""

    GLOBALS = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): lambda data, *_: data,
        **{("torch", name): np.dtype(dtype) for name, dtype in _TORCH_STORAGES.items()},
    }

    def __init__(self, data: bytes, read_storage):
        super().__init__(io.BytesIO(data))
        self.read_storage, self.storages = read_storage, {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.GLOBALS:
            raise pickle.UnpicklingError(f"it needs {module}.{name}, which is not a tensor")
        return self.GLOBALS[module, name]

    def persistent_load(self, pid: Any) -> np.ndarray:
        # ("storage", element dtype, key, location, numel): the raw bytes are the archive's data/<key>.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], np.dtype)):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        key = str(pid[2])
        if key not in self.storages:
            self.storages[key] = np.frombuffer(self.read_storage(key), pid[1])
        return self.storages[key]


def read_torch_pickle(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a `torch.save`d state dict (zip format) without running pickle code.

    Only dicts of tensors are built (no torch needed); any other object in the pickle (a module,
    a class, a function, an int) is a ValueError naming it, and nothing of it is executed.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a zip-format torch.save file (the pre-1.6 legacy format is not read)") from None
    with archive:
        pickles = [name for name in archive.namelist() if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one <archive>/data.pkl, found {pickles}")
        prefix = pickles[0][: -len("data.pkl")]
        if prefix + "byteorder" in archive.namelist() and archive.read(prefix + "byteorder") != b"little":
            raise ValueError(f"{path}: big-endian tensors are not read")
        try:
            state = _TensorUnpickler(archive.read(pickles[0]), lambda key: archive.read(f"{prefix}data/{key}")).load()
        except (pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError, AttributeError, IndexError) as error:
            raise ValueError(f"{path}: refusing the pickle: {error}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            raise ValueError(f"{path}: holds a non-tensor payload: {name!r} is of type {type(value).__name__}")
    return dict(state)


def read_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a draft directory: model.safetensors, pytorch_model.bin or the shards of an index."""
    path = Path(path)
    for name, reader in (("model.safetensors", read_safetensors), ("pytorch_model.bin", read_torch_pickle)):
        if (path / name).is_file():
            return reader(path / name)
        index = path / f"{name}.index.json"
        if index.is_file():
            weight_map = read_json(index, "shard index").get("weight_map") or {}
            tensors = {}
            for shard in sorted(set(weight_map.values())):
                if Path(shard).name != shard or not (path / shard).is_file():
                    raise ValueError(f"{index}: shard {shard!r} is not a file of {path}")
                part = reader(path / shard)
                if set(part) & set(tensors):
                    raise ValueError(f"{index}: tensors {sorted(set(part) & set(tensors))} are in more than one shard")
                tensors |= part
            if not weight_map or set(weight_map) - set(tensors):
                raise ValueError(f"{index}: tensors {sorted(set(weight_map) - set(tensors))} are in no shard (or no weight_map)")
            return tensors
    raise FileNotFoundError(f"{path}: no model.safetensors, pytorch_model.bin, or an .index.json of their shards")


def _is_export_of(path: Path, architectures: tuple[str, ...]) -> bool:
    """path is absent, an empty directory, or a directory whose config.json names one of `architectures`."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return True
    try:
        return bool(set(architectures) & set(json.loads((path / "config.json").read_text())["architectures"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_draft(
    path: str | Path, tensors: dict[str, np.ndarray], config: dict, architectures: tuple[str, ...], what: str, *,
    overwrite: bool = False,
) -> None:
    """Write `path/model.safetensors` and `path/config.json` (which must name `architectures`).

    Written into a directory beside `path` (other files of `path` hard-linked in), renamed into
    place: a failed or killed write leaves the previous export. A non-finite floating tensor is a
    ValueError naming it; a `path` holding anything but `what` (a draft of these architectures) is
    refused unless `overwrite`.
    """
    path = Path(path)
    if not overwrite and not _is_export_of(path, architectures):
        raise FileExistsError(f"{path} holds something other than {what}; pass overwrite=True to replace it")
    for name, array in tensors.items():
        if array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16:
            if not np.isfinite(array.astype(np.float32)).all():
                raise ValueError(f"{path}: refusing to save tensor {name!r}: it holds non-finite values")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.partial")
    previous = staging.with_suffix(".previous")
    files = ("model.safetensors", "config.json")
    try:
        if path.is_dir():  # files other than ours stay, hard-linked
            top_level_files = lambda directory, names: files if Path(directory) == path else ()
            shutil.copytree(path, staging, symlinks=True, ignore=top_level_files, copy_function=os.link)
        else:
            staging.mkdir()
        write_safetensors(staging / "model.safetensors", tensors)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if path.exists():
            path.rename(previous)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(previous) if previous.is_dir() else previous.unlink(missing_ok=True)


def layer_config_json(config) -> dict[str, Any]:
    """The Llama config.json keys of a one-layer draft (a config with `models.config.layer_shape`'s fields)."""
    return {
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
        "rope_scaling": rope_scaling_json(config.rope_scaling),
        "max_position_embeddings": config.max_position_embeddings,
    }


def layer_config_fields(raw: dict) -> dict[str, Any]:
    """`models.config.layer_shape`'s fields from a one-layer draft's config.json (KeyError for a
    missing key; the rope in both styles: rope_theta + rope_scaling, or rope_parameters)."""
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    return dict(
        hidden_size=raw["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
    )


def save_model(path: str | Path, config: ModelConfig, params: dict, dtype=np.float32, *, overwrite: bool = False) -> None:
    """A Llama-family model (`specjax.models.llama` params) as a Hugging Face directory: config.json
    and model.safetensors under the names `hf.load` reads (and transformers, vLLM, SGLang)."""
    tensors = {}
    for key, value in params.items():
        if key != "layers":
            tensors[HF_NAMES[key]] = np.asarray(value).T if key in LINEAR_KEYS else np.asarray(value)
    for i, layer in enumerate(params["layers"]):
        for key, value in layer.items():
            tensors[HF_NAMES[key].format(i=i)] = np.asarray(value).T if key in LINEAR_KEYS else np.asarray(value)
    tensors = {name: np.ascontiguousarray(array.astype(dtype)) for name, array in tensors.items()}
    hf_config = {**config.to_hf(), "torch_dtype": np.dtype(dtype).name}
    write_draft(path, tensors, hf_config, tuple(hf_config["architectures"]), "a Hugging Face model", overwrite=overwrite)
