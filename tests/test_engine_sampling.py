"""Engine-level exactness under sampling: the joint law of the first three generated tokens.

A tiny random target (vocabulary 12) decodes one prompt in many rows of one batch. The
empirical joint distribution of (t1, t2, t3) is compared, by chi-square, with the exact one
enumerated from the target: q(t1) q(t2 | t1) q(t3 | t1, t2), where q is the processed
distribution (`sampling.probs`). Chains (a sampled draft model, and an EAGLE-3 head sampling its
drafts; Leviathan rule), trees (an EAGLE-2 tree from a random EAGLE-3 head, siblings sampled
without replacement, multi-draft rule, pruned to its first nodes or keeping its whole pool;
Lookahead's pool n-grams with its window riding along, Medusa's and EAGLE-1's static trees,
point-mass rule; an EAGLE-2 tree from a random EAGLE-1 layer) and an EAGLE-3 chain
of adaptive length, at temperature 1 and with top-p (n-gram-first drafting:
test_ngram_first.py, same check). A deliberately broken commit, and drafters misreporting their
draft distributions, must fail the same check.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import EAGLE1_STATIC_TREE, MEDUSA_TREE, eagle1_drafter, eagle3_drafter, medusa_drafter, tiny_config, tiny_params
from specjax import kv_cache
from specjax.drafters.adaptive import AdaptiveDepth
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.lookahead import LookaheadDrafter
from specjax.engine import Engine
from specjax.models import llama
from specjax.sampling import SamplingParams, probs
from specjax.tree import causal_mask
from goodness_of_fit import chi_square_pvalue

VOCAB = 12
ROWS = 12_000
CONFIG = tiny_config(vocab_size=VOCAB, num_layers=4, hidden_size=16)
PARAMS = tiny_params(CONFIG, seed=1, scale=10.0)
DRAFT_CONFIG = tiny_config(vocab_size=VOCAB, num_layers=1, hidden_size=16)
DRAFT_PARAMS = tiny_params(DRAFT_CONFIG, seed=2, scale=10.0)
PROMPT = [3, 7, 1]
MAX_LEN = 32  # room for a 10-node tree after the prompt and three tokens
PEAKED = 50.0  # a random EAGLE-3 head's logits scaled up: its sampled drafts are far from uniform
SETTINGS = {"t1": dict(temperature=1.0), "top_p": dict(temperature=1.0, top_p=0.8)}


def exact_joint(setting: dict) -> np.ndarray:
    """[V, V, V] exact probability of each first three tokens, by enumeration."""
    sequences = np.array([PROMPT + list(t) for t in itertools.product(range(VOCAB), repeat=2)], np.int32)
    length = sequences.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length), sequences.shape)
    logits = llama.forward(PARAMS, CONFIG, jnp.asarray(sequences), positions, None, causal_mask(length)).logits
    q = np.asarray(probs(logits, SamplingParams.make(len(sequences), **setting)), np.float64)  # [V*V, T, V]
    p = len(PROMPT)
    q1 = q[0, p - 1]  # [V]
    q2 = q[::VOCAB, p].reshape(VOCAB, VOCAB)  # [t1, t2]
    q3 = q[:, p + 1].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return q1[:, None, None] * q2[:, :, None] * q3


def sample_joint(engine: Engine, setting: dict, seed: int) -> np.ndarray:
    stats = engine.generate([PROMPT] * ROWS, SamplingParams.make(ROWS, **setting), max_new_tokens=3, seed=seed)
    tokens = np.array(stats.tokens)  # [ROWS, 3]
    return (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]


def make_engine(method: str) -> Engine:
    drafter = {
        "chain": lambda: DraftModelDrafter(DRAFT_CONFIG, DRAFT_PARAMS, num_draft=2),
        "tree": lambda: eagle3_drafter(CONFIG, PARAMS, depth=2, top_k=2, nodes=4, logit_scale=PEAKED),
        "tree-pool": lambda: eagle3_drafter(CONFIG, PARAMS, depth=3, top_k=2, nodes=10, logit_scale=PEAKED),
        "eagle3-chain": lambda: eagle3_drafter(CONFIG, PARAMS, depth=2, logit_scale=PEAKED),
        "lookahead": lambda: LookaheadDrafter(VOCAB, window=2, ngram=3, guesses=2),
        "medusa": lambda: medusa_drafter(CONFIG, PARAMS, MEDUSA_TREE),  # point-mass rule on a static tree
        # EAGLE-1 (its logits through the target's LM head): an EAGLE-2 tree, and its static tree.
        "eagle1-tree": lambda: eagle1_drafter(CONFIG, PARAMS, depth=2, top_k=2, tree_nodes=4),
        "eagle1-static": lambda: eagle1_drafter(CONFIG, PARAMS, paths=EAGLE1_STATIC_TREE),
        # The engine picks the chain's length (0, 1 or 2) every step from the rows' acceptance.
        "auto": lambda: AdaptiveDepth(eagle3_drafter(CONFIG, PARAMS, depth=2, logit_scale=PEAKED), costs=[1.0, 1.2, 1.4]),
    }[method]()
    return Engine(CONFIG, PARAMS, drafter, max_len=MAX_LEN, eos_ids=())


cached_engine = functools.cache(make_engine)  # one compilation per method, shared by the settings


@pytest.mark.parametrize(
    "method, setting",
    [(m, s) for m in ("chain", "tree", "lookahead", "medusa", "eagle1-tree") for s in sorted(SETTINGS)]
    + [("eagle3-chain", "t1"), ("tree-pool", "t1"), ("eagle1-static", "t1")],
)  # the sampled EAGLE-3 chain meets truncated distributions through the draft model's rule
def test_first_three_tokens_follow_the_target(method, setting):
    samples = sample_joint(cached_engine(method), SETTINGS[setting], seed=11)
    assert chi_square_pvalue(samples, exact_joint(SETTINGS[setting])) > 1e-4


def test_adaptive_draft_length_follows_the_target():
    engine = cached_engine("auto")
    samples = sample_joint(engine, SETTINGS["t1"], seed=11)
    assert chi_square_pvalue(samples, exact_joint(SETTINGS["t1"])) > 1e-4


@pytest.mark.parametrize("method", ["eagle3-chain", "tree", "eagle1-tree"])
def test_misreported_draft_probabilities_are_detected(method):
    """Power check for sampled EAGLE-3 drafts: verifying against a flattened p (the drafts still
    come from the head's true p) must fail the same check."""
    drafter = make_engine(method).drafter

    class Flattened(type(drafter)):
        def propose(self, *args):
            state, proposal = super().propose(*args)
            flat = jnp.sqrt(proposal.draft_probs)
            return state, proposal.replace(draft_probs=flat / flat.sum(-1, keepdims=True))

    drafter.__class__ = Flattened  # the same head and weights, misreporting p
    samples = sample_joint(Engine(CONFIG, PARAMS, drafter, max_len=MAX_LEN, eos_ids=()), SETTINGS["t1"], seed=11)
    assert chi_square_pvalue(samples, exact_joint(SETTINGS["t1"])) < 1e-6


def test_broken_commit_is_detected(monkeypatch):
    commit = kv_cache.commit
    monkeypatch.setattr(kv_cache, "commit", lambda cache, num_new: commit(cache, num_new + (num_new > 0)))
    samples = sample_joint(make_engine("chain"), SETTINGS["t1"], seed=11)  # compiled with the broken commit
    assert chi_square_pvalue(samples, exact_joint(SETTINGS["t1"])) < 1e-6
