"""Exactness of chain and tree verification.

The target is a bigram model over a small vocabulary: q after the prompt, then q(. | last
token); the drafter is another bigram model p (sampled for chains, ranked top-k for trees).
Each case decodes 50,000 rows per model kind (two kinds per batch, so every call has one
shape) and checks by chi-square, against the exact target, the first emitted token (q at the
root) and the first two and three emitted tokens jointly (q(x1) q(x2 | x1) q(x3 | x2)). Steps
follow each other as in the decoder (a step starts from the last token emitted), so accepted
drafts, residual samples and bonus tokens at every depth all enter the joint law. The same
checks must fail for deliberately wrong rules (a swapped-in `verify._residual`).

Then: acceptance rates against their exact values, greedy rows, and hypothesis properties of
the verdict over batch sizes, draft lengths and random tree shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from goodness_of_fit import chi_square_pvalue
from specjax import sampling, verify
from specjax.sampling import SamplingParams
from specjax.tree import Tree, from_branching

VOCAB = 8
PROMPT = VOCAB  # context index of "after the prompt"; context x < VOCAB is "after token x"
ROWS_PER_KIND = 50_000
KINDS = 2
BATCH = KINDS * ROWS_PER_KIND
NUM_DRAFT = 2  # chain drafts per step
SEQUENCE = 3  # emitted tokens checked jointly: covers accept, residual and bonus at every depth
TREE_BRANCHING = [3, 1]  # 3 candidates below the root, 1 below each: 7 nodes, depth 2
P_PASS = 1e-4  # an exact rule passes every check above this p-value (fixed seeds)
P_FAIL = 1e-10  # a wrong rule must fall below this
ACCEPT_SIGMAS = 5.0  # empirical acceptance rates within this many standard errors


# ----------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Bigram:
    """Per kind: target q and draft p of the next token in each of VOCAB + 1 contexts."""

    target: np.ndarray  # [K, V + 1, V] float32 processed q
    draft: np.ndarray  # [K, V + 1, V] float32; the chain drafter samples it, the tree drafter ranks by it
    params: SamplingParams  # [B]; kind k is rows k * ROWS_PER_KIND ..

    def sequence(self, kind: int, length: int) -> np.ndarray:
        """[V] * length: probability that the target emits x_1 .. x_length after the prompt."""
        q = np.asarray(self.target[kind], np.float64)
        probabilities = q[PROMPT]
        for _ in range(length - 1):
            probabilities = probabilities[..., :, None] * q[:VOCAB]
        return probabilities


def bigram(target, draft, params: SamplingParams) -> Bigram:
    return Bigram(np.asarray(target, np.float32), np.asarray(draft, np.float32), params)


def kinds_params(*kinds: dict) -> SamplingParams:
    """Row parameters for KINDS kinds of ROWS_PER_KIND rows each."""
    return SamplingParams.stack([SamplingParams.make(ROWS_PER_KIND, **kind) for kind in kinds])


probs = jax.jit(sampling.probs)


def processed(logits: np.ndarray, kind: dict) -> np.ndarray:
    """sampling.probs of [C, V] logits under one kind's parameters."""
    params = SamplingParams.make(logits.shape[0], **kind)
    return np.asarray(probs(jnp.asarray(logits, jnp.float32), params), np.float64)


