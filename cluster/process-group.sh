# Sourced by local-down.sh and local-node.sh. stop_group PID: SIGTERM to PID, the leader of its process
# group (a `ray start --block`, which stops the processes it started in order), then SIGKILL to
# whatever is left of the group after 60 s.
stop_group() {
  kill -TERM "$1"
  for _ in $(seq 60); do
    kill -0 -- "-$1" 2>/dev/null || return 0
    sleep 1
  done
  kill -KILL -- "-$1" 2>/dev/null || true
}
