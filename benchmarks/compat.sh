#!/usr/bin/env bash
# The version matrix: one fresh venv per combination at the ends of each supported range, the integration and
# family tests that depend on those versions run in each, a markdown table at the end (also $COMPAT_DIR/matrix.md).
#
#   nice -n 15 bash benchmarks/compat.sh    # every cell (make compat); goal: < 30 min on 2 cores shared with
#       # other jobs. high+low+opt-edge: 17 min measured (1-min load mean 11). torch-top: 138 s install + 87-204 s
#       # tests (load 3-7); torch-low: 32 s + 31 s; once per $COMPAT_DIR, torch 2.14.1 (123 s, from disk) and 2.4.0
#       # (201 s: 2.8 GB from PyPI). Sum: 27-29 min the first time, 22-24 min after (each cell measured alone, not
#       # the five in one run)
#   CELLS="high low opt-edge torch-top" bash benchmarks/compat.sh   # without the 2.8 GB torch 2.4 download
#   CELLS="high low" bash benchmarks/compat.sh
#   COMPAT_DIR=/tmp/ht-compat KEEP=1 bash benchmarks/compat.sh   # keep the venvs for a look afterwards
#   CELLS=low TESTS="tests/test_optuna.py" bash benchmarks/compat.sh
#
# Not part of `make test` (`make compat` runs it). Each cell names its torch: each version is installed once (with
# its own dependencies: a CUDA build's nvidia-* libraries, which it needs to import even on a CPU), outside the venvs,
# into $COMPAT_DIR/torch-VERSION, and every venv of that torch sees it through a .pth file. 2.13.0 is the CPU build
# and 2.14.1 a CUDA build, both from this machine's disk (/opt/wheels, /opt/pypi-more); 2.4.0 is PyPI's CUDA build
# (0.8 GB wheel + 2.0 GB of nvidia-*/triton: ~2 min download at ~25 MB/s, once). Downloads are kept in
# $PIP_CACHE_DIR (default $COMPAT_DIR/pip-cache, kept between runs), so only the first run fetches them. Each cell:
# name, torch, ray, optuna, transformers ("-": not installed, its tests skip), tests.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${COMPAT_DIR:-/tmp/hydra_tune_compat}
PY=${PY:-python3}
FIND_LINKS=$([ -d /opt/wheels ] && echo "--find-links /opt/wheels")
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$DIR/pip-cache}
# Which tests where (the choice that keeps the matrix under 30 min): high is the version set of the development venv,
# where `make test` runs everything; its cell checks what make test cannot: a fresh resolve of the pins, the wheel
# installed with [all] (benchmarks/wheel_check.py: imports and the examples' --help from outside the checkout) and
# one run of each integration in that environment. low runs every integration and family test that depends on
# ray, optuna or transformers at the bottom of their ranges. opt-edge: OPT stages are refused below transformers
# 5.23 (stages/compat.py FAMILY_MIN; test_compat.py checks the refusal in low), so they are tested at 5.23 there,
# with transformers alone. Left out everywhere: tests that do not depend on these versions (test_stages_exactness:
# custom declared stages), and test_optuna_processes/test_stages_bert/llama in high (make test runs them there).
HIGH="tests/test_compat.py tests/test_wheel.py tests/test_optuna.py tests/test_postgres.py tests/test_stages.py"
HIGH="$HIGH tests/test_accuracy_search.py"
LOW="tests/test_ray_tune.py tests/test_optuna.py tests/test_optuna_processes.py tests/test_postgres.py"
LOW="$LOW tests/test_stages.py tests/test_stages_bert.py tests/test_stages_llama.py tests/test_compat.py"
# torch-top / torch-low: the ends of torch's range. torch-top runs the tests that depend on torch internals hydra_tune
# repeats or routes (dispatch modes, RNG streams, clipping and GradScaler steps, OOM, the family stages,
# checkpoints), the version checks, and one integration run (Optuna; ray is left out: nothing in its integration
# depends on torch's version). torch-low runs those that need no transformers: no transformers release imports its
# models on torch 2.4 (5.9 declares torch>=2.4 but imports torch.distributed.tensor.device_mesh, new in 2.5; 5.24
# declares >=2.6), so the hf extra declares torch>=2.5 and the GPT-2 fixtures of the other tests cannot run there.
TORCH_TESTS="tests/test_compat.py tests/test_transparency.py tests/test_dispatch.py tests/test_seed_exactness.py"
TORCH_TESTS="$TORCH_TESTS tests/test_precision.py tests/test_oom.py tests/test_stages.py tests/test_stages_exactness.py"
TORCH_TESTS="$TORCH_TESTS tests/test_checkpoint.py tests/test_optuna.py tests/test_torch_range.py"
TORCH_TESTS="$TORCH_TESTS tests/test_torch_seed_compat.py"
TORCH_LOW="tests/test_compat.py tests/test_dispatch.py tests/test_seed_exactness.py tests/test_stages_exactness.py"
TORCH_LOW="$TORCH_LOW tests/test_torch_range.py tests/test_torch_seed_compat.py"
# name | torch | ray[tune] | optuna | transformers | tests ("wheel" in the name's cell: installed from the wheel first)
MATRIX="
high|2.13.0|2.60.0|5.0.0|5.24.0|$HIGH
low|2.13.0|2.41.0|3.1.1|5.9.0|$LOW
opt-edge|2.13.0|-|-|5.23.0|tests/test_stages_opt.py tests/test_compat.py
torch-top|2.14.1|-|5.0.0|5.24.0|$TORCH_TESTS
torch-low|2.4.0|-|-|-|$TORCH_LOW
"
WHEEL_CELL=${WHEEL_CELL:-high}
CELLS=${CELLS:-$(echo "$MATRIX" | cut -d'|' -f1 | xargs)}
mkdir -p "$DIR/logs"

