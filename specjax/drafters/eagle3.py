"""EAGLE-3 drafting: a chain, or an EAGLE-2 dynamic tree, from the trained draft head.

The head (models/eagle3.py) fuses three target layers (`fc`) into its feature input and
predicts a draft vocabulary (d2t maps it to target ids). Drafting, reading the committed path
and the tree grower are shared with EAGLE-1 (drafters/feature_draft.py).
"""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.checkpoints.eagle3 import load_eagle3
from specjax.drafters.base import TREE, Method, Priors
from specjax.drafters.feature_draft import FeatureDrafter, HeadShape
from specjax.models import block_matmul, eagle3
from specjax.models.llama import Taps


def default_draft_path() -> Path:
    """The shipped SmolLM2-135M-Instruct EAGLE-3 draft (package data of specjax.drafts)."""
    path = Path(importlib.resources.files("specjax.drafts")) / "smollm2-135m-eagle3"
    if not (path / "config.json").exists():
        raise ValueError(f"no default EAGLE-3 draft at {path}; pass --draft PATH")
    return path


class Eagle3Drafter(FeatureDrafter):
    def __init__(
        self,
        head_config: eagle3.Eagle3Config,
        head_params,
        vocab: eagle3.DraftVocab,
        embed_tokens: jax.Array,
        *,
        depth: int = 5,
        top_k: int = 1,
        tree_nodes: int | None = None,
        feature_layers: tuple[int, ...],
        chunk_size: int = 256,
    ):
        c = head_config
        shape = HeadShape("EAGLE-3 draft", c.hidden_size, c.num_kv_heads, c.head_dim, c.draft_vocab_size, c.target_vocab_size)
        super().__init__(shape, Taps(layer_inputs=tuple(feature_layers)), depth=depth, top_k=top_k, tree_nodes=tree_nodes, chunk_size=chunk_size)
        self.head_config = head_config
        self.params = {"head": head_params, "d2t": vocab.d2t, "embed_tokens": embed_tokens}
        self.matmuls = "xla"  # the head's `block_matmul` mode (`with_matmuls`)

    def with_matmuls(self, mode: str) -> Eagle3Drafter:
        """Under "streamed" the head's matrices are held in bfloat16, as EAGLE-3 drafts are trained and
        stored (a float32 checkpoint's are rounded), and stream through the kernel with float32
        activations: half the bytes, and the whole head stays in a CPU's last-level cache between
        the forwards of a chain (docs/architecture.md, "Streamed block matmuls")."""
        if mode == self.matmuls:
            return self
        if self.matmuls != "xla":
            raise ValueError(f"this EAGLE-3 drafter's matmuls are already {self.matmuls!r}")
        head = self.params["head"]
        if mode == "streamed":
            head = {name: w.astype(jnp.bfloat16) if w.ndim == 2 else w for name, w in head.items()}
        block_matmul.check(mode, {name: w for name, w in head.items() if w.ndim == 2}, weight_dtype="bfloat16")
        if mode == "streamed":
            head = block_matmul.pack_matrices(head)
        variant = copy.copy(self)
        variant.matmuls, variant.params = mode, self.params_with_head(head)
        return variant

    def params_with_head(self, head_params: eagle3.Params):
        """This drafter's params pytree with other head weights (e.g. a draft being trained)."""
        return {**self.params, "head": head_params}

    @property
    def dtype(self):
        return eagle3.activation_dtype(self.params["head"])

    def _head(self, params, cache, tokens, hidden, positions, block_mask) -> eagle3.Eagle3Output:
        embeddings = params["embed_tokens"][tokens]  # [B, T, H]
        return eagle3.forward(
            params["head"], self.head_config, embeddings, hidden, positions, cache, block_mask,
            chunk_size=self.chunk_size, matmuls=self.matmuls,
        )

    def _logits(self, params, hidden):
        return eagle3.head_logits(params["head"], self.head_config, hidden, self.matmuls)

    def _project(self, params, features):
        return eagle3.project_features(params["head"], features, self.matmuls)

    def _to_target(self, params, draft_ids):
        return eagle3.draft_to_target(draft_ids, params["d2t"])


def _build(spec, context) -> Eagle3Drafter:
    head_config, head_params, vocab = load_eagle3(
        context.draft_path or default_draft_path(), target_vocab_size=context.target_config.vocab_size, dtype=context.dtype
    )
    embed_tokens = head_params.pop("embed_tokens", context.target_params["embed_tokens"])  # the draft's own, as vLLM
    depth, top_k, nodes = spec.shape or (spec.num_spec, 1, spec.num_spec)
    return Eagle3Drafter(
        head_config, head_params, vocab, embed_tokens, depth=depth, top_k=top_k,
        tree_nodes=nodes, feature_layers=head_config.target_taps(context.target_config.num_layers),
    )


METHOD = Method(
    "eagle3",
    "the EAGLE-3 draft head: a chain, or an EAGLE-2 dynamic tree DEPTH,TOPK,NODES",
    build=_build,
    num_spec=3,
    shape=(TREE, None),
    draft="an EAGLE-3 draft directory (default: the shipped SmolLM2-135M-Instruct draft)",
    priors=Priors(
        alpha={"chat": 0.7, "code": 0.75, "structured": 0.75, "long-form": 0.65, "creative": 0.55},
        temperature_decay=0.35,
        draft_cost=0.05,
    ),
)
