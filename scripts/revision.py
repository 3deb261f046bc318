"""An earlier revision's code imported beside the current one, for side-by-side measurements (scripts only).

Run inside the repository: the sources are read with `git show` / `git archive`. A revision's
`specjax` package is imported as `specjax_<revision>`, so several revisions can sit side by side.
"""

import importlib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_name(revision: str) -> str:
    return "specjax_" + re.sub(r"\W", "_", revision)


def _rebased(source: str, revision: str) -> str:
    """Python source whose `specjax` imports read `revision`'s package."""
    name = package_name(revision)
    return source.replace("from specjax", f"from {name}").replace("import specjax", f"import {name}")


def baseline_package(revision: str) -> str:
    """Import `revision`'s whole specjax package (once) and return its module name."""
    name = package_name(revision)
    if name not in sys.modules:
        root = Path(tempfile.mkdtemp())
        archive = subprocess.run(["git", "archive", revision, "specjax"], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        package = root / name
        (root / "specjax").rename(package)
        for file in package.rglob("*.py"):
            file.write_text(_rebased(file.read_text(), revision))
        sys.path.insert(0, str(root))
        importlib.import_module(name)
    return name


def baseline_module(revision: str, path: str, own_package: bool = False):
    """The module at `path` as of `revision`; with own_package it imports that revision's specjax too."""
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    if own_package:
        baseline_package(revision)
        source = _rebased(source, revision)
    file = Path(tempfile.mkdtemp()) / Path(path).name
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(f"baseline_{package_name(revision)}_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_engine_class(revision: str):
    """The Engine class of `revision`'s own specjax package, imported beside the current one."""
    return importlib.import_module(f"{baseline_package(revision)}.engine").Engine
