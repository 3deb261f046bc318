"""Test-wide setup: four simulated CPU devices (for mesh tests), cheap compilation, exact matmuls.

XLA's expensive LLVM passes roughly double compile time and buy nothing for tiny test models;
every test compares computations compiled under the same flags.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
