"""Cancellation frees what a task held: device bytes, resident shard copies, the runtime's records of it, and (once
every worker waits for work) its model and optimizer. Cancels land at real moments seen in the runtime's threads:
mid-unit, mid-prefetch, while queued, at close. The short soak is benchmarks/soak.py --quick."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.device import measured
from hydra_tune.errors import RuntimeClosed, TaskCancelled

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import soak  # noqa: E402  (benchmarks/soak.py: the watcher and the settle/measure helpers)


@contextlib.contextmanager
def _watching() -> Iterator[soak.Watcher]:
    """The soak's watcher thread (it cancels a task at a named moment), stopped however the test ends."""
    watcher = soak.Watcher()
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop = True
        watcher.join()


def _data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _tracked(refs: list, width: int = 512, depth: int = 3):
    def build() -> nn.Module:
        model = soak._mlp(width, depth)
        refs.append(weakref.ref(model))
        return model
    return build


def _task(refs: list, name: str, batches: int = 50, epochs: int = 50, loss=_mse, width: int = 512) -> ht.ModelTask:
    return ht.ModelTask(_tracked(refs, width), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), _data(batches),
                        loss=loss, epochs=epochs, name=name)


def _assert_released(rt: ht.Runtime, refs: list) -> None:
    """Once every worker waits for work: no device bytes, no resident copies, no task tracked, models collected."""
    soak.quiesce(rt)
    gc.collect()
    assert [d.current_bytes() for d in rt.devices] == [0] * len(rt.devices)
    assert [len(d.account._live) for d in rt.devices] == [0] * len(rt.devices)
    assert [len(d.resident) for d in rt.devices] == [0] * len(rt.devices)
    counts = rt.scheduler.counts()
    assert counts["admitted"] == 0 and counts["ready"] == 0
    assert [r() for r in refs] == [None] * len(refs), "a cancelled task's model is still referenced"


def _ended(handle) -> str:
    with pytest.raises(TaskCancelled):
        handle.result(timeout=120)
    return handle.status


def test_cancel_from_inside_the_loss_stops_at_the_next_unit_and_frees_the_task():
    refs: list = []
    box: dict = {"handle": None, "calls": 0, "thread": None}

    def loss(out, batch):  # the L unit: cancel from the device's worker thread, mid-unit
        if box["handle"] is not None:
            box["calls"] += 1
            if box["calls"] == 3:
                box["thread"] = threading.current_thread().name
                box["handle"].cancel()
        return _mse(out, batch)

    with ht.Runtime(devices=["cpu", "cpu"], device_memory=soak.BUDGET) as rt:
        box["handle"] = h = rt.submit(_task(refs, "victim", loss=loss))
        assert _ended(h) == "cancelled" and box["thread"].startswith("hydra-cpu")
        mine = [e for e in rt.trace().units() if e.task == "victim"]
        assert len(rt.stats()["tasks"]["victim"]["shards"]) >= 3
        assert mine[-1].kind == "L" and sum(e.kind == "L" for e in mine) == 3  # no unit ran after the cancelled L
        _assert_released(rt, refs)


@pytest.mark.parametrize("where", ["prefetch", "next"])
def test_cancel_while_its_shard_is_copied_ahead_frees_the_task(where):
    """``prefetch``: the copy thread copies the task's next shard while its unit runs; ``next``: the copy thread
    copies the first shard of the task the device runs next, while another task's segment ends."""
    refs: list = []
    out: dict = {}
    with _watching() as watcher:
        with ht.Runtime(devices=["cpu"], device_memory=16 << 20, policy="round_robin") as rt:
            other = rt.submit(_task(refs, "other", width=1024))  # 4 MiB layers: copies take milliseconds
            victim = rt.submit(_task(refs, "victim", width=1024))
            watcher.arm(victim, out, where)
            assert _ended(victim) == "cancelled"
            assert out["moment"] == where and out["confirmed"], out  # still copying when cancel() returned
            other.cancel()
            _ended(other)
            _assert_released(rt, refs)


def test_cancel_mid_unit_from_another_thread_frees_the_task():
    refs: list = []
    out: dict = {}
    with _watching() as watcher:
        with ht.Runtime(devices=["cpu", "cpu"], device_memory=soak.BUDGET) as rt:
            h = rt.submit(_task(refs, "victim"))
            watcher.arm(h, out, "unit")
            assert _ended(h) == "cancelled" and out["moment"] == "unit" and out["confirmed"], out
            _assert_released(rt, refs)


