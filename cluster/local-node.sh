#!/usr/bin/env bash
# Worker nodes on this machine for the head of local-up.sh (RAY_DASHBOARD_PORT picks the head, as there):
#   cluster/local-node.sh add NAME [ray start args]   # e.g. --num-cpus 2; a raylet joined to the head
#   cluster/local-node.sh lose NAME                   # SIGKILL to its raylet and workers: a node lost
#   cluster/local-node.sh stop NAME                   # SIGTERM: the node leaves as `ray stop` would
# Each node runs as `ray start --block` in a session of its own, whose id (its pid) goes to
# runs/ray-node-NAME.pid: lose and stop end that process group and no other Ray on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
. cluster/process-group.sh
usage="usage: cluster/local-node.sh add|lose|stop NAME [ray start args]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
action="$1" name="$2"
shift 2
venv="$(cd "${VENV:-.venv}" && pwd)"
export PATH="$venv/bin:$PATH"
head="runs/ray-head-${RAY_DASHBOARD_PORT:-8265}"
state="runs/ray-node-$name"

alive() { # the pid in $state.pid is still that node's `ray start`
  [ -f "$state.pid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$(cat "$state.pid")/cmdline" | grep -q 'ray start --address'
}

case "$action" in
add)
  [ -s "$head.address" ] || { echo "no $head.address: start the head with cluster/local-up.sh first" >&2; exit 1; }
  if alive; then
    echo "node $name already runs (pid $(cat "$state.pid"))" >&2
    exit 1
  fi
  export RAY_AUTH_MODE=token RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"
  temp_dir=()
  [ ! -s "$head.tempdir" ] || temp_dir=(--temp-dir "$(cat "$head.tempdir")")
  # The head's dashboard agent listens on 52365; a second agent on this machine needs another port.
  agent_port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  setsid ray start --address "$(cat "$head.address")" --block --disable-usage-stats \
    --dashboard-agent-listen-port "$agent_port" "${temp_dir[@]}" "$@" </dev/null >"$state.log" 2>&1 &
  echo $! >"$state.pid"
  for _ in $(seq 120); do
    grep -q "block forever" "$state.log" && { echo "node $name joined (pid $!, log $state.log)"; exit 0; }
    kill -0 "$!" 2>/dev/null || { echo "ray start exited; its output ($state.log):" >&2; tail -40 "$state.log" >&2; exit 1; }
    sleep 1
  done
  echo "node $name did not join within 120 s; see $state.log; end it with: cluster/local-node.sh stop $name" >&2
  exit 1
  ;;
lose | stop)
  if ! alive; then
    echo "node $name is not running (no live runs/ray-node-$name.pid)" >&2
    rm -f "$state.pid"
    exit 1
  fi
  pid="$(cat "$state.pid")"
  if [ "$action" = lose ]; then
    kill -KILL -- "-$pid"
  else
    stop_group "$pid"
  fi
  rm -f "$state.pid"
  echo "node $name: $action (process group $pid)"
  ;;
*)
  echo "$usage" >&2
  exit 2
  ;;
esac
