"""Tensor-parallel layouts for params and the KV cache on a ("data", "model") mesh.

Megatron-style: q/k/v/gate/up are split by output column over "model", o/down by input row,
so each layer needs one all-reduce after attention and one after the MLP. Embeddings and the
LM head are split over the vocabulary. The cache is split over batch ("data") and KV heads
("model"), matching the k/v column split. An axis is split only where its size divides evenly;
otherwise that dimension stays replicated (same results, less parallelism).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.kv_cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.llama import Params, param_shapes

DATA, MODEL = "data", "model"

# Which dimension of each weight is split over "model"; absent = replicated.
_MODEL_DIM = {
    "embed_tokens": 0,  # [V, H] vocab
    "lm_head": 1,  # [H, V] vocab
    "q_proj": 1,  # [H, Hq*D] columns
    "k_proj": 1,
    "v_proj": 1,
    "q_bias": 0,
    "k_bias": 0,
    "v_bias": 0,
    "o_proj": 0,  # [Hq*D, H] rows
    "gate_proj": 1,  # [H, F] columns
    "up_proj": 1,
    "down_proj": 0,  # [F, H] rows
}


def _spec(shape: tuple[int, ...], model_dim: int | None, mesh: Mesh) -> P:
    """PartitionSpec splitting dimension model_dim of the weight over "model"."""
    axes = [None] * len(shape)
    if model_dim is not None and shape[model_dim] % mesh.shape[MODEL] == 0:
        axes[model_dim] = MODEL
    return P(*axes)


def param_specs(config: ModelConfig, mesh: Mesh) -> Params:
    """PartitionSpecs with the structure of the params pytree."""
    shapes = param_shapes(config)
    # Attention projections are split on head boundaries only.
    heads_divide = config.num_heads % mesh.shape[MODEL] == 0
    kv_heads_divide = config.num_kv_heads % mesh.shape[MODEL] == 0
    splittable = {"q_proj": heads_divide, "q_bias": heads_divide, "o_proj": heads_divide}
    splittable |= {key: kv_heads_divide for key in ("k_proj", "k_bias", "v_proj", "v_bias")}

    def model_dim(key: str) -> int | None:
        return _MODEL_DIM.get(key) if splittable.get(key, True) else None

    specs = {key: _spec(shape, model_dim(key), mesh) for key, shape in shapes.items() if key != "layers"}
    specs["layers"] = [{key: _spec(shape, model_dim(key), mesh) for key, shape in layer.items()} for layer in shapes["layers"]]
    return specs


def cache_specs(config: ModelConfig, mesh: Mesh) -> KVCache:
    """PartitionSpecs for a KVCache: batch over "data", KV heads over "model" (when they divide)."""
    heads = MODEL if config.num_kv_heads % mesh.shape[MODEL] == 0 else None
    kv = P(None, DATA, heads, None, None)  # [L, B, Hkv, S, D]
    return KVCache(k=kv, v=kv, lengths=P(DATA))


def shard_params(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """Place params on the mesh with the tensor-parallel layout."""
    specs = param_specs(config, mesh)
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs)


def shard_cache(cache: KVCache, config: ModelConfig, mesh: Mesh) -> KVCache:
    """Place a KVCache on the mesh (its batch size must divide by the "data" axis)."""
    specs = cache_specs(config, mesh)
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), cache, specs)
