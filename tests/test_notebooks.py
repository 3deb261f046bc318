"""The Colab notebooks: outputs stripped, TPU metadata and badge present, and they execute on CPU.

CI runs them headless with SPECJAX_NOTEBOOK_TINY=1 (a tiny configuration, same code path).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "train_eagle3.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_colab_tpu(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("accelerator") == "TPU" and "colab" in nb.metadata
    assert "colab.research.google.com" in nb.cells[0].source and path.name in nb.cells[0].source
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs not stripped"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_on_cpu(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("SPECJAX_NOTEBOOK_WORKDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(path.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
