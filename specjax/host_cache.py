"""Where specjax keeps what it builds once per machine (the streamed matmul kernels, compiled programs,
tokenizers built from GGUF metadata): `$SPECJAX_CACHE`, else `$XDG_CACHE_HOME/specjax`, else
`~/.cache/specjax`; and how an entry is named and written."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def directory() -> Path:
    """The cache directory (not created here)."""
    return Path(os.environ.get("SPECJAX_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specjax")


def key(*parts: str) -> str:
    """A short hex name for an entry built from these inputs (sources, versions, flags)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def publish(entry: Path, write: Callable[[Path], None]) -> None:
    """Put `entry` (a file or a folder) in place whole or not at all: `write(staged)` builds it in a
    scratch folder beside it, then one rename moves it in. A folder a concurrent writer put there
    first stays (it is whole too). Whatever `write` raises propagates, leaving nothing behind."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent) as scratch:
        staged = Path(scratch) / entry.name
        write(staged)
        try:
            os.replace(staged, entry)  # atomic
        except OSError:
            if not entry.exists():
                raise
