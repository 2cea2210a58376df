#!/usr/bin/env bash
# Stop the head that local-up.sh started with the same RAY_DASHBOARD_PORT (default 8265): SIGTERM to
# its `ray start --block`, which stops the processes it started, then SIGKILL to whatever is left
# of its process group after 60 s. Other Ray processes on the machine are left
# alone (`ray stop` would end them all).
set -euo pipefail
cd "$(dirname "$0")/.."
. cluster/process-group.sh
state="runs/ray-head-${RAY_DASHBOARD_PORT:-8265}"
[ -f "$state.pid" ] || { echo "no $state.pid: no head of local-up.sh to stop" >&2; exit 1; }
pid="$(cat "$state.pid")"
# Only while the pid is still that `ray start` (a stale file must not signal whoever has the pid now),
# and only the leader: it stops the others in order.
if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q 'ray start --head'; then
  stop_group "$pid"
  echo "stopped the Ray head of $state.pid (process group $pid)"
else
  echo "the head of $state.pid (pid $pid) had already ended"
fi
if [ -s "$state.tempdir" ]; then  # the head's own Ray temp folder (local-up.sh, other ports)
  address_file="$(cat "$state.tempdir")/ray_current_cluster"
else
  address_file="$("${VENV:-.venv}/bin/python" -c 'from jaxray.raytrain.cluster import ray_address_file; print(ray_address_file())')"
fi
if [ -s "$state.address" ] && [ -f "$address_file" ] && [ "$(cat "$address_file")" = "$(cat "$state.address")" ]; then
  rm -f "$address_file"
fi
rm -f "$state.pid" "$state.address" "$state.tempdir"
