"""A ``hydra_tune.py`` (or ``hydra_tune/`` folder) in the working directory a node server is started from cannot
shadow the package inside the server; one on the server's ``PYTHONPATH`` stops its start, and ``connect`` raises
ImportError naming that file and the fix."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import node_sandbox
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune import node
from hydra_tune.node import boot

SHADOW = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nraise SystemExit('the shadow ran')\n"


@pytest.fixture()
def node_dir():
    with node_sandbox("hts", "1") as (_, pids):
        yield pids


def _task() -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), name="shadowed-cwd")


def _shadow(folder, kind: str, marker) -> str:
    if kind == "script":
        path = folder / "hydra_tune.py"
        path.write_text(SHADOW.format(marker=str(marker)))
        return str(path)
    (folder / "hydra_tune").mkdir()
    (folder / "hydra_tune" / "__init__.py").write_text(SHADOW.format(marker=str(marker)))
    return str(folder / "hydra_tune")


@pytest.mark.parametrize("kind", ["script", "folder"])
def test_a_hydra_tune_in_the_working_directory_does_not_reach_the_server(tmp_path, monkeypatch, node_dir, kind):
    cwd, marker = tmp_path / "work", tmp_path / "shadow-ran"
    cwd.mkdir()
    _shadow(cwd, kind, marker)
    monkeypatch.chdir(cwd)
    with node.connect(devices=["cpu"], device_memory=None) as rt:   # before: HydraError, the server ran the shadow
        node_dir.append(rt.pid)
        got = trained(rt.submit(_task()))
    assert not marker.exists()
    assert max_param_diff(plain_train(_task())[0], got) == 0.0


def test_a_hydra_tune_on_the_servers_path_is_named_with_the_fix(tmp_path, monkeypatch, node_dir):
    shadow_dir, marker = tmp_path / "libs", tmp_path / "shadow-ran"
    shadow_dir.mkdir()
    path = _shadow(shadow_dir, "script", marker)
    monkeypatch.setenv("PYTHONPATH", str(shadow_dir))
    with pytest.raises(ImportError) as err:   # before: HydraError with the log's tail ("the shadow ran")
        node.connect(devices=["cpu"], device_memory=None)
    msg = str(err.value)
    assert "`import hydra_tune` in the node server loads the client's package must hold" in msg
    assert f"loads={path!r}" in msg and f"Fix: rename or move {path}" in msg
    assert not marker.exists()   # checked before anything imports it


def test_check_package_accepts_this_package_only(tmp_path):
    assert boot.check_package(boot.package_dir()) is None
    assert "client_package=" in (boot.check_package(str(tmp_path)) or "")
    assert boot.shadowing_error("noise\n" + boot.ERROR_PREFIX + "the rule. Fix: x.\n").args == ("the rule. Fix: x.",)
