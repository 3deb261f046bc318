"""EAGLE-3 training: TTT attention and loss, config loading, resume, data parallelism, learning."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import word_tokenizer
from train_helpers import TARGET, TRAIN_CONFIG, pattern_rows, target_params
from specjax import kv_cache
from specjax.checkpoints.eagle3 import load_eagle3
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.engine import Engine
from specjax.kv_cache import KVCache
from specjax.models import eagle3
from train import core, data, eagle3_method, ttt
from train.config import load_config, make_config, parse_overrides

DRAFT = eagle3.Eagle3Config.from_target(TARGET, draft_vocab_size=24)
REPO = Path(__file__).resolve().parents[1]


TTT_LOGITS = jax.jit(ttt.ttt_logits, static_argnums=(1, 4))
TTT_LOSS = jax.jit(ttt.ttt_loss, static_argnums=1, static_argnames=("num_steps", "decay"))


def _synthetic(batch, length, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    embeddings = jax.random.normal(keys[0], (batch, length, 32))  # [B, T, H]
    features = jax.random.normal(keys[1], (batch, length, 96))  # [B, T, 3H]
    target_logits = 3 * jax.random.normal(keys[2], (batch, length, 24))  # [B, T, Vd]
    in_vocab = jax.random.bernoulli(keys[3], 0.8, (batch, length))
    loss_mask = jnp.arange(length)[None, :] >= jnp.array([[3], [5]])[:batch]
    return embeddings, features, target_logits, in_vocab, loss_mask


def test_ttt_step_k_equals_the_inference_chain():
    """Step k at index t == the cached draft chain: prefix 0..t, then k one-token steps."""
    params = eagle3.init_params(DRAFT, jax.random.key(0))
    params = jax.tree.map(lambda p: p * 10 if p.ndim == 2 else p, params)  # sharp attention
    embeddings, features, *_ = _synthetic(2, 9)
    steps = TTT_LOGITS(params, DRAFT, embeddings, features, 4)
    hidden0 = eagle3.project_features(params, features)
    forward = jax.jit(eagle3.forward, static_argnums=1, static_argnames="chunk_size")
    for t in (4,):
        cache = KVCache.init(1, 2, 16, DRAFT.num_kv_heads, DRAFT.head_dim)
        positions = jnp.broadcast_to(jnp.arange(t + 1), (2, t + 1))
        causal = jnp.tril(jnp.ones((t + 1, t + 1), bool))
        out = forward(params, DRAFT, embeddings[:, 1 : t + 2], hidden0[:, : t + 1], positions, cache, causal, chunk_size=16)
        cache = kv_cache.commit(kv_cache.write(cache, out.k, out.v), jnp.full((2,), t + 1))
        np.testing.assert_allclose(out.logits[:, t], steps[0][:, t], atol=2e-4)
        hidden = out.hidden[:, t : t + 1]
        for k in range(1, 4):
            out = forward(
                params, DRAFT, embeddings[:, t + 1 + k : t + 2 + k], hidden,
                jnp.full((2, 1), t + k), cache, jnp.ones((1, 1), bool), chunk_size=16,
            )
            cache = kv_cache.commit(kv_cache.write(cache, out.k, out.v), jnp.ones((2,), jnp.int32))
            np.testing.assert_allclose(out.logits[:, 0], steps[k][:, t], atol=2e-4, err_msg=f"t={t} k={k}")
            hidden = out.hidden


@pytest.mark.parametrize("block", [ttt.ATTENTION_BLOCK, 4])  # one block; blocks of 4 over 10 queries (last one short)
def test_ttt_attention_is_causal_plus_diagonal(block):
    """Dense attention with the explicit [T, (k+1)T] mask equals ttt_attention, values and gradients."""
    keys = jax.random.split(jax.random.key(1), 7)
    batch, length, dim = 2, 10, 8
    q = jax.random.normal(keys[0], (batch, length, 4, dim))
    step_keys = [jax.random.normal(keys[1 + i], (batch, length, 2, dim)) for i in range(3)]
    step_values = [jax.random.normal(keys[4 + i], (batch, length, 2, dim)) for i in range(3)]
    mask = jnp.concatenate([jnp.tril(jnp.ones((length, length), bool))] + [jnp.eye(length, dtype=bool)] * 2, 1)

    def dense(q, k0, v0, k_diag, v_diag):
        all_k = jnp.repeat(jnp.concatenate([k0, *k_diag], 1), 2, axis=2)  # [B, 3T, Hq, D]
        all_v = jnp.repeat(jnp.concatenate([v0, *v_diag], 1), 2, axis=2)
        scores = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, all_k) / np.sqrt(dim), -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), all_v)

    blocked = lambda *args: ttt.ttt_attention(*args, block=block)
    args = (q, step_keys[0], step_values[0], step_keys[1:], step_values[1:])
    np.testing.assert_allclose(jax.jit(blocked)(*args), dense(*args), atol=1e-5)
    loss = lambda attend: lambda *args: jnp.sum(jnp.sin(attend(*args)))
    got, want = (jax.grad(loss(f), argnums=(0, 1, 2, 3, 4))(*args) for f in (blocked, dense))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_ttt_loss_matches_a_per_position_reference():
    params = eagle3.init_params(DRAFT, jax.random.key(2))
    embeddings, features, target_logits, in_vocab, loss_mask = _synthetic(2, 10)
    loss, stats = TTT_LOSS(
        params, DRAFT, embeddings, features, target_logits, in_vocab, loss_mask, num_steps=3, decay=0.8
    )
    steps = np.asarray(TTT_LOGITS(params, DRAFT, embeddings, features, 3))  # [K, B, T, Vd]
    target_logits, in_vocab, loss_mask = map(np.asarray, (target_logits, in_vocab, loss_mask))
    log_softmax = lambda x: x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    expected_total = 0.0
    for k, logits in enumerate(steps):
        losses, correct, response = [], 0, 0
        for b in range(2):
            for t in range(10 - 2 - k):
                target_pos = t + 1 + k  # the draft at (t, k) predicts the target at t + 1 + k
                if not loss_mask[b, target_pos + 1]:
                    continue
                response += 1
                if not in_vocab[b, target_pos]:
                    continue
                p = np.exp(log_softmax(target_logits[b, target_pos]))
                losses.append(-np.sum(p * log_softmax(logits[b, t])))
                correct += int(np.argmax(logits[b, t]) == np.argmax(target_logits[b, target_pos]))
        np.testing.assert_allclose(stats["loss"][k], np.mean(losses), rtol=1e-5)
        assert stats["weight"][k] == len(losses) and stats["response"][k] == response
        assert stats["correct"][k] == correct
        expected_total += 0.8**k * np.mean(losses)
    np.testing.assert_allclose(loss, expected_total, rtol=1e-5)
    np.testing.assert_allclose(ttt.acceptance_length(jnp.array([0.5, 0.5, 0.0])), 1.75)


def test_bfloat16_ttt_loss_and_gradient_follow_float32():
    """compute_dtype bfloat16 (bf16 dots accumulating in f32): the f32 loss within bf16 rounding,
    and every weight's gradient pointing the same way as the f32 one."""
    params = eagle3.init_params(DRAFT, jax.random.key(7))
    inputs = _synthetic(2, 10)
    loss_fn = lambda dtype: jax.jit(jax.value_and_grad(lambda p: ttt.ttt_loss(
        jax.tree.map(lambda x: x.astype(dtype), p), DRAFT, inputs[0].astype(dtype), inputs[1].astype(dtype), *inputs[2:],
        num_steps=3)[0]))
    (want, want_grad), (got, got_grad) = loss_fn(jnp.float32)(params), loss_fn(jnp.bfloat16)(params)
    np.testing.assert_allclose(got, want, rtol=2e-2)
    for name in ("fc", "q_proj", "o_proj", "down_proj", "lm_head"):
        a, b = (np.asarray(g[name], np.float32).ravel() for g in (got_grad, want_grad))
        assert a.dtype == np.float32 and np.linalg.norm(b) > 0
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99, name


