"""The command lines on the embedded SmolLM2 (slow: real weights) and their error messages."""

from __future__ import annotations

import json

import pytest

from infer import bench, generate

PROMPT = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta."


def run_generate(capsys, *argv: str) -> str:
    generate.main(list(argv))
    return capsys.readouterr().out


@pytest.mark.slow
def test_generate_speculative_text_equals_autoregressive(capsys):
    common = ["--prompt", PROMPT, "--max-new-tokens", "12", "--max-len", "256", "--no-stream"]
    plain = run_generate(capsys, *common)
    ngram = run_generate(capsys, "--method", "ngram", "--num-spec", "4", *common)
    text = lambda out: out.split("--- [0] ")[1].split("\n[")[0]
    assert text(plain) == text(ngram)
    assert "tokens/s" in ngram and "compile" in ngram
    assert "tau" in ngram and "acceptance by position" in ngram
    streamed = run_generate(capsys, "--method", "ngram", "--num-spec", "4", *common[:-1])
    assert streamed.startswith(text(plain))
    lookup_first = run_generate(capsys, "--method", "eagle3+ngram", "--num-spec", "3", *common)  # the shipped draft
    assert text(lookup_first) == text(plain) and "tau" in lookup_first
    with pytest.raises(ValueError, match="eagle3\\+ngram: only eagle3 drafts trees"):
        generate.main(["--method", "eagle3+ngram", "--tree", "3,2,4", *common])


@pytest.mark.slow
def test_generate_rejects_a_prompt_longer_than_the_cache():
    with pytest.raises(ValueError, match="cache slots"):
        generate.main(["--prompt", "word " * 200, "--max-len", "128", "--max-new-tokens", "8"])


def test_unknown_option_is_an_error(capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(["--temprature", "0.5"])
    assert "unrecognized arguments: --temprature" in capsys.readouterr().err


def test_method_specs_parse_and_fail_clearly():
    specs = bench.split_methods("ngram:5,eagle3:4,4,16,eagle3:3,eagle3+ngram:3")
    assert [s.label for s in specs] == ["ar", "ngram:5", "eagle3:4,4,16", "eagle3:3", "eagle3+ngram:3"]
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        bench.split_methods("medusa:3")
    with pytest.raises(ValueError, match="only eagle3 drafts trees"):
        bench.split_methods("ngram:4,4,16")
    with pytest.raises(ValueError, match="only eagle3 drafts trees"):
        bench.split_methods("eagle3+ngram:4,2,8")


@pytest.mark.slow
def test_bench_writes_table_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--methods", "ar,ngram:3", "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "8",
                "--repeats", "1", "--max-len", "512", "--out", str(out), "--plots", str(tmp_path)])
    assert "of bound" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["batch_size"]) for r in results] == [("ar", 2), ("ngram:3", 2)]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["t_decode_ms"] > 0 and 1.0 <= r["tau"] <= 4.0
        assert r["speedup"] == pytest.approx(1.0) if r["method"] == "ar" else r["speedup"] > 0
    assert (tmp_path / "speedup.png").stat().st_size > 0 and (tmp_path / "acceptance.png").stat().st_size > 0
