"""Streamed block matmuls: the target's weight matmuls for 2..8 rows on XLA:CPU, each weight read once.

A verification block of T tokens (batch 1) multiplies T rows by every weight of the target. At
one row XLA:CPU streams each weight once; at 2..8 rows it calls a library GEMM that takes about
twice as long, which is most of what a speculative step costs over a plain one on a CPU
(docs/architecture.md, "Streamed block matmuls"). `block_matmul.cc` holds a kernel that walks
an [K, N] weight in memory order once, whatever the number of rows (a tied LM head streams as its
own [H, V] copy, `llama.with_untied_head`, which the engine makes in this mode); it is built on
first use with the host's C++ compiler (`$CXX`, default g++, `-march=native`) into a cache
directory (`specjax.host_cache`: `$SPECJAX_CACHE`, default `~/.cache/specjax`) and called through
the XLA FFI.

Modes (static under jit):
    "xla"       every matmul is XLA's own (the default).
    "streamed"  float32 matmuls of 2..8 rows go to the kernels; 1 row (XLA's matrix-vector loop
                is as fast) and more than 8 rows (the GEMM wins there) stay XLA's.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax import host_cache

MODES = ("xla", "streamed")
MAX_ROWS = 8
SOURCE = Path(__file__).with_suffix(".cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


def check(mode: str, params) -> None:
    """Raise a ValueError naming the problem where `mode` cannot run on these params; build the
    kernels for "streamed" (a RuntimeError if that fails)."""
    _check_mode(mode)
    if mode == "xla":
        return
    if jax.default_backend() != "cpu":
        raise ValueError(f"block_matmul='streamed' is for XLA:CPU; the default backend is {jax.default_backend()!r}")
    leaves = jax.tree.leaves(params)
    dtypes = sorted({str(leaf.dtype) for leaf in leaves if leaf.ndim == 2})
    if dtypes != ["float32"]:
        raise ValueError(f"block_matmul='streamed' takes float32 weights; these are {', '.join(dtypes)}")
    if any(len(getattr(leaf, "sharding", None).device_set) > 1 for leaf in leaves if hasattr(leaf, "sharding")):
        raise ValueError("block_matmul='streamed' runs on one device; these params are sharded over several")
    _register()


def dense(x: jax.Array, w: jax.Array, mode: str) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    if not _streams(mode, x, w):
        return x @ w
    return _call(x, w)


def head(x: jax.Array, lm_head: jax.Array, mode: str) -> jax.Array:
    """x [..., H] @ lm_head [H, V] -> float32 logits [..., V]."""
    if not _streams(mode, x, lm_head):
        return jnp.einsum("...h,hv->...v", x, lm_head, preferred_element_type=jnp.float32)
    return _call(x, lm_head)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"block_matmul must be one of {MODES}, got {mode!r}")


def _streams(mode: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether this matmul goes to a kernel: mode "streamed", 2..MAX_ROWS rows, float32."""
    _check_mode(mode)
    return mode == "streamed" and 2 <= math.prod(x.shape[:-1]) <= MAX_ROWS and x.dtype == w.dtype == jnp.float32


def _call(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] as [M, K] rows through the kernel -> x @ w [..., N] float32."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    result = jax.ShapeDtypeStruct((rows.shape[0], w.shape[1]), jnp.float32)
    out = jax.ffi.ffi_call(_register(), result, vmap_method="sequential")(rows, w)  # [M, N]
    return out.reshape(*x.shape[:-1], w.shape[1])


@functools.cache
def _register() -> str:
    """The kernel's FFI target, registered once: named after its build, so another build of it (an
    earlier revision's, measured beside this one) can be registered in the same process."""
    path = build()
    library = ctypes.cdll.LoadLibrary(str(path))
    target = "specjax_rows_" + path.stem.removeprefix("block_matmul-")
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.SpecjaxRows), platform="cpu")
    return target


def build() -> Path:
    """The kernels' shared library for this host, compiled once into the cache directory."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"block_matmul='streamed' builds {SOURCE.name} with a C++ compiler; {compiler!r} is not on PATH "
                           "(install g++ or set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = host_cache.key(SOURCE.read_text(), compiler, version, " ".join(FLAGS), jax.__version__, _cpu_flags())
    library = host_cache.directory() / f"block_matmul-{key}.so"
    if library.exists():
        return library

    def compile_to(built: Path) -> None:
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(command)}):\n{run.stderr[-4000:]}")

    host_cache.publish(library, compile_to)  # a concurrent build leaves one whole library
    return library


def _cpu_flags() -> str:
    """What -march=native compiles for: the host's instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()