def random_pairs(seed: int, correlated: bool) -> Bigram:
    """Two kinds of random (p, q): independent Dirichlet, or p = q with log-noise (a drafter)."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.ones(VOCAB), size=(KINDS, VOCAB + 1))
    if correlated:
        draft = softmax(np.log(target) + rng.normal(size=target.shape))
    else:
        draft = rng.dirichlet(np.ones(VOCAB), size=(KINDS, VOCAB + 1))
    return bigram(target, draft, kinds_params({"temperature": 1.0}, {"temperature": 1.0}))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def edge_case(name: str) -> Bigram:
    """Two kinds per case, chosen to stress one corner of the rules each."""
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = (VOCAB + 1, VOCAB)
    half = np.arange(VOCAB) < VOCAB // 2

    def dirichlet(support=None):
        x = rng.dirichlet(np.ones(VOCAB), size=VOCAB + 1)
        if support is not None:
            x = np.where(support, x, 0.0)
        return x / x.sum(-1, keepdims=True)

    sampled = {"temperature": 1.0}
    if name == "disjoint-and-one-hot":
        # kind 0: p and q on disjoint halves (nothing accepted); kind 1: q one-hot, p full.
        one_hot = np.eye(VOCAB)[rng.integers(0, VOCAB, size=VOCAB + 1)]
        target = [dirichlet(half), one_hot]
        draft = [dirichlet(~half), dirichlet()]
        kinds = (sampled, sampled)
    elif name == "equal-and-zero-p":
        # kind 0: p == q (everything accepted); kind 1: p zero on half of q's support.
        q = dirichlet()
        target = [q, dirichlet()]
        draft = [q.copy(), dirichlet(half)]
        kinds = (sampled, sampled)
    elif name == "top-k-and-top-p":
        # q truncated by sampling.probs; p from other logits with full support.
        kinds = ({"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.6, "min_p": 0.05})
        target = [processed(rng.normal(size=shape) * 2.0, kind) for kind in kinds]
        draft = [softmax(rng.normal(size=shape)), softmax(rng.normal(size=shape))]
    elif name == "greedy-and-sampled":
        kinds = ({"temperature": 0.0}, {"temperature": 1.0})
        logits = rng.normal(size=shape) * 2.0
        target = [processed(logits, kind) for kind in kinds]
        draft = [softmax(logits + rng.normal(size=shape)) for _ in kinds]
    elif name == "one-hot-p":
        # Deterministic drafter (p one-hot on its argmax) next to a sampled one.
        q = dirichlet()
        target = [q, q]
        noisy = softmax(np.log(q) + rng.normal(size=shape))
        draft = [np.eye(VOCAB)[noisy.argmax(-1)], noisy]
        kinds = (sampled, sampled)
    else:
        raise ValueError(name)
    return bigram(np.stack(target), np.stack(draft), kinds_params(*kinds))


CHAIN_CASES = ["disjoint-and-one-hot", "equal-and-zero-p", "top-k-and-top-p", "greedy-and-sampled", "one-hot-p"]
TREE_CASES = ["disjoint-and-one-hot", "top-k-and-top-p", "greedy-and-sampled"]


# ----------------------------------------------------------------------------- simulation

ROW_KIND = np.arange(BATCH) // ROWS_PER_KIND  # [B]
emitted_tokens = jax.jit(verify.emitted_tokens)


def draw(rng: np.random.Generator, probabilities: np.ndarray) -> np.ndarray:
    """One token per row of [B, V] by inverse CDF; zero-probability tokens are never drawn."""
    cdf = np.cumsum(probabilities, axis=-1, dtype=np.float64)  # [B, V]
    return (rng.random(len(cdf))[:, None] * cdf[:, -1:] < cdf).argmax(-1)


def chain_step(verify_fn, model: Bigram, rng: np.random.Generator, key, context: np.ndarray):
    """One decode step from each row's context [B]: draft NUM_DRAFT tokens from p, verify against q.

    Returns (emitted [B, N + 1], verdict, draft_tokens [B, N]).
    """
    drafts, draft_probs, target_probs = [], [], [model.target[ROW_KIND, context]]
    last = context
    for _ in range(NUM_DRAFT):
        p = model.draft[ROW_KIND, last]  # [B, V]
        last = draw(rng, p)
        drafts.append(last)
        draft_probs.append(p)
        target_probs.append(model.target[ROW_KIND, last])
    draft_tokens = np.stack(drafts, 1)  # [B, N]
    verdict = verify_fn(
        key,
        jnp.asarray(draft_tokens, jnp.int32),
        jnp.asarray(np.stack(draft_probs, 1)),  # [B, N, V]
        jnp.asarray(np.stack(target_probs, 1)),  # [B, N + 1, V]
        model.params,
    )
    node_tokens = jnp.asarray(np.pad(draft_tokens, ((0, 0), (1, 0))), jnp.int32)  # root placeholder, never emitted
    return np.asarray(emitted_tokens(verdict, node_tokens)), verdict, draft_tokens


def tree_topology() -> Tree:
    return from_branching(BATCH, TREE_BRANCHING)


def tree_contexts(model: Bigram, duplicate_siblings: bool = False) -> np.ndarray:
    """[K, V + 1, N] each node's context (its token; for the root, the step's context) for a
    tree drafted at every context: sibling s is the s-th most likely draft token at its parent
    (with duplicate_siblings, siblings 2s and 2s + 1 both take the s-th)."""
    parents = np.asarray(tree_topology().parents[0])
    ranked = np.argsort(-model.draft, axis=-1, kind="stable")  # [K, V + 1, V]
    kind_index = np.arange(KINDS)[:, None]
    contexts = [np.broadcast_to(np.arange(VOCAB + 1), (KINDS, VOCAB + 1))]
    for node in range(1, len(parents)):
        sibling = np.sum(parents[1:node] == parents[node])
        rank = sibling // 2 if duplicate_siblings else sibling
        contexts.append(ranked[kind_index, contexts[parents[node]], rank])
    return np.stack(contexts, -1)


def tree_step(verify_fn, model: Bigram, topology: Tree, contexts: np.ndarray, key, context: np.ndarray):
    """One decode step: verify the tree drafted at each row's context. Returns (emitted, verdict)."""
    node_contexts = contexts[ROW_KIND, context]  # [B, N]
    node_tokens = node_contexts.copy()
    node_tokens[:, 0] = np.minimum(context, VOCAB - 1)  # the root is the pending token
    target_probs = model.target[ROW_KIND[:, None], node_contexts]  # [B, N, V]
    node_tokens = jnp.asarray(node_tokens, jnp.int32)
    verdict = verify_fn(key, topology, node_tokens, jnp.asarray(target_probs), model.params)
    return np.asarray(emitted_tokens(verdict, node_tokens)), verdict


