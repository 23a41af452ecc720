"""Check an installed hydra_tune wheel from outside the checkout: the package, its integrations and the examples.

    /path/to/venv/bin/python benchmarks/wheel_check.py      # exit 0 and "wheel ok" when all works

Run with the python of a venv that has the wheel installed (``pip install 'hydra_tune-*.whl[all]'``), never the
editable checkout: it asserts that ``hydra_tune`` comes from that venv's site-packages. Used by
benchmarks/compat.sh (cell high, on the cell's own fresh venv) and tests/test_wheel.py (a venv of its own).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
CHECK = """
import hydra_tune, sys
assert hydra_tune.__file__.startswith(sys.prefix), hydra_tune.__file__   # the wheel's copy, not the checkout
print(hydra_tune.HydraExecutor.__module__, hydra_tune.optuna_study.__module__)
import hydra_tune.integrations, hydra_tune.node, hydra_tune.sim, hydra_tune.stages.compat, hydra_tune.runtime.progress
"""
MODULES = ["hydra_tune.integrations.ray_tune", "hydra_tune.integrations.optuna"]
SCRIPTS = ("demo_gpt2.py", "tune_gpt2.py", "optuna_gpt2.py", "minilm_classify.py")


def check(python: str = sys.executable) -> list[str]:
    """What fails, in words (empty: all works), running ``python`` in a folder outside the checkout."""
    problems = []
    with tempfile.TemporaryDirectory() as elsewhere:   # not the checkout: only the installed wheel can be imported
        out = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd=elsewhere, timeout=300)
        if out.returncode != 0 or out.stdout.split() != MODULES:
            problems.append(f"import: {out.stdout.strip()} {out.stderr[-2000:]}")
        for example in SCRIPTS:
            ran = subprocess.run([python, os.path.join(EXAMPLES, example), "--help"], capture_output=True, text=True,
                                 cwd=elsewhere, timeout=300)
            if ran.returncode != 0 or "usage:" not in ran.stdout:
                problems.append(f"{example} --help: {ran.stderr[-2000:]}")
    return problems


if __name__ == "__main__":
    found = check()
    print("\n".join(found) if found else "wheel ok")
    sys.exit(1 if found else 0)
