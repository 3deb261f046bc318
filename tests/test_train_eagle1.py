"""EAGLE-1 training on the shared core: the unrolled steps, the loss, exact resume, export and re-import, engine tau."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.checkpoints.eagle1 import load_eagle1
from specjax.drafters.eagle1 import Eagle1Drafter
from specjax.engine import Engine
from specjax.kv_cache import KVCache, write
from specjax.models import eagle1, llama
from train import core, data, eagle1_method, ttt
from train.config import load_config, make_config
from train_helpers import TARGET, TRAIN_CONFIG, pattern_rows, target_params

REPO = Path(__file__).resolve().parents[1]


def _setup(tmp_path, **overrides):
    """A tiny online run over a sharpened random 4-layer target on repeating patterns (train_helpers)."""
    config = make_config({**TRAIN_CONFIG, "output_dir": str(tmp_path), "ttt_length": 2, "data_parallel": 1, **overrides})
    train_rows, eval_rows = pattern_rows()
    ids = data.draft_vocab_ids(train_rows, 24, TARGET.vocab_size)
    return core.Setup(
        config=config,
        method=eagle1_method.Eagle1Method(config, TARGET, target_params(), jnp.asarray(ids, jnp.int32)),
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


def _perturbed(method):
    return jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), method.init_params(jax.random.key(0)))


def test_unrolled_steps_are_the_chain_drafter_forwards(tmp_path):
    """Step 0 is one causal block; step 1 at index t is the query a chain drafter runs after
    reading entries 0..t: (its step-0 output at t, token t + 2) at position t + 1."""
    method = _setup(tmp_path).method
    params, config = _perturbed(method), method.draft_config
    tokens = jnp.asarray(pattern_rows()[0].tokens[:2])  # [2, 16]
    features = method.target_outputs(np.asarray(tokens))["features"].astype(np.float32)
    embeddings = llama.embed(method.target_params, tokens)
    predicted = eagle1_method.unrolled_features(params, config, embeddings, jnp.asarray(features), 2)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    empty = KVCache.init(1, 2, 16, config.num_kv_heads, config.head_dim)
    step0 = eagle1.forward(params, config, ttt.shift_left(embeddings, 1), features, positions, empty, jnp.tril(jnp.ones((16, 16), bool)))
    np.testing.assert_allclose(predicted[0], step0.hidden, atol=1e-5)
    cache = write(empty, step0.k, step0.v)
    for t in range(14):
        read = cache.replace(lengths=jnp.full((2,), t + 1, jnp.int32))
        step1 = eagle1.forward(params, config, embeddings[:, t + 2 : t + 3], step0.hidden[:, t : t + 1], positions[:, t + 1 : t + 2], read, jnp.ones((1, 1), bool))
        np.testing.assert_allclose(predicted[1][:, t], step1.hidden[:, 0], atol=1e-5, err_msg=f"index {t}")


def test_loss_matches_a_per_position_reference(tmp_path):
    setup = _setup(tmp_path)
    method = setup.method
    params = _perturbed(method)
    batch = core.get_batch(setup, setup.train_rows, np.arange(4))
    total, stats = method.loss(params, method.frozen(False), batch)
    mask = np.asarray(batch["loss_mask"])
    outputs = method.target_outputs(np.asarray(batch["tokens"]))
    features = outputs["features"].astype(np.float32)
    predicted = eagle1_method.unrolled_features(
        params, method.draft_config, llama.embed(method.target_params, batch["tokens"]), jnp.asarray(features), 2
    )
    head = np.asarray(llama.output_head(method.target_params, TARGET))[:, np.asarray(method.vocab_ids)]  # [H, Vd]
    log_softmax = lambda x: x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    huber = lambda x: np.where(np.abs(x) < 1, 0.5 * x * x, np.abs(x) - 0.5)
    expected_total = 0.0
    for k in range(2):
        pred = np.asarray(predicted[k])
        loss_sum, regression_sum, responses, correct = 0.0, 0.0, 0, 0
        for b in range(4):
            for t in range(16 - k - 2):
                if not mask[b, t + k + 2]:  # step k at t predicts f_{t+k+1}, whose head predicts the token at t + k + 2
                    continue
                true = features[b, t + k + 1]
                regression = np.mean(huber(pred[b, t] - true))
                responses += 1
                regression_sum += regression
                loss_sum += regression
                if outputs["in_vocab"][b, t + k + 1]:
                    q, log_p = np.exp(log_softmax(true @ head)), log_softmax(pred[b, t] @ head)
                    loss_sum += 0.1 * -np.sum(q * log_p)
                    correct += int(np.argmax(log_p) == np.argmax(q))
        np.testing.assert_allclose(stats["loss_sum"][k], loss_sum, rtol=1e-4)
        np.testing.assert_allclose(stats["regression_sum"][k], regression_sum, rtol=1e-4)
        assert stats["response"][k] == responses and stats["correct"][k] == correct
        expected_total += 0.8**k * loss_sum / responses
    np.testing.assert_allclose(total, expected_total, rtol=1e-4)


def test_resume_is_exact(tmp_path, full_run):
    setup, _, full_records = full_run
    _, first_half = core.train(_setup(tmp_path), stop_at=3)
    _, second_half = core.train(_setup(tmp_path))
    assert [r["update"] for r in first_half + second_half] == [1, 2, 3, 4, 5, 6]
    assert [r["total"] for r in first_half + second_half] == [r["total"] for r in full_records]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and len(metrics[0]["regression"]) == 2


def test_loss_decreases_and_export_reloads_to_identical_features(tmp_path, full_run):
    setup, state, records = full_run
    totals = [r["total"] for r in records]
    assert totals[-1] < 0.9 * totals[0], totals
    evaluation = core.evaluate(setup, state.params)
    assert len(evaluation["acc"]) == 2 and evaluation["acceptance_length"] >= 1
    config = dataclasses.replace(setup.config, export_dir=str(tmp_path / "f32"), export_dtype="float32")
    exact = dataclasses.replace(setup, config=config, method=dataclasses.replace(setup.method, config=config))
    path = core.export(exact, state.params, evaluation)
    draft_config, params = load_eagle1(path, target_config=TARGET)
    assert draft_config == setup.method.draft_config
    embeddings, features = jax.random.normal(jax.random.key(2), (2, 2, 5, TARGET.hidden_size))
    predict = lambda p: eagle1_method.unrolled_features(p, draft_config, embeddings, features, 2)
    for ours, theirs in zip(predict(params), predict(state.params)):
        np.testing.assert_array_equal(ours, theirs)


def test_offline_target_outputs_match_online(tmp_path):
    setup = _setup(tmp_path)
    rows = data.TokenRows(
        np.concatenate([setup.train_rows.tokens, setup.eval_rows.tokens]),
        np.concatenate([setup.train_rows.loss_mask, setup.eval_rows.loss_mask]),
    )
    offline = dataclasses.replace(setup, offline=core.offline_features(setup.method, rows, tmp_path / "features", 8, key="k"))
    params = _perturbed(setup.method)
    online_eval, offline_eval = core.evaluate(setup, params), core.evaluate(offline, params)
    np.testing.assert_allclose(online_eval["loss"], offline_eval["loss"], rtol=2e-2)
    np.testing.assert_allclose(online_eval["acc"], offline_eval["acc"], atol=0.05)


def test_engine_tau_evaluation_during_training(tmp_path):
    setup = _setup(tmp_path, tau_eval_every=3, tau_eval_prompts=4, tau_eval_num_spec=3, tau_eval_max_new_tokens=12)
    evaluate_tau = setup.method.tau_evaluator(setup.eval_rows)
    state, records = core.train(setup, evaluate_tau=evaluate_tau)
    assert [r["update"] for r in records if "engine" in r] == [3, 6]
    final = records[-1]["engine"]
    assert len(final["acceptance_by_position"]) == 3
    assert evaluate_tau.engine._decode_jit._cache_size() == 1  # new weights, same compilation
    drafter = Eagle1Drafter(setup.method.draft_config, state.params, TARGET, setup.method.target_params, depth=3)
    prompts = [list(map(int, t[:4])) for t in setup.eval_rows.tokens]
    stats = Engine(TARGET, setup.method.target_params, drafter, max_len=64).generate(prompts, max_new_tokens=12)
    assert final["tau"] == round(stats.tau, 4)


def test_shipped_config_loads():
    config = load_config(REPO / "configs" / "eagle1_smollm2.yaml")
    assert config.eagle1_cls_weight > 0 and config.export_dir.endswith("smollm2-135m-eagle1")
