"""Exact checkpoints: a task checkpointed mid-run and resumed (new runtime, new process) ends bit-identical to
the uninterrupted task; files are written atomically and read without unpickling arbitrary objects."""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, trained
from test_transparency import _adamw_two_groups, _Tokens, _warmup
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hydra_tune as ht
from hydra_tune.training import checkpoint


def _task(**kw) -> ht.ModelTask:
    loader = DataLoader(_Tokens(24, seed=3), batch_size=4, shuffle=True)  # 6 batches, reshuffled every epoch
    return ht.ModelTask(make_gpt2, functools.partial(_adamw_two_groups, lr=1e-3), loader, epochs=3, seed=21,
                        grad_clip_norm=1.0, grad_accumulation=2, lr_scheduler=_warmup, name="ckpt", **kw)


def test_resumed_task_ends_bit_identical(tmp_path):
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        whole = rt.submit(_task())
        expected, expected_metrics = trained(whole), list(whole.metrics())
    paths = []
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        first = rt.submit(_task())
        for i in range(2):  # two checkpoints at two different step boundaries
            paths.append(first.checkpoint(tmp_path / f"ckpt{i}.pt", timeout=60))
        first.cancel()
    for path in paths:
        data = checkpoint.load(path)
        pos = data["position"]
        with ht.Runtime(devices=["cpu"], device_memory="500KiB") as rt:  # another runtime, another plan
            resumed = rt.submit(_task(resume_from=path))
            model, metrics = trained(resumed), list(resumed.metrics())
        assert max_param_diff(expected, model) == 0.0, pos
        later = [m for m in expected_metrics if m["epoch"] >= pos["epoch"]]
        assert [(m["epoch"], m["train_loss"], m["steps"]) for m in metrics] == [
            (m["epoch"], m["train_loss"], m["steps"]) for m in later]


def _fp16_task(**kw) -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 2, generator=g))
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        DataLoader(ds, batch_size=8, shuffle=True), epochs=3, seed=4, precision="fp16",
                        loss=lambda out, b: F.mse_loss(out.float(), b[1]), name="child", **kw)


_CHILD = """
import sys, torch
torch.set_num_threads(1)   # as the test session runs (conftest)
from test_checkpoint import _fp16_task
import hydra_tune as ht
with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
    h = rt.submit(_fp16_task(resume_from=sys.argv[1]))
    h.result()
    torch.save(h.model().state_dict(), sys.argv[2])
"""


def test_resume_in_a_new_process(tmp_path):
    """Trained whole, and checkpointed then cancelled, in this process (each in a runtime of its own); resumed by a
    new process, it ends with the whole run's weights. One child process: an interpreter and `import torch` cost
    seconds on 2 busy cores, and only the resume needs to be elsewhere."""
    ckpt, resumed = tmp_path / "c.pt", tmp_path / "resumed.pt"
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        whole = trained(rt.submit(_fp16_task()))
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h = rt.submit(_fp16_task())
        h.checkpoint(ckpt, timeout=60)
        h.cancel()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), str(resumed)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])})
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = whole.state_dict(), torch.load(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert oct(os.stat(ckpt).st_mode & 0o777) == "0o600"  # private file


def test_a_checkpoint_at_an_epoch_start_resumes_bit_identical(tmp_path):
    """With more accumulation than batches per epoch the only step boundaries are epoch ends, so the checkpoint's
    position is the start of an epoch (nothing to step over): the resumed task draws on from its RNG state."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 2, generator=g))

    def task(**kw) -> ht.ModelTask:
        return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2)),
                            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                            DataLoader(data, batch_size=8, shuffle=True), loss=lambda o, b: F.mse_loss(o, b[1]),
                            epochs=5, seed=4, grad_accumulation=4, name="epoch-start", **kw)

    with ht.Runtime(devices=["cpu"]) as rt:
        expected = trained(rt.submit(task()))
        h = rt.submit(task())
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        h.cancel()
    pos = checkpoint.load(path)["position"]
    assert pos["batch_in_epoch"] == 0 and 2 <= pos["epoch"] <= 5, pos
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=8_000) as rt:  # another runtime and plan
        resumed = trained(rt.submit(task(resume_from=path)))
    assert max_param_diff(expected, resumed) == 0.0


_GPT2_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from test_checkpoint import _task
import hydra_tune as ht
with ht.Runtime(devices=["cpu"], device_memory="500KiB") as rt:  # another process, runtime and plan
    h = rt.submit(_task(resume_from=sys.argv[1]))
    metrics = list(h.metrics())
    model = h.model()
torch.save(model.state_dict(), sys.argv[2])
print(json.dumps([(m["epoch"], m["train_loss"], m["steps"]) for m in metrics]))
"""


def test_gpt2_checkpointed_mid_epoch_resumes_bit_identical_in_a_new_process(tmp_path):
    """GPT-2 with dropout, a shuffled DataLoader, clipping, accumulation and a schedule: checkpointed at a step in
    the middle of epoch 2 (its data order replayed after a reshuffle), resumed by a new process."""
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        whole = rt.submit(_task())
        expected, expected_metrics = trained(whole), list(whole.metrics())
        first = rt.submit(_task())
        next(m for m in first.metrics() if m["epoch"] == 1)
        # Two requests may share a boundary (asked while the task still stands at it): at most three reach mid-epoch
        for i in range(3):
            path = first.checkpoint(tmp_path / f"c{i}.pt", timeout=60)
            pos = checkpoint.load(path)["position"]
            if pos["batch_in_epoch"] > 0:
                break
        first.cancel()
    assert pos["epoch"] == 2 and 0 < pos["batch_in_epoch"] < 6, pos
    out = subprocess.run([sys.executable, "-c", _GPT2_CHILD, str(path), str(tmp_path / "resumed.pt")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])})
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.equal(v, resumed[k]) for k, v in expected.state_dict().items())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        [m["epoch"], m["train_loss"], m["steps"]] for m in expected_metrics if m["epoch"] >= 2]


