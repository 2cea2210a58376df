"""What serving shows (issue 16): the checkpoint named in one line, ``/info``'s model with only the
fields its model uses, the checkpoint of ``serve/config.yaml`` from ``JAXRAY_CHECKPOINT`` (default
``runs/demo``), and ``python -m jaxray.serve``'s terminal: the ready line with the URL, the compile
time and the routes, without Serve's "Connecting to existing Serve app" line. On the transformer
trained on real TinyShakespeare bytes by ``tests/conftest.py``."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import requests
import yaml
from serve_load import free_port, start_serving

from jaxray import checkpoint
from jaxray.config import ModelConfig
from jaxray.serve.__main__ import build_parser, read_config
from jaxray.serve.app import app_builder
from jaxray.serve.routes import ROUTES
from jaxray.serve.schema import MODEL_FIELDS, served_model
from jaxray.serve.settings import CHECKPOINT_ENV, DEFAULT_CHECKPOINT, with_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "serve" / "config.yaml"


def test_info_shows_only_the_fields_the_served_model_uses(trained_transformer):
    model = served_model(checkpoint.load_model_config(trained_transformer).model_dump())
    assert model == {k: model[k] for k in MODEL_FIELDS["transformer"]} and model["width"] == 64
    assert "block_repeats" not in model
    assert "block_repeats" in served_model(ModelConfig(workload="shared_block_mlp").model_dump())
    assert "num_heads" not in served_model(ModelConfig(workload="mlp").model_dump())


def test_every_model_field_is_shown_for_some_workload():
    # A field added to ModelConfig must be placed in MODEL_FIELDS, or /info would never show it.
    assert set(ModelConfig.model_fields) == {f for fields in MODEL_FIELDS.values() for f in fields}


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
    assert app is not None
    named = [line for line in capsys.readouterr().err.splitlines() if line.startswith("checkpoint: ")]
    assert named == [checkpoint.describe(trained_transformer)]


@pytest.mark.ray
@pytest.mark.slow  # a private Ray and one replica: about a minute
def test_the_terminal_shows_the_checkpoint_and_a_ready_line(trained_transformer):
    port = free_port()
    proc = start_serving(trained_transformer, port)  # returns once the ready line came
    try:
        info = requests.get(f"http://127.0.0.1:{port}/info", timeout=30).json()
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    lines = [line.rstrip("\n") for line in proc.lines]
    text = "\n".join(lines)
    ready = lines[-1]
    assert ready.startswith(f"jaxray is serving on http://127.0.0.1:{port} ("), text
    assert f"compiled in {info['compile_s']:.1f} s) routes: {ROUTES}" in ready
    assert checkpoint.describe(trained_transformer) in lines, text
    assert "Connecting to existing Serve app" not in text + rest and "Started a local Ray" not in text
    assert "block_repeats" not in info["model"] and info["model"]["max_seq_len"] == 64
    assert proc.returncode == 0, rest
