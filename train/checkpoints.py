"""Training checkpoints: one safetensors file per kept update, written whole or not at all,
verified before it is used.

    <directory>/<update>/state.safetensors

holds every leaf of the training state, named by its tree path (`jax.tree_util.keystr`), and in
its metadata the SHA-256 of the tensor data. A save writes `<update>.partial/`, syncs it and
renames it into place, then drops all but the newest `keep`; a read checks the digest and every
leaf's name, shape and dtype against the state it restores into, and raises `CheckpointError`
naming what is wrong. Everything runs in the calling thread: nothing is left reading or writing
in the background when a read fails or the process stops.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specjax.checkpoints.draft_files import read_safetensors, read_safetensors_metadata, write_safetensors

STATE_FILE = "state.safetensors"
DIGEST_KEY = "data_sha256"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, altered since it was written, or of another shape."""


class CheckpointStore:
    """Numbered checkpoints of one run in `directory`, the newest `keep` of them kept."""

    def __init__(self, directory: str | Path, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory, self.keep = Path(directory).resolve(), keep
        self.directory.mkdir(parents=True, exist_ok=True)
        for unfinished in self.directory.glob("*.partial"):  # a save the last process did not finish
            shutil.rmtree(unfinished)

    def steps(self) -> list[int]:
        """The saved updates, oldest first (unfinished `.partial` saves are not steps)."""
        return sorted(int(path.name) for path in self.directory.iterdir() if path.name.isdigit() and path.is_dir())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any) -> Path:
        """Write `state` (a pytree of arrays) as update `step`; atomic, then prune to `keep`."""
        leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
        tensors = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
        partial, final = self.directory / f"{step}.partial", self.directory / str(step)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        write_safetensors(partial / STATE_FILE, tensors, metadata={DIGEST_KEY: _digest(tensors)})
        _sync(partial / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _sync(self.directory)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.directory / str(old))
        return final

    def restore(self, step: int, like: Any) -> Any:
        """Update `step` as a pytree shaped like `like` (same structure, shapes and dtypes)."""
        file = self.directory / str(step) / STATE_FILE
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        try:
            tensors = read_safetensors(file)
            metadata = read_safetensors_metadata(file)
        except (ValueError, KeyError, OSError) as error:
            raise CheckpointError(f"unreadable: {error}") from None
        if metadata.get(DIGEST_KEY) != _digest(tensors):
            raise CheckpointError(f"{file}: its tensor data does not match the digest written with it (altered or damaged)")
        expected = jax.tree_util.tree_leaves_with_path(like)
        names = [jax.tree_util.keystr(path) for path, _ in expected]
        if missing := [name for name in names if name not in tensors]:
            raise CheckpointError(f"{file}: no tensor for {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        if extra := sorted(set(tensors) - set(names)):
            raise CheckpointError(f"{file}: tensors this run has no place for: {', '.join(extra[:5])}")
        leaves = []
        for name, (_, leaf) in zip(names, expected):
            array = tensors[name]
            if array.shape != tuple(leaf.shape) or array.dtype != np.dtype(leaf.dtype):
                raise CheckpointError(
                    f"{file}: {name} is {array.dtype}{list(array.shape)}, this run expects {np.dtype(leaf.dtype)}{list(leaf.shape)}"
                )
            leaves.append(array)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)

    def set_aside(self, step: int) -> Path:
        """Move update `step` out of the store, to <directory>/../corrupt_checkpoints/<step>-<time>."""
        aside = self.directory.parent / "corrupt_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(exist_ok=True)
        shutil.move(self.directory / str(step), aside)
        return aside


def _digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over the tensors' bytes, in order."""
    digest = hashlib.sha256()
    for array in tensors.values():
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
