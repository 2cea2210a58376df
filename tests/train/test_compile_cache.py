"""JAX's persistent compilation cache (``jaxray.train.compile_cache``): a second process compiling the same
step takes it from the cache folder and says so; the folder follows the setting, then the environment."""

import json
import os
import subprocess
import sys

import pytest

from jaxray.train import compile_cache


def test_the_folder_is_the_setting_then_the_environment_then_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.folder_for(str(tmp_path / "yaml")) == str(tmp_path / "yaml")
    assert compile_cache.folder_for(None) == str(tmp_path / "env")
    assert compile_cache.folder_for("") is None
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.folder_for(None) == str(tmp_path / "xdg" / "jaxray" / "jax-compilation-cache")


def _step(cache, data_dir) -> dict:
    cmd = [sys.executable, "-m", "jaxray.bench", "throughput", "--workload", "transformer", "--width", "32",
           "--seq-len", "64", "--batch", "4", "--steps", "1", "--repeats", "1", "--json", "--out", "",
           "--data-dir", str(data_dir), "--compile-cache", str(cache)]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache this small step however fast it compiles
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two subprocess runs (~20 s); CI runs it
def test_a_second_run_compiles_from_the_cache(real_dir, tmp_path):
    first, second = _step(tmp_path / "cache", real_dir), _step(tmp_path / "cache", real_dir)
    assert (first["compile_from_cache"], second["compile_from_cache"]) == (False, True)
    assert second["compile_cache_dir"] == str(tmp_path / "cache")
    assert any((tmp_path / "cache").iterdir())
    assert second["final_loss"] == first["final_loss"]
