"""The app's arguments without starting Ray: ``app_builder`` (serve run) and ``python -m jaxray.serve``
refuse bad settings and missing paths with messages naming them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxray.serve.__main__ import main
from jaxray.serve.app import app_builder

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args,match",
    [
        ({}, "serve args: checkpoint: Field required"),
        ({"checkpoint": "x", "bogus": 1}, "serve args: bogus: Extra inputs are not permitted"),
        ({"checkpoint": "x", "engine": {"chunks": 3}}, "serve args: engine.chunks"),
        ({"checkpoint": "x", "batch_wait_ms": -1}, "serve args: batch_wait_ms"),
        ({"checkpoint": "x", "max_batch_size": 0}, "serve args: max_batch_size"),
        ({"checkpoint": "x", "compute_cpus": 0}, "serve args: compute_cpus"),
    ],
)
def test_app_builder_refuses_bad_args(args, match):
    with pytest.raises(ValueError, match=match):
        app_builder(args)


def test_app_builder_names_a_missing_checkpoint_and_a_batch_too_big(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=f"checkpoint runs/none does not exist \\(looked for {tmp_path}/runs/none"
    ):
        app_builder({"checkpoint": "runs/none"})
    with pytest.raises(ValueError, match="max_batch_size 8 exceeds the largest compiled batch size 4"):
        app_builder({"checkpoint": ".", "max_batch_size": 8, "engine": {"batch_sizes": [1, 4]}})


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--checkpoint", "no/such/dir"], "checkpoint no/such/dir does not exist"),
        (["--checkpoint", ".", "--buckets", "32,0"], "--buckets: expected comma-separated positive integers"),
        (
            ["--checkpoint", ".", "--max-batch-size", "32"],
            "max_batch_size 32 exceeds the largest compiled batch size 16",
        ),
        (
            ["--checkpoint", ".", "--batch-sizes", "1,4", "--max-ongoing-requests", "2"],
            "max_batch_size 4 exceeds max_ongoing_requests 2",
        ),
        (["--checkpoint", ".", "--chunk", "0"], "--chunk: expected a positive integer"),
        (["--checkpoint", ".", "--context-keep", "1"], "--context-keep: expected an integer >= 2"),
        (["--checkpoint", ".", "--port", "70000"], "--port: expected a TCP port 1..65535"),
        (["--checkpoint", "."], "is neither a checkpoint"),
        (["--checkpoint", ".", "--port", "0"], "--port: expected a positive integer"),
        (["--checkpoint", ".", "--batch-wait-ms", "-5"], "--batch-wait-ms: expected a finite number >= 0"),
        (["--checkpoint", ".", "--batch-wait-ms", "inf"], "--batch-wait-ms: expected a finite number >= 0"),
        (["--checkpoint", ".", "--compute-cpus", "0"], "--compute-cpus: expected a positive integer"),
        (["--checkpoint", ".", "--compute-cpus", "999"], "--compute-cpus: at most"),
    ],
)
def test_cli_refuses_bad_options_before_ray_starts(argv, match, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert match in capsys.readouterr().err


def test_pin_compute_pins_the_calling_thread_only():
    """Run in its own thread: the affinity call pins the calling thread (and threads it starts)."""
    import os
    import threading

    from jaxray.serve.app import pin_compute

    available, seen = sorted(os.sched_getaffinity(0)), {}

    def pinned():
        seen["default"] = pin_compute(None)
        seen["mask"] = sorted(os.sched_getaffinity(0))
        with pytest.raises(ValueError, match=f"compute_cpus must be in 1..{len(seen['mask'])}"):
            pin_compute(len(available) + 1)

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen["default"] == seen["mask"] == available[: max(1, len(available) - 1)]
    assert sorted(os.sched_getaffinity(0)) == available  # this thread is untouched


def test_cli_names_a_port_in_use(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SystemExit) as caught:
            main(["--checkpoint", ".", "--port", str(busy.getsockname()[1])])
    assert caught.value.code == 2 and "--port: cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_the_shipped_serve_config_is_valid():
    """serve/config.yaml parses as a Serve config, and its args as AppArgs (what `serve run` checks
    only once Ray is up)."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from jaxray.serve.app import AppArgs

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve" / "config.yaml").read_text()))
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    [application] = config.applications
    assert application.import_path == "jaxray.serve.app:app_builder" and application.route_prefix == "/"
    args = AppArgs.model_validate(application.args)
    assert args.checkpoint == "runs/demo" and args.max_batch_size == max(args.engine.batch_sizes)


@pytest.mark.parametrize("num_gpus,expected", [(1, {"num_gpus": 1.0}), (0, {})])
def test_num_gpus_reserves_gpus_for_the_replica(trained_transformer, num_gpus, expected):
    application = app_builder({"checkpoint": str(trained_transformer), "num_gpus": num_gpus})
    options = application._bound_deployment.ray_actor_options
    assert {k: v for k, v in options.items() if k == "num_gpus"} == expected


@pytest.mark.parametrize("value", [-1, True, "1", float("nan")])
def test_num_gpus_must_be_a_number_not_below_zero(value):
    with pytest.raises(ValueError, match="serve args: num_gpus"):
        app_builder({"checkpoint": "x", "num_gpus": value})


@pytest.mark.slow  # starts a private Ray: make test-all
def test_cli_refuses_more_gpus_than_its_private_ray_has(trained_transformer):
    # A replica asking for a GPU the cluster lacks would never be placed; say so instead of waiting.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxray.serve",
            "--checkpoint",
            str(trained_transformer),
            "--num-gpus",
            "1",
            "--port",
            str(port),
        ],
        env={**os.environ, "RAY_ADDRESS": "local"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2 and "--num-gpus 1: the Ray cluster has 0 GPU(s)" in proc.stderr
