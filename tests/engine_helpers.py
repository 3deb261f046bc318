"""Helpers for the tests: tiny models and drafters, and a word-level chat tokenizer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import tree as tree_lib
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.eagle1 import Eagle1Drafter
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.lookahead import LookaheadDrafter
from specjax.drafters.medusa import MedusaDrafter, chain_paths
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.ngram_first import NgramFirst
from specjax.models import eagle1, eagle3, llama, medusa
from specjax.models.config import ModelConfig
from specjax.tree import causal_mask


def tiny_config(vocab_size: int = 96, num_layers: int = 2, hidden_size: int = 32, eos: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden_size // 4,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_ids=eos,
    )


def tiny_params(config: ModelConfig, seed: int, scale: float = 1.0):
    """Random params; `scale` sharpens the output distribution (N(0, 0.02) is near uniform)."""
    params = llama.init_params(config, jax.random.key(seed))
    return params | {"lm_head": params["lm_head"] * scale}


def eagle3_drafter(
    config: ModelConfig, params, *, seed: int = 7, depth: int = 4, top_k: int = 1, nodes: int | None = None, logit_scale: float = 1.0
):
    """A random EAGLE-3 head over half of the target vocabulary (logit_scale > 1: peaked drafts)."""
    head_config = eagle3.Eagle3Config.from_target(config, draft_vocab_size=config.vocab_size // 2)
    head_params = eagle3.init_params(head_config, jax.random.key(seed))
    head_params["lm_head"] = head_params["lm_head"] * logit_scale
    ids = jnp.sort(jax.random.permutation(jax.random.key(seed + 1), config.vocab_size)[: config.vocab_size // 2])
    vocab = eagle3.DraftVocab.from_target_ids(ids, config.vocab_size)
    return Eagle3Drafter(
        head_config, head_params, vocab, params["embed_tokens"], depth=depth, top_k=top_k, tree_nodes=nodes,
        feature_layers=eagle3.feature_layers(config.num_layers),
    )


def eagle1_drafter(config: ModelConfig, params, *, seed: int = 9, fc_bias: bool = False, **kwargs) -> Eagle1Drafter:
    """A random EAGLE-1 layer (kwargs: depth, top_k, tree_nodes, or paths for a static tree)."""
    layer_config = dataclasses.replace(eagle1.Eagle1Config.from_target(config), fc_bias=fc_bias)
    layer_params = eagle1.init_params(layer_config, jax.random.key(seed))
    if fc_bias:
        layer_params["fc_bias"] = 0.1 * jax.random.normal(jax.random.key(seed + 1), layer_params["fc_bias"].shape)
    return Eagle1Drafter(layer_config, layer_params, config, params, **kwargs)


#: A small EAGLE-1 static tree: ranks below the root, the best continuing two levels.
EAGLE1_STATIC_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


def medusa_heads(config: ModelConfig, params, *, seed: int = 5, num_heads: int = 3, residual_scale: float = 0.5):
    """Random Medusa heads over a truncated half of the target vocabulary: (config, params, token_map)."""
    head_config = medusa.MedusaConfig(num_heads, config.hidden_size, config.vocab_size, truncated_vocab_size=config.vocab_size // 2)
    token_map = jnp.sort(jax.random.permutation(jax.random.key(seed), config.vocab_size)[: config.vocab_size // 2])
    head_params = medusa.init_params(head_config, llama.output_head(params, config), token_map)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 2 * num_heads))
    for head in head_params["heads"]:
        for layer in head["layers"]:
            layer["weight"] = residual_scale * jax.random.normal(next(keys), layer["weight"].shape) / config.hidden_size**0.5
            layer["bias"] = 0.1 * jax.random.normal(next(keys), layer["bias"].shape)
    return head_config, head_params, token_map


def medusa_drafter(config: ModelConfig, params, paths=None, **kwargs) -> MedusaDrafter:
    """Random Medusa heads (`medusa_heads`) proposing `paths` (default: a chain of every head)."""
    head_config, head_params, token_map = medusa_heads(config, params, **kwargs)
    return MedusaDrafter(head_config, head_params, token_map, chain_paths(head_config.num_heads) if paths is None else paths)


#: A small Medusa tree: two candidates for the first head, the best continuing two levels.
MEDUSA_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


class OracleTreeDrafter(Drafter):
    """Proposes the target's own greedy continuation, each true token preceded by a wrong sibling.

    Under greedy decoding every drafted level is accepted on its second child, so the accepted
    path is never contiguous: it exercises full acceptance, the bonus token and compaction.
    """

    def __init__(self, config: ModelConfig, params, depth: int = 3):
        self.config, self.params, self.depth = config, params, depth

    @property
    def num_nodes(self) -> int:
        return 2 * self.depth + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    def propose(self, params, state, key, ctx, sampling):
        batch = ctx.pending.shape[0]
        max_len = ctx.history.shape[1]
        # Greedy continuation by re-running the target on the whole history (slow, test only).
        history = ctx.history
        rows = jnp.arange(batch)
        lengths = ctx.lengths + 1  # tokens so far, the pending one included
        truth = []
        for _ in range(self.depth):
            positions = jnp.broadcast_to(jnp.arange(max_len), (batch, max_len))
            causal = causal_mask(max_len)
            logits = llama.forward(params, self.config, history, positions, None, causal).logits
            token = jnp.argmax(logits[rows, lengths - 1], -1).astype(jnp.int32)
            truth.append(token)
            history = history.at[rows, lengths].set(token, mode="drop")
            lengths = lengths + 1
        truth = jnp.stack(truth, 1)  # [B, D]
        wrong = (truth + 1) % self.config.vocab_size
        # Node 2i+1 is the wrong child, node 2i+2 the true one; both hang from the true node above.
        parents = [-1] + [p for level in range(self.depth) for p in (2 * level, 2 * level)]
        depths = [0] + [d for level in range(1, self.depth + 1) for d in (level, level)]
        tokens = jnp.stack([wrong, truth], 2).reshape(batch, 2 * self.depth)
        tree = tree_lib.Tree(
            parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch, self.num_nodes)),
            depths=jnp.broadcast_to(jnp.asarray(depths, jnp.int32), (batch, self.num_nodes)),
            max_depth=self.depth,
        )
        return state, Proposal(tree=tree, tokens=jnp.concatenate([ctx.pending[:, None], tokens], 1))


ADAPTIVE_COSTS = [1.0, 1.3, 1.6, 1.9]  # step cost at draft depth 0 .. 3, relative to a decode step


def all_drafters(config: ModelConfig, params) -> dict[str, Drafter]:
    """Every method, with an untrained draft (many rejections) and one that agrees with the target."""
    draft_config = tiny_config(config.vocab_size, num_layers=1, hidden_size=16)
    return {
        "ngram": NgramDrafter(num_draft=4),
        "draft-random": DraftModelDrafter(draft_config, tiny_params(draft_config, 3), num_draft=3),
        "draft-self": DraftModelDrafter(config, params, num_draft=3),
        "eagle3-chain": eagle3_drafter(config, params, depth=3),
        "eagle3-tree": eagle3_drafter(config, params, depth=3, top_k=2, nodes=6),
        "eagle3-ngram-first": NgramFirst(eagle3_drafter(config, params, depth=3), min_ngram=2),
        # Adaptive draft length with fixed costs (steps get dearer with depth): the depth varies.
        "eagle3-auto": AdaptiveDepth(eagle3_drafter(config, params, depth=3), costs=ADAPTIVE_COSTS),
        "eagle3-ngram-auto": AdaptiveDepth(NgramFirst(eagle3_drafter(config, params, depth=3), min_ngram=2), costs=ADAPTIVE_COSTS),
        "draft-ngram-first": NgramFirst(DraftModelDrafter(draft_config, tiny_params(draft_config, 3), num_draft=3), min_ngram=2),
        "oracle-tree": OracleTreeDrafter(config, params, depth=3),
        "lookahead": LookaheadDrafter(config.vocab_size, window=3, ngram=3, guesses=2),
        "medusa-chain": medusa_drafter(config, params),
        "medusa-tree": medusa_drafter(config, params, MEDUSA_TREE),
        "medusa-auto": AdaptiveDepth(medusa_drafter(config, params), costs=ADAPTIVE_COSTS),
        "eagle1-chain": eagle1_drafter(config, params, depth=3, fc_bias=True),
        "eagle1-tree": eagle1_drafter(config, params, depth=3, top_k=2, tree_nodes=6),
        "eagle1-static": eagle1_drafter(config, params, paths=EAGLE1_STATIC_TREE),
        "eagle1-auto": AdaptiveDepth(eagle1_drafter(config, params, depth=3), costs=ADAPTIVE_COSTS),
    }


def word_tokenizer():
    """A whitespace word-level tokenizer (vocabulary 10, '<end>' = 1) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate("<unk> <end> <user> <bot> hi there hello you bye see".split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<bot> ' }}{{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}<bot> {% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", chat_template=template)
