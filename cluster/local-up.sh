#!/usr/bin/env bash
# Start a single-node Ray head from the project's venv (so jobs run with its interpreter), with the
# dashboard and job API on 127.0.0.1:${RAY_DASHBOARD_PORT:-8265}. Extra arguments go to `ray start`,
# e.g. --num-cpus 4, or --port 6380 for a GCS port other than 6379. It returns once a job can be
# submitted (the head within LOCAL_UP_TIMEOUT_S, default 180 s, its job agent within
# LOCAL_UP_AGENT_TIMEOUT_S of the dashboard answering, default 60 s; otherwise it exits non-zero
# saying what was not ready, and the head, still running, is stopped with local-down.sh).
# The head runs as `ray start --block` in a session of its own, whose id (its pid) goes to
# runs/ray-head-<dashboard port>.pid: local-down.sh stops that head and no other Ray on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"  # relative to the repository root, or absolute
[ -x "$venv/bin/ray" ] || { echo "no $venv/bin/ray: run 'make install' first" >&2; exit 1; }
venv="$(cd "$venv" && pwd)"
export PATH="$venv/bin:$PATH"
port="${RAY_DASHBOARD_PORT:-8265}"
state="runs/ray-head-$port"
if [ -f "$state.pid" ] && kill -0 "$(cat "$state.pid")" 2>/dev/null; then
  echo "a head started by local-up.sh already runs with its dashboard on $port (pid $(cat "$state.pid"))" >&2
  exit 1
fi
mkdir -p runs
# Ray 2.60 token auth on the dashboard, job API and every RPC: make this user's token if there is
# none yet (~/.ray/auth_token), and start the head with it.
ray get-auth-token --generate >/dev/null
export RAY_AUTH_MODE=token
# On SIGTERM Ray 2.60 first drains the node (for Serve replicas on Kubernetes); after a job the node
# seldom turns idle, so local-down.sh would wait out the 30 s timeout. A local head skips it.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"
# A head on other than the default port gets a Ray temp folder of its own. Ray's job supervisor
# gives each job's driver the address in <temp folder>/ray_current_cluster, which `ray start` of
# the latest head on the machine overwrites: with one shared folder, a job submitted to one head
# ran its driver on the other (Ray 2.60, JobSupervisor._get_driver_env_vars).
temp_dir=()
if [ "$port" != 8265 ] && [[ " $* " != *" --temp-dir"* ]]; then
  temp_dir=(--temp-dir "${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray-$port")
  echo "${temp_dir[1]}" >"$state.tempdir"
else
  rm -f "$state.tempdir"
fi
# setsid: the head and every process it starts share one process group, which local-down.sh ends.
setsid ray start --head --block --dashboard-host 127.0.0.1 --dashboard-port "$port" --disable-usage-stats \
  "${temp_dir[@]}" "$@" </dev/null >"$state.log" 2>&1 &
echo $! >"$state.pid"
# Up once `ray start` says it blocks (the node is started and has written Ray's address file), the
# dashboard answers at all (401 without the token) and the job API can take a job: the dashboard
# hands a submission to the head node's dashboard agent, which it finds through the agent's entry
# in the GCS (written once the agent's HTTP server is up). Before that entry exists a `ray job
# submit` fails with "No available agent to submit job", so this waits for it and for the agent to
# answer. The head's GCS address, from its output, goes to $state.address, so local-down.sh removes
# Ray's address file only while it names this head.
python - "$port" "$!" "$state.log" "$state.address" "${LOCAL_UP_TIMEOUT_S:-180}" "${LOCAL_UP_AGENT_TIMEOUT_S:-60}" <<'PY'
import json, re, sys, time, urllib.request
port, pid, log, address_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
timeout, agent_timeout = float(sys.argv[5]), float(sys.argv[6])

def answers(url):
    try:
        urllib.request.urlopen(url, timeout=2)
    except OSError as err:
        return bool(getattr(err, "code", None))
    return True

def job_agent(gcs_address):
    """The head's job agent URL once it is registered in the GCS and answers, else None (Ray's own
    lookup: ray.dashboard.modules.job.job_head.JobHead.get_target_agent)."""
    # Imported here: Ray takes seconds to import, and only once the head is up is it needed.
    from ray._private import ray_constants
    from ray._raylet import GcsClient
    from ray.dashboard.consts import DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX

    try:
        gcs = GcsClient(address=gcs_address)
        head = gcs.internal_kv_get(ray_constants.KV_HEAD_NODE_ID_KEY, ray_constants.KV_NAMESPACE_JOB, timeout=2)
        if not head:
            return None
        key = f"{DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{head.decode()}".encode()
        info = gcs.internal_kv_get(key, ray_constants.KV_NAMESPACE_DASHBOARD, timeout=2)
    except Exception:  # the GCS not answering yet (Ray raises its own RPC errors)
        return None
    if not info:
        return None
    ip, http_port = json.loads(info)[:2]
    url = f"http://{ip}:{http_port}"
    return url if answers(f"{url}/api/job_agent/jobs/") else None

deadline, waiting_for = time.monotonic() + timeout, "ray start"
while time.monotonic() < deadline:  # the head's; then the agent's, from the dashboard's first answer
    try:  # gone, or a zombie this script has not reaped: it exited
        alive = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        alive = False
    output = open(log, errors="replace").read()
    if not alive:
        sys.exit(f"ray start exited; its output ({log}):\n{output[-4000:]}")
    gcs = re.search(r"--address='([^']+)'", output)
    if "block forever" in output and answers(f"http://127.0.0.1:{port}/api/version"):
        if waiting_for != "the job agent":
            waiting_for, deadline = "the job agent", time.monotonic() + agent_timeout
        if gcs and job_agent(gcs.group(1)):
            open(address_file, "w").write(gcs.group(1))
            sys.exit(0)
    time.sleep(1)
if waiting_for == "the job agent":
    sys.exit(
        f"the head's dashboard answers on 127.0.0.1:{port}, but its job agent was not ready "
        f"{agent_timeout:.0f} s later, so `ray job submit` would fail (\"No available agent to submit job\"); see "
        f"{log} and dashboard_agent.log in the head's session logs (session_latest/logs in its Ray "
        f"temp folder: /tmp/ray, or /tmp/ray-{port} for a head on another port); "
        f"stop it with local-down.sh"
    )
sys.exit(f"the head was not up within {timeout:.0f} s; see {log}; stop it with local-down.sh")
PY
echo "dashboard and job API: http://127.0.0.1:$port (token auth: 'ray get-auth-token' prints the token)"
echo "GCS address (RAY_ADDRESS for a driver run on this machine): $(cat "$state.address")"
# The README's submission (On a cluster). The job runs with the head's environment, so a
# JAXRAY_DATA_DIR exported before this script serves instead of --data-dir.
data_dir=" --data-dir \$PWD/../shared/data"
[ -z "${JAXRAY_DATA_DIR:-}" ] || data_dir=""
echo "submit: RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:$port --runtime-env cluster/runtime_env.yaml -- python -m jaxray.tune --config tune_configs/smoke.yaml$data_dir --out \$PWD/runs/smoke"
echo "stop:   ${RAY_DASHBOARD_PORT:+RAY_DASHBOARD_PORT=$port }cluster/local-down.sh"
