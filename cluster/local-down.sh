#!/usr/bin/env bash
# Stop the Ray started by local-up.sh (`ray stop` ends this user's Ray processes on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
"${VENV:-.venv}/bin/ray" stop