def sampled_tree_step(verify_fn, model: Bigram, topology: Tree, rng: np.random.Generator, key, context: np.ndarray):
    """One decode step: each node's children drawn from p at the node one after another without
    replacement (once p's support is used up, a child takes a fresh token of probability 0),
    verified by the multi-draft rule. Returns (emitted, verdict)."""
    parents = np.asarray(topology.parents[0])
    rows = np.arange(BATCH)
    node_contexts, draft_probs = [context], []
    for node in range(1, len(parents)):
        p = model.draft[ROW_KIND, node_contexts[parents[node]]]  # [B, V]
        taken = np.zeros((BATCH, VOCAB), bool)
        for sibling in range(1, node):
            if parents[sibling] == parents[node]:
                taken[rows, node_contexts[sibling]] = True
        remaining = np.where(taken, 0.0, p)
        left = remaining.sum(1) > 0
        fresh = np.argmax(~taken & (p == 0), axis=1)  # a token no sibling has, with p = 0
        node_contexts.append(np.where(left, draw(rng, np.where(left[:, None], remaining, 1.0)), fresh))
        draft_probs.append(p)
    node_contexts = np.stack(node_contexts, 1)  # [B, N]
    node_tokens = node_contexts.copy()
    node_tokens[:, 0] = np.minimum(context, VOCAB - 1)  # the root is the pending token
    target_probs = model.target[ROW_KIND[:, None], node_contexts]  # [B, N, V]
    node_tokens = jnp.asarray(node_tokens, jnp.int32)
    verdict = verify_fn(key, topology, node_tokens, jnp.asarray(np.stack(draft_probs, 1)), jnp.asarray(target_probs), model.params)
    return np.asarray(emitted_tokens(verdict, node_tokens)), verdict


def decode(step, key) -> tuple[np.ndarray, tuple]:
    """The first SEQUENCE emitted tokens per row [B, SEQUENCE], decoding step after step from
    the prompt (each step starts from the last token emitted), and the first step's outputs
    (emitted, verdict, ...)."""
    tokens = np.full((BATCH, SEQUENCE), -1)
    filled = np.zeros(BATCH, int)
    context = np.full(BATCH, PROMPT)
    first_outputs = None
    for step_key in jax.random.split(key, SEQUENCE):
        outputs = step(step_key, context)
        first_outputs = first_outputs or outputs
        emitted = outputs[0]  # [B, D + 1], -1 after the next token
        for column in emitted.T:
            take = (column >= 0) & (filled < SEQUENCE)
            tokens[take, filled[take]] = column[take]
            filled += take
        context = emitted[np.arange(BATCH), (emitted >= 0).sum(1) - 1]
    assert np.all(filled == SEQUENCE)
    return tokens, first_outputs


# Wrong rules for the power checks, swapped in for verify._residual.
def no_residual(q, p):
    """Resample from q itself on rejection (ignores what the draft already covered)."""
    return q


