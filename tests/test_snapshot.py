"""``TaskHandle.model()`` is the trained model of an ended task only (it raises at once on a running one), and
``TaskHandle.snapshot()`` is a copy of the model as of a step boundary equal to the plain loop's model after as
many optimizer steps (max abs diff 0.0)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.training.boundary import Boundary, BoundaryRequests, take_snapshot
from hydra_tune.training.state import TaskState

NOT_ENDED = "the task has ended: model\\(\\) returns the trained model must hold"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.2), nn.ReLU(), nn.Linear(64, 64), nn.Dropout(0.1),
                         nn.ReLU(), nn.Linear(64, 4))


def _batches(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _slow_mse(out, batch):
    time.sleep(0.004)  # a task that trains a while: the caller acts while it runs
    return F.mse_loss(out, batch[1])


def _mlp_task(**kw) -> ht.ModelTask:
    kw = {"epochs": 3, "seed": 3, "grad_accumulation": 2, "name": "mlp", "loss": _slow_mse, **kw}
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _batches(11),
                        **kw)


def _in_thread(fn, seconds: float = 60.0):
    """Run ``fn`` in a thread: ("returned", value) or ("raised", error); fails (never hangs) past ``seconds``."""
    out: list = []

    def run() -> None:
        try:
            out.append(("returned", fn()))
        except BaseException as exc:  # noqa: BLE001
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still blocked after {seconds} s"
    return out[0]


def test_model_of_a_running_task_raises_at_once_inside_the_metrics_loop():
    task = _mlp_task()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=61_000) as rt:
        h = rt.submit(task)
        assert len(rt.stats()["tasks"]["mlp"]["shards"]) >= 2
        for m in h.metrics():
            if m["epoch"] == 1:
                t0 = time.monotonic()
                how, value = _in_thread(h.model)   # before: blocked until the task ended, then the FINAL model
                assert how == "raised", f"model() inside the metrics loop returned {value!r}"
                assert time.monotonic() - t0 < 5 and isinstance(value, RuntimeError)
                assert "task='mlp', status='running'" in str(value) and "handle.snapshot()" in str(value)
                with pytest.raises(RuntimeError, match=NOT_ENDED):
                    h.model()
        model = h.model()  # ended: the trained model, as before
        assert model is h.model()
    assert max_param_diff(plain_train(task)[0], model) == 0.0


class _GatedAfterEpoch1:
    """The batches, except that once one pass went through them all (epoch 1; the sample batch taken at submit
    is one batch), the next pass waits until a snapshot was asked: the loop stays at epoch 1's end until then."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.passes = 0
        self.asked = threading.Event()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        if self.passes >= 1:
            assert self.asked.wait(60), "no snapshot was asked"
        return self._pass()

    def _pass(self):
        yield from self.batches
        self.passes += 1


def _gpt2_task(data, epochs: int) -> ht.ModelTask:
    return ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), data, epochs=epochs,
                        grad_clip_norm=1.0, seed=5, name="gpt2-snap")


def test_snapshot_in_the_train_loop_after_epoch_1_equals_the_plain_loop_after_epoch_1(monkeypatch):
    data = _GatedAfterEpoch1(lm_batches(4))
    asked = TaskState.request_snapshot

    def asking(self):
        req = asked(self)
        data.asked.set()
        return req

    monkeypatch.setattr(TaskState, "request_snapshot", asking)
    task = _gpt2_task(data, epochs=2)
    seen, snaps = [], []
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        for m in ht.train(task, runtime=rt):
            handle = ht.current_handle()
            seen.append(m)
            if m["epoch"] == 1:
                assert _in_thread(handle.model)[0] == "raised"
                snaps.append(handle.snapshot(timeout=60))
        final = ht.current_handle().model()   # after the loop: the trained model (README's Ray Tune pattern)
        assert len(rt.stats()["tasks"]["gpt2-snap"]["shards"]) >= 2
    snap = snaps[0]
    assert (snap.epoch, snap.steps, snap.epoch_end) == (1, seen[0]["steps"], True)
    plain_epoch1, _ = plain_train(_gpt2_task(lm_batches(4), epochs=1))
    assert max_param_diff(plain_epoch1, snap.model) == 0.0
    assert max_param_diff(plain_train(_gpt2_task(lm_batches(4), epochs=2))[0], final) == 0.0
    assert max_param_diff(plain_epoch1, final) > 0   # epoch 2 trained on: the snapshot is not the final model
    # the evaluation a user does on it equals evaluating the plain loop's model at that step
    plain_epoch1.eval(), snap.model.eval()
    batch = lm_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(plain_epoch1(**batch).loss, snap.model(**batch).loss)


