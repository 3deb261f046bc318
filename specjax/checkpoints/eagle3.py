"""EAGLE-3 drafts in the Hugging Face layout that vLLM, SGLang, SpecForge and the EAGLE reference read and write.

A draft directory holds a Llama-style `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`,
`draft_vocab_size`, optional `eagle_config.eagle_aux_hidden_state_layer_ids` and
`norm_before_residual`) and torch-named weights ([out, in] matrices): `fc`, `midlayer.*` (or
`layers.0.*`), `norm`, `lm_head`, optionally `embed_tokens` (the draft's own input embedding),
`d2t` int64 and `t2d` bool (optional for a full-vocabulary draft), in `model.safetensors`,
`pytorch_model.bin` (read without running pickle code) or the shards of either's `.index.json`.
What is read, written and refused, and why: docs/architecture.md, "Checkpoint formats".
"""

from __future__ import annotations

import collections
import dataclasses
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

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checkpoints.hf import check_safetensors, read_json
from specjax.models.config import _rope
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
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SpecForge/EAGLE, vLLM
FILES = ("model.safetensors", "config.json")
# Config keys that change the forward, with the one value implemented here (an absent key has it).
FIXED_KEYS = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bias": False,  # SGLang: a bias on fc
    "tie_word_embeddings": False,
    "logit_scale": 1.0,  # vLLM
    "partial_rotary_factor": 1.0,
    "quantization_config": None,
}
FIXED_EAGLE_KEYS = {  # eagle_config (SpecForge, ModelOpt); any key not here or below is refused
    "use_aux_hidden_state": True,
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp": False,
}
TAPS_KEY = "eagle_aux_hidden_state_layer_ids"  # decoder layers whose OUTPUTS fc reads (SpecForge, SGLang)

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