def unnormalised_residual(q, p):
    """Zero the rejected mass but do not renormalise."""
    return jnp.maximum(q - p, 0.0)


WRONG_CHAIN = {"no_residual": jax.jit(functools.partial(verify._chain, residual=no_residual))}
WRONG_TREE = {"unnormalised_residual": jax.jit(functools.partial(verify._tree, residual=unnormalised_residual))}
WRONG_SAMPLED_TREE = {"no_residual": jax.jit(functools.partial(verify._sampled_tree, residual=no_residual))}


def model(name: str) -> Bigram:
    """A named model: 'pairs-S' (independent p, q), 'drafter-S' (p = noisy q), or an edge case."""
    kind, _, seed = name.partition("-")
    if kind in ("pairs", "drafter") and seed.isdigit():
        return random_pairs(int(seed), correlated=kind == "drafter")
    return edge_case(name)


def name_seed(name: str) -> int:
    return sum(map(ord, name))


def run_chain(name: str, rule: str = "exact"):
    """(tokens [B, SEQUENCE], first step's (emitted, verdict, draft_tokens)), shared across tests."""
    return _run_chain(name, rule)


def run_tree(name: str, rule: str = "exact", duplicate_siblings: bool = False):
    """(tokens [B, SEQUENCE], first step's (emitted, verdict)), shared across tests."""
    return _run_tree(name, rule, duplicate_siblings)


@functools.cache
def _run_chain(name: str, rule: str):
    verify_fn = verify.chain if rule == "exact" else WRONG_CHAIN[rule]
    step = functools.partial(chain_step, verify_fn, model(name), np.random.default_rng(name_seed(name)))
    return decode(step, jax.random.key(name_seed(name)))


@functools.cache
def _run_tree(name: str, rule: str, duplicate_siblings: bool):
    verify_fn = verify.tree if rule == "exact" else WRONG_TREE[rule]
    contexts = tree_contexts(model(name), duplicate_siblings)
    step = functools.partial(tree_step, verify_fn, model(name), tree_topology(), contexts)
    return decode(step, jax.random.key(name_seed(name) + duplicate_siblings))


def run_sampled_tree(name: str, rule: str = "exact"):
    """(tokens [B, SEQUENCE], first step's (emitted, verdict)), shared across tests."""
    return _run_sampled_tree(name, rule)


@functools.cache
def _run_sampled_tree(name: str, rule: str):
    verify_fn = verify.sampled_tree if rule == "exact" else WRONG_SAMPLED_TREE[rule]
    rng = np.random.default_rng(name_seed(name) + 1)
    step = functools.partial(sampled_tree_step, verify_fn, model(name), tree_topology(), rng)
    return decode(step, jax.random.key(name_seed(name) + 1))


def pvalues(bigram_model: Bigram, tokens: np.ndarray) -> list[list[float]]:
    """Per kind, chi-square p-values of the first 1 .. SEQUENCE emitted tokens jointly."""
    result = []
    for kind in range(KINDS):
        rows = tokens[ROW_KIND == kind]
        result.append([
            chi_square_pvalue(
                np.ravel_multi_index(rows[:, :length].T, (VOCAB,) * length), bigram_model.sequence(kind, length)
            )
            for length in range(1, SEQUENCE + 1)
        ])
    return result


def assert_exact(bigram_model: Bigram, tokens: np.ndarray):
    for kind, kind_pvalues in enumerate(pvalues(bigram_model, tokens)):
        assert min(kind_pvalues) > P_PASS, (kind, kind_pvalues)


# ----------------------------------------------------------------------------- chain


@pytest.mark.parametrize("name", [f"pairs-{seed}" for seed in range(5)] + CHAIN_CASES)
def test_chain_exact(name):
    assert_exact(model(name), run_chain(name)[0])


@pytest.mark.parametrize("rule", sorted(WRONG_CHAIN))
def test_chain_wrong_rule_fails(rule):
    """Power: the same check catches a wrong rejection rule."""
    for kind_pvalues in pvalues(model("pairs-0"), run_chain("pairs-0", rule)[0]):
        assert kind_pvalues[0] < P_FAIL and kind_pvalues[-1] < P_FAIL, kind_pvalues


