"""The speculation-math report: exactness and the cost model, measured with the real code.

    python scripts/speculation_report.py

Every number comes from specjax.verify (exact rejection sampling, chain and tree), specjax.kv_cache
(per-row lengths, rollback by not committing) and specjax.theory (the cost model), on synthetic
distributions over a small vocabulary. Sections:

  (a) Leviathan check: speculative samples (one draft) vs direct samples from q, chi-square.
  (b) Draft length at a = 0.9, c = 0.04: tokens per verifier call and time per token, N = 1..10.
  (c) Draft quality: p perturbed away from q; measured acceptance vs sum(min(p, q)).
  (d) EAGLE-2-style tree [2, 2, 2] vs a chain, both 14 drafted nodes: per-node acceptance and
      tokens per call, measured and predicted.
  (e) Two sequences sharing a KV cache, one accepting everything, one rejecting at position 2.
  (f) The exact optimal draft length and speedup for two (a, c) settings.

`main()` prints the report and returns its numbers (tests check them against specjax.theory).
Runs in well under a minute on a laptop CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from specjax import kv_cache, sampling, theory, verify
from specjax.kv_cache import KVCache
from specjax.sampling import SamplingParams
from specjax.tree import from_branching

VOCAB = 8
PROMPT = VOCAB  # the context index of "after the prompt" in the synthetic bigram tables

# Jitted once per shape (eager calls would compile every primitive separately).
sample = jax.jit(sampling.sample)
write, compact, commit, append = (jax.jit(f) for f in (kv_cache.write, kv_cache.compact, kv_cache.commit, kv_cache.append))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rows(array, samples: int) -> jax.Array:
    """The same [...] array for every row: [samples, ...] float32."""
    array = np.asarray(array, np.float32)
    return jnp.asarray(np.broadcast_to(array, (samples,) + array.shape))


def first_emitted(verdict: verify.Verdict, draft_tokens: jax.Array) -> np.ndarray:
    """The first token each row emits: its first draft if accepted, else the residual sample."""
    return np.asarray(jnp.where(verdict.accepted > 0, draft_tokens[:, 0], verdict.next_token))


def one_draft_chain(keys, p: np.ndarray, q: np.ndarray, samples: int) -> tuple[verify.Verdict, jax.Array]:
    """Draft one token from p per row and verify it against q (the bonus position also sees q)."""
    draft_key, verify_key = next(keys), next(keys)
    draft_tokens = sample(draft_key, rows(p, samples))[:, None]  # [S, 1]
    verdict = verify.chain(
        verify_key, draft_tokens, rows(p[None], samples), rows(np.stack([q, q]), samples),
        SamplingParams.make(samples, temperature=1.0),
    )
    return verdict, draft_tokens


# ----------------------------------------------------------------------------- (a)


def leviathan_check(keys, samples: int, out) -> dict:
    rng = np.random.default_rng(0)
    q, p = rng.dirichlet(np.ones(VOCAB), size=2)
    verdict, draft_tokens = one_draft_chain(keys, p, q, samples)
    speculative = first_emitted(verdict, draft_tokens)
    direct = np.asarray(sample(next(keys), rows(q, samples)))
    table = np.stack([np.bincount(speculative, minlength=VOCAB), np.bincount(direct, minlength=VOCAB)])
    table = table[:, table.sum(0) > 0]
    statistic, pvalue, dof, _ = scipy.stats.chi2_contingency(table)
    critical = scipy.stats.chi2.ppf(0.95, dof)
    fit = scipy.stats.chisquare(table[0], q * samples)
    out("(a) Leviathan check: one draft from p, verified against q, vs direct samples from q")
    out(f"    {samples:,} speculative and {samples:,} direct samples, vocabulary {VOCAB}")
    acceptance = np.mean(np.asarray(verdict.accepted))
    out(f"    acceptance {acceptance:.4f}  (sum min(p, q) = {theory.acceptance_rate(p, q):.4f})")
    out(f"    two-sample chi-square {statistic:.2f} vs 95% critical value {critical:.2f} ({dof} dof): "
        f"{'same distribution' if statistic < critical else 'DIFFERENT'} (p = {pvalue:.3f})")
    out(f"    speculative vs exact q: chi-square {fit.statistic:.2f}, p = {fit.pvalue:.3f}")
    return dict(
        statistic=float(statistic), critical=float(critical), dof=int(dof), pvalue=float(pvalue), fit_pvalue=float(fit.pvalue)
    )


# ----------------------------------------------------------------------------- (b)


def draft_length_table(out, alpha: float = 0.9, c: float = 0.04) -> dict:
    table = []
    for n in range(1, 11):
        tokens = theory.expected_accepted(alpha, n)
        table.append(dict(n=n, tokens_per_call=tokens, time_per_token=(n * c + 1) / tokens))
    best = min(table, key=lambda row: row["time_per_token"])
    optimal_n, optimal_speedup = theory.optimal_draft_length(alpha, c)
    out(f"(b) Draft length at a = {alpha}, c = {c} (time per token relative to plain decoding)")
    out("     N   tokens/call   time/token")
    for row in table:
        marker = "  <- minimum over 1..10" if row is best else ""
        out(f"    {row['n']:2d}   {row['tokens_per_call']:11.3f}   {row['time_per_token']:10.4f}{marker}")
    out(f"    unconstrained optimum: N = {optimal_n}, speedup {optimal_speedup:.3f} "
        f"(time/token {1 / optimal_speedup:.4f}); the curve is flat past N = 10")
    return dict(alpha=alpha, c=c, table=table, best_n=best["n"], optimal=(optimal_n, optimal_speedup))


# ----------------------------------------------------------------------------- (c)


def draft_quality_sweep(keys, samples: int, out) -> list[dict]:
    rng = np.random.default_rng(1)
    q = rng.dirichlet(np.full(VOCAB, 0.5))
    direction = rng.normal(size=VOCAB)
    draft_lengths = (1, 2, 4, 8)
    out("(c) Draft quality: p = softmax(log q + amplitude * z); acceptance measured with verify.chain")
    lengths = ", ".join(map(str, draft_lengths))
    out(f"    amplitude   measured a   sum min(p,q)   |diff|/se   tokens/call for N = {lengths}")
    sweep = []
    for amplitude in (0.0, 0.5, 1.0, 2.0, 4.0):
        p = softmax(np.log(q) + amplitude * direction)
        verdict, _ = one_draft_chain(keys, p, q, samples)
        measured = float(np.mean(np.asarray(verdict.accepted)))
        overlap = theory.acceptance_rate(p, q)
        standard_error = max(np.sqrt(overlap * (1 - overlap) / samples), 1e-12)
        tokens = {n: theory.expected_accepted(measured, n) for n in draft_lengths}
        sweep.append(
            dict(amplitude=amplitude, measured=measured, overlap=overlap, standard_error=standard_error, tokens_per_call=tokens)
        )
        z = abs(measured - overlap) / standard_error
        per_length = "  ".join(f"{tokens[n]:5.2f}" for n in draft_lengths)
        out(f"    {amplitude:9.1f}   {measured:10.4f}   {overlap:12.4f}   {z:9.2f}   {per_length}")
    return sweep


# ----------------------------------------------------------------------------- (d)


def bigram_tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic target q and drafter p, [V + 1, V]: the next-token law in each context
    (context x < V: after token x; context V: after the prompt). Peaked, as LM outputs are."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.full(VOCAB, 0.3), size=VOCAB + 1)
    draft = softmax(np.log(target + 1e-6) + 0.8 * rng.normal(size=target.shape))
    return target, draft


def tree_vs_chain(keys, samples: int, out) -> dict:
    target, draft = bigram_tables(2)

    # Tree: every node's children are the drafter's top-2 tokens in its context.
    topology = from_branching(samples, [2, 2, 2])
    parents, depths = np.asarray(topology.parents[0]), np.asarray(topology.depths[0])
    num_nodes = len(parents)
    contexts = np.full(num_nodes, PROMPT)  # a node's context is its token; the root's, the prompt
    for node in range(1, num_nodes):
        rank = np.sum(parents[1:node] == parents[node])
        contexts[node] = np.argsort(-draft[contexts[parents[node]]], kind="stable")[rank]
    node_tokens = jnp.asarray(np.broadcast_to(np.where(contexts == PROMPT, 0, contexts), (samples, num_nodes)), jnp.int32)
    params = SamplingParams.make(samples, temperature=1.0)
    verdict = verify.tree(next(keys), topology, node_tokens, rows(target[contexts], samples), params)
    path, accepted = np.asarray(verdict.path), np.asarray(verdict.accepted)
    on_path = (path[:, depths] == np.arange(num_nodes)) & (depths <= accepted[:, None])  # [S, N]
    reached = on_path.sum(0)
    tree_measured = reached[1:] / np.maximum(reached[parents[1:]], 1)  # P(node | parent reached)
    tree_exact = target[contexts[parents[1:]], contexts[1:]]  # the point-mass rule: q_parent(token)
    tree_tokens = accepted + 1
    tree = dict(
        per_node_measured=tree_measured.tolist(),
        per_node_exact=tree_exact.tolist(),
        per_node_trials=reached[parents[1:]].tolist(),  # rows that reached each node's parent
        tokens_per_call=float(tree_tokens.mean()),
        standard_error=float(tree_tokens.std() / np.sqrt(samples)),
        theory=theory.tree_expected_accepted(parents, np.r_[1.0, tree_exact]),
    )

    # Chain: 14 drafts sampled from the drafter, verified by the Leviathan rule.
    num_draft = num_nodes - 1
    drafts, draft_probs, target_probs = [], [], [np.broadcast_to(target[PROMPT], (samples, VOCAB))]
    context = np.full(samples, PROMPT)
    for _ in range(num_draft):
        p = draft[context].astype(np.float32)  # [S, V]
        context = np.asarray(sample(next(keys), jnp.asarray(p)))
        drafts.append(context)
        draft_probs.append(p)
        target_probs.append(target[context])
    verdict = verify.chain(
        next(keys),
        jnp.asarray(np.stack(drafts, 1), jnp.int32),  # [S, N]
        jnp.asarray(np.stack(draft_probs, 1)),  # [S, N, V]
        jnp.asarray(np.stack(target_probs, 1), jnp.float32),  # [S, N + 1, V]
        params,
    )
    accepted = np.asarray(verdict.accepted)
    survivors = np.array([(accepted >= k).sum() for k in range(num_draft + 1)])
    chain_measured = survivors[1:] / np.maximum(survivors[:-1], 1)  # P(position k | positions < k)
    # Exact: v_k(x) = P(first k drafts accepted, k-th is x) = (v_{k-1} M)(x), M = min(p, q) per context.
    overlap = np.minimum(draft, target)  # [V + 1, V]
    accepted_mass = [1.0]
    v = overlap[PROMPT]
    for _ in range(num_draft):
        accepted_mass.append(v.sum())
        v = v @ overlap[:VOCAB]
    accepted_mass = np.asarray(accepted_mass)
    chain_exact = accepted_mass[1:] / accepted_mass[:-1]
    chain_tokens = accepted + 1
    chain = dict(
        per_position_measured=chain_measured.tolist(),
        per_position_exact=chain_exact.tolist(),
        per_position_trials=survivors[:-1].tolist(),  # rows that accepted every earlier position
        tokens_per_call=float(chain_tokens.mean()),
        standard_error=float(chain_tokens.std() / np.sqrt(samples)),
        theory=theory.expected_accepted_from_curve(chain_exact),
        iid_estimate=theory.expected_accepted(chain_exact[0], num_draft),
    )

    out(f"(d) EAGLE-2-style tree [2, 2, 2] vs chain, both {num_draft} drafted nodes (one verifier call each)")
    out("    tree, P(node accepted | parent accepted), measured / exact q_parent(token):")
    for depth in range(1, depths.max() + 1):
        at_depth = [i - 1 for i in range(1, num_nodes) if depths[i] == depth]
        cells = [f"{tree_measured[i]:.3f}/{tree_exact[i]:.3f}" for i in at_depth]
        out(f"      depth {depth}: " + "  ".join(cells))
    out("    chain, P(position k accepted | all before accepted), measured / exact:")
    out("      " + "  ".join(f"{m:.3f}/{e:.3f}" for m, e in zip(chain_measured, chain_exact)))
    out(f"    tokens per verifier call   tree {tree['tokens_per_call']:.3f} +- {tree['standard_error']:.3f} "
        f"(theory.tree_expected_accepted: {tree['theory']:.3f})")
    out(f"                               chain {chain['tokens_per_call']:.3f} +- {chain['standard_error']:.3f} "
        f"(expected_accepted_from_curve: {chain['theory']:.3f}; "
        f"i.i.d. at the first position's a: {chain['iid_estimate']:.3f})")
    winner = "tree" if tree["tokens_per_call"] > chain["tokens_per_call"] else "chain"
    out(f"    -> the {winner} emits more per call at this draft quality; the i.i.d. formula at the first"
        " position's rate misjudges the chain, the measured per-position curve does not")
    return dict(tree=tree, chain=chain)


# ----------------------------------------------------------------------------- (e)


def entries(tokens: np.ndarray) -> jax.Array:
    """A KV block [L=1, B, T, H=1, D=1] whose entries are the tokens they belong to."""
    return jnp.asarray(np.asarray(tokens, np.float32)[None, :, :, None, None])


def two_sequences(keys, out, steps: int = 3, num_draft: int = 3) -> dict:
    """Greedy rows with deterministic drafts: A's drafts are always right, B's third is always
    wrong. Cache entries hold the token they belong to, so what attention can read is checkable."""
    prompt_lengths = np.array([5, 3])
    true_next = lambda row, position: (3 * row + position) % (VOCAB - 1)  # the target's greedy continuation
    max_len = int(prompt_lengths.max()) + steps * (num_draft + 1) + num_draft + 1
    cache = KVCache.init(num_layers=1, batch_size=2, max_len=max_len, num_kv_heads=1, head_dim=1)
    prompt = np.array([[true_next(row, position) for position in range(max_len)] for row in range(2)])
    cache = append(cache, *[entries(prompt)] * 2, jnp.asarray(prompt_lengths))
    committed = [list(prompt[row, : prompt_lengths[row]]) for row in range(2)]
    pending = np.array([true_next(row, prompt_lengths[row]) for row in range(2)])
    params = SamplingParams.make(2)  # greedy
    lengths_history, accepted_history, reads_committed_only = [np.asarray(cache.lengths).tolist()], [], True
    out(f"(e) Two sequences in one KV cache (greedy, {num_draft} drafts per step): A accepts every draft,")
    out("    B rejects its draft at position 2 (0-based) every step; prompt lengths 5 and 3")
    out(f"    step 0: lengths {lengths_history[0]}")
    for step in range(steps):
        lengths = np.asarray(cache.lengths)
        positions = lengths[:, None] + 1 + np.arange(num_draft)  # positions of the drafted tokens
        truth = np.array([[true_next(row, position) for position in positions[row]] for row in range(2)])
        drafts = truth.copy()
        drafts[1, 2] = VOCAB - 1  # B's third draft never matches (true_next < VOCAB - 1)
        bonus = np.array([true_next(row, positions[row, -1] + 1) for row in range(2)])
        one_hot = np.eye(VOCAB, dtype=np.float32)
        target_probs = one_hot[np.concatenate([truth, bonus[:, None]], 1)]  # [B, N + 1, V] greedy q: one-hot
        verdict = verify.chain(
            next(keys), jnp.asarray(drafts, jnp.int32), jnp.asarray(one_hot[drafts]), jnp.asarray(target_probs), params
        )
        block = np.concatenate([pending[:, None], drafts], 1)  # [B, T]: the verifier's input
        cache = write(cache, *[entries(block)] * 2)
        cache = commit(compact(cache, verdict.path), verdict.accepted + 1)
        accepted = np.asarray(verdict.accepted)
        for row in range(2):
            committed[row] += list(block[row, : accepted[row] + 1])
        pending = np.asarray(verdict.next_token)
        # The next step's first query sees exactly the committed tokens, never a stale slot.
        mask = np.arange(cache.max_len)[None, :] < np.asarray(cache.lengths)[:, None]  # [B, S], as attention reads
        slots = np.asarray(cache.k)[0, :, 0, :, 0]  # [B, S]
        for row in range(2):
            visible = slots[row, mask[row]]
            reads_committed_only &= visible.tolist() == committed[row]
        lengths_history.append(np.asarray(cache.lengths).tolist())
        accepted_history.append(accepted.tolist())
        out(f"    step {step + 1}: accepted {accepted.tolist()}, lengths {lengths_history[-1]}")
    out(f"    attention reads only committed entries: {reads_committed_only}")
    return dict(lengths=lengths_history, accepted=accepted_history, reads_committed_only=bool(reads_committed_only))


# ----------------------------------------------------------------------------- (f)


def optimal_settings(out) -> list[dict]:
    out("(f) Optimal draft length (exact scan over N = 0..64)")
    found = []
    for alpha, c in ((0.8, 0.05), (0.95, 0.02)):
        n, best = theory.optimal_draft_length(alpha, c)
        found.append(dict(alpha=alpha, c=c, n=n, speedup=best))
        tokens = theory.expected_accepted(alpha, n)
        out(f"    a = {alpha}, c = {c}: N = {n}, speedup {best:.3f}, tokens per call {tokens:.3f}")
    return found


def main(samples: int = 50_000, seed: int = 0, out=print) -> dict:
    """Print the report; return its numbers."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))  # fresh keys on demand: next(keys)
    report = dict(leviathan=leviathan_check(keys, samples, out))
    out("")
    report["draft_length"] = draft_length_table(out)
    out("")
    report["draft_quality"] = draft_quality_sweep(keys, samples, out)
    out("")
    report["tree_vs_chain"] = tree_vs_chain(keys, samples, out)
    out("")
    report["two_sequences"] = two_sequences(keys, out)
    out("")
    report["optimal"] = optimal_settings(out)
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--samples", type=int, default=50_000, help="samples per chi-square check")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.samples < 1 or args.seed < 0:
        parser.error("--samples must be >= 1 and --seed >= 0")
    main(args.samples, args.seed)
