"""Files on disk: what hydra_tune writes is private (0700 directory, 0600 files) and goes away when its owner ends;
nothing is unpickled from a file or a peer another user could control (README "Files on disk")."""
from __future__ import annotations

import ast
import os
import pathlib
import pickle
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import process_alive

import hydra_tune as ht
from hydra_tune import node
from hydra_tune.training import checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Touch:
    """Unpickling this creates ``path``: proof that something unpickled it."""

    def __init__(self, path: os.PathLike) -> None:
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def _mlp_task(**kw) -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                        loss=lambda o, b: F.mse_loss(o, b[1]), **kw)


def _private(path: str, mode: int | None) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o077 and (mode is None or stat.S_IMODE(st.st_mode) == mode)


def _frame(sock: socket.socket) -> bytes:
    """One multiprocessing.connection message: 4-byte big-endian length, then the bytes."""
    head = sock.recv(4, socket.MSG_WAITALL)
    return sock.recv(struct.unpack("!i", head)[0], socket.MSG_WAITALL) if len(head) == 4 else b""


def test_node_server_files_are_private_never_unpickle_strangers_and_go_with_the_server(monkeypatch):
    base = tempfile.mkdtemp(prefix="hth", dir="/tmp")  # short: AF_UNIX paths are limited to 107 bytes
    home = os.path.join(base, "n")                     # made by hydra_tune
    monkeypatch.setenv("HYDRA_TUNE_NODE_DIR", home)
    monkeypatch.setenv("HYDRA_TUNE_NODE_LINGER", "1")
    marker = pathlib.Path(base, "unpickled")
    cfg = dict(devices=["cpu"], device_memory=1 << 20)
    pid = None
    try:
        with node.connect(**cfg) as rt:
            pid, files = rt.pid, node.server_files(**cfg)
            assert rt.submit(_mlp_task(name="t")).result(timeout=60)["epoch"] == 1
            assert _private(home, 0o700) and stat.S_ISDIR(os.lstat(home).st_mode)
            for name in ("authkey", "lock", "log"):
                assert _private(files[name], 0o600), name
            assert stat.S_ISSOCK(os.lstat(files["socket"]).st_mode) and _private(files["socket"], None)
            # A peer without the authkey: its bytes are compared with the expected HMAC, never unpickled.
            evil = pickle.dumps(_Touch(marker))
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(files["socket"])
                assert _frame(s).startswith(b"#CHALLENGE#")
                s.sendall(struct.pack("!i", len(evil)) + evil)     # as the answer to the challenge
                assert _frame(s) == b"#FAILURE#"
                with pytest.raises(OSError):                       # and as a request: the server hung up
                    for _ in range(50):
                        s.sendall(struct.pack("!i", len(evil)) + evil)
                        time.sleep(0.01)
            assert rt.stats()["server"]["pid"] == pid               # still serving its clients
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:       # idle: it exits after its linger
            time.sleep(0.05)
        assert not process_alive(pid)
        assert not marker.exists(), "the node server unpickled bytes from an unauthenticated peer"
        # Gone with the server: its socket and log. Kept by design: the authkey (the user's key for every server
        # and client) and the lock file (an flock rendezvous; unlinking it would let two starters both proceed).
        assert sorted(os.listdir(home)) == sorted(["authkey", os.path.basename(files["lock"])])
    finally:
        if pid is not None and process_alive(pid):
            os.kill(pid, signal.SIGTERM)
        shutil.rmtree(base, ignore_errors=True)


