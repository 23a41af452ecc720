#!/usr/bin/env bash
# Usage: benchmarks/gpu_all.sh [--cpu] [OUT.json]
#
# One prepared GPU run, meant to finish in under 8 minutes on one H200: gpu_check.py (exactness, peaks, copies,
# spilling, memory model profiled on the device, keep/offload/recompute bit-identical, real OOM re-plan), then
# gpu_gil.py (Python time per minibatch that holds the GIL, and how many GPUs one process keeps busy), then
# gpu_perf.py (hydra_tune vs plain PyTorch) with what is left of the time (--time-budget). Writes one JSON object to
# OUT.json (default gpu_all.json in the current directory):
#   {"gpu_check": ..., "gpu_gil": ..., "gpu_perf": ..., "exit": {...}, "seconds": ...}
# the scripts' output to gpu_check.log, gpu_gil.log and gpu_perf.log next to it, and prints one summary table.
# --cpu: the same as a dry run on CPU stand-ins with tiny sizes. The Python used: $PY, else the repository's .venv,
# else python3. GPU_ALL_SECONDS (default 480) is the whole run's time; gpu_perf gets at least 60 s.
# If (h) fails on a GPU (a crash or a difference between backward modes), HYDRA_TUNE_CUDA_RECOMPUTE=1 makes every
# CUDA plan recompute until it is fixed.
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
"$py" "$here/gpu_gil.py" "${cpu[@]}" --json "$dir/gpu_gil.json" 2>&1 | tee "$dir/gpu_gil.log"
gil_rc=${PIPESTATUS[0]}
left=$(( total - ($(date +%s) - start) ))
if [ "$left" -lt 60 ]; then left=60; fi
"$py" "$here/gpu_perf.py" "${cpu[@]}" --time-budget "$left" --json "$dir/gpu_perf.json" 2>&1 | tee "$dir/gpu_perf.log"
perf_rc=${PIPESTATUS[0]}

"$py" "$here/_gpu_summary.py" "$out" "$dir/gpu_check.log" "$dir/gpu_gil.json" "$dir/gpu_perf.json" \
  "$check_rc" "$gil_rc" "$perf_rc" "$(( $(date +%s) - start ))"
[ "$check_rc" -eq 0 ] && [ "$gil_rc" -eq 0 ] && [ "$perf_rc" -eq 0 ]
