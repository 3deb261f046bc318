"""Test-wide setup: four simulated CPU devices (for mesh tests), cheap compilation, exact matmuls,
no persistent compilation cache, and compiled code released after each test module.

Compilation is most of the suite's time. XLA's expensive LLVM passes roughly double it, and
XLA:CPU's newer fusion emitters add a third to a tiny engine's decode step (10 s -> 7 s); neither
buys anything for tiny test models. Every test compares computations compiled under the same flags.
The command lines' persistent compilation cache (`--compile-cache`) stays off here, for the test
processes and the commands they start: a fresh cache only costs a test run its writes, and a
user's cache is no place for test programs (tests/test_cli.py turns it on where it is tested).
"""

import gc
import os

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false",
)

os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code(request):
    """Drop a module's compiled executables when it ends: its functools caches of engines, then
    JAX's caches. One worker process runs many modules, every executable keeps its code in
    memory maps, and Linux caps a process at vm.max_map_count (65530) of them: past that, the
    next compilation segfaults (seen at 97% of the suite before this)."""
    yield
    for value in vars(request.module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()
