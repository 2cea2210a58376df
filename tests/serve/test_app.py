"""The app's arguments without starting Ray: ``app_builder`` (serve run) and ``python -m jaxray.serve``
refuse bad settings and missing paths with messages naming them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from checkpoint_copies import damaged_copy

from jaxray.serve.__main__ import main
from jaxray.serve.app import app_builder
from jaxray.serve.settings import AppArgs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def damaged(trained_transformer, tmp_path_factory) -> tuple[Path, str]:
    """(a copy of ``trained_transformer`` with one params byte flipped, that file relative to it)."""
    return damaged_copy(trained_transformer, tmp_path_factory.mktemp("damaged"))


@pytest.mark.parametrize(
    "args,match",
    [
        ({"checkpoint": None}, "serve args: checkpoint: Input should be a valid string"),
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
        (
            ["--checkpoint", ".", "--prefix-cache-mib", "0", "--prefill-chunk", "64"],
            "prefill_chunk needs the prefix cache",
        ),
        (
            ["--checkpoint", ".", "--prefix-cache-mib", "8", "--prefill-chunk", "40"],
            "prefill_chunk must be a multiple of prefix_block 32",
        ),
        (["--checkpoint", ".", "--port", "70000"], "--port: expected a TCP port 1..65535"),
        (["--checkpoint", "."], "is neither a checkpoint"),
        (["--checkpoint", ".", "--port", "0"], "--port: expected a positive integer"),
        (["--checkpoint", ".", "--batch-wait-ms", "-5"], "--batch-wait-ms: expected a finite number >= 0"),
        (["--checkpoint", ".", "--batch-wait-ms", "inf"], "--batch-wait-ms: expected a finite number >= 0"),
        (["--checkpoint", ".", "--compute-cpus", "0"], "--compute-cpus: expected a positive integer"),
        (["--checkpoint", ".", "--compute-cpus", "999"], "--compute-cpus: at most"),
        (["--checkpoint", ".", "--prefix-cache-mib", "1000000"], "--prefix-cache-mib: at most"),
    ],
)
def test_cli_refuses_bad_options_before_ray_starts(argv, match, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_errors_after_parsing_print_the_error_alone(capsys):
    """A checkpoint or port error is one line, as generate's, not argparse's usage block first."""
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", "no/such/dir"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "usage:" not in err
    assert err.startswith("python -m jaxray.serve: error: checkpoint no/such/dir does not exist")


def test_cli_refuses_a_prefix_block_the_model_cannot_hold_before_ray_starts(trained_transformer, capsys):
    argv = ["--checkpoint", str(trained_transformer), "--prefix-cache-mib", "1", "--prefix-block", "4096"]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2 and "prefix_block must be below max_seq_len" in capsys.readouterr().err


def test_cli_reads_a_serve_config_and_refuses_a_bad_one_before_ray_starts(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    config["applications"][0]["args"]["engine"]["chunk"] = 0
    bad.write_text(yaml.safe_dump(config))
    cases = [
        ([], "one of --checkpoint or --config is required"),
        (["--config", str(tmp_path / "none.yaml")], "No such file or directory"),
        (["--config", str(bad)], f"--config {bad}: args: engine.chunk: Input should be greater than 0"),
        # the shipped config's args, its checkpoint overridden: that path is what is refused
        (["--config", str(ROOT / "serve" / "config.yaml"), "--checkpoint", "no/such"], "checkpoint no/such"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2 and match in capsys.readouterr().err, argv


def test_pin_compute_pins_the_calling_thread_only():
    """Run in its own thread: the affinity call pins the calling thread (and threads it starts)."""
    import os
    import threading

    from jaxray.serve.replica import pin_compute

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
    from ray.serve.schema import ServeDeploySchema

    from jaxray.serve.settings import AppArgs

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve" / "config.yaml").read_text()))
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    [application] = config.applications
    assert application.import_path == "jaxray.serve.app:app_builder" and application.route_prefix == "/"
    args = AppArgs.model_validate({**application.args, "checkpoint": "runs/demo"})  # its default
    assert args.max_batch_size == max(args.engine.batch_sizes)


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


def test_app_builder_restores_the_checkpoint_and_refuses_a_damaged_one(damaged, capsys):
    # What `serve run` calls: the weights are checked before anything is deployed.
    copy, victim = damaged
    with pytest.raises(ValueError, match=f"{copy} is damaged: {victim} does not match its checksum"):
        app_builder({"checkpoint": str(copy)})
    assert f"jaxray: cannot serve: {copy} is damaged" in capsys.readouterr().err


@pytest.mark.slow  # 11 s: JAX's import and a restore in a fresh process
@pytest.mark.parametrize("config", [False, True], ids=["checkpoint", "config"])
def test_cli_refuses_a_damaged_checkpoint_in_seconds_before_ray_starts(damaged, config):
    copy, victim = damaged
    argv = ["--checkpoint", str(copy), "--port", str(_free_port())]
    argv += ["--config", str(ROOT / "serve" / "config.yaml")] if config else []
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.serve", *argv],
        env={**os.environ, "RAY_ADDRESS": "local"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and f"{victim} does not match its checksum" in proc.stderr, proc.stderr
    assert elapsed < 30 and "Started a local Ray instance" not in proc.stderr, (elapsed, proc.stderr)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_deployment_keeps_faults_short():
    from jaxray.serve import app as serve_app

    config = serve_app.deployment(AppArgs(checkpoint="x", max_queued_requests=7))._deployment_config
    assert config.max_constructor_retry_count == serve_app.CONSTRUCTOR_TRIES == 1  # no retry loop
    assert (config.max_ongoing_requests, config.max_queued_requests) == (256, 7)
    assert (config.backpressure_config.status_code, config.backpressure_config.retry_after_s) == (503, 1)
    assert config.health_check_period_s == serve_app.HEALTH_CHECK_PERIOD_S
    assert config.graceful_shutdown_timeout_s == serve_app.SHUTDOWN_TIMEOUT_S < 10


@pytest.mark.slow  # JAX's import and a restore in a fresh process
def test_serve_run_of_the_import_path_ends_with_the_cause_of_a_damaged_checkpoint(damaged):
    # Ray's own command builds an import path's app in its process, before Ray starts: the error
    # ends it (a config file's build runs in a Serve task, and `serve run` then idles).
    copy, victim = damaged
    serve_cli = Path(sys.executable).with_name("serve")
    start = time.monotonic()
    proc = subprocess.run(
        [str(serve_cli), "run", "jaxray.serve.app:app_builder", f"checkpoint={copy}", "max_batch_size=4"],
        env={**os.environ, "RAY_ADDRESS": "local"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1 and f"jaxray: cannot serve: {copy} is damaged: {victim}" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert elapsed < 30 and "Started a local Ray instance" not in proc.stderr, (elapsed, proc.stderr)


@pytest.mark.slow  # an export and two interpreters: ~8 s
def test_an_artifact_is_checked_without_starting_jax(trained_transformer, tmp_path):
    """build_app checks an export artifact's files by their digests without starting a JAX backend
    (ray.init's processes would fork it: Python's os.fork() warning, twice, at start-up); a damaged
    one is still refused."""
    from jaxray.inference.artifact import export_checkpoint
    from jaxray.inference.settings import EngineSettings

    out = tmp_path / "artifact"
    export_checkpoint(trained_transformer, out, EngineSettings(buckets=(16,), batch_sizes=(1,), chunk=8))
    check = (
        "import sys; from jaxray.serve.app import build_app; from jaxray.serve.settings import AppArgs; "
        "engine = {'buckets': [16], 'batch_sizes': [1], 'chunk': 8}; "
        "build_app(AppArgs(checkpoint=sys.argv[1], max_batch_size=1, engine=engine))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}  # any backend started here fails
    done = subprocess.run([sys.executable, "-c", check, str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = next(out.glob("*.npz"))
    weights.write_bytes(weights.read_bytes()[:-10])
    done = subprocess.run([sys.executable, "-c", check, str(out)], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and f"{weights} is damaged" in done.stderr
