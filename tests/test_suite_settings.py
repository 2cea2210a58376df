"""The suite-wide settings of tests/conftest.py: float32 matmuls compile at precision "highest" in
the test process and in the subprocesses tests start (so float32 parity holds on a GPU, where the
default is TF32), and ``gpu``-marked tests run only where JAX's backend is a GPU."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import child_env

PROBE = (
    "import jax, jax.numpy as jnp; x = jnp.ones((4, 4), jnp.float32); "
    "print(jax.config.jax_default_matmul_precision); print(jax.jit(jnp.dot).lower(x, x).as_text())"
)


def test_float32_matmuls_compile_at_highest_precision():
    x = jnp.ones((4, 4), jnp.float32)
    assert jax.config.jax_default_matmul_precision == "highest"
    assert "precision = [HIGHEST, HIGHEST]" in jax.jit(jnp.dot).lower(x, x).as_text()


def test_subprocesses_inherit_the_precision():
    # What the 4-device parity scripts, the CLI tests and local Ray workers rely on.
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    setting, hlo = proc.stdout.split("\n", 1)
    assert setting == "highest" and "precision = [HIGHEST, HIGHEST]" in hlo


@pytest.mark.gpu
def test_gpu_marked_tests_run_only_on_a_gpu():
    # Skipped by tests/conftest.py elsewhere; if the hook failed to skip, this would fail on a CPU.
    assert jax.default_backend() == "gpu"