def test_chain_edge_case_acceptance():
    """Disjoint supports accept nothing; p == q accepts everything."""
    _, (_, verdict, _) = run_chain("disjoint-and-one-hot")
    assert np.all(np.asarray(verdict.accepted)[ROW_KIND == 0] == 0)
    _, (_, verdict, _) = run_chain("equal-and-zero-p")
    assert np.all(np.asarray(verdict.accepted)[ROW_KIND == 0] == NUM_DRAFT)


def test_chain_greedy_rows_are_deterministic_argmax_walk():
    _, (emitted, verdict, drafts) = run_chain("greedy-and-sampled")
    greedy = ROW_KIND == 0
    target = model("greedy-and-sampled").target[0]
    walk = [target[PROMPT].argmax()]
    for _ in range(NUM_DRAFT):
        walk.append(target[walk[-1]].argmax())
    drafts = drafts[greedy]
    accepted = np.cumprod(drafts == np.asarray(walk[:-1])[None, :], axis=1).sum(1)
    np.testing.assert_array_equal(np.asarray(verdict.accepted)[greedy], accepted)
    emitted = emitted[greedy]
    for count in range(NUM_DRAFT + 1):  # accepted drafts, then the argmax at the stop position
        rows = accepted == count
        expected = np.broadcast_to(walk[: count + 1], (rows.sum(), count + 1))
        np.testing.assert_array_equal(emitted[rows, : count + 1], expected)


@pytest.mark.parametrize("name", ["pairs-0", "pairs-1"])
def test_chain_acceptance_rate_matches_overlap(name):
    """P(accept d1) = a = sum min(p, q); P(accept d2 | d1 accepted) = sum_x min(p, q)(x) a(x) / a."""
    bigram_model = model(name)
    _, (_, verdict, _) = run_chain(name)
    accepted = np.asarray(verdict.accepted)
    for kind in range(KINDS):
        kind_accepted = accepted[ROW_KIND == kind]
        overlap = np.minimum(bigram_model.target[kind], bigram_model.draft[kind]).sum(-1)  # [V + 1] per context
        first_rate = overlap[PROMPT]
        both_first = np.minimum(bigram_model.target[kind, PROMPT], bigram_model.draft[kind, PROMPT])
        second_rate = (both_first * overlap[:VOCAB]).sum() / first_rate
        checks = [
            ((kind_accepted >= 1).mean(), first_rate, kind_accepted.size),
            ((kind_accepted >= 2).sum() / (kind_accepted >= 1).sum(), second_rate, (kind_accepted >= 1).sum()),
        ]
        for measured, rate, count in checks:
            standard_error = np.sqrt(rate * (1 - rate) / count)
            assert abs(measured - rate) < ACCEPT_SIGMAS * standard_error, (kind, measured, rate)


def test_chain_zero_draft_probability_convention():
    """p(d) = 0: accepted iff q(d) > 0 (the limit of min(1, q/p)); q(d) = 0 is never accepted."""
    batch, num_draft = 4, 3  # the property tests' shapes (one compilation)
    q = np.full((batch, num_draft + 1, PROPERTY_VOCAB), 0.25, np.float32)
    q[..., -1] = 0.0
    p = np.zeros((batch, num_draft, PROPERTY_VOCAB), np.float32)
    p[..., 1] = 1.0  # the drafts below have p = 0
    params = SamplingParams.make(batch, temperature=1.0)
    for token, expected in [(0, num_draft), (PROPERTY_VOCAB - 1, 0)]:
        drafts = jnp.full((batch, num_draft), token, jnp.int32)
        verdict = verify.chain(jax.random.key(token), drafts, jnp.asarray(p), jnp.asarray(q), params)
        assert np.all(np.asarray(verdict.accepted) == expected)
        assert np.all(np.asarray(verdict.next_token) < PROPERTY_VOCAB - 1)


# ----------------------------------------------------------------------------- tree


@pytest.mark.parametrize("name", [f"drafter-{seed}" for seed in range(2)] + TREE_CASES)
def test_tree_exact(name):
    assert_exact(model(name), run_tree(name)[0])


def test_tree_exact_with_duplicate_sibling_tokens():
    assert_exact(model("drafter-0"), run_tree("drafter-0", duplicate_siblings=True)[0])


@pytest.mark.parametrize("rule", sorted(WRONG_TREE))
def test_tree_wrong_rule_fails(rule):
    for kind_pvalues in pvalues(model("drafter-0"), run_tree("drafter-0", rule)[0]):
        assert kind_pvalues[0] < P_FAIL and kind_pvalues[-1] < P_FAIL, kind_pvalues


