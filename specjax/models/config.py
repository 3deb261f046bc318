"""The target model's static configuration, and its mapping from Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
# config.json keys without a default, each a positive integer.
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: Llama 2/3.x, SmolLM2, Mistral, Qwen2, Qwen3.

    Frozen and hashable, so it can be a static argument of `jax.jit`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (G in [B, T, Hkv, G, D])."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config.json (model_type llama, qwen2, qwen3 or mistral).

        Reads both rope formats: `rope_theta` + `rope_scaling` (transformers 4) and
        `rope_parameters` (transformers 5). A sliding attention window is exact while the
        context fits in it, so it caps `max_position_embeddings` instead of being modelled.
        Raises ValueError for anything this model cannot reproduce exactly.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        if hf.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True")
        if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
            raise ValueError(f"unsupported attention_bias=True for {model_type} (it adds an o_proj bias)")
        missing = [key for key in REQUIRED_HF_KEYS if key not in hf]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(missing)}")
        for key in (*REQUIRED_HF_KEYS, "num_key_value_heads", "head_dim"):
            if hf.get(key) is not None and not _positive_int(hf[key]):
                raise ValueError(f"{key} must be a positive integer, got {hf[key]!r}")

        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope(hf)
        max_positions = hf.get("max_position_embeddings", 4096)
        window = _sliding_window(hf, model_type)
        if window is not None:
            max_positions = min(max_positions, window)
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            max_position_embeddings=max_positions,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json of this model (`from_hf` of it gives it back)."""
        model_type = "qwen2" if self.attention_bias else "qwen3" if self.qk_norm else "llama"
        if self.attention_bias and self.qk_norm:
            raise ValueError("no Hugging Face model type has both q/k/v biases and q/k norms")
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling_json(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos or None,
        }


def layer_shape(target: ModelConfig) -> dict[str, Any]:
    """The fields of a one-layer draft shaped like one of `target`'s layers (EAGLE-1, EAGLE-3 drafts)."""
    return dict(
        hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta, rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings,
    )


def rope_scaling_json(scaling: Llama3RopeScaling | None) -> dict[str, Any] | None:
    """The config.json `rope_scaling` of a scaling (`_rope` reads it back)."""
    return None if scaling is None else {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def _rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either rope format; only default and llama3 rope types exist here."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, llama3")


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    """The attention window if the model uses one (Mistral always; Qwen only with use_sliding_window)."""
    if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window")):
        return hf.get("sliding_window")
    return None