def test_the_blockwise_head_loss_has_the_dense_loss_and_gradient():
    """Blocks of 4 positions sorted loss-first (skipping those with none) == the head over every position."""
    params = eagle3.init_params(DRAFT, jax.random.key(3))
    hidden = jax.random.normal(jax.random.key(4), (2, 10, 32))
    target_logits = 3 * jax.random.normal(jax.random.key(5), (2, 10, 24))
    weight = (jnp.arange(10)[None, :] < jnp.array([[4], [8]])) & (jnp.arange(10)[None, :] >= 2)  # 8 of 20 positions
    def dense(params):
        logits = eagle3.head_logits(params, DRAFT, hidden)
        target = ttt.shift_left(target_logits, 2)
        cross_entropy = -jnp.sum(jax.nn.softmax(target) * jax.nn.log_softmax(logits), -1)
        agree = weight & (jnp.argmax(logits, -1) == jnp.argmax(target, -1))
        return jnp.sum(jnp.where(weight, cross_entropy, 0.0)), jnp.sum(agree)
    target = jax.nn.softmax(target_logits), jnp.argmax(target_logits, -1)
    blockwise = lambda params: ttt.masked_head_loss(params, DRAFT, hidden, *target, weight, offset=2, block=4)
    (want, want_agree), (got, got_agree) = dense(params), jax.jit(blockwise)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(got_agree) == int(want_agree)
    want_grad = jax.grad(lambda p: dense(p)[0])(params)
    got_grad = jax.jit(jax.grad(lambda p: blockwise(p)[0]))(params)
    for name in ("lm_head", "norm"):
        assert np.abs(np.asarray(want_grad[name])).max() > 0
        np.testing.assert_allclose(got_grad[name], want_grad[name], rtol=1e-4, atol=1e-6)


