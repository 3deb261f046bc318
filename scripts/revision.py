"""An earlier revision's code imported beside the current one, for side-by-side measurements (scripts only).

Run inside the repository: the sources are read with `git show` / `git archive`.
"""

import importlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def baseline_module(revision: str, path: str):
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    file = Path(tempfile.mkdtemp()) / Path(path).name
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(f"baseline_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_engine_class(revision: str):
    """The Engine class of `revision`'s own specjax package, imported beside the current one."""
    root = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", revision, "specjax"], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    package = root / "specjax_baseline"
    (root / "specjax").rename(package)
    for file in package.rglob("*.py"):
        file.write_text(file.read_text().replace("from specjax", "from specjax_baseline").replace("import specjax", "import specjax_baseline"))
    sys.path.insert(0, str(root))
    return importlib.import_module("specjax_baseline.engine").Engine