def test_cancel_while_queued_ends_it_at_once_and_it_never_runs():
    refs: list = []
    with ht.Runtime(devices=["cpu"], device_memory=soak.BUDGET) as rt:
        blocker = rt.submit(_task(refs, "blocker"))
        with rt.scheduler.cond:  # the scheduler's (re-entrant) lock: the device cannot take the victim before its cancel
            victim = rt.submit(_task(refs, "victim"))
            assert victim.status == "queued" and any(a.handle is victim for a in rt.scheduler.ready())
            victim.cancel()
            assert victim.done() and victim.status == "cancelled"  # a queued task ends within cancel()
        assert _ended(victim) == "cancelled"
        blocker.cancel()
        _ended(blocker)
        assert "victim" not in rt.trace().tasks() and rt.stats()["tasks"]["victim"]["units"] == 0
        _assert_released(rt, refs)


def test_close_with_running_and_queued_tasks_frees_them():
    refs: list = []
    rt = ht.Runtime(devices=["cpu", "cpu"], device_memory=soak.BUDGET)
    handles = [rt.submit(_task(refs, f"t{i}")) for i in range(4)]  # two run, two wait
    rt.close()
    for h in handles:
        with pytest.raises(RuntimeClosed):
            h.result(timeout=60)
    gc.collect()
    assert [d.current_bytes() for d in rt.devices] == [0, 0] and [len(d.resident) for d in rt.devices] == [0, 0]
    assert rt.scheduler.counts()["admitted"] == 0 and len(refs) >= 4 and all(r() is None for r in refs)   # meta builds count too


def test_what_the_device_learned_of_an_ended_task_goes_with_it():
    """A task's end drops the device's record of its measured segments: a later task that takes its name (and batch
    shapes) is not run unmeasured on what the earlier one showed as that task. What the class of equal tasks they
    both belong to measured stays (training/measure_class.py: guarded, and bounded by MEASURED_CLASSES)."""
    refs: list = []
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        device = rt.devices[0]
        rt.submit(_task(refs, "same", batches=2, epochs=1)).result(timeout=60)
        first = device.account.reset_peak()
        rt.submit(_task(refs, "same", batches=2, epochs=1)).result(timeout=60)
        assert first > 0 and device.peak_bytes() > 0  # 0: its segments ran unmeasured
        soak.quiesce(rt)
        records = device.records
        assert not [who for who in records.begun if isinstance(who, str)], records.begun
        assert not [who for who in records.unrouted if isinstance(who, str)], records.unrouted
        assert len(records.begun) <= measured.MEASURED_CLASSES


def test_a_device_remembers_the_latest_classes_only(monkeypatch):
    """The classes of equal tasks a CPU device measured outlive their tasks (a search's later trials share them), up
    to MEASURED_CLASSES of them, the latest: a runtime that saw many architectures does not grow without bound."""
    monkeypatch.setattr(measured, "MEASURED_CLASSES", 2)
    refs: list = []
    with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
        device = rt.devices[0]
        for width in (4, 5, 6):
            rt.submit(_task(refs, f"w{width}", batches=2, epochs=1, width=width)).result(timeout=60)
        soak.quiesce(rt)
        begun = device.records.begun
        assert len(begun) == 2 and all(not isinstance(who, str) for who in begun)


def test_short_soak_returns_to_baseline(tmp_path):
    """benchmarks/soak.py --quick in its own process (its malloc settings stay there): 32 tasks cancelled at every
    kind of moment; accounted bytes exactly back, every model collected, RSS and malloc within tolerance."""
    path = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "soak.py"), "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(path.read_text())
    assert soak.failures(r, r["fixed_malloc_thresholds"]) == [] and proc.returncode == 0, proc.stdout[-3000:]
    assert r["after"]["device_bytes"] == [0, 0] and r["after"]["tasks"] == 0 and r["models_alive"] == 0
    assert r["models_built"] == 32 and {o["action"] for o in r["outcomes"]} == set(soak.ACTIONS)
    assert {"queued", "loss", "unit", "prefetch", "data", "epoch", "finished"} <= set(r["moments"]), r["moments"]
    assert r["prefetch_confirmed"] >= 1
