"""Medusa training on the shared core: the per-head loss, exact resume, export and re-import, engine tau."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.checkpoints.medusa import load_medusa
from specjax.drafters.medusa import MedusaDrafter, chain_paths
from specjax.engine import Engine
from specjax.models import llama, medusa
from train import core, data, medusa_method
from train.config import load_config, make_config
from train_helpers import TARGET, TRAIN_CONFIG, pattern_rows, target_params

REPO = Path(__file__).resolve().parents[1]


def _setup(tmp_path, **overrides):
    """A tiny online run over a sharpened random 4-layer target on repeating patterns (train_helpers)."""
    config = make_config({**TRAIN_CONFIG, "output_dir": str(tmp_path), "medusa_num_heads": 2, "data_parallel": 1, **overrides})
    train_rows, eval_rows = pattern_rows()
    ids = data.draft_vocab_ids(train_rows, 24, TARGET.vocab_size)
    return core.Setup(
        config=config,
        method=medusa_method.MedusaMethod(config, TARGET, target_params(), jnp.asarray(ids, jnp.int32)),
        train_rows=train_rows,
        eval_rows=eval_rows,
        offline=None,
        mesh=core.make_mesh(1),
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    setup = _setup(tmp_path_factory.mktemp("full"))
    state, records = core.train(setup)
    return setup, state, records


def test_loss_matches_a_per_position_reference(tmp_path):
    setup = _setup(tmp_path)
    method = setup.method
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), method.init_params(jax.random.key(0)))
    batch = core.get_batch(setup, setup.train_rows, np.arange(4))
    total, stats = method.loss(params, method.frozen(False), batch)
    mask = np.asarray(batch["loss_mask"])
    out = llama.forward(method.target_params, TARGET, batch["tokens"], jnp.broadcast_to(jnp.arange(16), (4, 16)), None,
                        jnp.tril(jnp.ones((16, 16), bool)), taps=llama.Taps(final_hidden=True))
    heads = np.asarray(medusa.forward(params, out.features))  # [B, T, K, Vt]
    target = np.asarray(out.logits)[..., np.asarray(method.token_map)]  # [B, T, Vt]
    full_argmax = np.asarray(out.logits).argmax(-1)
    log_softmax = lambda x: x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    expected_total = 0.0
    for k in range(2):
        losses, correct, second = [], 0, 0
        for b in range(4):
            for t in range(16 - k - 2):
                if not mask[b, t + k + 2]:  # head k at t predicts the token at t + k + 2
                    continue
                q = np.exp(log_softmax(target[b, t + k + 1]))
                log_p = log_softmax(heads[b, t, k])
                losses.append(-np.sum(q * log_p))
                ranking = list(np.asarray(method.token_map)[np.argsort(-log_p)])
                correct += int(ranking[0] == full_argmax[b, t + k + 1])
                second += int(ranking[1] == full_argmax[b, t + k + 1])
        np.testing.assert_allclose(stats["loss_sum"][k] / stats["weight"][k], np.mean(losses), rtol=1e-5)
        assert stats["weight"][k] == len(losses) and stats["correct"][k] == correct
        assert stats["rank_hits"][k][0] == correct and stats["rank_hits"][k][1] == second
        expected_total += 0.8**k * np.mean(losses)
    np.testing.assert_allclose(total, expected_total, rtol=1e-5)


def test_resume_is_exact(tmp_path, full_run):
    setup, _, full_records = full_run
    _, first_half = core.train(_setup(tmp_path), stop_at=3)
    _, second_half = core.train(_setup(tmp_path))
    assert [r["update"] for r in first_half + second_half] == [1, 2, 3, 4, 5, 6]
    assert [r["total"] for r in first_half + second_half] == [r["total"] for r in full_records]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and len(metrics[0]["acc"]) == 2 and len(metrics[0]["rank_acc"][1]) == medusa_method.RANKS


def test_loss_decreases_and_export_reloads_to_identical_logits(tmp_path, full_run):
    setup, state, records = full_run
    totals = [r["total"] for r in records]
    assert totals[-1] < 0.9 * totals[0], totals
    evaluation = core.evaluate(setup, state.params)
    config = dataclasses.replace(setup.config, export_dir=str(tmp_path / "f32"), export_dtype="float32")
    exact = dataclasses.replace(setup, config=config, method=dataclasses.replace(setup.method, config=config))
    path = core.export(exact, state.params, evaluation)
    config, params, token_map, accuracy = load_medusa(path, target_vocab_size=TARGET.vocab_size)
    assert config == setup.method.draft_config and accuracy == evaluation["rank_acc"]
    np.testing.assert_array_equal(token_map, setup.method.token_map)
    hidden = jax.random.normal(jax.random.key(2), (3, TARGET.hidden_size))
    np.testing.assert_array_equal(medusa.forward(params, hidden), medusa.forward(state.params, hidden))


def test_offline_target_outputs_match_online(tmp_path):
    setup = _setup(tmp_path)
    rows = data.TokenRows(
        np.concatenate([setup.train_rows.tokens, setup.eval_rows.tokens]),
        np.concatenate([setup.train_rows.loss_mask, setup.eval_rows.loss_mask]),
    )
    offline = dataclasses.replace(setup, offline=core.offline_features(setup.method, rows, tmp_path / "features", 8, key="k"))
    params = setup.method.init_params(jax.random.key(0))
    online_eval, offline_eval = core.evaluate(setup, params), core.evaluate(offline, params)
    np.testing.assert_allclose(online_eval["loss"], offline_eval["loss"], rtol=2e-2)
    np.testing.assert_allclose(online_eval["acc"], offline_eval["acc"], atol=0.05)


def test_engine_tau_evaluation_during_training(tmp_path):
    setup = _setup(tmp_path, tau_eval_every=3, tau_eval_prompts=4, tau_eval_num_spec=3, tau_eval_max_new_tokens=12)
    evaluate_tau = setup.method.tau_evaluator(setup.eval_rows)
    state, records = core.train(setup, evaluate_tau=evaluate_tau)
    assert [r["update"] for r in records if "engine" in r] == [3, 6]
    final = records[-1]["engine"]
    assert len(final["acceptance_by_position"]) == 2  # min(heads, tau_eval_num_spec)
    assert evaluate_tau.engine._decode_jit._cache_size() == 1  # new weights, same compilation
    drafter = MedusaDrafter(setup.method.draft_config, state.params, setup.method.token_map, chain_paths(2))
    prompts = [list(map(int, t[:4])) for t in setup.eval_rows.tokens]
    stats = Engine(TARGET, setup.method.target_params, drafter, max_len=64).generate(prompts, max_new_tokens=12)
    assert final["tau"] == round(stats.tau, 4)


def test_shipped_config_loads():
    config = load_config(REPO / "configs" / "medusa_smollm2.yaml")
    assert config.medusa_num_heads >= 1 and config.export_dir.endswith("smollm2-135m-medusa")