def test_tree_greedy_rows_follow_the_argmax_walk():
    _, (_, verdict) = run_tree("greedy-and-sampled")
    bigram_model = model("greedy-and-sampled")
    contexts = tree_contexts(bigram_model)[0, PROMPT]  # [N] step-1 tree of the greedy kind
    parents = np.asarray(tree_topology().parents[0])
    q = bigram_model.target[0][contexts]  # [N, V] q at each node
    walk, _ = greedy_walk(list(parents), contexts, q)
    greedy = ROW_KIND == 0
    path = np.asarray(verdict.path)[greedy]
    assert np.all(np.asarray(verdict.accepted)[greedy] == len(walk) - 1)
    assert np.all(path[:, : len(walk)] == walk)


def reach_probabilities(parents: np.ndarray, node_contexts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """[N] probability that the walk reaches each node: the point-mass rule moves to child c
    with probability q_parent(token c), or 0 if an earlier sibling has the same token."""
    reach = np.ones(len(parents))
    for node in range(1, len(parents)):
        parent = parents[node]
        earlier = [s for s in range(1, node) if parents[s] == parent]
        duplicate = any(node_contexts[s] == node_contexts[node] for s in earlier)
        move = 0.0 if duplicate else target[node_contexts[parent], node_contexts[node]]
        reach[node] = reach[parent] * move
    return reach


@pytest.mark.parametrize("duplicate_siblings", [False, True])
def test_tree_reach_matches_point_mass_probabilities(duplicate_siblings):
    bigram_model = model("drafter-0")
    _, (_, verdict) = run_tree("drafter-0", duplicate_siblings=duplicate_siblings)
    topology = tree_topology()
    contexts = tree_contexts(bigram_model, duplicate_siblings)
    parents, depths = np.asarray(topology.parents[0]), np.asarray(topology.depths[0])
    path, accepted = np.asarray(verdict.path), np.asarray(verdict.accepted)
    on_path = (path[:, depths] == np.arange(len(parents))) & (depths <= accepted[:, None])  # [B, N]
    for kind in range(KINDS):
        rows = ROW_KIND == kind
        expected = reach_probabilities(parents, contexts[kind, PROMPT], bigram_model.target[kind])
        measured = on_path[rows].mean(0)
        standard_error = np.sqrt(expected * (1 - expected) / rows.sum())
        assert np.all(np.abs(measured - expected) <= ACCEPT_SIGMAS * standard_error + 1e-12), (measured, expected)


# ----------------------------------------------------------------------------- sampled tree


@pytest.mark.parametrize("name", ["drafter-0", "pairs-1"] + CHAIN_CASES)
def test_sampled_tree_exact(name):
    """Siblings without replacement, including p with fewer tokens than children (one-hot-p)."""
    assert_exact(model(name), run_sampled_tree(name)[0])


@pytest.mark.parametrize("rule", sorted(WRONG_SAMPLED_TREE))
def test_sampled_tree_wrong_rule_fails(rule):
    for kind_pvalues in pvalues(model("drafter-0"), run_sampled_tree("drafter-0", rule)[0]):
        assert kind_pvalues[0] < P_FAIL and kind_pvalues[-1] < P_FAIL, kind_pvalues


def test_sampled_tree_accepts_more_than_point_mass_candidates():
    """Why sample: with p close to q, a sampled first child is accepted with probability
    sum(min(p, q)); the top-ranked candidate only with q(top); the root's first try shows it."""
    bigram_model = model("drafter-0")
    first_try = {}
    for rule, run in (("sampled", run_sampled_tree), ("point-mass", run_tree)):
        _, (_, verdict) = run("drafter-0")
        first_try[rule] = np.mean(np.asarray(verdict.path)[:, 1] == 1)  # the walk took the first child
    for kind in range(KINDS):
        p, q = bigram_model.draft[kind, PROMPT], bigram_model.target[kind, PROMPT]
        assert np.minimum(p, q).sum() > q[np.argmax(p)]  # the premise, for this model
    assert first_try["sampled"] > first_try["point-mass"] + 0.02, first_try


# ----------------------------------------------------------------------------- properties

PROPERTY_VOCAB = 5
PROPERTY_NODES = 7
property_settings = settings(max_examples=20, deadline=None, derandomize=True, database=None)


def random_rows(rng: np.random.Generator, batch: int, positions: int):
    """Per-row params (greedy and sampled, some top-k truncated) and processed q [B, positions, V],
    computed in numpy as sampling.probs defines it (greedy rows one-hot)."""
    temperature = rng.choice([0.0, 0.7, 1.0], size=batch)
    top_k = rng.choice([0, 2, 3], size=batch)
    logits = rng.normal(size=(batch, positions, PROPERTY_VOCAB)) * 2.0
    q = softmax(logits / np.where(temperature > 0, temperature, 1.0)[:, None, None])
    kth_index = np.broadcast_to((np.maximum(top_k, 1) - 1)[:, None, None], (batch, positions, 1))
    kth = np.take_along_axis(-np.sort(-logits, axis=-1), kth_index, axis=-1)  # [B, positions, 1]
    q = np.where((top_k[:, None, None] == 0) | (logits >= kth), q, 0.0)
    q /= q.sum(-1, keepdims=True)
    q = np.where((temperature == 0)[:, None, None], np.eye(PROPERTY_VOCAB)[logits.argmax(-1)], q)
    params = SamplingParams(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.ones((batch,), jnp.float32),
        min_p=jnp.zeros((batch,), jnp.float32),
    )
    return params, q.astype(np.float32)


@st.composite
def chain_batches(draw):
    batch, num_draft = draw(st.sampled_from([(4, 3), (1, 0)]))
    return batch, num_draft, draw(st.integers(0, 2**32 - 1))


@given(chain_batches())
@property_settings
def test_chain_properties(example):
    batch, num_draft, seed = example
    rng = np.random.default_rng(seed)
    params, q = random_rows(rng, batch, num_draft + 1)  # [B, N + 1, V]
    # Drafts: the target's argmax half the time (so greedy rows accept), else random; p sparse
    # but never zero at the draft (a draft is always possible under its p).
    drafts = np.where(
        rng.random((batch, num_draft)) < 0.5,
        q[:, :-1].argmax(-1),
        rng.integers(0, PROPERTY_VOCAB, (batch, num_draft)),
    )  # [B, N]
    p = rng.dirichlet(np.ones(PROPERTY_VOCAB), size=(batch, num_draft))  # [B, N, V]
    p = np.where(rng.random(p.shape) < 0.3, 0.0, p) + 0.2 * np.eye(PROPERTY_VOCAB)[drafts]
    p /= p.sum(-1, keepdims=True)
    verdict = verify.chain(
        jax.random.key(seed % 1000), jnp.asarray(drafts, jnp.int32), jnp.asarray(p, jnp.float32), jnp.asarray(q), params
    )
    accepted, next_token = np.asarray(verdict.accepted), np.asarray(verdict.next_token)
    greedy = np.asarray(params.greedy)
    for row in range(batch):
        a = accepted[row]
        assert 0 <= a <= num_draft
        np.testing.assert_array_equal(np.asarray(verdict.path[row]), np.minimum(np.arange(num_draft + 1), a))
        np.testing.assert_array_equal(np.asarray(verdict.accepted_at[row]), np.arange(num_draft) < a)
        if greedy[row]:
            walk = np.cumprod(drafts[row] == q[row, :-1].argmax(-1)).sum()
            assert a == walk and next_token[row] == q[row, a].argmax()
        else:
            assert np.all(q[row, np.arange(a), drafts[row, :a]] > 0), "accepted a token the target cannot emit"
            if a < num_draft:  # residual support: where q exceeds p
                assert q[row, a, next_token[row]] > p[row, a, next_token[row]]
            else:
                assert q[row, a, next_token[row]] > 0


def depths_of(parents: list[int]) -> list[int]:
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    return depths


def greedy_walk(parents, tokens, q) -> tuple[list[int], int]:
    """Reference: follow the first child whose token is argmax q; emit argmax q at the stop."""
    path = [0]
    while True:
        best = q[path[-1]].argmax()
        children = [j for j in range(1, len(parents)) if parents[j] == path[-1] and tokens[j] == best]
        if not children:
            return path, int(best)
        path.append(children[0])


@st.composite
def tree_batches(draw):
    """Random per-row topologies in topological order, PROPERTY_NODES nodes each."""
    batch = draw(st.sampled_from([1, 4]))
    parents = [[-1] + [draw(st.integers(0, node - 1)) for node in range(1, PROPERTY_NODES)] for _ in range(batch)]
    return parents, draw(st.integers(0, 2**32 - 1))


def random_tree_batch(parents: list[list[int]], seed: int):
    """A Tree (max_depth a static bound, as for per-row topologies), tokens, q and params."""
    rng = np.random.default_rng(seed)
    batch = len(parents)
    depths = [depths_of(row) for row in parents]
    topology = Tree(
        parents=jnp.asarray(parents, jnp.int32), depths=jnp.asarray(depths, jnp.int32), max_depth=PROPERTY_NODES - 1
    )
    params, q = random_rows(rng, batch, PROPERTY_NODES)  # [B, N, V]
    # Tokens: often the parent's argmax (greedy rows accept), else random (repeats happen).
    parent_argmax = q[np.arange(batch)[:, None], np.maximum(np.asarray(parents), 0)].argmax(-1)
    random_tokens = rng.integers(0, PROPERTY_VOCAB, (batch, PROPERTY_NODES))
    tokens = np.where(rng.random((batch, PROPERTY_NODES)) < 0.5, parent_argmax, random_tokens)
    return topology, tokens, q, params


@given(tree_batches())
@property_settings
def test_tree_properties(example):
    parents, seed = example
    topology, tokens, q, params = random_tree_batch(parents, seed)
    verdict = verify.tree(jax.random.key(seed % 1000), topology, jnp.asarray(tokens, jnp.int32), jnp.asarray(q), params)
    accepted, next_token, path = map(np.asarray, (verdict.accepted, verdict.next_token, verdict.path))
    greedy = np.asarray(params.greedy)
    for row, row_parents in enumerate(parents):
        a, stop = accepted[row], path[row, accepted[row]]
        depths = depths_of(row_parents)
        assert 0 <= a <= max(depths)
        assert path[row, 0] == 0
        for i in range(1, a + 1):  # a root-to-node chain of parent links
            assert row_parents[path[row, i]] == path[row, i - 1] and depths[path[row, i]] == i
        assert np.all(path[row, a + 1 :] == stop)
        np.testing.assert_array_equal(np.asarray(verdict.accepted_at[row]), np.arange(PROPERTY_NODES - 1) < a)
        if greedy[row]:
            walk, token = greedy_walk(row_parents, tokens[row], q[row])
            assert list(path[row, : a + 1]) == walk and next_token[row] == token
        else:
            for i in range(1, a + 1):
                assert q[row, path[row, i - 1], tokens[row, path[row, i]]] > 0
            assert q[row, stop, next_token[row]] > 0
            rejected = [tokens[row, j] for j in range(1, PROPERTY_NODES) if row_parents[j] == stop]
            assert next_token[row] not in rejected, "residual emitted a rejected child's token"


@given(tree_batches())
@property_settings
def test_greedy_verdict_is_the_argmax_walk(example):
    """`verify.greedy` (an all-greedy batch, from the target's argmax tokens alone) on random
    per-row topologies: the reference walk, and the layout every rule's verdict has."""
    parents, seed = example
    topology, tokens, q, _ = random_tree_batch(parents, seed)
    verdict = verify.greedy(topology, jnp.asarray(tokens, jnp.int32), jnp.asarray(q.argmax(-1), jnp.int32))
    accepted, next_token, path = map(np.asarray, (verdict.accepted, verdict.next_token, verdict.path))
    for row, row_parents in enumerate(parents):
        walk, token = greedy_walk(row_parents, tokens[row], q[row])
        a = len(walk) - 1
        assert accepted[row] == a and next_token[row] == token
        assert list(path[row]) == walk + [walk[-1]] * (PROPERTY_NODES - 1 - a)
        np.testing.assert_array_equal(np.asarray(verdict.accepted_at[row]), np.arange(PROPERTY_NODES - 1) < a)


def test_emitted_tokens_layout():
    verdict = verify.Verdict(
        accepted=jnp.asarray([0, 2]),
        next_token=jnp.asarray([9, 8]),
        path=jnp.asarray([[0, 0, 0], [0, 2, 5]]),
        accepted_at=jnp.asarray([[False, False], [True, True]]),
    )
    node_tokens = jnp.asarray([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(verify.emitted_tokens(verdict, node_tokens), [[9, -1, -1], [3, 6, 8]])