def test_draft_vocab_is_most_frequent_response_tokens_sorted():
    rows = data.TokenRows(
        tokens=np.array([[9, 5, 5, 7, 7, 7, 1], [9, 9, 9, 9, 2, 3, 0]], np.int32),
        loss_mask=np.array([[0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0]], bool),
    )
    np.testing.assert_array_equal(data.draft_vocab_ids(rows, 3, 10), [1, 5, 7])  # 7:3, 5:2, then 1 < 2 < 3
    np.testing.assert_array_equal(data.draft_vocab_ids(rows, 6, 10), [0, 1, 2, 3, 5, 7])  # filled with 0


def test_rows_truncate_pad_and_pack():
    samples = [(np.arange(n, dtype=np.int32) + 1, np.arange(n) >= 2) for n in (3, 4, 9, 2)]
    rows = data.to_rows(samples, 8)  # the last sample has no response token: dropped
    np.testing.assert_array_equal(rows.tokens, [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0], np.arange(8) + 1])
    packed = data.to_rows(samples, 8, pack=True)
    np.testing.assert_array_equal(packed.tokens, [[1, 2, 3, 1, 2, 3, 4, 0], np.arange(8) + 1])
    np.testing.assert_array_equal(packed.loss_mask[0], [0, 0, 1, 0, 0, 1, 1, 0])


def test_batch_indices_are_a_function_of_the_step():
    first_epoch = np.concatenate([data.batch_indices(10, 3, step, seed=1) for step in range(3)])
    assert len(set(first_epoch)) == 9
    np.testing.assert_array_equal(data.batch_indices(10, 3, 4, 1), data.batch_indices(10, 3, 4, 1))
    assert not np.array_equal(data.batch_indices(10, 3, 0, 1), data.batch_indices(10, 3, 3, 1))


