"""The wheel: built from a copy of the checkout, it holds every package of the source tree (integrations/ as
hydra_tune.integrations) with all their modules, and nothing else (no tests, benchmarks or examples); its metadata
declares the tested ranges. Installing it into a fresh venv with its extras is slow (the extras' downloads): that
check runs where HYDRA_TUNE_WHEEL_VENV=1 is set and is skipped otherwise; benchmarks/compat.sh's cell high runs the
same check (benchmarks/wheel_check.py) on its own fresh venv, where it installs the wheel with [all].
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from hydra_tune.integrations import _versions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import wheel_check  # noqa: E402  (benchmarks/wheel_check.py: what compat.sh's cell high runs on its own venv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel built (no build isolation: this venv's setuptools, nothing downloaded) from a copy of the checkout,
    so the checkout itself gets no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src") / "hydra_tune_src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    done = subprocess.run(cmd[:4] + ["--no-build-isolation"] + cmd[4:], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:   # this venv's setuptools cannot build it (e.g. no bdist_wheel): pip's own build env
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (name,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return str(out / name)


def _source_modules() -> set[str]:
    """Every .py file the installed package must hold, by its path inside the wheel."""
    want = set()
    for top, prefix in (("hydra_tune", "hydra_tune"), ("integrations", "hydra_tune/integrations")):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(folder, os.path.join(ROOT, top))
            for f in files:
                if f.endswith(".py"):
                    want.add("/".join(p for p in (prefix, "" if rel == "." else rel, f) if p))
    return want


def test_wheel_holds_every_module_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    py = {n for n in names if n.endswith(".py")}
    want = _source_modules()
    assert want - py == set(), f"missing from the wheel: {sorted(want - py)}"
    assert py - want == set(), f"in the wheel but not in the source packages: {sorted(py - want)}"
    packages = {n.rsplit("/", 1)[0] for n in want if n.endswith("/__init__.py")}
    assert {"hydra_tune/integrations", "hydra_tune/node", "hydra_tune/stages", "hydra_tune/runtime"} <= packages
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"hydra_tune", os.path.basename(wheel).split("-")[0] + "-0.1.0.dist-info"}, tops
    for folder in ("tests", "benchmarks", "examples", "integrations"):
        assert not [n for n in names if n.startswith(folder + "/")], folder


def test_wheel_metadata_declares_the_tested_ranges(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    ray_low, ray_high = _versions.SUPPORTED["ray"]
    assert any(r.startswith("ray[tune]") and f">={ray_low[0]}.{ray_low[1]}" in r and f"<{ray_high[0]}.{ray_high[1]}"
               in r and 'extra == "ray"' in r for r in requires), requires
    assert any(r.startswith("optuna") and 'extra == "optuna"' in r for r in requires), requires
    assert any(r.startswith("pgserver") and 'extra == "postgres"' in r for r in requires), requires
    assert "Provides-Extra: all" in meta and "Provides-Extra: postgres" in meta


@pytest.mark.skipif(os.environ.get("HYDRA_TUNE_WHEEL_VENV") != "1",
                    reason="slow: installs the wheel with [all] into a fresh venv; run with HYDRA_TUNE_WHEEL_VENV=1 "
                           "(benchmarks/compat.sh's cell high checks its own venv's wheel install)")
def test_wheel_installs_into_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    torch_dir = os.environ.get("HYDRA_TUNE_TORCH_DIR")   # compat.sh's shared CPU torch (no multi-GB download)
    if torch_dir:
        purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, "torch.pth"), "w") as f:
            f.write(torch_dir + "\n")
    done = subprocess.run([py, "-m", "pip", "install", "-q", f"{wheel}[all]"], capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert wheel_check.check(py) == []   # the package, its integrations and the examples' --help, from elsewhere
