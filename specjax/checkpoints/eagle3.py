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

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checkpoints.draft_files import layer_config_fields, layer_config_json, read_weights, write_draft
from specjax.checkpoints.hf import read_json
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

def config_to_json(config: Eagle3Config, dtype: str, target: dict | None = None) -> dict:
    """The config.json of a draft, read alike by the EAGLE reference, vLLM and SGLang.

    No `target_hidden_size` (it equals hidden_size; its presence makes the EAGLE reference skip
    loading the target's embedding); the taps in SpecForge's convention when known; `target`
    (e.g. {"name_or_path": ...}) is recorded as `target_model`.
    """
    raw = {
        "architectures": [ARCHITECTURES[0]],
        **layer_config_json(config),
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
    taps = eagle.get(TAPS_KEY)
    if taps is not None and not all(isinstance(layer, int) for layer in taps):
        raise ValueError(f"eagle_config.{TAPS_KEY} must be layer indices, got {taps!r}")
    return Eagle3Config(
        **layer_config_fields(raw),
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_vocab_size=raw["vocab_size"],
        tap_layers=None if taps is None else tuple(layer + 1 for layer in taps),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def save_eagle3(
    path: str | Path, config: Eagle3Config, params: Params, vocab: DraftVocab, dtype=np.float32, *,
    overwrite: bool = False, target: dict | None = None,
) -> None:
    """Write `path/model.safetensors` and `path/config.json`; weights stored as `dtype`.

    Atomic, non-finite weights refused, a `path` holding anything but an EAGLE-3 draft refused
    unless `overwrite` (`checkpoints.export.write_draft`). `target` identifies the target model
    in config.json (`target_model`).
    """
    dtype_name = "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name
    raw_config = config_to_json(config, dtype_name, target)
    tensors = {}
    for name, torch_name in TORCH_NAMES.items():
        array = np.asarray(params[name], np.float32)
        tensors[torch_name] = (array.T if array.ndim == 2 else array).astype(dtype)
    tensors["d2t"] = np.asarray(vocab.d2t, np.int64)
    tensors["t2d"] = np.asarray(vocab.t2d, np.bool_)
    write_draft(path, tensors, raw_config, ARCHITECTURES, "an EAGLE-3 draft", overwrite=overwrite)


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
