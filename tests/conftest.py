"""Shared fixtures. The real data files come from JAXRAY_DATA_DIR (CI and `make test` set it).

Two settings make the suite hold on an NVIDIA GPU or a TPU as on the CPU:

- float32 matmuls run at precision "highest" in every test: ``JAX_DEFAULT_MATMUL_PRECISION=highest``
  is set below, at import, before anything imports jax. On NVIDIA GPUs JAX's default precision runs
  float32 matmuls on TF32 tensor cores (10-bit mantissa, ~1e-3 relative error per product), so two
  float32 paths that tests hold to 1e-5 (KV cache vs full forward, 4 devices vs 1, export vs live)
  would differ by TF32 rounding, not by a bug (on a TPU, one bfloat16 pass: ~1e-2). An environment
  variable rather than a ``jax.default_matmul_precision`` context manager because subprocesses (the
  4-device parity scripts, the CLIs) and local Ray workers inherit it, and a context manager reaches
  neither. A value already set in the environment is kept. bfloat16/float16 matmuls are not affected.
- subprocesses that import JAX get ``child_env()``: ``JAX_PLATFORMS=cpu`` where this process holds a
  TPU, which allows one process per chip (a second fails on libtpu's lockfile).
- tests marked ``gpu`` (``pytest -m gpu`` on a GPU host) are skipped, with the reason, where
  ``jax.default_backend()`` is not "gpu".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before jax is imported anywhere (jax reads it once, at import: ``saved`` below imports it); see the
# docstring for why.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

from saved import save_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def child_env(**more: str) -> dict[str, str]:
    """The environment for a subprocess that imports JAX: this one's, with ``JAX_PLATFORMS=cpu`` when
    this process holds a TPU (one process per chip), plus ``more``."""
    import jax

    held = {"JAX_PLATFORMS": "cpu"} if jax.default_backend() == "tpu" else {}
    return {**os.environ, **held, **more}


# `make test-all` runs the slow tests on two workers a module at a time (--dist loadfile), in
# collection order (--no-loadscope-reorder): these, the longest (a run's --durations, 2 cores),
# first, so that no worker ends alone on one of them while the other is done.
LONGEST_FIRST = (
    "integration/test_bench_check.py",
    "integration/test_multi_worker.py",
    "integration/test_local_head.py",
    "integration/test_tune_smoke.py",
    "integration/test_object_storage.py",
    "integration/test_sharded_config.py",
    "integration/test_tune_driver_loss.py",
    "bench/test_cli.py",
    "integration/test_tune_resume.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """``LONGEST_FIRST``'s modules first (the rest in collection order); skip ``gpu``-marked tests
    off an NVIDIA GPU. jax is imported only when such a test was collected, so collecting the rest
    stays cheap."""
    rank = {ROOT / "tests" / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: a module's order kept
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(
        reason=f"needs an NVIDIA GPU (marked gpu); jax's default backend here is {backend!r}"
    )
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """The folder holding tinyshakespeare.txt and fashion-mnist/; fails (never skips) when unset."""
    value = os.environ.get("JAXRAY_DATA_DIR")
    if not value:
        pytest.fail(
            "JAXRAY_DATA_DIR is not set. These tests need the real data files: set it to the folder "
            "holding tinyshakespeare.txt and fashion-mnist/ (e.g. JAXRAY_DATA_DIR=../shared/data)."
        )
    path = Path(value).resolve()
    if not (path / "tinyshakespeare.txt").is_file():
        pytest.fail(f"JAXRAY_DATA_DIR={value} does not hold tinyshakespeare.txt")
    return path


@pytest.fixture(scope="session")
def trained_transformer(real_dir, tmp_path_factory) -> Path:
    """A checkpoint of a small transformer (d_model 64, 2 layers, max_seq_len 64) trained for 60
    steps on the real TinyShakespeare bytes in this process (seconds): enough for text-like output,
    so parity tests compare real predictions rather than those of random weights."""
    from jaxray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
    from jaxray.data.batching import train_batches
    from jaxray.data.workloads import load_arrays
    from jaxray.parallel.mesh import make_mesh
    from jaxray.train.run import train

    trial = TrialConfig(
        model=ModelConfig(workload="transformer", width=64, num_layers=2, num_heads=2, max_seq_len=64),
        train=TrainConfig(steps=60, global_batch=16, learning_rate=3e-3, log_every=20),
        data=DataConfig(seq_len=64, data_dir=str(real_dir)),
    )
    train_arrays, held_out = load_arrays(trial)
    result = train(
        trial, train_batches(train_arrays, trial.train.global_batch, trial.train.seed), held_out, make_mesh()
    )
    return save_params(tmp_path_factory.mktemp("trained") / "transformer", result.state.params, trial)


@pytest.fixture(scope="session")
def copied_run_folder(trained_transformer, tmp_path_factory) -> Path:
    """``trained_transformer`` in a run folder copied elsewhere, the original gone
    (``checkpoint_copies.copied_run_folder``)."""
    from checkpoint_copies import copied_run_folder

    return copied_run_folder(
        trained_transformer, tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("laptop")
    )


@pytest.fixture(scope="session")
def restored(trained_transformer):
    """(model, params) of ``trained_transformer``."""
    from jaxray import checkpoint

    return checkpoint.restore(trained_transformer)


@pytest.fixture(scope="session")
def engine(restored):
    """A compiled engine over ``restored``: buckets 8 and 32 (and 64 = max_seq_len), batch sizes 1
    and 4, chunks of 16 tokens, at most 200 new tokens and 1000 prompt bytes."""
    from jaxray.inference.engine import Engine
    from jaxray.inference.settings import EngineSettings

    model, params = restored
    engine = Engine.for_model(
        model,
        params,
        EngineSettings(
            buckets=(8, 32), batch_sizes=(1, 4), chunk=16, max_new_tokens=200, max_prompt_bytes=1000
        ),
    )
    engine.compile()
    return engine
