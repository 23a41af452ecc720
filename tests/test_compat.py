"""Version ranges: the declared extras equal the tested ranges, versions outside them are refused at import naming
the installed and supported versions, the transformers keyword renames (stages/compat.py) and Ray's session hook.

benchmarks/compat.sh runs this file in every cell of the version matrix, so the tests that read the installed
transformers check the real refusal on an old release (e.g. OPT on transformers 5.9) as well as on the newest.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
import torch

from hydra_tune.integrations import _versions
from hydra_tune.stages import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras() -> dict[str, list[str]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_declared_extras_are_the_tested_ranges():
    extras = _extras()
    assert f"ray[tune]{_versions.spec('ray')}" in extras["ray"]
    assert f"ray[tune]{_versions.spec('ray')}" in extras["test"]
    assert f"optuna{_versions.spec('optuna')}" in extras["optuna"]
    low = ".".join(map(str, compat.TRANSFORMERS_MIN))
    assert f"transformers>={low}" in extras["hf"]
    assert f"transformers>={low}" in extras["test"]


@pytest.mark.parametrize("name, version, ok", [
    ("ray", "2.41.0", True), ("ray", "2.60.0", True), ("ray", "2.40.0", False), ("ray", "2.61.0", False),
    ("ray", "3.0.0", False), ("optuna", "3.1.1", True), ("optuna", "5.0.0", True), ("optuna", "3.0.6", False),
    ("optuna", "4.0.0rc1", True), ("ray", "2.60.0+local", True)])
def test_supported_ranges(name, version, ok):
    assert _versions.supported(name, version) is ok
    if ok:
        _versions.require(name, version)
    else:
        with pytest.raises(ImportError) as info:
            _versions.require(name, version)
        text = str(info.value)
        assert version in text and _versions.spec(name) in text and "Fix: pip install" in text


CHECK_IMPORTS = """
import importlib, sys
for module, tool, version in (("ray_tune", "ray", "2.40.0"), ("optuna", "optuna", "3.0.6")):
    mod = importlib.import_module(tool)
    mod.__version__ = version
    try:
        importlib.import_module("hydra_tune.integrations." + module)
    except ImportError as exc:
        print(type(exc).__name__, exc)
    else:
        print("imported", module)
"""


def test_import_outside_the_range_names_installed_and_supported():
    """Each integration refuses at import, before it touches its tool's internals (a fresh interpreter)."""
    pytest.importorskip("ray")
    pytest.importorskip("optuna")
    out = subprocess.run([sys.executable, "-c", CHECK_IMPORTS], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    for line, (tool, version) in zip(lines, (("ray", "2.40.0"), ("optuna", "3.0.6"))):
        assert line.startswith("ImportError ") and f"{tool}='{version}'" in line, line
        assert f"supported='{_versions.spec(tool)}'" in line and "Fix: pip install" in line


def test_ray_session_hook_names_the_supported_range():
    """The runtime actor's message for a Ray that moved its session names the same range as the extras."""
    pytest.importorskip("ray")
    from hydra_tune.integrations import _tune_session

    assert f"'ray[tune]{_versions.spec('ray')}'" in _tune_session._moved("x")


def test_ray_session_hook_routes_and_detects_a_moved_session(monkeypatch):
    pytest.importorskip("ray")
    from ray.train._internal import session as module

    from hydra_tune.integrations import _tune_session

    router = _tune_session.ThreadRoutedSession()
    monkeypatch.setattr(module, "_session", None)
    _tune_session.route_sessions(router)
    assert module.get_session() is router   # what tune.report reads on this Ray
    monkeypatch.setattr(module, "get_session", lambda: None)   # a Ray that reads its session elsewhere
    with pytest.raises(RuntimeError, match=r"ray=.*Fix: install a supported Ray"):
        _tune_session.route_sessions(router)


def test_keywords_renamed_only_to_declared_parameters():
    def old(x, past_key_values=None, past_key_values_length=0, **kwargs):
        return past_key_values, past_key_values_length, kwargs

    def new(x, cache=None, cache_length=0, **kwargs):
        return cache, cache_length, kwargs

    def neither(x, **kwargs):
        return kwargs

    assert compat.call_renamed(old, 1, cache="c", cache_length=3, use_cache=True) == ("c", 3, {"use_cache": True})
    assert compat.call_renamed(new, 1, cache="c", cache_length=3) == ("c", 3, {})
    assert compat.call_renamed(neither, 1, cache="c") == {"cache": "c"}   # a **kwargs callee gets today's name


def test_keywords_renamed_for_module_forward():
    class Layer(torch.nn.Module):
        def forward(self, hidden, past_key_values=None):
            return hidden, past_key_values

    assert compat.call_renamed(Layer(), 1, cache="c") == (1, "c")


def test_keep_all_positions_keeps_every_position():
    pytest.importorskip("transformers")
    h = torch.randn(2, 5, 3)
    out = compat.keep_all_positions(h)
    assert out.shape == h.shape and torch.equal(out, h)


def _version(text: str) -> tuple[int, int]:
    return compat._version(text)


def test_family_refused_below_its_minimum(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "5.22.2")
    with pytest.raises(ValueError) as info:
        compat.check_family("opt")
    text = str(info.value)
    assert "transformers >= 5.23 for opt" in text and "transformers='5.22.2'" in text and "unsharded" in text
    compat.check_family("gpt2")   # 5.22 repeats GPT-2's forward
    monkeypatch.setattr(transformers, "__version__", "5.8.1")
    with pytest.raises(ValueError, match=r"transformers >= 5\.9 for gpt2 .*transformers='5\.8\.1'"):
        compat.check_family("gpt2")


def test_installed_transformers_cuts_or_refuses_opt_visibly():
    """On the installed release (every matrix cell): an OPT model is cut when the release is supported for OPT,
    else extract_stages raises the named refusal; never a silent cut."""
    transformers = pytest.importorskip("transformers")
    from transformers import OPTConfig, OPTForCausalLM

    from hydra_tune.stages import extract_stages

    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16))
    if _version(transformers.__version__) >= compat.FAMILY_MIN["opt"]:
        assert extract_stages(model).family == "opt"
    else:
        with pytest.raises(ValueError, match=f"transformers='{transformers.__version__}'"):
            extract_stages(model)