def test_loss_mask_covers_assistant_turns_only():
    tokenizer = word_tokenizer()
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello you"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    tokens, mask = data.tokenize_conversation(tokenizer, messages)
    words = tokenizer.convert_ids_to_tokens(tokens.tolist())
    assert [w for w, m in zip(words, mask) if m] == ["hello", "you", "<end>", "see", "you", "<end>"]


def test_config_unknown_keys_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 4\nlearning_rate: 3e-4\nbogus_key: 1\nanother: 2\n")
    with pytest.raises(ValueError, match="another, bogus_key"):
        load_config(path)
    path.write_text("batch_size: 4\ndata_files: [a.jsonl]\n")
    config = load_config(path, parse_overrides(["--learning-rate", "0.01", "--ttt_length", "3"]))
    assert (config.batch_size, config.learning_rate, config.ttt_length) == (4, 0.01, 3)
    assert config.data_files == ("a.jsonl",)
    with pytest.raises(ValueError, match="batch_size"):
        make_config({"batch_size": "four"})


@pytest.mark.parametrize("name", ["eagle3_smollm2_stage1", "eagle3_smollm2", "eagle3_llama31_8b", "eagle3_qwen3_8b", "eagle3_tiny"])
def test_shipped_configs_load(name):
    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert config.batch_size % max(config.data_parallel, 1) == 0


