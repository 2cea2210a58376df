#!/usr/bin/env bash
# One prepared device check: every figure a lent GPU should give, in at most 9 minutes.
#
#   bash scripts/gpu-check.sh [--cpu] [--bundle DIR] [--data-dir DIR] [--budget S] [--work DIR] OUTDIR
#
# Steps, most important first (each under its own `timeout`; one that fails is recorded and the
# next one runs): doctor; bench precision (--preset gpu); a real Ray Tune + Ray Train sweep
# (tune_configs/gpu_check.yaml: one worker owning the GPU, float32 vs bfloat16) and the GPU UUID its
# worker logs; bench serve --url (1 and 16 clients) against python -m jaxray.serve of that sweep's
# checkpoint, started in the background; bench compile float32 and bfloat16; pytest -m gpu; bench
# decode; pytest of decoding/export/attention; bench attention; bench batch-sweep; bench throughput
# --model-preset gpt2_small (optional).
#
# --cpu       the same steps at tiny sizes (--preset tiny, gpu_check_cpu.yaml, ...), to know the
#             script works before a GPU minute is spent (about 4 minutes on 2 cores)
# --bundle D  run D/install.sh first (the offline bundle of ../shared/tools/gpu-host-bundle.sh) and
#             use python3 with PYTHONPATH=/tmp/site:<project>; else .venv/bin/python, else python3
# --data-dir  the data files (default: $JAXRAY_DATA_DIR, else ../shared/data); exported as JAXRAY_DATA_DIR
# --budget S  seconds for the whole run, install included (default 540 on a GPU, 1500 with --cpu);
#             a step gets at most what is left, and a step that would get under 20 s is skipped
# --work D    where the sweep's checkpoints go (default: a new /tmp/gpu-check-work.XXXXXX); OUTDIR
#             only gets its reports, so it stays small and shallow
#
# Writes OUTDIR/gpu-check.json (environment; per step: name, command, exit code, seconds, key
# figures, log path), OUTDIR/gpu-check.md (the same as tables), every step's log in OUTDIR/logs/ and
# the benchmarks' summaries in OUTDIR/<step>/. Exit code 0 when every step passed, else 1.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

cpu=0 bundle="" data_dir="${JAXRAY_DATA_DIR:-}" budget="" work="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --bundle|--data-dir|--budget|--work)
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "gpu-check: $1 needs a value" >&2; exit 2; }
      case "$1" in
        --bundle) bundle="$2" ;; --data-dir) data_dir="$2" ;; --budget) budget="$2" ;; --work) work="$2" ;;
      esac
      shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu-check: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu-check: one OUTDIR only (got $out and $1)" >&2; exit 2; }; out="$1" ;;
  esac
  shift
