"""Test-wide setup: four simulated CPU devices (for mesh tests) and float32 matmuls."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
