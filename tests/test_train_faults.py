"""Training faults: nothing lost, nothing silently wrong, every error named.

A tiny Llama target in the Hugging Face layout with a word-level chat tokenizer, run through the
real `prepare` (target, rows, draft vocabulary, caches) and the real loop.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

import specjax.checkpoints.draft_files as draft_files
from engine_helpers import word_tokenizer
from specjax.checkpoints.eagle3 import load_eagle3, save_eagle3
from specjax.models import eagle3
from train import core, data, eagle3_method
from train.config import make_config, parse_overrides
from train.eagle3 import main

WORDS = "hi there hello you bye see".split()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama (vocabulary 16) in the HF layout, with the word-level chat tokenizer."""
    path = tmp_path_factory.mktemp("target")
    hidden, inter, layers, vocab = 32, 64, 4, 16
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1,
    )
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,)}
        attention = {"q": (32, hidden), "k": (16, hidden), "v": (16, hidden), "o": (hidden, 32)}
        shapes |= {layer + f"self_attn.{name}_proj.weight": shape for name, shape in attention.items()}
        mlp = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        shapes |= {layer + f"mlp.{name}_proj.weight": shape for name, shape in mlp.items()}
    rng = np.random.default_rng(0)
    tensors = {name: (np.ones(s) if len(s) == 1 else rng.normal(0, 0.3, s)).astype(np.float32) for name, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    word_tokenizer().save_pretrained(path)
    return path


def _write_chats(path: Path, count: int, seed: int = 0, response_words=WORDS) -> str:
    rng = np.random.default_rng(seed)
    lines = [
        json.dumps({"conversations": [
            {"role": "user", "content": " ".join(rng.choice(WORDS, 2))},
            {"role": "assistant", "content": " ".join(rng.choice(response_words, 3))},
        ]})
        for _ in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(target_dir: Path, tmp_path: Path, **overrides):
    values = dict(
        target=str(target_dir), output_dir=str(tmp_path / "run"), seq_len=16, draft_vocab_size=8, ttt_length=2,
        batch_size=4, num_steps=4, learning_rate=1e-2, warmup_steps=1, checkpoint_every=2, log_every=1, eval_samples=4,
        data_parallel=1,
    )
    if "data_files" not in overrides:
        values["data_files"] = [_write_chats(tmp_path / "chats.jsonl", 24)]
    return make_config({**values, **overrides})


def _updates(output_dir) -> list[int]:
    return [json.loads(line)["update"] for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


class Poisoned:
    """The method, with the frozen target turned to NaN from micro-step `after` + 1 of a run on."""

    def __init__(self, method, after: int):
        self.method, self.after, self.calls = method, after, 0

    def __getattr__(self, name):
        return getattr(self.method, name)

    def frozen(self, offline):
        self.calls += 1
        frozen = self.method.frozen(offline)
        if self.calls > self.after:
            frozen = {**frozen, "target": jax.tree.map(lambda x: x * np.nan, frozen["target"])}
        return frozen


def test_cli_run_then_changed_data_rebuilds_the_caches(target_dir, tmp_path):
    config = _config(target_dir, tmp_path, num_steps=2)
    values = {key: list(value) if isinstance(value, tuple) else value for key, value in vars(config).items()}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    main(["--config", str(tmp_path / "c.yaml")])
    run = tmp_path / "run"
    assert _updates(run) == [1, 2] and json.loads((run / "eval.json").read_text())["acc"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    load_eagle3(run / "draft", target_vocab_size=16)
    config = make_config({**vars(config), "features": "offline"})
    eagle3_method.prepare(config)
    rows_key, features_key = np.load(run / "rows.npz")["key"], (run / "features" / "key").read_text()

    _write_chats(Path(config.data_files[0]), 30, seed=1)  # new data, same vocabulary: caches rebuilt
    setup = eagle3_method.prepare(config)
    assert len(setup.train_rows) == 26 and np.load(run / "rows.npz")["key"] != rows_key
    assert (run / "features" / "key").read_text() != features_key and len(setup.offline["features"]) == 30

    _write_chats(Path(config.data_files[0]), 30, seed=1, response_words=["hi", "you"])  # a new draft vocabulary
    with pytest.raises(ValueError, match="holds checkpoints of another draft"):
        eagle3_method.prepare(config)


def test_target_dtype_keeps_the_float32_target_under_bfloat16_compute(target_dir, tmp_path):
    """compute_dtype bfloat16 with target_dtype float32: the target (and so its offline features,
    reused from the float32 run's cache) stays float32; without target_dtype it follows compute_dtype."""
    config = _config(target_dir, tmp_path, features="offline")
    eagle3_method.prepare(config)
    features_key = (tmp_path / "run" / "features" / "key").read_text()
    setup = eagle3_method.prepare(make_config({**vars(config), "compute_dtype": "bfloat16", "target_dtype": "float32"}))
    assert (tmp_path / "run" / "features" / "key").read_text() == features_key
    assert setup.method.target_params["embed_tokens"].dtype == jnp.float32 and setup.method.loss.compute_dtype == "bfloat16"
    setup = eagle3_method.prepare(make_config({**vars(config), "compute_dtype": "bfloat16"}))
    assert (tmp_path / "run" / "features" / "key").read_text() != features_key
    assert setup.method.target_params["embed_tokens"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="target_dtype"):
        make_config({**vars(config), "target_dtype": "float16"})


def test_an_empty_first_run_saves_no_cache(target_dir, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    config = _config(target_dir, tmp_path, data_files=[str(path)])
    with pytest.raises(ValueError, match=f"no conversation with an assistant turn in {path}"):
        eagle3_method.prepare(config)
    assert not (tmp_path / "run" / "rows.npz").exists()
    _write_chats(path, 24)
    assert len(eagle3_method.prepare(config).train_rows) == 20


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(target_dir, tmp_path):
    config = _config(target_dir, tmp_path)
    setup = eagle3_method.prepare(config)
    core.train(setup)  # checkpoints 2 and 4
    state_file = tmp_path / "run" / "checkpoints" / "4" / "state.safetensors"
    state_file.write_bytes(state_file.read_bytes()[:-16])  # cut short
    six = eagle3_method.prepare(make_config({**vars(config), "num_steps": 6}))
    moved = r"checkpoints/4 is broken \(.*\); moved to .*corrupt_checkpoints/4-.*resuming from step 2"
    with pytest.warns(UserWarning, match=moved):
        _, records = core.train(six)
    assert [r["update"] for r in records] == [3, 4, 5, 6]
    assert _updates(config.output_dir) == [1, 2, 3, 4, 5, 6]  # each update once, across resumes
    for step in (4, 6):
        (tmp_path / "run" / "checkpoints" / str(step) / "state.safetensors").write_bytes(b"")
    with pytest.raises(RuntimeError, match="no intact checkpoint .*step 6: .*step 4: "):
        core.train(six)


def test_a_nan_stops_the_run_and_keeps_checkpoint_and_export(target_dir, tmp_path):
    config = _config(target_dir, tmp_path)
    setup = eagle3_method.prepare(config)
    state, _ = core.train(setup, stop_at=2)
    good = core.export(setup, state.params)
    poisoned = core.Setup(**{**vars(setup), "method": Poisoned(setup.method, after=1)})
    with pytest.raises(core.NonFiniteError, match=r"update 4 \(micro-step 4\): non-finite loss \(grad_norm, .*total\)"):
        core.train(poisoned)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    assert _updates(config.output_dir) == [1, 2, 3]
    nan_params = {**jax.device_get(state.params), "fc": np.full_like(state.params["fc"], np.nan)}
    with pytest.raises(ValueError, match="'fc.weight'.*non-finite"):
        core.export(setup, nan_params)
    _, params, _ = load_eagle3(good)
    np.testing.assert_allclose(params["fc"], state.params["fc"], rtol=1e-2, atol=1e-3)
    _, records = core.train(setup)  # the rerun resumes from update 2
    assert [r["update"] for r in records] == [3, 4] and _updates(config.output_dir) == [1, 2, 3, 4]


def _draft(seed):
    config = eagle3.Eagle3Config(
        hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, draft_vocab_size=4, target_vocab_size=10
    )
    return config, eagle3.init_params(config, jax.random.key(seed)), eagle3.DraftVocab.from_target_ids(jnp.arange(4) * 2, 10)


def test_a_failed_export_leaves_the_previous_one(tmp_path, monkeypatch):
    config, params, vocab = _draft(0)
    path = tmp_path / "draft"
    save_eagle3(path, config, params, vocab)
    (path / "README.md").write_text("kept")

    def killed(file, tensors):
        Path(file).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_files, "write_safetensors", killed)
    with pytest.raises(KeyboardInterrupt):
        save_eagle3(path, config, _draft(1)[1], vocab)
    monkeypatch.undo()
    _, loaded, _ = load_eagle3(path)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no staging left behind
    save_eagle3(path, config, _draft(1)[1], vocab)
    assert (path / "README.md").read_text() == "kept"
    np.testing.assert_array_equal(load_eagle3(path)[1]["fc"], _draft(1)[1]["fc"])


def test_export_refuses_a_foreign_directory(tmp_path):
    config, params, vocab = _draft(0)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds something other than an EAGLE-3 draft"):
        save_eagle3(tmp_path, config, params, vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    save_eagle3(tmp_path, config, params, vocab, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine" and load_eagle3(tmp_path)[0] == config
    assert parse_overrides(["--overwrite", "--seed", "3"]) == {"overwrite": True, "seed": 3}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"checkpoint_every": 0}, "checkpoint_every must be >= 1, got 0"),
        ({"log_every": -1}, "log_every must be >= 1"),
        ({"eval_samples": -4}, "eval_samples must be >= 0"),
        ({"learning_rate": float("nan")}, "learning_rate must be > 0, got nan"),
        ({"grad_clip": 0.0}, "grad_clip must be > 0"),
        ({"b2": 1.0}, r"b2 must be in \[0, 1\)"),
        ({"export_dtype": "int8"}, "export_dtype must be 'bfloat16', 'float16' or 'float32'"),
    ],
)
def test_bad_config_values_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        make_config(values)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("missing.jsonl", None, "No such file or directory: .*missing.jsonl"),
        ("empty.jsonl", "", "data file .*empty.jsonl holds no records"),
        ("bad.jsonl", '{"conversations": []}\n{"conversations": [\n', r"bad.jsonl:2: not valid JSON"),
        ("shape.jsonl", '{"conversations": []}\n\n{"turns": []}\n', r"shape.jsonl:3: record has neither 'conversations' nor"),
        ("role.json", '[{"messages": [{"role": "robot", "content": "x"}]}]', r"role.json record 0: a turn needs a known role"),
        ("chats.csv", "a,b\n", "data files must be .json, .jsonl or .parquet"),
    ],
)
def test_bad_data_files_are_named(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        data.load_conversations([str(tmp_path / name)])
