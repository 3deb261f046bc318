"""Medusa-1 heads in vLLM's layout (`vllm/model_executor/models/medusa.py`).

config.json: `architectures: ["MedusaModel"]`, `model_type: "medusa"`, `hidden_size`,
`vocab_size` (the target's), `num_heads`, `num_hidden_layers` (residual layers per head),
`truncated_vocab_size`, `medusa_fc_bias`, and vLLM's unused `max_paths` / `topk`. The original
Medusa repository's names `medusa_num_heads` / `medusa_num_layers` are read too (vLLM renames them).
Tensors (torch [out, in] matrices): `blocks.{k}.layers.{l}.weight` [H, H] and `.bias` [H],
`lm_heads.{k}.weight` [Vt, H], and `token_map` [Vt] int64 when Vt < vocab_size; a `medusa_heads.`
prefix is accepted. specjax adds `specjax_topk_accuracy` to config.json ([K][R] held-out rates at
which the target's token is rank r of head k), which sizes static trees (drafters/medusa.py).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checkpoints.draft_files import read_weights, write_draft
from specjax.checkpoints.hf import read_json
from specjax.models.medusa import MedusaConfig, Params

ARCHITECTURES = ("MedusaModel",)
ACCURACY_KEY = "specjax_topk_accuracy"


def save_medusa(
    path: str | Path, config: MedusaConfig, params: Params, token_map, dtype=np.float32, *,
    topk_accuracy: list[list[float]] | None = None, overwrite: bool = False,
) -> None:
    """Write the heads in vLLM's layout, weights as `dtype` (atomic; `draft_files.write_draft`)."""
    raw = {
        "architectures": list(ARCHITECTURES),
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.truncated_vocab_size,
        "medusa_fc_bias": True,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name,
    }
    if topk_accuracy is not None:
        raw[ACCURACY_KEY] = [[round(float(a), 5) for a in head] for head in topk_accuracy]
    tensors = {}
    for k, head in enumerate(params["heads"]):
        for l, layer in enumerate(head["layers"]):
            tensors[f"blocks.{k}.layers.{l}.weight"] = np.asarray(layer["weight"], np.float32).T.astype(dtype)
            tensors[f"blocks.{k}.layers.{l}.bias"] = np.asarray(layer["bias"], np.float32).astype(dtype)
        tensors[f"lm_heads.{k}.weight"] = np.asarray(head["lm_head"], np.float32).T.astype(dtype)
    if config.truncated_vocab_size < config.vocab_size:
        tensors["token_map"] = np.asarray(token_map, np.int64)
    write_draft(path, tensors, raw, ARCHITECTURES, "a Medusa draft", overwrite=overwrite)


def _config(raw: dict, where: Path) -> MedusaConfig:
    def key(*names):
        for name in names:
            if name in raw:
                return raw[name]
        raise ValueError(f"{where}: missing key {names[0]!r}")

    if raw.get("original_lm_head"):
        raise ValueError(f"{where}: original_lm_head (one LM head shared by every head) is not supported")
    vocab_size = int(key("vocab_size"))
    return MedusaConfig(
        num_heads=int(key("num_heads", "medusa_num_heads")),
        hidden_size=int(key("hidden_size")),
        vocab_size=vocab_size,
        truncated_vocab_size=int(raw.get("truncated_vocab_size") or vocab_size),
        num_layers=int(key("num_hidden_layers", "medusa_num_layers")),
    )


def load_medusa(
    path: str | Path, *, target_vocab_size: int | None = None, dtype=jnp.float32
) -> tuple[MedusaConfig, Params, jnp.ndarray, list[list[float]] | None]:
    """Read a Medusa directory: (config, params [in, out] as `dtype`, token_map [Vt], top-k accuracy or None).

    ValueError naming a missing key, a missing, unexpected, mis-shaped or non-finite tensor, a
    token_map with repeated or out-of-range ids, or a vocabulary other than `target_vocab_size`.
    """
    path = Path(path)
    raw = read_json(path / "config.json", "Medusa config")
    config = _config(raw, path / "config.json")
    if target_vocab_size is not None and config.vocab_size != target_vocab_size:
        raise ValueError(f"{path}: Medusa heads were trained for a vocabulary of {config.vocab_size} tokens, the target has {target_vocab_size}")
    tensors = {name.removeprefix("medusa_heads."): array for name, array in read_weights(path).items()}
    H, Vt = config.hidden_size, config.truncated_vocab_size
    expected = {}
    for k in range(config.num_heads):
        for l in range(config.num_layers):
            expected[f"blocks.{k}.layers.{l}.weight"] = (H, H)
            expected[f"blocks.{k}.layers.{l}.bias"] = (H,)
        expected[f"lm_heads.{k}.weight"] = (Vt, H)
    if Vt < config.vocab_size:
        expected["token_map"] = (Vt,)
    optional_bias = not raw.get("medusa_fc_bias", True)  # vLLM's default is no bias
    missing = sorted(n for n in set(expected) - set(tensors) if not (optional_bias and n.endswith(".bias")))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, array in tensors.items():
        if tuple(array.shape) != expected[name]:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, expected {expected[name]}")
        if name != "token_map" and not np.isfinite(array.astype(np.float32)).all():
            raise ValueError(f"{path}: tensor {name!r} holds non-finite values")
    token_map = tensors["token_map"].astype(np.int64) if "token_map" in tensors else np.arange(Vt)
    if token_map.min() < 0 or token_map.max() >= config.vocab_size or len(np.unique(token_map)) != Vt:
        raise ValueError(f"{path}: token_map holds ids outside the vocabulary [0, {config.vocab_size}) or repeats one")
    as_param = lambda array: jnp.asarray(array.astype(np.float32), dtype)
    layer = lambda k, l: {
        "weight": as_param(tensors[f"blocks.{k}.layers.{l}.weight"].T),
        "bias": as_param(tensors.get(f"blocks.{k}.layers.{l}.bias", np.zeros(H, np.float32))),
    }
    params = {
        "heads": [
            {"layers": [layer(k, l) for l in range(config.num_layers)], "lm_head": as_param(tensors[f"lm_heads.{k}.weight"].T)}
            for k in range(config.num_heads)
        ]
    }
    return config, params, jnp.asarray(token_map, jnp.int32), raw.get(ACCURACY_KEY)
