"""``hydra_tune.train`` submits when it is called: ``current_handle()`` is that task's from the moment ``train``
returns (never the previous task's), submit errors raise at the call, and an iterator dropped unused cancels its
task."""
from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.api import bind
from hydra_tune.errors import PlanError


def _task(name: str, epochs: int = 1, **kw) -> ht.ModelTask:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]
    return ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 2)),
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=epochs, name=name, **kw)


def test_current_handle_before_the_first_iteration_is_this_tasks():
    with ht.Runtime(devices=["cpu"]) as rt:
        assert [m["epoch"] for m in ht.train(_task("first"), runtime=rt)] == [1]
        assert ht.current_handle().name == "first"
        metrics = ht.train(_task("second", epochs=2), runtime=rt)
        handle = ht.current_handle()
        assert handle.name == "second"     # before: "first", the previous task's (train submitted lazily)
        assert [m["epoch"] for m in metrics] == [1, 2]
        assert ht.current_handle() is handle
        assert max_param_diff(plain_train(_task("second", epochs=2))[0], handle.model()) == 0.0


def test_in_a_fresh_bind_scope_the_handle_exists_once_train_returns():
    with ht.Runtime(devices=["cpu"]) as rt, bind(rt.submit):
        with pytest.raises(RuntimeError, match="was started in this thread before"):
            ht.current_handle()
        metrics = ht.train(_task("bound"))
        assert ht.current_handle().name == "bound"   # before: raised (nothing submitted yet)
        assert list(metrics)[-1]["epoch"] == 1


def test_submit_errors_raise_at_the_call_and_leave_no_stale_handle():
    with ht.Runtime(devices=["cpu"]) as rt:
        list(ht.train(_task("earlier"), runtime=rt))
    with ht.Runtime(devices=["cpu"], device_memory=1_000) as rt:
        with pytest.raises(PlanError):
            ht.train(_task("too-big"), runtime=rt)   # before: only at the first next()
        with pytest.raises(RuntimeError, match="latest `hydra_tune.train\\(task\\)` submitted its task") as err:
            ht.current_handle()                      # before: the handle of "earlier"
    assert "task='too-big'" in str(err.value) and "PlanError" in str(err.value)


def test_an_iterator_dropped_before_its_first_item_cancels_its_task():
    with ht.Runtime(devices=["cpu"]) as rt:
        ht.train(_task("dropped", epochs=10_000), runtime=rt)   # never iterated, not kept
        gc.collect()
        deadline = time.monotonic() + 30
        while rt.stats()["tasks"]["dropped"]["state"] != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rt.stats()["tasks"]["dropped"]["state"] == "cancelled"