def test_snapshots_at_any_moment_equal_the_plain_loop_after_as_many_steps():
    task = _mlp_task()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=61_000) as rt:
        h = rt.submit(task)
        assert len(rt.stats()["tasks"]["mlp"]["shards"]) >= 2
        snaps = [h.snapshot(timeout=60)]              # its first step boundary
        for m in h.metrics():
            snaps.append(h.snapshot(timeout=60))     # the epoch's end, or a step or more past it
            assert snaps[-1].steps >= m["steps"] and snaps[-1].epoch >= m["epoch"]
        final = h.model()
    assert [s.steps for s in snaps] == sorted(s.steps for s in snaps) and snaps[0].steps >= 1
    for snap in snaps:
        assert not any(p.data_ptr() == q.data_ptr() for p in snap.model.parameters() for q in final.parameters())
        plain, _ = plain_train(_mlp_task(max_steps=snap.steps))
        assert max_param_diff(plain, snap.model) == 0.0, (snap.epoch, snap.steps)
    with torch.no_grad():  # the caller owns the copy: changing it leaves the task's model alone
        for p in snaps[-1].model.parameters():
            p.add_(1.0)
    assert max_param_diff(plain_train(task)[0], final) == 0.0


def test_snapshot_of_a_done_task_is_a_copy_of_its_final_model():
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(_mlp_task(epochs=2))
        last = h.result()
        snap = h.snapshot()
        assert snap.model is not h.model() and max_param_diff(snap.model, h.model()) == 0.0
        assert (snap.epoch, snap.steps, snap.epoch_end) == (2, last["steps"], True)


def _failing_loss(out, batch):
    if out.shape[0] == 5:   # the third batch (the sample batch measured at submit is the first)
        raise ValueError("boom in user loss")
    return F.mse_loss(out, batch[1])


def test_model_and_snapshot_of_failed_and_cancelled_tasks_raise():
    data = _batches(4)
    data[2] = (data[2][0][:5], data[2][1][:5])
    with ht.Runtime(devices=["cpu"]) as rt:
        bad = rt.submit(ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), data,
                                     loss=_failing_loss, name="bad"))
        with pytest.raises(ValueError, match="boom in user loss"):
            bad.result(timeout=60)
        with pytest.raises(ValueError, match="boom in user loss"):
            bad.model()                                   # its own error, as result()
        with pytest.raises(RuntimeError, match="snapshot\\(\\) copies its model must hold") as err:
            bad.snapshot()
        assert "status='failed'" in str(err.value) and isinstance(err.value.__cause__, ValueError)
        h = rt.submit(_mlp_task(name="victim", epochs=50))
        h.snapshot(timeout=60)   # it runs
        h.cancel()
        with pytest.raises(ht.TaskCancelled):
            h.result(timeout=60)
        with pytest.raises(ht.TaskCancelled):
            h.model()
        with pytest.raises(RuntimeError, match="status='cancelled'"):
            h.snapshot()


def test_requests_are_served_at_the_boundary_they_stand_at_and_never_wait_for_one_that_will_not_come():
    model = _mlp()
    state = type("S", (), {"model": model})()   # serving a snapshot reads only the model
    req = BoundaryRequests("t")
    first = req.ask_snapshot()
    req.reach(state, Boundary(None, 1, 4, False))          # asked before: served at the boundary
    assert first.wait(0).steps == 4
    standing = req.ask_snapshot()                         # asked while it stands there: served before it leaves
    req.leave(state)
    assert standing.wait(0).steps == 4
    later = req.ask_snapshot()                            # asked after it left: waits for the next boundary
    with pytest.raises(TimeoutError, match="no step boundary within 0.01 s for snapshot"):
        later.wait(0.01)
    late_ck = req.ask_checkpoint("/nonexistent/never.pt")
    req.finish(model, Boundary(None, 3, 12, True))         # the loop is through: snapshots get the final model
    assert (later.wait(0).steps, req.ask_snapshot().wait(0).epoch_end) == (12, True)
    with pytest.raises(RuntimeError, match="task 't' finished before a checkpoint could be taken"):
        late_ck.wait(0)
    req.end("done")                                        # the runtime lets it go: finished snapshots stay
    assert req.ask_snapshot().wait(0).steps == 12
    failed = BoundaryRequests("f")
    waiting = failed.ask_snapshot()
    failed.end("failed")
    for r in (waiting, failed.ask_snapshot()):
        with pytest.raises(RuntimeError, match="task 'f' failed before a snapshot could be taken"):
            r.wait(0)


