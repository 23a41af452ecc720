"""Checkpoints on a full file system or an unwritable directory: the request fails with an error naming the path
(and, when full, the bytes needed), the previous checkpoint at that path stays whole, and the task and the runtime
go on (the task ends bit-identical to the plain loop). The file systems are real: a small tmpfs, and one remounted
read-only (both need mount rights: skipped, with the reason, without them); a chmod-ed directory where permissions
are enforced (not for root)."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.training.checkpoint import load
from hydra_tune.training.write_errors import CheckpointNotWritten

from reference import max_param_diff, plain_train


def _slow_mse(out, batch):
    time.sleep(0.004)  # the task stays running while the test checkpoints it twice
    return F.mse_loss(out, batch[1])


def _task() -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(30)]
    return ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                                    torch.nn.Linear(256, 4)),
                        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), data, loss=_slow_mse, epochs=3,
                        seed=3, name="ck")


@contextlib.contextmanager
def _tmpfs(where: str, size: int) -> Iterator[str]:
    """A tmpfs of ``size`` bytes mounted at ``where`` (skips the test, saying why, where mounting is not allowed)."""
    os.makedirs(where, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs mount rights): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _finishes_exactly(rt: ht.Runtime, h) -> None:
    h.result(timeout=300)
    assert h.status == "done"
    expected, _ = plain_train(_task())
    assert max_param_diff(h.model(), expected) == 0.0
    other = rt.submit(_task())  # the runtime still runs tasks (the name is free again)
    other.result(timeout=300)  # the runtime still runs tasks
    assert other.status == "done"


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a short path: the message quotes the checkpoint path in full only up to 80 characters, and
    pytest's tmp_path under xdist (.../popen-gw0/test_...) is longer."""
    where = tempfile.mkdtemp(prefix="htdf", dir="/tmp")
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_full_file_system_fails_the_checkpoint_keeps_the_previous_one_and_the_task_goes_on(tmp_path, short_dir):
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(_task())
        size = os.path.getsize(h.checkpoint(tmp_path / "probe.pt", timeout=60))
        # room for one checkpoint, not for the new one's temp file beside it
        with _tmpfs(os.path.join(short_dir, "small"), (size * 3 // 2 + 4095) // 4096 * 4096) as small:
            path = os.path.join(small, "ck.pt")
            assert h.checkpoint(path, timeout=60) == path
            before = _digest(path)
            with pytest.raises(CheckpointNotWritten) as info:
                h.checkpoint(path, timeout=60)
            msg = str(info.value)
            assert info.value.errno in (errno.ENOSPC, errno.EFBIG) and isinstance(info.value, OSError)
            assert "the checkpoint's file system has room for it must hold" in msg and repr(path) in msg
            needed = int(re.search(r"bytes_needed=(\d+)", msg).group(1))
            assert abs(needed - size) < 4096, (needed, size)  # the same model and optimizer: about the same bytes
            assert "No space left on device" in msg and "Fix: free space there" in msg
            assert _digest(path) == before and load(path)["model"]  # whole, loadable
            assert sorted(os.listdir(small)) == ["ck.pt"]  # the temp file is gone
            assert h.status == "running"
        _finishes_exactly(rt, h)


def test_read_only_file_system_fails_the_checkpoint_and_the_task_goes_on(short_dir):
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(_task())
        with _tmpfs(os.path.join(short_dir, "ro"), 16 << 20) as where:
            path = os.path.join(where, "ck.pt")
            h.checkpoint(path, timeout=60)
            before = _digest(path)
            subprocess.run(["mount", "-o", "remount,ro", where], check=True)
            with pytest.raises(CheckpointNotWritten, match=r"the checkpoint's directory is writable by this process "
                               rf"must hold, but got \(path={re.escape(repr(path))}.*Read-only file system.*"
                               r"Fix: make it writable") as info:
                h.checkpoint(path, timeout=60)
            assert info.value.errno == errno.EROFS
            again = pickle.loads(pickle.dumps(info.value))   # how a node server's error reaches its client
            assert type(again) is CheckpointNotWritten and again.errno == errno.EROFS and str(again) == str(info.value)
            assert _digest(path) == before and h.status == "running"
        _finishes_exactly(rt, h)


def test_unwritable_directory_fails_the_checkpoint_and_the_task_goes_on(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: directory permissions are not enforced for root (the read-only file system "
                    "test covers an unwritable path)")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with ht.Runtime(devices=["cpu"]) as rt:
            h = rt.submit(_task())
            with pytest.raises(CheckpointNotWritten, match=r"directory is writable.*Permission denied"):
                h.checkpoint(locked / "ck.pt", timeout=60)
            assert h.status == "running"
            _finishes_exactly(rt, h)
    finally:
        locked.chmod(0o700)