def _setup(tmp_path, mesh_devices=1, **overrides):
    """A tiny online-feature run over a sharpened random 4-layer target on repeating patterns."""
    values = dict(TRAIN_CONFIG, output_dir=str(tmp_path), ttt_length=2, data_parallel=mesh_devices)
    config = make_config({**values, **overrides})
    train_rows, eval_rows = pattern_rows()
    vocab_ids = data.draft_vocab_ids(train_rows, 24, TARGET.vocab_size)
    vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(vocab_ids), TARGET.vocab_size)
    return core.Setup(
        config=config,
        method=eagle3_method.Eagle3Method(config, TARGET, target_params(), vocab),
        train_rows=train_rows,
        eval_rows=eval_rows,
        offline=None,
        mesh=core.make_mesh(mesh_devices),
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """6 updates of 2 accumulated micro-batches, uninterrupted."""
    setup = _setup(tmp_path_factory.mktemp("full"))
    state, records = core.train(setup)
    return setup, state, records


def test_resume_is_exact(tmp_path, full_run):
    setup, _, full_records = full_run
    _, first_half = core.train(_setup(tmp_path), stop_at=3)
    assert [r["update"] for r in first_half] == [1, 2, 3]
    _, second_half = core.train(_setup(tmp_path))
    assert [r["update"] for r in second_half] == [4, 5, 6]
    assert [r["total"] for r in first_half + second_half] == [r["total"] for r in full_records]
    metrics = [json.loads(line) for line in (Path(setup.config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and len(metrics[0]["acc"]) == 2 and "acceptance_length" in metrics[0]


def test_loss_decreases_and_export_loads(full_run):
    setup, state, records = full_run
    totals = [r["total"] for r in records]
    assert np.all(np.diff(totals) < 0) and totals[-1] < 0.92 * totals[0], totals
    path = core.export(setup, state.params)
    config, params, vocab = load_eagle3(path, target_vocab_size=TARGET.vocab_size)
    assert config == DRAFT
    np.testing.assert_array_equal(vocab.t2d, setup.method.vocab.t2d)
    np.testing.assert_allclose(params["fc"], state.params["fc"], rtol=1e-2, atol=1e-3)  # bfloat16 export


def test_data_parallel_step_matches_single_device(tmp_path):
    assert len(jax.devices()) >= 4
    results = []
    for devices in (1, 4):
        setup = _setup(tmp_path / str(devices), mesh_devices=devices)
        state = core.init_state(setup)
        batch = core.get_batch(setup, setup.train_rows, np.arange(4))
        assert batch["tokens"].sharding.shard_shape(batch["tokens"].shape) == (4 // devices, 16)
        state, stats = core.train_step(state, setup.frozen, batch, **core.step_kwargs(setup))
        results.append(jax.device_get((state.params, stats)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *results)


@pytest.mark.slow
def test_offline_features_match_online(tmp_path):
    setup = _setup(tmp_path)
    rows = data.TokenRows(
        np.concatenate([setup.train_rows.tokens, setup.eval_rows.tokens]),
        np.concatenate([setup.train_rows.loss_mask, setup.eval_rows.loss_mask]),
    )
    features = core.offline_features(setup.method, rows, tmp_path / "features", 8, key="k")
    offline = dataclasses.replace(setup, offline=features)
    state = core.init_state(setup)
    online_eval = core.evaluate(setup, state.params)
    offline_eval = core.evaluate(offline, state.params)
    np.testing.assert_allclose(online_eval["loss"], offline_eval["loss"], rtol=2e-2)
    np.testing.assert_allclose(online_eval["acc"], offline_eval["acc"], atol=0.05)


def test_bfloat16_compute_keeps_float32_master_weights(tmp_path):
    setup = _setup(tmp_path, compute_dtype="bfloat16")
    state = core.init_state(setup)
    batch = core.get_batch(setup, setup.train_rows, np.arange(4))
    new_state, stats = core.train_step(state, setup.frozen, batch, **core.step_kwargs(setup))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new_state.params))
    assert np.isfinite(stats["total"])
    f32_stats = core.eval_step(state.params, setup.frozen, batch, loss=_setup(tmp_path).method.loss)
    np.testing.assert_allclose(stats["loss"], f32_stats["loss"], rtol=5e-2)


def test_engine_tau_evaluation_during_training(tmp_path):
    setup = _setup(tmp_path, tau_eval_every=3, tau_eval_prompts=4, tau_eval_num_spec=3, tau_eval_max_new_tokens=12)
    evaluate_tau = setup.method.tau_evaluator(setup.eval_rows)
    state, records = core.train(setup, evaluate_tau=evaluate_tau)
    evaluated = [r["update"] for r in records if "engine" in r]
    assert evaluated == [3, 6]
    final = records[-1]["engine"]
    assert final["prompts"] == 4 and len(final["acceptance_by_position"]) == 3
    assert evaluate_tau.engine._decode_jit._cache_size() == 1  # new weights, same compilation
    # The same number from an engine built independently on the trained head.
    drafter = Eagle3Drafter(
        DRAFT, state.params, setup.method.vocab, setup.method.target_params["embed_tokens"], depth=3,
        feature_layers=eagle3.feature_layers(TARGET.num_layers),
    )
    prompts = [list(map(int, t[:4])) for t in setup.eval_rows.tokens]
    stats = Engine(TARGET, setup.method.target_params, drafter, max_len=64).generate(prompts, max_new_tokens=12)
    assert final["tau"] == round(stats.tau, 4)
    assert stats.calls.sum() > 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics if "engine" in m] == [3, 6]


def test_batch_must_split_over_the_data_parallel_devices(tmp_path):
    with pytest.raises(ValueError, match="batch_size 6 must be a multiple of the 4"):
        eagle3_method.prepare(make_config({"output_dir": str(tmp_path), "batch_size": 6, "data_parallel": 4}))
    with pytest.raises(ValueError, match="tau_eval_every needs held-out rows"):
        make_config({"tau_eval_every": 10})


def test_continue_from_an_exported_draft(tmp_path, full_run):
    setup, state, _ = full_run
    path = core.export(dataclasses.replace(setup, config=dataclasses.replace(setup.config, export_dir=str(tmp_path / "d"))), state.params)
    params, vocab = eagle3_method.load_initial_draft(str(path), DRAFT, TARGET)
    np.testing.assert_array_equal(vocab.d2t, setup.method.vocab.d2t)
    resumed = core.init_state(dataclasses.replace(setup, method=dataclasses.replace(setup.method, initial_params=params)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3), jax.device_get(resumed.params), jax.device_get(state.params))
    assert int(resumed.micro_step) == 0  # a new run: fresh optimizer and schedule
    other = eagle3.Eagle3Config.from_target(TARGET, draft_vocab_size=32)
    with pytest.raises(ValueError, match=r"draft_vocab_size': \(24, 32\)"):
        eagle3_method.load_initial_draft(str(path), other, TARGET)


def test_conversation_files_in_the_usual_shapes(tmp_path):
    records = [
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "human", "value": "bye"}, {"from": "gpt", "value": "see you"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"conversations": [], "source": "dropped by self-distillation"},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    conversations = data.load_conversations([str(path)])
    assert [[m["role"] for m in c] for c in conversations] == [["user", "assistant"]] * 2 + [["system", "user", "assistant"]]
    assert conversations[1][1] == {"role": "assistant", "content": "see you"}
    path.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match="neither 'conversations' nor 'messages'"):
        data.load_conversations([str(path)])


def test_continue_with_a_rebuilt_draft_vocabulary(tmp_path, full_run):
    setup, state, _ = full_run
    path = core.export(dataclasses.replace(setup, config=dataclasses.replace(setup.config, export_dir=str(tmp_path / "d"))), state.params)
    larger = eagle3.Eagle3Config.from_target(TARGET, draft_vocab_size=32)
    params, vocab = eagle3_method.load_initial_draft(str(path), larger, TARGET, any_vocab_size=True)
    with pytest.raises(ValueError, match=r"intermediate_size"):  # only the vocabulary size may differ
        eagle3_method.load_initial_draft(str(path), dataclasses.replace(larger, intermediate_size=32), TARGET, any_vocab_size=True)

    old_ids = np.asarray(vocab.target_ids)  # [24]
    new_ids = np.sort(np.concatenate([old_ids[::2], np.setdiff1d(np.arange(64), old_ids)[:20]]))  # [32]
    remapped = eagle3_method.remap_draft_head(params, old_ids, new_ids, setup.method.target_params, TARGET)
    head, new_head, target_head = (np.asarray(h) for h in (params["lm_head"], remapped["lm_head"], setup.method.target_params["lm_head"]))
    assert new_head.shape == (32, 32)
    for column, token in enumerate(new_ids):
        if token in old_ids:  # trained column kept
            np.testing.assert_array_equal(new_head[:, column], head[:, np.searchsorted(old_ids, token)])
        else:  # the target's output embedding, rescaled
            cosine = new_head[:, column] @ target_head[:, token] / np.linalg.norm(new_head[:, column]) / np.linalg.norm(target_head[:, token])
            assert cosine == pytest.approx(1.0, abs=1e-5)
    ratios = np.linalg.norm(head[:, ::2], axis=0) / np.linalg.norm(target_head[:, old_ids[::2]], axis=0)
    fresh = np.setdiff1d(new_ids, old_ids)[0]
    np.testing.assert_allclose(
        np.linalg.norm(new_head[:, np.searchsorted(new_ids, fresh)]), np.median(ratios) * np.linalg.norm(target_head[:, fresh]), rtol=1e-5
    )
    assert all(np.array_equal(remapped[k], params[k]) for k in params if k != "lm_head")
    with pytest.raises(ValueError, match="shares no token"):
        eagle3_method.remap_draft_head(params, old_ids, np.setdiff1d(np.arange(64), old_ids)[:8], setup.method.target_params, TARGET)
    with pytest.raises(ValueError, match="init_vocab must be 'keep' or 'rebuild'"):
        make_config({"init_vocab": "extend"})