done
[ -n "$out" ] || { usage >&2; exit 2; }
# Every argument is checked before anything is created.
if [ -n "$budget" ] && ! [[ "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu-check: --budget must be a whole number of seconds, got '$budget'" >&2; exit 2
fi
if [ -n "$bundle" ]; then
  [ -f "$bundle/install.sh" ] || { echo "gpu-check: --bundle $bundle holds no install.sh (build it with ../shared/tools/gpu-host-bundle.sh)" >&2; exit 2; }
  bundle="$(cd "$bundle" && pwd)"
fi
if [ -e "$out" ] && [ ! -d "$out" ]; then echo "gpu-check: OUTDIR $out is a file" >&2; exit 2; fi
t0=$(date +%s)
root="$(cd "$(dirname "$0")/.." && pwd)"
abs() { mkdir -p "$1" && (cd "$1" && pwd); }  # a folder given relative to where the script was called
# OUTDIR is new, empty, or an earlier run's (it holds logs/run.json): only then are its folders replaced.
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ] && [ ! -f "$out/logs/run.json" ]; then
  echo "gpu-check: $out is not empty and holds no earlier gpu-check run (logs/run.json); choose a new OUTDIR" >&2
  exit 2
fi
out="$(abs "$out")" || exit 2
[ -z "$work" ] || work="$(abs "$work")" || exit 2
[ -z "$data_dir" ] || [ ! -d "$data_dir" ] || data_dir="$(cd "$data_dir" && pwd)"  # relative to the caller
cd "$root"
data_dir="${data_dir:-../shared/data}"
[ -d "$data_dir" ] && data_dir="$(cd "$data_dir" && pwd)" || echo "gpu-check: warning: data folder $data_dir not found" >&2
export JAXRAY_DATA_DIR="$data_dir" PYTHONUNBUFFERED=1 RAY_ADDRESS=local
budget="${budget:-$([ $cpu = 1 ] && echo 1500 || echo 540)}"
deadline=$(( t0 + budget - 5 ))  # 5 s for the report
KILL_AFTER=40  # a step past its timeout gets SIGINT (Tune saves, serve stops its server), then this long before SIGKILL
MIN_STEP=20
mode=$([ $cpu = 1 ] && echo cpu || echo gpu)

rm -rf "$out"/logs "$out"/bench-* "$out"/compile-* "$out"/tune "$out"/serve "$out"/decode "$out"/gpu-check.json "$out"/gpu-check.md
mkdir -p "$out/logs"
steps="$out/logs/steps.tsv"
: > "$steps"

say() { printf '[gpu-check %4ds] %s\n' $(( $(date +%s) - t0 )) "$*"; }

# record NAME STATUS RC START END LIMIT OK OPTIONAL NOTE CMD...
record() {
  local name=$1 status=$2 rc=$3 start=$4 end=$5 limit=$6 ok=$7 optional=$8 note=$9; shift 9
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$start" "$end" "$limit" \
    "logs/$name.log" "$ok" "$optional" "$note" "$(quoted "$@")" >> "$steps"
}

# The command as one line a shell would read back (arguments with spaces or quotes single-quoted).
quoted() {
  local arg line=""
  for arg in "$@"; do
    [[ "$arg" =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]] || arg="'${arg//\'/\'\\\'\'}'"
    line+="${line:+ }$arg"
  done
  printf '%s' "$line"
}

# step NAME GPU_TIMEOUT CPU_TIMEOUT OK_CODES OPTIONAL CMD...: run CMD under timeout, output in logs/NAME.log
step() {
  local name=$1 cap=$2 ok=$4 optional=$5 limit left start end rc began
  [ $cpu = 1 ] && cap=$3
  shift 5
  left=$(( deadline - $(date +%s) - KILL_AFTER ))
  limit=$(( cap < left ? cap : left ))
  start=$(date +%s.%N)
  if [ "$limit" -lt "$MIN_STEP" ]; then
    say "$name: SKIPPED, $(( left > 0 ? left : 0 )) s left of the ${budget} s budget"
    : > "$out/logs/$name.log"
    record "$name" skipped "" "$start" "$start" "$limit" "$ok" "$optional" "skipped: out of time (budget ${budget} s)" "$@"
    return 0
  fi
  say "$name: start (timeout ${limit} s): $(quoted "$@")"
  began=$(date +%s)
  timeout -s INT -k "$KILL_AFTER" "$limit" "$PY" scripts/gpu_check_report.py exec "$@" > "$out/logs/$name.log" 2>&1 < /dev/null
  rc=$?
  end=$(date +%s.%N)
  record "$name" ran "$rc" "$start" "$end" "$limit" "$ok" "$optional" "" "$@"
  say "$name: exit $rc after $(( $(date +%s) - began )) s$([ $rc = 124 ] || [ $rc = 137 ] && echo ' (TIMED OUT)')"
}

# skip NAME OPTIONAL NOTE CMD...: a step that cannot run here, recorded with the reason
skip() {
  local name=$1 optional=$2 note=$3 now
  shift 3
  now=$(date +%s.%N)
  : > "$out/logs/$name.log"
  record "$name" skipped "" "$now" "$now" "" 0 "$optional" "$note" "$@"
  say "$name: SKIPPED: $note"
}

# Python: the bundle's, the venv's, or the system's.
if [ -n "$bundle" ]; then
  PY=python3
  step install 120 120 0 0 bash "$bundle/install.sh"
  export PYTHONPATH="/tmp/site:$root"
elif [ -x .venv/bin/python ]; then
  PY="$root/.venv/bin/python"
else
  PY=python3
fi
if ! problem=$($PY -c "import jax, ray, jaxray" 2>&1); then
  echo "gpu-check: $PY cannot import jax, ray and jaxray (${problem##*$'\n'}): run 'make install' here, or pass --bundle DIR on a GPU host" >&2
  exit 2
fi
[ -n "$work" ] || work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work.XXXXXX")"
$PY - "$out/logs/run.json" "$mode" "$budget" "$PY" "$data_dir" "$bundle" "$work" "$t0" <<'EOF'
import json, os, subprocess, sys
path, mode, budget, py, data, bundle, work, t0 = sys.argv[1:]
version = subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True).stdout.strip()
json.dump({"mode": mode, "budget_s": int(budget), "python": py, "python_version": version, "data_dir": data,
           "bundle": bundle or None, "work_dir": work, "started": float(t0),
           "pythonpath": os.environ.get("PYTHONPATH"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
          open(path, "w"), indent=1)
EOF

# GPU utilization and memory every second, so each step shows whether it used the GPU.
sampler=""
if [ $cpu = 0 ] && command -v nvidia-smi > /dev/null; then
  ( while :; do
      printf '%s %s\n' "$(date +%s.%N)" "$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)"
      sleep 1
    done ) > "$out/logs/gpu-samples.tsv" 2>/dev/null &
  sampler=$!
fi
trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null' EXIT
say "mode $mode, budget $budget s, python $PY, data $JAXRAY_DATA_DIR, out $out, work $work"

if [ $cpu = 1 ]; then
  preset=tiny tune_yaml=tune_configs/gpu_check_cpu.yaml serve_load=(--duration 5)
  serve_gpus=()
  compile_size=(--batch 4 --width 32 --seq-len 32)
  pytest_files=(tests/inference/test_detokenize.py)  # seconds: the step's own run, not the models'
  decode_opts=(--new-tokens 24 --repeats 1)
  sweep_opts=(--batches 32,64,128)
  gpt2_opts=(--width 96 --seq-len 32 --batch 2 --steps 2 --repeats 1)
else
  preset=gpu tune_yaml=tune_configs/gpu_check.yaml serve_load=(--duration 10)
  serve_gpus=(--num-gpus 1)  # Ray reserves the GPU for the replica, as on a cluster
  compile_size=(--batch 64)
  pytest_files=(tests/inference tests/models)
  decode_opts=()
  sweep_opts=()
  gpt2_opts=(--dtype bfloat16 --batch 16)
fi

# NAME GPU-timeout CPU-timeout ok-codes optional command
step doctor 60 60 0 0 "$PY" -m jaxray.doctor --json
step precision 150 240 0 0 "$PY" -m jaxray.bench precision --preset $preset --out "$out/bench-precision"

step tune 240 400 0 0 "$PY" -m jaxray.tune --config $tune_yaml --out "$work/tune" --verbose
mkdir -p "$out/tune"  # the sweep's reports and compile reports (not its checkpoints) into OUTDIR
run_dir=$(ls -d "$work"/tune/*/ 2>/dev/null | sort | tail -n 1)  # the run's own folder: <YYYYmmdd-HHMMSS>/
cp "$run_dir"summary.* "$run_dir"*.png "$out/tune/" 2>/dev/null
for f in "$run_dir"train/*/compile.json; do
  [ -f "$f" ] && cp "$f" "$out/tune/compile-$(basename "$(dirname "$f")").json"
done

# Serving and the tests start several JAX processes at once (server and replica; a test and the CLI it
# runs): none preallocates 75 % of the GPU's memory, so none starves another (the benchmarks keep it).
noprealloc=(env XLA_PYTHON_CLIENT_PREALLOCATE=false)
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The app runs in the background (log: logs/serve-app.log) while `bench serve --url` loads it.
"${noprealloc[@]}" "$PY" scripts/gpu_check_report.py exec "$PY" -m jaxray.serve --checkpoint "$work/tune" \
  --host 127.0.0.1 --port "$port" ${serve_gpus[@]+"${serve_gpus[@]}"} > "$out/logs/serve-app.log" 2>&1 < /dev/null &
server=$!
up=$(( deadline - $(date +%s) - KILL_AFTER - MIN_STEP ))
[ $cpu = 1 ] || up=$(( up < 240 ? up : 240 ))
"$PY" -c '
import os, sys, time, urllib.request
url, end, pid = sys.argv[1], time.time() + float(sys.argv[2]), int(sys.argv[3])
while time.time() < end:
    try:
        sys.exit(urllib.request.urlopen(url, timeout=2).close())
    except OSError:
        os.kill(pid, 0)  # raises (exit 1) once the app has exited
        time.sleep(1)
sys.exit(1)' "http://127.0.0.1:$port/healthz" "$up" "$server" 2>/dev/null ||
  say "serve: the app did not answer /healthz (see logs/serve-app.log)"
step serve 200 300 0 0 "$PY" -m jaxray.bench serve --url "http://127.0.0.1:$port" --clients 1,16 \
  "${serve_load[@]}" --out "$out/serve"
kill -INT "$server" 2>/dev/null  # as Ctrl-C: the app is removed and its Ray stopped
for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; sleep 10; kill -KILL "$server" 2>/dev/null; fi
wait "$server" 2>/dev/null

for dtype in float32 bfloat16; do
  step compile-$dtype 90 120 0 0 "$PY" -m jaxray.bench compile --workload transformer --dtype $dtype \
    "${compile_size[@]}" --json --out "$out/compile-$dtype"
done

gpu_files=$(grep -rlE 'mark\.gpu\b' tests --include='*.py' | sort | tr '\n' ' ')
if [ -n "$gpu_files" ]; then
  # On a CPU every gpu test is skipped (exit 0); 5 (none selected) is accepted there only.
  # shellcheck disable=SC2086
  step pytest-gpu 90 120 "$([ $cpu = 1 ] && echo 0,5 || echo 0)" 0 "${noprealloc[@]}" "$PY" -m pytest -q -p no:cacheprovider -m gpu $gpu_files
else
  skip pytest-gpu "$cpu" "no test file marks a test gpu" "$PY" -m pytest -m gpu
fi

ckpt=()
[ $cpu = 1 ] && compgen -G "$work/tune/*/summary.json" >/dev/null && ckpt=(--checkpoint "$work/tune")  # the tiny model: seconds, not minutes
step decode 120 240 0 0 "$PY" -m jaxray.bench decode --batch-sizes 1,16 ${decode_opts[@]+"${decode_opts[@]}"} ${ckpt[@]+"${ckpt[@]}"} --out "$out/decode"

step pytest 150 300 0 0 "${noprealloc[@]}" "$PY" -m pytest -q -p no:cacheprovider "${pytest_files[@]}" -m "not slow and not gpu"
step attention 100 180 0 0 "$PY" -m jaxray.bench attention --preset $preset --out "$out/bench-attention"
step batch-sweep 100 180 0 0 "$PY" -m jaxray.bench batch-sweep --preset $preset ${sweep_opts[@]+"${sweep_opts[@]}"} --out "$out/bench-batch-sweep"

gpt2=("$PY" -m jaxray.bench throughput --model-preset gpt2_small "${gpt2_opts[@]}" --json --out "$out/bench-throughput")
if help=$("$PY" -m jaxray.bench throughput --help 2>&1) && ! grep -q -- --model-preset <<< "$help"; then
  skip throughput-gpt2 1 "python -m jaxray.bench throughput has no --model-preset here" "${gpt2[@]}"
else  # also when --help itself fails: the step's log then says why
  step throughput-gpt2 90 240 0 1 "${gpt2[@]}"
fi

[ -n "$sampler" ] && kill "$sampler" 2>/dev/null
sampler=""
"$PY" scripts/gpu_check_report.py report "$out"
rc=$?
say "done in $(( $(date +%s) - t0 )) s: $out/gpu-check.md"
exit $rc
