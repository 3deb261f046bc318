"""Where specjax keeps what it builds once per machine (the streamed matmul kernels, compiled programs):
`$SPECJAX_CACHE`, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`."""

from __future__ import annotations

import os
from pathlib import Path


def directory() -> Path:
    """The cache directory (not created here)."""
    return Path(os.environ.get("SPECJAX_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specjax")