def test_a_checkpoint_holding_a_pickled_object_is_refused_not_run(tmp_path):
    marker, path = tmp_path / "unpickled", tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "model": {}, "extra": _Touch(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load(path)
    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(pickle.UnpicklingError):
        rt.submit(_mlp_task(resume_from=str(path)))
    assert not marker.exists()


_LOADERS = {"pickle", "cloudpickle", "dill", "torch", "joblib", "marshal", "numpy", "np"}
# Every place hydra_tune turns bytes into objects, and why no other user can have written those bytes. A new one
# fails this test until it is added here with its reason (and the README's "Files on disk" says the same).
# torch.load is weights_only everywhere but in shipping.py: node frames and Tune trainables carry functions by value.
_FRAMES = {"hydra_tune/shipping.py"}
_KNOWN = {
    "hydra_tune/training/checkpoint.py": (1, "torch.load(weights_only=True): tensors and plain data only"),
    "hydra_tune/node/client.py": (1, "frames of the node server's connection (messages), after the mutual HMAC "
                                    "handshake"),
    "hydra_tune/shipping.py": (2, "a task, a trained model or a snapshot in a frame of the node connection, after the "
                                 "HMAC handshake, or a Tune trainable in a Ray actor call: torch's format holding "
                                 "cloudpickle's graph (functions by value, so torch.load(weights_only=False)), or a "
                                 "plain cloudpickle blob"),
    "hydra_tune/node/wire.py": (2, "an error in a frame of the node connection (above/below); the server's own error"),
    "hydra_tune/node/connections.py": (1, "frames of a client's connection after the HMAC handshake"),
    "integrations/_tune_proxy.py": (1, "a failed trial's exception: a Ray actor call (Ray's own transport)"),
}


def test_every_unpickling_site_is_known_and_torch_load_is_weights_only():
    found: dict[str, int] = {}
    for path in sorted([*ROOT.glob("hydra_tune/**/*.py"), *ROOT.glob("integrations/**/*.py")]):
        rel = str(path.relative_to(ROOT))
        for call in ast.walk(ast.parse(path.read_text())):
            f = getattr(call, "func", None)
            if not (isinstance(call, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id in _LOADERS and f.attr in ("load", "loads", "Unpickler")):
                continue
            found[rel] = found.get(rel, 0) + 1
            if f.value.id == "torch" and rel not in _FRAMES:
                weights_only = [k.value for k in call.keywords if k.arg == "weights_only"]
                assert weights_only and getattr(weights_only[0], "value", None) is True, f"{rel}:{call.lineno}"
    assert found == {k: n for k, (n, _) in _KNOWN.items()}, "review the new unpickling site and add it to _KNOWN"


_TRAIN = """
import torch, hydra_tune as ht
from hydra_tune.errors import TaskCancelled
from test_hygiene import _mlp_task
torch.set_num_threads(1)
with ht.Runtime(devices=["cpu", "cpu"], device_memory=30_000) as rt:
    done = rt.submit(_mlp_task(epochs=2, name="done"))
    cut = rt.submit(_mlp_task(epochs=500, name="cut"))
    done.result(60)
    try:
        for m in cut.metrics():
            cut.cancel()
    except TaskCancelled:
        pass
    rt.trace(); rt.stats()
"""


def test_training_and_cancelling_writes_no_file(tmp_path):
    """The runtime keeps everything in memory: training, cancelling and closing leave the working directory, the
    temporary directory and the home directory as they were (files appear only where the user asks: checkpoints,
    traces; and the node server's, tested above)."""
    dirs = {name: tmp_path / name for name in ("cwd", "tmp", "home", "node")}
    for d in dirs.values():
        d.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path]),
           "TMPDIR": str(dirs["tmp"]), "HOME": str(dirs["home"]), "HYDRA_TUNE_NODE_DIR": str(dirs["node"]),
           # torch's own: importing torch._dynamo (torch.optim's optimizers do, in a plain loop too) makes inductor's
           # cache directory, under TMPDIR unless this is set; a parent that imported it first had set it for us
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache")}
    proc = subprocess.run([sys.executable, "-c", _TRAIN], cwd=dirs["cwd"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {name: sorted(os.listdir(d)) for name, d in dirs.items()} == {name: [] for name in dirs}
