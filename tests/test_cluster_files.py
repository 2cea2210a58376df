"""The deployment files under cluster/ (no cluster, no network): the YAMLs parse; the KubeRay workers
take both L4s of a node; every Ray pod runs the image cluster/Dockerfile builds; the RayJob runs
`python -m jaxray.tune` on a config that exists, on the RayCluster's own spec; the runtime_env keeps
the git history, outputs and data files out of the upload and what is left stays far below Ray's cap;
the launcher config passes Ray's own validation and its GPU node type has 2 L4s."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from ray._private.runtime_env.packaging import _get_excludes  # the matcher `ray job submit` zips with
from ray.autoscaler._private.util import prepare_config, validate_config  # what `ray up` checks first

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
UPLOAD_LIMIT = 100 * 2**20  # Ray's long-standing working_dir cap; Ray 2.60's gRPC cap is larger


def load(relative: str) -> dict:
    return yaml.safe_load((CLUSTER / relative).read_text())


def containers(spec: dict) -> list[dict]:
    """Every Ray container of a RayCluster spec: head group first, then each worker group."""
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def gpu_group(spec: dict) -> dict:
    (group,) = spec["workerGroupSpecs"]
    return group


def runtime_env() -> dict:
    return load("runtime_env.yaml")


def excluded(env: dict):
    """Whether `ray job submit --runtime-env` leaves a path out: Ray prunes a folder that matches,
    so a path goes when it or any folder above it matches the excludes."""
    match = _get_excludes(ROOT, env["excludes"])
    return lambda rel: any(match(ROOT / p) for p in [Path(rel), *Path(rel).parents][:-1])


@pytest.mark.parametrize(
    "path",
    sorted(p.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".yml")),
)
def test_yaml_parses(path):
    assert isinstance(load(path), dict)


def test_worker_group_takes_both_l4s_of_a_node():
    cluster = load("kuberay/raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    pod = gpu_group(cluster["spec"])["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


def test_every_ray_pod_runs_the_dockerfile_image():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    documented = re.search(r"docker build -f cluster/Dockerfile -t (\S+) \.", dockerfile).group(1)
    for manifest, spec in (
        ("raycluster", load("kuberay/raycluster.yaml")["spec"]),
        ("rayjob", load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]),
    ):
        assert {c["image"] for c in containers(spec)} == {documented}, manifest
    assert "-e '.[gpu]'" in dockerfile
    extras = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \["jax\[cuda12\]', extras, re.M)


def test_rayjob_runs_jaxray_tune_on_the_raycluster_spec():
    job = load("kuberay/rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "jaxray.tune"]
    assert (ROOT / argv[argv.index("--config") + 1]).is_file()
    assert spec["rayClusterSpec"] == load("kuberay/raycluster.yaml")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    # --out lies on a volume every Ray pod mounts: the driver reads what the GPU workers write.
    out = argv[argv.index("--out") + 1]
    for container in containers(spec["rayClusterSpec"]):
        assert any(out.startswith(m["mountPath"] + "/") for m in container["volumeMounts"]), container["name"]
    job_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert job_env["excludes"] == runtime_env()["excludes"]


def test_runtime_env_leaves_out_git_runs_and_data_files():
    env = runtime_env()
    assert env["working_dir"] == "."
    out = excluded(env)
    for path in (
        ".git",
        ".git/HEAD",
        ".venv/bin/python",
        "runs/demo/summary.json",
        "checkpoints/a/b",
        "exports/x/manifest.json",
        "tinyshakespeare.txt",
        "data/fashion-mnist/t10k-labels-idx1-ubyte.gz",
        "fashion-mnist/train-images-idx3-ubyte",
        "arrays.npz",
        "jaxray/__pycache__/tune.cpython-311.pyc",
    ):
        assert out(path), path
    for path in (
        "jaxray/tune.py",
        "jaxray/data/shakespeare.py",
        "tune_configs/smoke.yaml",
        "pyproject.toml",
        "cluster/runtime_env.yaml",
        "serve/config.yaml",
    ):
        assert not out(path), path


def test_upload_stays_far_below_ray_cap():
    """What the job would upload: the files git tracks plus the untracked ones it does not ignore
    (Ray honours .gitignore too), less the runtime_env's excludes, as Ray matches them."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out = excluded(runtime_env())
    upload = [p for p in listing.split("\0") if p and not out(p) and (ROOT / p).is_file()]
    assert "jaxray/tune.py" in upload and "tune_configs/smoke.yaml" in upload
    total = sum((ROOT / p).stat().st_size for p in upload)
    assert total < UPLOAD_LIMIT, f"{total / 2**20:.1f} MiB in {len(upload)} files"


def test_launcher_gpu_nodes_have_two_l4s():
    launcher = load("gcp/cluster.yaml")
    validate_config(prepare_config(load("gcp/cluster.yaml")))  # Ray's schema, GCP defaults filled in
    assert launcher["provider"]["type"] == "gcp"
    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    assert head["node_config"]["machineType"] == "n2-standard-8" and "GPU" not in head["resources"]
    (worker,) = [t for name, t in types.items() if name != launcher["head_node_type"]]
    assert worker["node_config"]["machineType"] == "g2-standard-24"
    (accelerator,) = worker["node_config"]["guestAccelerators"]
    assert accelerator["acceleratorCount"] == 2 and accelerator["acceleratorType"].endswith("/nvidia-l4")
    assert worker["resources"]["GPU"] == 2
    assert any("pip install" in c and "'.[gpu]'" in c for c in launcher["setup_commands"])
    assert {".git", ".venv", "runs"} <= set(launcher["rsync_exclude"])
