"""Draft-model training on the shared core: the loss, frozen embedding and head, exact resume,
a Hugging Face export that transformers and specjax both read, engine tau, metrics.png."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from checkpoint_helpers import tiny_llama
from specjax.checkpoints import hf, load_model
from specjax.checkpoints.draft_files import save_model
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.engine import Engine
from specjax.models import llama
from train import core, draft_lm_method
from train.config import make_config
from train.metrics_plot import metric_series
from train_helpers import TARGET, TRAIN_CONFIG, pattern_rows, target_params


def _setup(tmp_path, **overrides):
    """A tiny online run: a 2-layer draft cut from the 4-layer sharpened random target (train_helpers)."""
    config = make_config({**TRAIN_CONFIG, "output_dir": str(tmp_path), "draft_num_layers": 2, "data_parallel": 1, **overrides})
    train_rows, eval_rows = pattern_rows()
    method = draft_lm_method.DraftLMMethod(config, TARGET, target_params())
    return core.Setup(config, method, train_rows, eval_rows, offline=None, mesh=core.make_mesh(1))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    setup = _setup(tmp_path_factory.mktemp("full"), tau_eval_every=3, tau_eval_prompts=4, tau_eval_num_spec=3, tau_eval_max_new_tokens=12)
    state, records = core.train(setup)
    return setup, state, records


def test_loss_is_the_next_token_cross_entropy_of_the_truncated_target(tmp_path):
    setup = _setup(tmp_path)
    method, target = setup.method, target_params()
    batch = core.get_batch(setup, setup.train_rows, np.arange(4))
    total, stats = method.loss(method.init_params(jax.random.key(0)), method.frozen(False), batch)
    # The untrained draft is the target's first two layers under its own norm and head, built here directly.
    truncated = {**target, "layers": target["layers"][:2]}
    tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["loss_mask"])
    logits = np.asarray(llama.forward(truncated, dataclasses.replace(TARGET, num_layers=2), jnp.asarray(tokens),
                                      jnp.broadcast_to(jnp.arange(16), (4, 16)), None, jnp.tril(jnp.ones((16, 16), bool))).logits)
    losses, correct = [], 0
    for b in range(4):
        for t in range(15):
            if mask[b, t + 1]:  # position t predicts the response token at t + 1
                row = logits[b, t].astype(np.float64)
                losses.append(np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[tokens[b, t + 1]])
                correct += int(row.argmax() == tokens[b, t + 1])
    assert stats["weight"][0] == len(losses) and stats["correct"][0] == correct
    np.testing.assert_allclose(total, np.mean(losses), rtol=1e-5)


def test_training_moves_only_the_layers_and_norm_and_learns(full_run):
    setup, state, records = full_run
    assert set(state.params) == {"layers", "norm"} and len(state.params["layers"]) == 2
    assert set(setup.frozen) == {"embed_tokens", "lm_head"}  # the target's, passed unchanged every step
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), state.params, setup.method.init_params(jax.random.key(0)))
    assert all(jax.tree.leaves(moved))
    assert records[-1]["loss"][0] < records[0]["loss"][0]


def test_resume_is_exact(tmp_path, full_run):
    _, _, full_records = full_run
    _, first = core.train(_setup(tmp_path), stop_at=3)
    _, rest = core.train(_setup(tmp_path))  # no engine tau: it does not change the trajectory
    assert [r["total"] for r in first + rest] == [r["total"] for r in full_records]


def test_export_is_a_hugging_face_model_with_the_drafts_logits(tmp_path, full_run):
    setup, state, _ = full_run
    method = dataclasses.replace(setup.method, config=dataclasses.replace(setup.config, export_dtype="float32"))
    path = tmp_path / "draft"
    method.export(state.params, path, overwrite=False)
    config, params = load_model(path)
    assert config == method.draft_config
    trained = method.model_params(jax.device_get(state.params))
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), params, trained))
    tokens = np.asarray(setup.eval_rows.tokens[:1])
    ours = llama.forward(params, config, jnp.asarray(tokens), jnp.arange(16)[None], None, jnp.tril(jnp.ones((16, 16), bool))).logits
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2


def test_save_model_round_trips_a_tied_hugging_face_model(tmp_path):
    model = tiny_llama()  # tied embeddings, as SmolLM2
    model.save_pretrained(tmp_path / "original")
    config, params = hf.load(tmp_path / "original")
    save_model(tmp_path / "copy", config, jax.tree.map(np.asarray, params))
    copy_config, copy_params = hf.load(tmp_path / "copy")
    assert copy_config == config and "lm_head" not in copy_params
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), copy_params, params))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy").eval()
    tokens = torch.tensor([[5, 17, 42, 3, 88]])
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy(), rtol=1e-5, atol=1e-5)


def test_engine_tau_during_training_is_a_fresh_engines(full_run):
    setup, state, records = full_run
    assert records[-1]["engine"]["tau"] >= 1.0
    method = setup.method
    drafter = DraftModelDrafter(method.draft_config, method.model_params(jax.device_get(state.params)), num_draft=setup.config.tau_eval_num_spec, chunk_size=64)
    evaluator = method.tau_evaluator(setup.eval_rows)
    engine = Engine(TARGET, target_params(), drafter, max_len=evaluator.engine.max_len, attention_chunk=64)
    stats = engine.generate(evaluator.prompts, max_new_tokens=setup.config.tau_eval_max_new_tokens)
    assert records[-1]["engine"]["tau"] == round(stats.tau, 4)


@pytest.mark.parametrize("overrides, message", [
    ({"draft_num_layers": 4}, "draft_num_layers 4 must be below the target's 4 layers"),
    ({"features": "offline", "draft_num_layers": 2}, "set features: online"),
])
def test_bad_settings_are_named(tmp_path, overrides, message):
    config = make_config({**TRAIN_CONFIG, "output_dir": str(tmp_path), **overrides})
    target = core.Target(tmp_path, TARGET, target_params())
    with pytest.raises(ValueError, match=message):
        draft_lm_method.DraftLMMethod.build(config, target, pattern_rows()[0])


def test_metrics_are_plotted_with_loss_acc_and_tau(full_run):
    setup, _, records = full_run
    assert (Path(setup.config.output_dir) / "metrics.png").stat().st_size > 0
    series = metric_series(records)
    assert [u for u, _ in series["loss"]] == list(range(1, 7))
    assert series["tau"] == [(3, records[2]["engine"]["tau"]), (6, records[5]["engine"]["tau"])]
    with_eval = [{"update": 5, "total": 1.0, "eval": {"acc": [0.5, 0.25]}}]
    assert metric_series(with_eval) == {"loss": [(5, 1.0)], "acc_0": [(5, 0.5)], "acc_1": [(5, 0.25)]}
