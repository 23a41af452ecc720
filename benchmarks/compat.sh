#!/usr/bin/env bash
# The version matrix: one fresh venv per combination at the ends of each supported range, the integration and
# family tests run in each, a markdown table at the end (also written to $COMPAT_DIR/matrix.md).
#
#   bash benchmarks/compat.sh    # every cell: 42 min measured on 2 cores shared with ~7 other jobs (4 cells then)
#   CELLS="high low" bash benchmarks/compat.sh
#   COMPAT_DIR=/tmp/ht-compat KEEP=1 bash benchmarks/compat.sh   # keep the venvs for a look afterwards
#   CELLS=low TESTS="tests/test_optuna.py" bash benchmarks/compat.sh
#
# Not part of `make test` (`make compat` runs it). torch is the one CPU build this machine has (torch==$TORCH from
# /opt/wheels where that folder exists): it is installed once, outside the venvs, and every venv sees it through a
# .pth file; the pip cache is reused for everything else. Each cell: name, ray, optuna, transformers, tests.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${COMPAT_DIR:-/tmp/hydra_tune_compat}
PY=${PY:-python3}
TORCH=${TORCH:-2.13.0}
FIND_LINKS=$([ -d /opt/wheels ] && echo "--find-links /opt/wheels")
STAGES="tests/test_stages.py tests/test_stages_exactness.py tests/test_stages_bert.py tests/test_stages_llama.py"
STAGES="$STAGES tests/test_stages_opt.py tests/test_compat.py"
ALL_TESTS="tests/test_ray_tune.py tests/test_optuna.py tests/test_optuna_processes.py tests/test_postgres.py $STAGES"
# name | ray[tune] | optuna | transformers | tests
# low: OPT stages are refused below transformers 5.23 (stages/compat.py FAMILY_MIN; test_compat.py checks the
# refusal there), so its OPT tests run in opt-edge, at 5.23. high also runs tests/test_wheel.py, whose fresh-venv
# install of the wheel with [all] takes its packages from the pip cache this cell just filled.
MATRIX="
high|2.60.0|5.0.0|5.24.0|$ALL_TESTS tests/test_wheel.py
low|2.41.0|3.1.1|5.9.0|${ALL_TESTS/tests\/test_stages_opt.py/}
opt-edge|2.60.0|5.0.0|5.23.0|tests/test_stages_opt.py tests/test_stages_llama.py tests/test_compat.py
"
CELLS=${CELLS:-$(echo "$MATRIX" | cut -d'|' -f1 | xargs)}
mkdir -p "$DIR/logs"

torch_dir="$DIR/torch-$TORCH"
if [ ! -f "$torch_dir/.done" ]; then
  echo "== torch $TORCH (once, shared by every cell)"
  "$PY" -m pip install -q --no-deps --target "$torch_dir" $FIND_LINKS "torch==$TORCH" && touch "$torch_dir/.done" \
    || { echo "compat: torch==$TORCH could not be installed" >&2; exit 1; }
fi

run_cell() {   # name ray optuna transformers tests...
  local name=$1 ray=$2 optuna=$3 tf=$4; shift 4
  local venv="$DIR/venv-$name" log="$DIR/logs/$name.log" t0=$SECONDS
  rm -rf "$venv"
  {
    "$PY" -m venv "$venv" &&
    echo "$torch_dir" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch.pth" &&
    "$venv/bin/pip" install -q "setuptools>=77" wheel numpy filelock typing-extensions sympy networkx jinja2 fsspec \
      pytest cloudpickle pgserver psycopg2-binary "ray[tune]==$ray" "optuna==$optuna" "transformers==$tf" &&
    "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"
  } > "$log" 2>&1 || { echo "$name|$ray|$optuna|$tf|install failed (see $log)|$((SECONDS - t0))" >> "$DIR/results"; return; }
  local versions
  versions=$("$venv/bin/python" -c "import torch, ray, optuna, transformers; print(torch.__version__, ray.__version__, optuna.__version__, transformers.__version__)" 2>>"$log")
  echo "== $name: torch ray optuna transformers = $versions" | tee -a "$log"
  (cd "$ROOT" && HYDRA_TUNE_WHEEL_VENV=1 HYDRA_TUNE_TORCH_DIR="$torch_dir" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") >> "$log" 2>&1
  local summary
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^(=+ )?[0-9]+ error|no tests ran" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ in [0-9.]*s.*//')
  echo "$name|$ray|$optuna|$tf|${summary:-no result (see $log)}|$((SECONDS - t0))" >> "$DIR/results"
  [ -n "${KEEP:-}" ] || rm -rf "$venv"
}

: > "$DIR/results"
for cell in $CELLS; do
  line=$(echo "$MATRIX" | grep "^$cell|") || { echo "compat: no cell named $cell" >&2; exit 2; }
  IFS='|' read -r name ray optuna tf tests <<< "$line"
  tests=${TESTS:-$tests}   # TESTS="tests/test_x.py ..." runs those instead
  echo "== cell $name: ray[tune]==$ray optuna==$optuna transformers==$tf torch==$TORCH"
  run_cell "$name" "$ray" "$optuna" "$tf" $tests
done

{
  echo "| cell | ray[tune] | optuna | transformers | torch | tests | seconds |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
  while IFS='|' read -r name ray optuna tf result secs; do
    echo "| $name | $ray | $optuna | $tf | $TORCH | $result | $secs |"
  done < "$DIR/results"
} | tee "$DIR/matrix.md"
! grep -qE "failed|error|install failed|no result" "$DIR/results"