install_torch() {   # version -> $DIR/torch-VERSION (once, shared by the cells of that version)
  local dir="$DIR/torch-$1"
  [ -f "$dir/.done" ] && return
  echo "== torch $1 (once, shared by the cells of that version)"
  rm -rf "$dir" && "$PY" -m pip install -q --target "$dir" $FIND_LINKS "torch==$1" && touch "$dir/.done"
}

build_wheel() {   # venv -> prints the wheel's path; built from a copy of the checkout (no build/ in it)
  local venv=$1 src="$DIR/wheel-src" out="$DIR/wheel"
  rm -rf "$src" "$out" && mkdir -p "$out" &&
  (cd "$ROOT" && git ls-files -co --exclude-standard | tar -cf - -T - 2>/dev/null) | (mkdir -p "$src" && tar -xf - -C "$src") &&
  "$venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$out" "$src" >&2 && ls "$out"/*.whl
}

run_cell() {   # name torch ray optuna transformers tests...
  local name=$1 torch=$2 ray=$3 optuna=$4 tf=$5; shift 5
  local venv="$DIR/venv-$name" log="$DIR/logs/$name.log" t0=$SECONDS wheel="" note="" torch_dir="$DIR/torch-$torch"
  local pkgs=(numpy filelock typing-extensions sympy networkx jinja2 fsspec pytest)
  [ "$tf" = - ] || pkgs+=("transformers==$tf")
  [ "$ray" = - ] || pkgs+=("ray[tune]==$ray")
  [ "$optuna" = - ] || pkgs+=("optuna==$optuna" cloudpickle pgserver psycopg2-binary)
  rm -rf "$venv"
  {
    install_torch "$torch" &&
    "$PY" -m venv "$venv" &&
    echo "$torch_dir" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch.pth" &&
    "$venv/bin/pip" install -q "setuptools>=77" wheel &&
    if [ "$name" = "$WHEEL_CELL" ]; then   # the cell's venv is the fresh one the wheel is checked in
      wheel=$(build_wheel "$venv") && "$venv/bin/pip" install -q "$wheel[all]" "${pkgs[@]}" &&
      "$venv/bin/python" "$ROOT/benchmarks/wheel_check.py"
    else
      "$venv/bin/pip" install -q "${pkgs[@]}"
    fi &&
    "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"   # the tests run against the checkout
  } > "$log" 2>&1 || { echo "$name|$torch|$ray|$optuna|$tf|install failed (see $log)|$((SECONDS - t0))" >> "$DIR/results"; return; }
  [ -n "$wheel" ] && note="wheel ok; "
  local installed=$((SECONDS - t0)) versions
  versions=$("$venv/bin/python" -c "import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return '-'
print(*map(version, ('torch', 'ray', 'optuna', 'transformers')))" 2>>"$log")
  echo "== $name: torch ray optuna transformers = $versions (installed in ${installed}s)" | tee -a "$log"
  (cd "$ROOT" && HYDRA_TUNE_TORCH_DIR="$torch_dir" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") >> "$log" 2>&1
  local summary
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^(=+ )?[0-9]+ error|no tests ran" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ in [0-9.:()]*s.*//')
  echo "$name|$torch|$ray|$optuna|$tf|${note}${summary:-no result (see $log)}|$installed + $((SECONDS - t0 - installed))" >> "$DIR/results"
  [ -n "${KEEP:-}" ] || rm -rf "$venv"
}

: > "$DIR/results"
for cell in $CELLS; do
  line=$(echo "$MATRIX" | grep "^$cell|") || { echo "compat: no cell named $cell" >&2; exit 2; }
  IFS='|' read -r name torch ray optuna tf tests <<< "$line"
  tests=${TESTS:-$tests}   # TESTS="tests/test_x.py ..." runs those instead
  echo "== cell $name: torch==$torch ray[tune]==$ray optuna==$optuna transformers==$tf ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  run_cell "$name" "$torch" "$ray" "$optuna" "$tf" $tests
done

{
  echo "| cell | torch | ray[tune] | optuna | transformers | tests | seconds (install + tests) |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
  while IFS='|' read -r name torch ray optuna tf result secs; do
    echo "| $name | $torch | $ray | $optuna | $tf | $result | $secs |"
  done < "$DIR/results"
} | tee "$DIR/matrix.md"
! grep -qE "failed|error|install failed|no result" "$DIR/results"
