"""Streamed block matmuls: weight matmuls of a few rows on XLA:CPU, each weight read once.

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
                is as fast) and more than 8 rows (the GEMM wins there) stay XLA's. Float32 rows
                times bfloat16 weights (a draft head's, `drafters.eagle3`) go to a kernel that
                widens each weight as it streams (XLA:CPU's own dot of bfloat16 weights is slower
                than float32's), 8 rows a pass up to 64 rows; more promote the weights (x @ w).
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
MAX_ROWS = 8  # rows of one kernel pass
MAX_BF16_ROWS = 64  # rows of bfloat16-weight matmuls streamed in passes of MAX_ROWS
KERNELS = {jnp.dtype(jnp.float32): "SpecjaxRows", jnp.dtype(jnp.bfloat16): "SpecjaxRowsBf16"}  # weight dtype -> handler in block_matmul.cc
SOURCE = Path(__file__).with_suffix(".cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


def check(mode: str, params, weight_dtype: str = "float32") -> None:
    """Raise a ValueError naming the problem where `mode` cannot run on these params (whose
    matrices must be `weight_dtype`); build the kernels for "streamed" (a RuntimeError if that fails)."""
    _check_mode(mode)
    if mode == "xla":
        return
    if jax.default_backend() != "cpu":
        raise ValueError(f"block_matmul='streamed' is for XLA:CPU; the default backend is {jax.default_backend()!r}")
    leaves = jax.tree.leaves(params)
    dtypes = sorted({str(leaf.dtype) for leaf in leaves if leaf.ndim == 2})
    if dtypes != [weight_dtype]:
        raise ValueError(f"block_matmul='streamed' takes {weight_dtype} weights here; these are {', '.join(dtypes)}")
    if any(len(getattr(leaf, "sharding", None).device_set) > 1 for leaf in leaves if hasattr(leaf, "sharding")):
        raise ValueError("block_matmul='streamed' runs on one device; these params are sharded over several")
    _register()


def dense(x: jax.Array, w: jax.Array, mode: str) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] (float32 for float32 x, whatever w's dtype)."""
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
    """Whether this matmul goes to a kernel: mode "streamed", float32 rows, and 2..MAX_ROWS of
    them times float32 weights or 1..MAX_BF16_ROWS times bfloat16 weights."""
    _check_mode(mode)
    if mode != "streamed" or x.dtype != jnp.float32 or w.dtype not in KERNELS:
        return False
    rows = math.prod(x.shape[:-1])
    return 1 <= rows <= MAX_BF16_ROWS if w.dtype == jnp.bfloat16 else 2 <= rows <= MAX_ROWS


def _call(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] as [M, K] rows through the kernel for w's dtype, MAX_ROWS a pass -> x @ w [..., N] float32."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    kernel = _register()[w.dtype.name]
    passes = []
    for first in range(0, rows.shape[0], MAX_ROWS):
        part = rows[first : first + MAX_ROWS]  # [<= MAX_ROWS, K]
        result = jax.ShapeDtypeStruct((part.shape[0], w.shape[1]), jnp.float32)
        passes.append(jax.ffi.ffi_call(kernel, result, vmap_method="sequential")(part, w))  # [<= MAX_ROWS, N]
    out = passes[0] if len(passes) == 1 else jnp.concatenate(passes)  # [M, N]
    return out.reshape(*x.shape[:-1], w.shape[1])


@functools.cache
def _register() -> dict[str, str]:
    """The kernels' FFI targets by weight dtype name, registered once: named after their build, so
    another build (an earlier revision's, measured beside this one) can be registered in the same process."""
    path = build()
    library = ctypes.cdll.LoadLibrary(str(path))
    build_key = path.stem.removeprefix("block_matmul-")
    targets = {}
    for dtype, symbol in KERNELS.items():
        targets[dtype.name] = f"specjax_{symbol.removeprefix('Specjax').lower()}_{build_key}"
        jax.ffi.register_ffi_target(targets[dtype.name], jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return targets


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
