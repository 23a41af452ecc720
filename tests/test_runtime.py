"""Runtime behaviour: budgets measured, errors early, cancellation and failures isolated, eval, buffers."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.errors import PlanError, TaskCancelled


def _data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_stage_bigger_than_budget_fails_at_submit_naming_it():
    task = ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters()), lm_batches(2))
    with ht.Runtime(devices=["cpu"], device_memory="300KiB") as rt:
        with pytest.raises(PlanError) as err:
            rt.submit(task)
        assert rt.stats()["tasks"] == {}
    msg = str(err.value)
    assert "stage 'h.0' (#1) alone needs" in msg and "device_memory=307200" in msg and "over by" in msg


def test_measured_peak_within_budget_and_device_memory_released():
    # enough work that the first task is still running when the last is submitted: both devices get some
    tasks = [ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters()), lm_batches(3, seed=i),
                          epochs=6, seed=i, name=f"t{i}") for i in range(3)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        for h in [rt.submit(t) for t in tasks]:
            h.result()
        stats = rt.stats()
    for d in stats["devices"]:
        assert 0 < d["peak_bytes"] <= d["budget"]
        assert d["current_bytes"] == 0
    for t in stats["tasks"].values():
        assert t["predicted_peak"] <= 600 * 1024 and t["state"] == "done"


def test_cancel_mid_epoch_frees_the_task_and_others_finish():
    refs: list = []
    started = threading.Event()

    def tracked_model():
        m = _mlp()
        refs.append(weakref.ref(m))
        return m

    def slow_loss(out, batch):
        started.set()
        time.sleep(0.01)
        return _mse(out, batch)

    victim = ht.ModelTask(tracked_model, _sgd, _data(200), loss=slow_loss, epochs=5, name="victim")
    other = ht.ModelTask(_mlp, _sgd, _data(4, seed=1), loss=_mse, epochs=2, seed=1, name="other")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=30_000) as rt:
        h = rt.submit(victim)
        h2 = rt.submit(other)
        assert started.wait(10)
        h.cancel()
        with pytest.raises(TaskCancelled):
            h.result(timeout=30)
        assert h.status == "cancelled" and rt.stats()["tasks"]["victim"]["state"] == "cancelled"
        h2.result(timeout=60)
        assert max_param_diff(plain_train(other)[0], h2.model()) == 0.0
        gc.collect()
        assert refs[0]() is None, "the cancelled task's model is still referenced"
        assert all(d["current_bytes"] == 0 for d in rt.stats()["devices"])


def test_closing_train_iterator_cancels():
    task = ht.ModelTask(_mlp, _sgd, _data(20), loss=_mse, epochs=50, name="closed-early")
    with ht.Runtime(devices=["cpu"]) as rt:
        it = ht.train(task, runtime=rt)
        first = next(it)
        assert first["epoch"] == 1
        it.close()
        deadline = time.time() + 30
        while rt.stats()["tasks"]["closed-early"]["state"] != "cancelled" and time.time() < deadline:
            time.sleep(0.01)
        assert rt.stats()["tasks"]["closed-early"]["state"] == "cancelled"


def test_failing_task_is_isolated():
    calls = {"n": 0}

    def flaky_loss(out, batch):
        calls["n"] += 1
        if calls["n"] > 3:  # the first calls are the profile pass and two training batches
            raise RuntimeError("boom in user loss")
        return _mse(out, batch)

    bad = ht.ModelTask(_mlp, _sgd, _data(10), loss=flaky_loss, epochs=3, name="bad")
    good = [ht.ModelTask(_mlp, _sgd, _data(6, seed=s), loss=_mse, epochs=2, seed=s, name=f"good{s}")
            for s in (1, 2)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=30_000) as rt:
        hb = rt.submit(bad)
        hg = [rt.submit(t) for t in good]
        with pytest.raises(RuntimeError, match="boom in user loss"):
            hb.result(timeout=60)
        for t, h in zip(good, hg):
            assert max_param_diff(plain_train(t)[0], trained(h)) == 0.0
        assert rt.stats()["tasks"]["bad"]["state"] == "failed"
        gc.collect()
        assert all(d["current_bytes"] == 0 for d in rt.stats()["devices"]), "the failed unit's memory is held"


def test_non_scalar_loss_fails_at_submit():
    task = ht.ModelTask(_mlp, _sgd, _data(2), loss=lambda out, b: (out - b[1]) ** 2)
    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(ValueError, match=r"scalar \(numel == 1\).*shape=\(8, 4\)"):
        rt.submit(task)


def test_dict_batch_for_sequential_fails_at_submit():
    task = ht.ModelTask(_mlp, _sgd, [{"x": torch.randn(2, 16)}], loss=_mse)
    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(TypeError, match=r"takes one input.*keys=\['x'\]"):
        rt.submit(task)


def test_model_without_parameters_fails_at_submit():
    task = ht.ModelTask(nn.ReLU, _sgd, _data(1), loss=_mse)
    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(ValueError, match="at least one parameter"):
        rt.submit(task)


def test_eval_loss_and_max_steps_match_plain():
    eval_data = lm_batches(2, seed=99)
    task = ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(4),
                        eval_data=eval_data, epochs=3, max_steps=6, seed=5, name="eval")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="600KiB") as rt:
        metrics = list(ht.train(task, runtime=rt))
        model = rt.stats()  # noqa: F841  (stats while done must not fail)
    assert [m["epoch"] for m in metrics] == [1, 2] and metrics[-1]["steps"] == 6
    ref, history = plain_train(task)
    assert [m["train_loss"] for m in metrics] == history
    ref.eval()
    with torch.no_grad():
        expected = sum(ref(**b).loss.item() for b in eval_data) / len(eval_data)
    assert metrics[-1]["eval_loss"] == pytest.approx(expected, abs=1e-6)
    assert {"epoch", "train_loss", "steps", "samples", "seconds", "eval_loss", "lr"} <= set(metrics[-1])


def test_batchnorm_buffers_match_plain_when_sharded():
    def bn_mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                             nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    task = ht.ModelTask(bn_mlp, _sgd, _data(4), loss=_mse, epochs=2, name="bn")
    with ht.Runtime(devices=["cpu"], device_memory=20_000) as rt:
        h = rt.submit(task)
        h.result()
        assert len(rt.stats()["tasks"]["bn"]["shards"]) >= 3
    ref, _ = plain_train(task)
    assert max_param_diff(ref, h.model()) == 0.0  # state_dict: running stats and num_batches_tracked included


def test_configure_sets_the_default_runtime_used_by_train():
    ht.configure(devices=["cpu", "cpu"], device_memory="1MiB")
    try:
        task = ht.ModelTask(_mlp, _sgd, _data(2), loss=_mse, name="via-default")
        assert [m["epoch"] for m in ht.train(task)] == [1]
        rt = ht.default_runtime()
        assert [d["budget"] for d in rt.stats()["devices"]] == [2**20, 2**20]
        assert rt.stats()["tasks"]["via-default"]["state"] == "done"
    finally:
        ht.configure()  # back to the defaults; closes the configured runtime


def test_one_module_in_two_running_tasks_is_rejected():
    shared = _mlp()
    first = ht.ModelTask(shared, _sgd, _data(50), loss=_mse, epochs=20, name="first")
    second = ht.ModelTask(shared, _sgd, _data(2), loss=_mse, name="second")
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(first)
        with pytest.raises(ValueError, match=r"each running task trains its own model object must hold, but got "
                                             r"\(task='second', model_also_in='first'\)"):
            rt.submit(second)
        h.cancel()


def test_a_module_a_running_task_trains_is_rejected_before_it_is_built(monkeypatch):
    # the build measures the module (forward, backward, its gradients put back) while the running task's thread steps
    # it: the check at admission came after that, and the race once aborted the process (`Fatal Python error`)
    from hydra_tune.training.state import TaskState

    builds = []
    real = TaskState.build.__func__

    def build(cls, task, *args, **kwargs):
        builds.append(task.name)
        return real(cls, task, *args, **kwargs)
    monkeypatch.setattr(TaskState, "build", classmethod(build))
    shared = _mlp()
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(ht.ModelTask(shared, _sgd, _data(50), loss=_mse, epochs=20, name="first"))
        with pytest.raises(ValueError, match=r"each running task trains its own model object"):
            rt.submit(ht.ModelTask(shared, _sgd, _data(2), loss=_mse, name="second"))
        h.cancel()
    assert builds == ["first"]


def test_a_factory_that_returns_a_running_tasks_module_is_rejected_before_it_is_measured(monkeypatch):
    # (a cache of models, `lambda: model`): the module is known once the factory returned it, and the build stops
    # there, before its profile runs the module's forward and backward under the running task's steps
    from hydra_tune.training import state as state_module

    measured = []
    real = state_module.measure_costs
    monkeypatch.setattr(state_module, "measure_costs", lambda *a, **k: measured.append(1) or real(*a, **k))
    shared = _mlp()
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(ht.ModelTask(lambda: shared, _sgd, _data(50), loss=_mse, epochs=20, name="first"))
        assert len(measured) == 1
        with pytest.raises(ValueError, match=r"model_also_in='first'"):
            rt.submit(ht.ModelTask(lambda: shared, _sgd, _data(2), loss=_mse, name="second"))
        h.cancel()
    assert len(measured) == 1


def test_model_factory_error_names_the_factory():
    def broken():
        raise KeyError("n_layer")

    with ht.Runtime(devices=["cpu"]) as rt, pytest.raises(KeyError, match="building the task's model failed"):
        rt.submit(ht.ModelTask(broken, _sgd, _data(1), loss=_mse))


def test_a_task_cancelled_after_its_last_metrics_ends_done():
    """A Tune trial stopped at its last report (ASHA's max_t) cancels its task while the task's host thread is
    only ending its chain (here: shutting down its DataLoader's persistent worker). Before, it ended "cancelled"
    although it had trained every epoch; the consumer waits for nothing more, and the model is the trained one."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g))
    loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    task = ht.ModelTask(_mlp, _sgd, loader, loss=_mse, epochs=2, name="stopped-at-the-end")
    with ht.Runtime(devices=["cpu"]) as rt:
        h = rt.submit(task)
        seen: list = []
        while not any(m["epoch"] == 2 for m in seen):
            seen += h.watch(len(seen), timeout=60).fresh
        h.cancel()   # what HydraExecutor.on_trial_complete does when Tune stops the trial at its last report
        assert h.wait(30) and h.status == "done", (h.status, h.error)
        assert max_param_diff(plain_train(ht.ModelTask(_mlp, _sgd, data_list(data), loss=_mse, epochs=2))[0],
                              h.model()) == 0.0


def data_list(data):
    return [(data.tensors[0][i:i + 4], data.tensors[1][i:i + 4]) for i in range(0, len(data), 4)]


def test_a_fault_of_the_board_fails_the_tasks_instead_of_hanging_them():
    """A bug in the scheduling policy (injected here) raised in a device thread's take(): the thread died and every
    task waited for ever. Now the admitted tasks fail with an error naming the device and the fault, and tasks
    submitted after the fault is gone train as usual."""
    calls = {"n": 0}
    with ht.Runtime(devices=["cpu"]) as rt:
        pick = rt.scheduler._picker.pick  # fault injection: the policy raises once

        def broken(records, index, idle):
            calls["n"] += 1
            if calls["n"] == 1:
                raise ZeroDivisionError("estimate / 0")
            return pick(records, index, idle)

        rt.scheduler._picker.pick = broken
        h = rt.submit(ht.ModelTask(_mlp, _sgd, _data(4), loss=_mse, epochs=2, name="victim"))
        assert h.wait(30), "the task hung"
        assert h.status == "failed" and "scheduler failed on device cpu:0" in str(h.error)
        assert isinstance(h.error.__cause__, ZeroDivisionError)
        task = ht.ModelTask(_mlp, _sgd, _data(4), loss=_mse, epochs=2, name="after")
        h2 = rt.submit(task)
        assert max_param_diff(plain_train(task)[0], trained(h2)) == 0.0


def test_a_task_whose_state_cannot_go_back_to_its_model_fails_instead_of_hanging(monkeypatch):
    # fault injection: the write-back at the task's end raises (a sparse gradient did, before sparse gradients
    # were refused). Before, the board had ended the task, but its handle was never told: result() waited forever
    from hydra_tune.training.resident import StateHome

    def broken(self, *args, **kwargs):
        raise RuntimeError("write-back failed")

    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        ok = rt.submit(ht.ModelTask(_mlp, _sgd, _data(4), loss=_mse, epochs=1, name="ok"))
        ok.result(timeout=60)
        monkeypatch.setattr(StateHome, "release", broken)
        handle = rt.submit(ht.ModelTask(_mlp, _sgd, _data(4), loss=_mse, epochs=1, name="broken"))
        with pytest.raises(RuntimeError, match="write-back failed"):
            handle.result(timeout=60)
        assert handle.status == "failed"
        monkeypatch.undo()
        after = rt.submit(ht.ModelTask(_mlp, _sgd, _data(4), loss=_mse, epochs=1, name="after"))
        assert after.result(timeout=60)["epoch"] == 1  # the runtime goes on
