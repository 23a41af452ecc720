"""A node server is named by hydra_tune's code too: a process whose package differs from a lingering server's
(upgraded, reinstalled, edited) gets a server of its own, never the old code's."""
from __future__ import annotations

import os
import shutil

from hydra_tune import node
from hydra_tune.node import files

CFG = dict(devices=["cpu"], device_memory="64MiB")


def _copy_of_the_package(tmp_path) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(files.__file__)))
    copy = str(tmp_path / "hydra_tune")
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_identity_follows_the_source_files(tmp_path):
    copy = _copy_of_the_package(tmp_path)
    before = files.code_identity(copy)
    assert files.code_identity(copy) == before  # nothing changed: the same name
    runtime = os.path.join(copy, "runtime", "runtime.py")
    with open(runtime, "a") as f:
        f.write("\n# an edit\n")
    edited = files.code_identity(copy)
    assert edited != before
    os.utime(runtime, ns=(1, 1))  # the same size, touched: another install of it
    assert files.code_identity(copy) not in (before, edited)
    os.remove(os.path.join(copy, "node", "wire.py"))
    assert files.code_identity(copy) not in (before, edited)


def test_a_server_for_other_code_has_other_files(monkeypatch):
    ours = node.server_files(**CFG)
    assert files.code_identity() in files._CODE  # computed once, kept for the process
    monkeypatch.setattr(files, "_CODE", ["0123456789abcdef"])  # as if the package changed since that server began
    other = node.server_files(**CFG)
    assert other["key"] != ours["key"] and other["socket"] != ours["socket"] and other["log"] != ours["log"]
    assert other["authkey"] == ours["authkey"] and other["config"] == ours["config"]
