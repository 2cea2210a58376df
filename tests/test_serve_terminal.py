"""What serving shows: the checkpoint named in one line, the checkpoint of ``serve/config.yaml`` from
``JAXRAY_CHECKPOINT`` (default ``runs/demo``). The terminal of ``python -m jaxray.serve`` is in
integration/test_serve_command.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve import Application

from jaxray.reporting import checkpoint_line
from jaxray.serve.__main__ import build_parser, read_config
from jaxray.serve.app import app_builder
from jaxray.serve.settings import CHECKPOINT_ENV, DEFAULT_CHECKPOINT, with_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "serve" / "config.yaml"


def test_the_shipped_config_names_no_checkpoint_and_the_builder_reads_the_environment(monkeypatch):
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    assert (
        "checkpoint" not in args and with_checkpoint(args)["checkpoint"] == DEFAULT_CHECKPOINT == "runs/demo"
    )
    monkeypatch.setenv(CHECKPOINT_ENV, "runs/other")
    assert with_checkpoint(args)["checkpoint"] == "runs/other"
    assert with_checkpoint({**args, "checkpoint": "mine"})["checkpoint"] == "mine"  # the config's wins
    _, read = read_config(str(CONFIG), build_parser().error)  # python -m jaxray.serve --config
    assert read["checkpoint"] == "runs/other"


def test_app_builder_defaults_to_runs_demo(tmp_path, monkeypatch):
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"checkpoint runs/demo does not exist \\(looked for {tmp_path}"):
        app_builder({})


def test_app_builder_serves_the_environments_checkpoint_and_names_it(
    trained_transformer, monkeypatch, capsys
):
    monkeypatch.setenv(CHECKPOINT_ENV, str(trained_transformer))
    app = app_builder({"engine": {"buckets": [16], "batch_sizes": [1]}})
    assert isinstance(app, Application)
    named = [line for line in capsys.readouterr().err.splitlines() if line.startswith("checkpoint: ")]
    assert named == [checkpoint_line.describe(trained_transformer)]
