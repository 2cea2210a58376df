#!/usr/bin/env bash
# Start a single-node Ray head from the project's venv (so jobs run with its interpreter), with the
# dashboard and job API on 127.0.0.1. Extra arguments go to `ray start`, e.g. --num-cpus 4.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(pwd)/${VENV:-.venv}"
[ -x "$venv/bin/ray" ] || { echo "no $venv/bin/ray: run 'make install' first" >&2; exit 1; }
export PATH="$venv/bin:$PATH"
port="${RAY_DASHBOARD_PORT:-8265}"
ray start --head --dashboard-host 127.0.0.1 --dashboard-port "$port" --disable-usage-stats "$@"
echo "dashboard and job API: http://127.0.0.1:$port (token auth: 'ray get-auth-token' prints the token)"
echo "submit: RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:$port --working-dir . -- python -m jaxray.tune --config tune_configs/smoke.yaml --out \$PWD/runs/smoke"