def config_to_json(config: Eagle3Config, dtype: str, target: dict | None = None) -> dict:
    """The config.json of a draft, read alike by the EAGLE reference, vLLM and SGLang.

    No `target_hidden_size` (it equals hidden_size; its presence makes the EAGLE reference skip
    loading the target's embedding); the taps in SpecForge's convention when known; `target`
    (e.g. {"name_or_path": ...}) is recorded as `target_model`.
    """
    raw = {
        "architectures": [ARCHITECTURES[0]],
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
        "rope_scaling": None if config.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if config.tap_layers is not None:
        if min(config.tap_layers) < 1:
            raise ValueError(f"tap layers {config.tap_layers}: layer 0's input (the embeddings) has no {TAPS_KEY} id")
        raw["eagle_config"] = {TAPS_KEY: [layer - 1 for layer in config.tap_layers], "use_aux_hidden_state": True}
    if target is not None:
        raw["target_model"] = target
    return raw


def config_from_json(raw: dict) -> Eagle3Config:
    """Eagle3Config from a draft's config.json; ValueError naming any key whose value this forward does not implement.

    Missing draft_vocab_size means the full vocabulary; the rope is read in both styles
    (rope_theta + rope_scaling, or transformers 5's rope_parameters).
    """
    if "speculators_config" in raw or "Eagle3Speculator" in (raw.get("architectures") or ()):
        raise ValueError("the speculators format is not read (docs/architecture.md, Checkpoint formats)")
    if not set(ARCHITECTURES) & set(raw.get("architectures") or ()):
        raise ValueError(f"architectures {raw.get('architectures')} name no EAGLE-3 draft ({', '.join(ARCHITECTURES)})")
    if TAPS_KEY in raw:
        raise ValueError(f"top-level {TAPS_KEY} (vLLM's convention) is not read; specjax reads eagle_config.{TAPS_KEY}")
    eagle = raw.get("eagle_config") or {}
    unknown = sorted(set(eagle) - set(FIXED_EAGLE_KEYS) - {TAPS_KEY})
    if unknown:
        raise ValueError(f"eagle_config keys {unknown} are not implemented")
    for given, fixed in ((raw, FIXED_KEYS), (eagle, FIXED_EAGLE_KEYS)):
        for key, value in fixed.items():
            if given.get(key, value) != value:
                raise ValueError(f"{key}={given[key]!r} is not implemented (only {value!r})")
    if raw.get("target_hidden_size", raw["hidden_size"]) != raw["hidden_size"]:
        raise ValueError(f"target_hidden_size {raw['target_hidden_size']} != hidden_size {raw['hidden_size']} is not implemented")
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    taps = eagle.get(TAPS_KEY)
    if taps is not None and not all(isinstance(layer, int) for layer in taps):
        raise ValueError(f"eagle_config.{TAPS_KEY} must be layer indices, got {taps!r}")
    return Eagle3Config(
        hidden_size=raw["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        intermediate_size=raw["intermediate_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_vocab_size=raw["vocab_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        tap_layers=None if taps is None else tuple(layer + 1 for layer in taps),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def _is_eagle3_export(path: Path) -> bool:
    """path is absent, an empty directory, or a directory whose config.json names an EAGLE-3 architecture."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return True
    try:
        return bool(set(ARCHITECTURES) & set(json.loads((path / "config.json").read_text())["architectures"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def save_eagle3(
    path: str | Path, config: Eagle3Config, params: Params, vocab: DraftVocab, dtype=np.float32, *,
    overwrite: bool = False, target: dict | None = None,
) -> None:
    """Write `path/model.safetensors` and `path/config.json`; weights stored as `dtype`.

    Written into a directory beside `path` (other files of `path` hard-linked in), renamed into
    place: a failed or killed write leaves the previous export. Non-finite weights are a ValueError
    naming the tensor; a `path` holding anything but an EAGLE-3 draft is refused unless `overwrite`.
    `target` identifies the target model in config.json (`target_model`).
    """
    path = Path(path)
    if not overwrite and not _is_eagle3_export(path):
        raise FileExistsError(f"{path} holds something other than an EAGLE-3 draft; pass overwrite=True to replace it")
    dtype_name = "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name
    raw_config = config_to_json(config, dtype_name, target)
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
        (staging / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
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

    params holds the head (Eagle3Config.param_shapes) and, when the draft ships its own input
    embedding, `embed_tokens` [V, H] (vLLM embeds with it in place of the target's). A
    full-vocabulary draft may omit d2t and t2d; t2d, when absent, follows from d2t.
    Raises ValueError naming any config key this forward does not implement, any missing,
    unexpected, mis-shaped or non-finite tensor, an inconsistent d2t/t2d pair, or a target
    vocabulary other than `target_vocab_size` (when given).
    """
    path = Path(path)
    raw = read_json(path / "config.json", "EAGLE-3 draft config")
    try:
        config = config_from_json(raw)
    except KeyError as error:
        raise ValueError(f"{path / 'config.json'}: missing key {error}") from None
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path / 'config.json'}: {error}") from None
    if target_vocab_size is not None and config.target_vocab_size != target_vocab_size:
        raise ValueError(
            f"{path}: draft was trained for a target vocabulary of {config.target_vocab_size} "
            f"tokens, the target has {target_vocab_size}"
        )
    tensors = {}
    for name, array in read_weights(path).items():  # vLLM's multi-layer names: layers.0.* is midlayer.*
        name = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
        if name in tensors:
            raise ValueError(f"{path}: tensor {name!r} appears both as midlayer.* and layers.0.*")
        tensors[name] = array
    vocab_size, draft_vocab_size = config.target_vocab_size, config.draft_vocab_size
    required = {
        TORCH_NAMES[name]: (shape[::-1] if len(shape) == 2 else shape) for name, shape in config.param_shapes().items()
    }
    optional = {"embed_tokens.weight": (vocab_size, config.hidden_size), "d2t": (draft_vocab_size,), "t2d": (vocab_size,)}
    if draft_vocab_size < vocab_size:  # a draft vocabulary needs its map
        required["d2t"] = optional.pop("d2t")
    missing = sorted(set(required) - set(tensors))
    unexpected = sorted(set(tensors) - set(required) - set(optional))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, shape in (required | optional).items():
        if name in tensors and tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, expected {shape}")
    d2t = tensors["d2t"].astype(np.int64) if "d2t" in tensors else np.zeros(draft_vocab_size, np.int64)
    target_ids = np.arange(draft_vocab_size) + d2t  # [Vd]
    if target_ids.min() < 0 or target_ids.max() >= vocab_size or len(np.unique(target_ids)) != draft_vocab_size:
        raise ValueError(f"{path}: d2t maps draft tokens outside the target vocabulary or two onto one")
    t2d = np.zeros(vocab_size, np.bool_)
    t2d[target_ids] = True
    if "t2d" in tensors and not np.array_equal(tensors["t2d"].astype(np.bool_), t2d):
        raise ValueError(f"{path}: d2t and t2d describe different draft vocabularies")
    params = {}
    names = {**TORCH_NAMES, **({"embed_tokens": "embed_tokens.weight"} if "embed_tokens.weight" in tensors else {})}
    for name, torch_name in names.items():
        array = tensors[torch_name].astype(np.float32)
        if not np.isfinite(array).all():
            raise ValueError(f"{path}: tensor {torch_name!r} holds non-finite values")
        params[name] = jnp.asarray(array.T if array.ndim == 2 and name != "embed_tokens" else array, dtype)
    vocab = DraftVocab(d2t=jnp.asarray(d2t, jnp.int32), t2d=jnp.asarray(t2d))
    return config, params, vocab