class _Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.lock = threading.Lock()   # copy.deepcopy cannot copy a lock


def test_a_model_that_does_not_deepcopy_fails_the_snapshot_with_a_rule_error():
    with pytest.raises(TypeError, match="the model copies with copy.deepcopy .* must hold, but got "
                                        "\\(model='_Locked'.*Fix: .*handle.checkpoint"):
        take_snapshot(_Locked(), Boundary(None, 1, 1, False))
    req = BoundaryRequests("t")
    bad = req.ask_snapshot()
    req.reach(type("S", (), {"model": _Locked()})(), Boundary(None, 1, 1, False))
    with pytest.raises(TypeError, match="copy.deepcopy"):
        bad.wait(0)


def test_waiting_on_the_task_from_inside_its_own_work_raises_instead_of_hanging(tmp_path):
    box: list = []   # the handle, once submitted (the loss also runs at submit, to measure the stages)
    seen: dict = {}

    def loss(out, batch):
        if box and not seen:
            h = box[0]
            calls = {"snapshot": lambda: h.snapshot(timeout=5), "result": h.result, "wait": h.wait,
                     "checkpoint": lambda: h.checkpoint(tmp_path / "ck.pt", timeout=5),
                     "metrics": lambda: next(h.metrics()), "watch": lambda: h.watch(0)}
            for what, call in calls.items():
                try:
                    seen[what] = call()
                except Exception as exc:  # noqa: BLE001
                    seen[what] = exc
            seen["poll"] = h.watch(0, timeout=0)   # a poll with a timeout cannot hang: allowed
        return F.mse_loss(out, batch[1])

    def run() -> None:
        task = _mlp_task(loss=loss, epochs=1, name="selfish")
        with ht.Runtime(devices=["cpu"]) as rt:
            box.append(rt.submit(task))
            box[0].result(timeout=60)
        assert max_param_diff(plain_train(_mlp_task(epochs=1))[0], box[0].model()) == 0.0

    assert _in_thread(run, 120)[0] == "returned"   # before: result() in the loss waited for the loss forever
    assert seen["poll"].status == "running"
    for what in ("snapshot", "result", "wait", "checkpoint", "metrics", "watch"):
        err = seen[what]
        assert isinstance(err, RuntimeError) and "is called outside the task's own work must hold" in str(err), \
            (what, err)
        assert "task='selfish', status='running'" in str(err) and "Fix: call it from the thread" in str(err)
    assert not (tmp_path / "ck.pt").exists()


def test_snapshot_and_model_of_a_task_waiting_for_host_memory_raise_at_once():
    gate = threading.Event()

    def held_sgd(m):   # the first task's steps wait for the gate: the second waits for host memory meanwhile
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        if not any(p.is_meta for p in m.parameters()):   # the footprint estimate steps it on the meta device
            opt.register_step_pre_hook(lambda o, args, kwargs: None if gate.wait(60) else None)
        return opt

    tasks = [_mlp_task(name="first", epochs=1), _mlp_task(name="second", epochs=1)]
    tasks[0].optimizer = held_sgd
    with ht.Runtime(devices=["cpu"]) as probe:
        one = probe.footprint(tasks[1]).total
    with ht.Runtime(devices=["cpu"], host_memory=one + one // 2) as rt:
        first, second = [rt.submit(t) for t in tasks]
        assert list(rt.host_memory()["waiting"]) == ["second"]
        with pytest.raises(RuntimeError, match="the task is built: snapshot\\(\\) copies its model must hold, but "
                                               "got \\(task='second', status='queued', waiting_for='host memory'"):
            second.snapshot(timeout=60)
        with pytest.raises(RuntimeError, match=NOT_ENDED + ", but got \\(task='second', status='queued'"):
            second.model()
        gate.set()
        second.result(timeout=60)
        assert second.snapshot().steps == second.result()["steps"]
