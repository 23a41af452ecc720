"""Checkpoints served at particular step boundaries resume to exactly the uninterrupted task: the one at the step
that reaches ``max_steps`` (no extra step, the same last epoch's metrics), and one taken after a minibatch was
skipped for a non-finite loss (the epoch's ``skipped_batches`` counts it)."""
from __future__ import annotations

import math
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.training import checkpoint
from hydra_tune.training.state import TaskState


def _batches(n: int, seed: int, nan_at: int | None = None) -> list:
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][1][0, 0] = math.nan   # that minibatch's loss is NaN in every epoch
    return out


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _task(loss=_mse, **kw) -> ht.ModelTask:
    kw = {"eval_data": _batches(3, 7), "epochs": 3, "max_steps": 6, "seed": 8, "name": "last-step", **kw}
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        kw.pop("train_data", _batches(4, 0)), loss=loss, **kw)


def _no_seconds(ms: list) -> list:
    return [{k: v for k, v in m.items() if k not in ("seconds", "task")} for m in ms]


def _checkpoint_during(make, call: int, path, monkeypatch) -> str:
    """Checkpoint of ``make(loss)``'s task asked while its ``call``-th training minibatch runs (its loss waits for
    the request): written at the step boundary that follows that minibatch."""
    at_call, asked, calls = threading.Event(), threading.Event(), [0]
    submitter = threading.current_thread()   # measures the loss at submit: those calls are not training
    request = TaskState.request_checkpoint

    def asking(self, where):
        req = request(self, where)
        asked.set()
        return req

    def loss(out, batch):
        if out.requires_grad and threading.current_thread() is not submitter:   # training, not evaluation
            calls[0] += 1
            if calls[0] == call:
                at_call.set()
                assert asked.wait(60)
        return _mse(out, batch)

    monkeypatch.setattr(TaskState, "request_checkpoint", asking)
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(make(loss))
        assert at_call.wait(60)
        written = h.checkpoint(path, timeout=60)
        h.result(timeout=60)
    return written


def _resume(task: ht.ModelTask) -> tuple[list, nn.Module]:
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(task)
        metrics = list(h.metrics())
        return metrics, h.model()


def test_a_checkpoint_at_the_max_steps_boundary_resumes_without_an_extra_step(tmp_path, monkeypatch):
    path = _checkpoint_during(lambda loss: _task(loss), 6, tmp_path / "last.pt", monkeypatch)
    pos = checkpoint.load(path)["position"]
    assert (pos["epoch"], pos["batch_in_epoch"], pos["steps"]) == (2, 2, 6)   # max_steps=6, mid-epoch 2
    expected, whole = _resume(_task())
    metrics, model = _resume(_task(resume_from=path))   # before: trained a 7th step, and its metrics said so
    assert _no_seconds(metrics) == _no_seconds(expected[1:])
    assert max_param_diff(whole, model) == 0.0 and max_param_diff(plain_train(_task())[0], model) == 0.0


def test_a_checkpoint_after_a_skipped_minibatch_resumes_with_the_epochs_skip_count(tmp_path, monkeypatch):
    def task(loss=_mse, **kw) -> ht.ModelTask:
        return _task(loss, train_data=_batches(4, 0, nan_at=1), nonfinite_loss="skip_step", max_steps=None,
                     epochs=2, name="skips", **kw)

    path = _checkpoint_during(task, 3, tmp_path / "skip.pt", monkeypatch)   # minibatch 2 was skipped
    pos = checkpoint.load(path)["position"]
    assert (pos["epoch"], pos["batch_in_epoch"], pos["steps"], pos["skipped"]) == (1, 3, 2, 1)
    expected, whole = _resume(task())
    metrics, model = _resume(task(resume_from=path))
    assert [m["skipped_batches"] for m in expected] == [1, 1]
    assert _no_seconds(metrics) == _no_seconds(expected)   # before: epoch 1 said skipped_batches=0
    assert max_param_diff(whole, model) == 0.0 and max_param_diff(plain_train(task())[0], model) == 0.0