_WRITER = """
import sys, torch
from hydra_tune.training import checkpoint
for i in range(10**6):
    checkpoint.save({"format": 1, "i": i, "blob": torch.full((int(sys.argv[2]),), float(i))}, sys.argv[1])
    print(i, flush=True)
"""


def test_sigkill_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    """A writer killed while a 32 MiB checkpoint is half written: the target is the previous checkpoint, whole and
    loadable; the torn temporary file is private and named after its writer; the next save removes it."""
    target, n = tmp_path / "c.pt", 1 << 23
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(n)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    killed_mid_write = False
    try:
        assert proc.stdout.readline().strip() == "0"  # one whole checkpoint is in place
        deadline = time.monotonic() + 60
        while not killed_mid_write and time.monotonic() < deadline:  # kill it while the next is under half written
            for p in tmp_path.iterdir():
                try:
                    if p.name.startswith(".hydra-ckpt-") and 0 < p.stat().st_size < 2 * n:
                        proc.kill()
                        killed_mid_write = True
                        break
                except FileNotFoundError:  # renamed into place meanwhile
                    pass
    finally:
        proc.kill()
        proc.wait()
    assert killed_mid_write and proc.returncode == -signal.SIGKILL
    data = checkpoint.load(target)
    assert data["blob"].numel() == n and torch.equal(data["blob"], torch.full((n,), float(data["i"])))
    left = [p for p in tmp_path.iterdir() if p != target]
    assert left and all(p.name.startswith(f".hydra-ckpt-{socket.gethostname()}-{proc.pid}-") for p in left)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in [target, *left])
    assert all(p.stat().st_size < target.stat().st_size for p in left)  # torn, and never the target
    live = tmp_path / f".hydra-ckpt-{socket.gethostname()}-{os.getpid()}-inflight"  # a running writer's
    live.write_bytes(b"")
    checkpoint.save({"format": 1, "i": -1}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name])


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    def torn(data, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"format": 1}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == []


def test_resuming_a_different_task_is_explained(tmp_path):
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h = rt.submit(_task())
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        h.cancel()
    no_scheduler = ht.ModelTask(make_gpt2, functools.partial(_adamw_two_groups, lr=1e-3), lm_batches(1), epochs=1,
                                resume_from=path)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        with pytest.raises(ValueError, match=r"has a scheduler exactly when the checkpointed one had"):
            rt.submit(no_scheduler)


def test_resume_hparams_task_applies_the_new_optimizer_settings(tmp_path):
    def task(lr: float, wd: float, name: str = "hp", **kw) -> ht.ModelTask:
        return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd),
                            lm_batches(4), epochs=2, seed=3, lr_scheduler=_warmup, name=name, **kw)

    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h = rt.submit(task(1e-3, 0.0))
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        h.cancel()
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        same = rt.submit(task(1e-3, 0.0, resume_from=path))
        new = rt.submit(task(2e-3, 0.1, "hp2", resume_from=path, resume_hparams="task"))
        kept, explored = same.result(), new.result()
    assert explored["lr"] == pytest.approx(2 * kept["lr"], rel=1e-12)   # same schedule position, doubled base
    with pytest.raises(ValueError, match="resume_hparams"):
        task(1e-3, 0.0, resume_from=path, resume_hparams="new")


def test_resume_from_an_epoch_start_position_is_exact(tmp_path):
    # One batch an epoch and grad_accumulation=2: a step only at each epoch's end, so every checkpoint is taken at
    # the next epoch's start (batch_in_epoch=0). Dropout draws from the RNG: the resumed epochs must not repeat it.
    def task(**kw) -> ht.ModelTask:
        return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(1),
                            epochs=4, grad_accumulation=2, seed=6, name="epoch-start", **kw)

    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        h = rt.submit(task())
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        h.cancel()
        try:   # it ends at its next unit boundary (or has finished): then its name is free again
            h.result(timeout=60)
        except ht.TaskCancelled:
            pass
        whole = rt.submit(task())
        expected, expected_metrics = trained(whole), list(whole.metrics())
    pos = checkpoint.load(path)["position"]
    assert (pos["epoch"], pos["batch_in_epoch"]) == (2, 0)
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        resumed = rt.submit(task(resume_from=path))
        model, metrics = trained(resumed), list(resumed.metrics())
    assert max_param_diff(expected, model) == 0.0
    assert [m["train_loss"] for m in metrics] == [m["train_loss"] for m in expected_metrics[1:]]


def test_a_checkpoint_asked_once_the_task_trains_no_more_fails_at_once(tmp_path):
    # The race behind a hang seen under load: save_checkpoint read the running task's state, the task then served
    # its last step and ended, and only then was the request added, to a list nobody would serve again.
    from hydra_tune.training.state import TaskState

    state = TaskState.build(_task(), None)
    state.abandon_checkpoints("finished")
    with pytest.raises(RuntimeError, match="task 'ckpt' finished before a checkpoint could be taken"):
        state.request_checkpoint(str(tmp_path / "late.pt")).wait(timeout=30)   # not a TimeoutError
    assert not (tmp_path / "late.pt").exists()
