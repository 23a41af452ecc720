#!/usr/bin/env bash
# Usage: benchmarks/gpu_all.sh [--cpu] [OUT.json]
#
# gpu_check.py (exactness, peaks, copies, spilling, memory model, OOM re-plan) and gpu_perf.py (hydra_tune vs plain
# PyTorch: fits, spills, many tasks, separate processes) in one go, meant to finish in about 8 minutes on one H200;
# gpu_perf gets what gpu_check left of that (--time-budget). Writes one JSON object to OUT.json (default
# gpu_all.json in the current directory): {"gpu_check": ..., "gpu_perf": ..., "exit": {...}, "seconds": ...}, and
# the two scripts' output to gpu_check.log and gpu_perf.log next to it. --cpu: the same as a dry run on CPU
# stand-ins with tiny sizes. The Python used: $PY, else the repository's .venv, else python3.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cpu=()
if [ "${1:-}" = "--cpu" ]; then cpu=(--cpu); shift; fi
out=${1:-gpu_all.json}
dir=$(dirname "$out")
py=${PY:-}
if [ -z "$py" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; else py=python3; fi
fi
total=${GPU_ALL_SECONDS:-480}
start=$(date +%s)

"$py" "$here/gpu_check.py" "${cpu[@]}" 2>&1 | tee "$dir/gpu_check.log"
check_rc=${PIPESTATUS[0]}
left=$(( total - ($(date +%s) - start) ))
if [ "$left" -lt 60 ]; then left=60; fi
"$py" "$here/gpu_perf.py" "${cpu[@]}" --time-budget "$left" --json "$dir/gpu_perf.json" 2>&1 | tee "$dir/gpu_perf.log"
perf_rc=${PIPESTATUS[0]}

"$py" - "$dir/gpu_check.log" "$dir/gpu_perf.json" "$out" "$check_rc" "$perf_rc" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
check_log, perf_json, out, check_rc, perf_rc, seconds = sys.argv[1:]

def last_json(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except OSError:
        return None

result = {"gpu_check": last_json(check_log), "gpu_perf": last_json(perf_json),
          "exit": {"gpu_check": int(check_rc), "gpu_perf": int(perf_rc)}, "seconds": int(seconds)}
with open(out, "w") as f:
    json.dump(result, f)
print(f"gpu_all: wrote {out} (gpu_check exit {check_rc}, gpu_perf exit {perf_rc}, {seconds} s)")
PY
[ "$check_rc" -eq 0 ] && [ "$perf_rc" -eq 0 ]
