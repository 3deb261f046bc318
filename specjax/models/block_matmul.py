"""Streamed block matmuls: weight matmuls of any number of rows on XLA:CPU, each weight read once.

A verification block of T tokens (batch 1) multiplies T rows by every weight of the target. At
one row XLA:CPU streams each weight once; at 2..8 rows it calls a library GEMM that takes about
twice as long, which is most of what a speculative step costs over a plain one on a CPU
(docs/architecture.md, "Streamed block matmuls"). `block_matmul.cc` holds a kernel that reads a
weight packed in panels of 32 columns (`pack`: [K, N] -> [ceil(N / 32), K, 32]), each panel one
sequential stream with the rows' sums in registers, so a block costs about what one row does. It
is built on first use with the host's C++ compiler (`$CXX`, default g++, `-march=native`) into a
cache directory (`specjax.host_cache`: `$SPECJAX_CACHE`, default `~/.cache/specjax`) and called
through the XLA FFI.

Modes (static under jit):
    "xla"       every matmul is XLA's own, of [K, N] weights (the default).
    "streamed"  every matmul is the kernel's, of `Packed` weights (the engine packs the target's,
                `llama.streamed`, and a draft head's, `drafters.eagle3`) and float32 rows: float32
                weights, or bfloat16 ones widened exactly as they stream (a draft head's as trained;
                XLA:CPU's own dot of bfloat16 weights is slower than float32's). Each sum adds the
                K products in order, whatever the number of rows: a row's result is the same bits
                alone or in a block.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import struct

from specjax import host_cache

MODES = ("xla", "streamed")
PANEL = 32  # columns of a packed panel (kPanel in block_matmul.cc)
KERNELS = {jnp.dtype(jnp.float32): "SpecjaxPanels", jnp.dtype(jnp.bfloat16): "SpecjaxPanelsBf16"}  # weight dtype -> handler in block_matmul.cc
SOURCE = Path(__file__).with_suffix(".cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


@struct.dataclass
class Packed:
    """A weight w [K, N] as the kernels read it: panels [ceil(N / 32), K, 32], panel p holding
    columns 32p..32p + 31 row after row, zero past N (`pack`)."""

    panels: jax.Array  # [P, K, 32]
    columns: int = struct.field(pytree_node=False)  # N

    @property
    def shape(self) -> tuple[int, int]:
        return self.panels.shape[1], self.columns

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w: jax.Array) -> Packed:
    """w [K, N] -> `Packed` (a new buffer of the same dtype, padded to whole panels)."""
    if w.ndim != 2:
        raise ValueError(f"pack takes a matrix [K, N]; got shape {w.shape}")
    rows, columns = w.shape
    panels = -(-columns // PANEL)
    padded = jnp.pad(w, ((0, 0), (0, panels * PANEL - columns)))  # [K, P * 32]
    return Packed(padded.reshape(rows, panels, PANEL).transpose(1, 0, 2), columns)


def pack_matrices(tree):
    """`tree` with every matrix (2-d array leaf) packed; vectors and `Packed` leaves as they are."""
    return jax.tree.map(lambda leaf: pack(leaf) if getattr(leaf, "ndim", 0) == 2 else leaf, tree,
                        is_leaf=lambda leaf: isinstance(leaf, Packed))


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


def dense(x: jax.Array, w: jax.Array | Packed, mode: str) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]: XLA's dot of an array under "xla", the kernel's of a
    `Packed` weight and float32 rows under "streamed" (float32 whatever w's dtype)."""
    if not _streams(mode, x, w):
        return x @ w
    return _call(x, w)


def head(x: jax.Array, lm_head: jax.Array | Packed, mode: str) -> jax.Array:
    """x [..., H] @ lm_head [H, V] -> float32 logits [..., V]."""
    if not _streams(mode, x, lm_head):
        return jnp.einsum("...h,hv->...v", x, lm_head, preferred_element_type=jnp.float32)
    return _call(x, lm_head)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"block_matmul must be one of {MODES}, got {mode!r}")


def _streams(mode: str, x: jax.Array, w: jax.Array | Packed) -> bool:
    """Whether this matmul goes to the kernel (mode "streamed"); a ValueError where the weight's
    layout or the rows' dtype does not suit the mode."""
    _check_mode(mode)
    packed = isinstance(w, Packed)
    if mode == "xla":
        if packed:
            raise ValueError("a packed weight is for block_matmul='streamed'; XLA's matmuls take the [K, N] array")
        return False
    if not packed:
        raise ValueError(f"block_matmul='streamed' takes packed weights (block_matmul.pack); got an array of shape {w.shape}")
    if x.dtype != jnp.float32 or w.dtype not in KERNELS:
        raise ValueError(f"block_matmul='streamed' takes float32 rows and float32 or bfloat16 weights; got {x.dtype} rows, {w.dtype} weights")
    return True


def _call(x: jax.Array, w: Packed) -> jax.Array:
    """x [..., K] as [M, K] rows through the kernel for w's dtype -> x @ w [..., N] float32."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[1] != w.shape[0]:
        raise ValueError(f"x [..., {rows.shape[1]}] @ w {w.shape}: the inner sizes differ")
    result = jax.ShapeDtypeStruct((rows.shape[0], w.columns), jnp.float32)
    out = jax.ffi.ffi_call(_register()[w.dtype.name], result, vmap_method="sequential")(rows, w.panels)  # [M, N]
    return out.reshape(*x.shape[:-1], w.columns)


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
