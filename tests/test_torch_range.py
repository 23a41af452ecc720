"""torch's supported range: the declared ``torch>=`` is the checked lower bound, and ``import hydra_tune`` with an
older torch fails at once with an ImportError naming the installed and the supported versions (not later, with an
AttributeError from some internal torch moved or lacked).

benchmarks/compat.sh's cells torch-top and torch-low run this file with the torch at each end of the range.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
import torch

from hydra_tune import _torch_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_declared_torch_is_the_checked_range():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert f"torch{_torch_version.spec()}" in deps


def test_hf_extra_declares_the_torch_transformers_imports_on():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    low = ".".join(map(str, _torch_version.HF_TORCH_MIN))
    assert f"torch>={low}" in extras["hf"] and f"torch>={low}" in extras["test"]


def test_installed_torch_is_supported():
    _torch_version.require_torch(torch.__version__)


@pytest.mark.parametrize("version, ok", [
    ("2.4.0", True), ("2.4.1+cu121", True), ("2.14.1", True), ("2.13.0+cpu", True), ("3.0.0", True),
    ("2.3.1", False), ("2.3.0+cpu", False), ("1.13.1", False), ("2.4.0a0+git1234", True)])
def test_supported_torch(version, ok):
    assert _torch_version.supported(version) is ok
    if ok:
        _torch_version.require_torch(version)
        return
    with pytest.raises(ImportError) as info:
        _torch_version.require_torch(version)
    text = str(info.value)
    assert f"torch='{version}'" in text and f"supported='{_torch_version.spec()}'" in text
    assert "Fix: pip install 'torch" in text


FAKE_OLD_TORCH = """
import torch
torch.__version__ = "2.3.1"
try:
    import hydra_tune
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    print("imported")
"""


def test_import_with_too_old_torch_names_installed_and_supported():
    """A fresh interpreter whose torch says 2.3.1: ``import hydra_tune`` refuses before using any torch internal."""
    out = subprocess.run([sys.executable, "-c", FAKE_OLD_TORCH], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip()
    assert line.startswith("ImportError ") and "torch='2.3.1'" in line, line
    assert "supported='>=2.4'" in line and "Fix: pip install 'torch>=2.4'" in line, line
