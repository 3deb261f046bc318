"""GGUF checkpoints (llama.cpp): architecture `llama`, any tensor type gguf can dequantize.

F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants are dequantized to float32 with
`gguf.quants.dequantize`, then cast. llama.cpp stores attn_q / attn_k rows permuted for its
interleaved RoPE; `unpermute` restores the Hugging Face (rotate-half) order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
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


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


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
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens) if tokens else None)
    eos_ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // num_heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=GGUF_NAMES["lm_head"] not in tensor_names,
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


class _GGUFTensors(Mapping):
    """Lazy name -> float32 torch-layout array, dequantized and with Q/K un-permuted."""

    def __init__(self, reader: GGUFReader, config: ModelConfig):
        self._tensors = {t.name: t for t in reader.tensors}
        self._heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        weight = dequantize(tensor.data, tensor.tensor_type)  # [out, in] (GGUF lists dims reversed)
        kind = name.split(".")[-2]
        if kind in self._heads and weight.ndim == 2 and weight.shape[0] % (2 * self._heads[kind]) == 0:
            weight = unpermute(weight, self._heads[kind])  # (other shapes fail validation, by name)
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, llama.Params]:
    """Load a .gguf file into (config, params) of the given dtype."""
    reader = GGUFReader(path)
    config = load_config(reader)
    return config, assemble_params(config, _GGUFTensors(reader, config), GGUF_NAMES, dtype)
