"""A non-editable install carries the shipped EAGLE-3 draft and the streamed matmuls' kernel source: `pip install .` into a fresh venv, then --method eagle3 --matmuls streamed elsewhere."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_package_runs_eagle3_outside_the_source_tree(tmp_path):
    source = tmp_path / "source"  # a copy, so the build writes nothing into the checkout
    for package in ("specjax", "train", "infer"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # The venv sees the installed dependencies, pip and setuptools (its own bundled ones would be older)
    # and the SmolLM2 wheel; specjax itself comes from the build.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", tmp_path / "venv"], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"SPECJAX_CACHE": str(tmp_path / "cache")}
    run = lambda *args: subprocess.run(
        args, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
    )
    install = run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", source)
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(source)
    where = run(python, "-c", "import infer; from specjax.drafters.eagle3 import default_draft_path as d; print(infer.__file__, d())")
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(path.startswith(str(tmp_path / "venv")) for path in where.stdout.split()), where.stdout
    generate = run(python, "-m", "infer.generate", "--method", "eagle3", "--matmuls", "streamed", "--max-new-tokens", "4", "--prompt", "hi")
    assert generate.returncode == 0, generate.stderr[-3000:]
    assert "tau" in generate.stdout + generate.stderr
    assert len(list((tmp_path / "cache").glob("block_matmul-*.so"))) == 1  # the kernels' source shipped and built
