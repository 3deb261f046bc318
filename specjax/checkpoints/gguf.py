"""GGUF checkpoints (llama.cpp): architecture `llama`, any tensor type gguf can dequantize.

F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants are dequantized to float32 with
`gguf.quants.dequantize`, then cast. llama.cpp stores attn_q / attn_k rows permuted for its
interleaved RoPE; `unpermute` restores the Hugging Face (rotate-half) order.

A bad file is a ValueError naming it and the problem, before any compilation: every read of
the header and every tensor's data range is checked against the file length (a truncated file
names the tensor it cuts), an unreadable header, missing metadata keys, and a tensor holding
NaN or inf once dequantized (`assemble_params` checks every weight) are all named.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from specjax.checkpoints.hf import assemble_params
from specjax.models import llama
from specjax.models.config import ModelConfig

GGUF_NAMES = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "input_layernorm": "blk.{i}.attn_norm.weight",
    "q_proj": "blk.{i}.attn_q.weight",
    "k_proj": "blk.{i}.attn_k.weight",
    "v_proj": "blk.{i}.attn_v.weight",
    "o_proj": "blk.{i}.attn_output.weight",
    "post_attention_layernorm": "blk.{i}.ffn_norm.weight",
    "gate_proj": "blk.{i}.ffn_gate.weight",
    "up_proj": "blk.{i}.ffn_up.weight",
    "down_proj": "blk.{i}.ffn_down.weight",
}


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation of a torch-layout [out, in] weight."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class _Truncated(Exception):
    """A read past the end of the file (raised inside the reader, turned into a named ValueError)."""


class _CheckedReader(GGUFReader):
    """GGUFReader that checks every read, and every tensor's data range, against the file length.

    The stock reader slices its memory map, so a short file surfaces as an IndexError or a failed
    reshape; and a corrupt array length could make it loop over the whole file. These overrides
    only add checks before delegating.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(f"the header needs bytes up to {end}, the file has {len(self.data)}")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:  # a corrupt length would loop over the file element by element
            item_type = int(self._get(orig_offs, np.uint32)[0])
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
            smallest = np.dtype(scalar).itemsize if scalar is not None else 8  # strings, arrays: >= 8 bytes
            if length * smallest > len(self.data) - orig_offs - 12:
                raise _Truncated(f"a metadata array of {length} items runs past the end of the file ({len(self.data)} bytes)")
            if item_type == GGUFValueType.STRING and self.byte_order == "I":
                return self._string_array_parts(orig_offs, length)
            if scalar is not None:
                return self._scalar_array_parts(orig_offs, length, GGUFValueType(item_type), scalar)
        return super()._get_field_parts(orig_offs, raw_type)

    def _scalar_array_parts(self, orig_offs: int, length: int, item_type: GGUFValueType, scalar):
        """An array of numbers (a tokenizer's 49k token types) read in one block, then split into the
        stock reader's one-item parts and indices (its item-by-item reads cost ~2 s there)."""
        values = self._get(orig_offs + 12, scalar, length)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        parts += [values[i : i + 1] for i in range(length)]
        types = [GGUFValueType.ARRAY] + ([item_type] if length else [])
        return 12 + int(values.nbytes), parts, list(range(2, 2 + length)), types

    def _string_array_parts(self, orig_offs: int, length: int):
        """An array of strings (a tokenizer's vocabulary and merges: ~100k items) read as the stock
        reader reads it, the same parts and indices, but without its per-item overhead (~9 s -> ~0.3 s)."""
        data = np.asarray(self.data)  # a plain view: slicing the memory map itself costs more per item
        size = len(data)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        indices = []
        offs = orig_offs + 12
        for _ in range(length):
            if offs + 8 > size:
                raise _Truncated(f"the header needs bytes up to {offs + 8}, the file has {size}")
            (count,) = struct.unpack_from("<Q", data, offs)
            if offs + 8 + count > size:
                raise _Truncated(f"the header needs bytes up to {offs + 8 + count}, the file has {size}")
            parts += [data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + count]]
            indices.append(len(parts) - 1)
            offs += 8 + count
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if length else [])
        return offs - orig_offs, parts, indices, types

    def _build_tensors(self, start_offs, fields):
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise _Truncated(f"tensor {name} has unknown type {int(raw_type[0])}; the header is corrupt") from None
            n_bytes = int(np.prod(dims, dtype=object)) * type_size // block_size
            end = int(start_offs) + int(offset[0]) + n_bytes
            if end > len(self.data):
                raise _Truncated(
                    f"truncated: tensor {name} needs bytes up to {end}, the file has {len(self.data)}"
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader over `path`, or ValueError naming the file and why it cannot be read."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file, not a GGUF")
    try:
        return _CheckedReader(path)
    except _Truncated as exc:
        message = str(exc) if str(exc).startswith("truncated") else f"truncated or corrupt GGUF: {exc}"
        raise ValueError(f"{path}: {message}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"missing metadata key {key}")
    return value


def load_config(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF metadata (`llama.*` keys and the tokenizer's special ids)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    tensor_names = {t.name for t in reader.tensors}
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"unsupported GGUF rope scaling ({scaling if scaling != 'none' else 'rope_freqs.weight'}); "
            "load the Hugging Face checkpoint instead"
        )
    hidden = int(_required(reader, "llama.embedding_length"))
    num_heads = int(_required(reader, "llama.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError("missing metadata key llama.vocab_size (and no tokenizer.ggml.tokens to count)")
    eos_ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, "llama.feed_forward_length")),
        num_layers=int(_required(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // num_heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=GGUF_NAMES["lm_head"] not in tensor_names,
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


class _GGUFTensors(Mapping):
    """Lazy name -> float32 torch-layout array, dequantized and with Q/K un-permuted."""

    def __init__(self, reader: GGUFReader, config: ModelConfig, path: Path):
        self._path = path
        self._tensors = {t.name: t for t in reader.tensors}
        self._heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # corrupt scales: assemble_params names the tensor
                weight = dequantize(tensor.data, tensor.tensor_type)  # [out, in] (GGUF lists dims reversed)
        except (NotImplementedError, ValueError) as exc:
            type_name = tensor.tensor_type.name
            raise ValueError(f"{self._path}: tensor {name}: cannot dequantize type {type_name} ({exc})") from exc
        kind = name.split(".")[-2]
        if kind in self._heads and weight.ndim == 2 and weight.shape[0] % (2 * self._heads[kind]) == 0:
            weight = unpermute(weight, self._heads[kind])  # (other shapes fail validation, by name)
        return weight

    def __contains__(self, name: object) -> bool:  # Mapping's default would dequantize the tensor
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, llama.Params]:
    """Load a .gguf file into (config, params) of the given dtype (ValueError naming a bad file)."""
    path = Path(path)
    reader = open_gguf(path)
    try:
        config = load_config(reader)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return config, assemble_params(config, _GGUFTensors(reader, config, path), GGUF_NAMES, dtype, source=path)


def transformers_model(path: str | Path) -> Any:
    """The same GGUF as a float32 torch model, read by transformers' own GGUF reader.

    The independent reference that `scripts/bench_target.py` and the tests compare specjax
    against (its dequantization and Q/K handling are not ours). Needs torch.
    (`from_pretrained(gguf_file=...)` would also need accelerate.)
    """
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: transformers found missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model.eval()
