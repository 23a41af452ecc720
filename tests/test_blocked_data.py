"""A data iterator that blocks holds no device: each task fetches its batches (and steps its optimizer) in its own
host thread, so other tasks keep running, ``cancel()`` ends the blocked task at once and ``Runtime.close()``
returns, leaving the stuck thread behind with a warning. Every wait here has a timeout: before the host threads
these tests failed by timing out, not by hanging."""
from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train

import hydra_tune as ht
from hydra_tune.errors import RuntimeClosed, TaskCancelled
from hydra_tune.runtime import runtime as runtime_module

PROMPT = 5.0  # seconds: "promptly" (close() waits CLOSE_WAIT, 0.2 s here, for stuck host threads before warning)


def _data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


class Stalling:
    """Yields ``after`` batches, then blocks in ``next()`` until ``release`` is set (``blocked`` tells when);
    each batch is kept in ``handed`` by weak reference."""

    def __init__(self, batches: list, after: int) -> None:
        self.batches, self.after = batches, after
        self.blocked, self.release = threading.Event(), threading.Event()
        self.handed: list[weakref.ref] = []

    def __iter__(self):
        for i, b in enumerate(self.batches):
            if i == self.after:
                self.blocked.set()
                self.release.wait()
            self.handed.append(weakref.ref(b[0]))
            yield b

    def __len__(self) -> int:
        return len(self.batches)


def _task(name: str, data: Any, seed: int, epochs: int = 2) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), data, epochs=epochs,
                        loss=lambda out, b: F.mse_loss(out, b[1]), seed=seed, name=name)


def _in_thread(fn, timeout: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (whether it returned within ``timeout``, what it returned or raised)."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            box["out"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), box.get("out")


@pytest.fixture(autouse=True)
def _short_close_wait(monkeypatch):
    """close() waits ``CLOSE_WAIT`` (2 s) for a stuck host thread before it warns and leaves it behind. These tests
    leave one stuck on purpose and check that close() returns within PROMPT and warns naming the task, which holds
    for any wait: 0.2 s spares 1.8 s a test, and keeps each close() a fraction of PROMPT."""
    monkeypatch.setattr(runtime_module, "CLOSE_WAIT", 0.2)


@pytest.fixture(autouse=True)
def _threads_left_behind_end():
    """After each test (whose ``finally`` releases the blocked iterators): wait for the host and admission threads
    it left behind, so none still runs torch code when the interpreter exits."""
    before = set(threading.enumerate())
    yield
    for t in set(threading.enumerate()) - before:
        if t.name.startswith(("hydra-host-", "hydra-admit")):
            t.join(60)


def _close_promptly(rt: ht.Runtime) -> list[warnings.WarningMessage]:
    def close() -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rt.close()
        return seen
    returned, seen = _in_thread(close, PROMPT)
    assert returned, "Runtime.close() did not return while a task's data iterator blocked"
    return seen


def _wait_hosts_idle(rt: ht.Runtime, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while rt.scheduler.counts()["host_busy"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.scheduler.counts()["host_busy"] == 0


@pytest.mark.parametrize("after,b_first", [(1, False), (3, True)])
def test_a_blocked_iterator_holds_no_device(after, b_first):
    """One device; A's iterator blocks after its first ``after`` training batches (submit's sample batch comes from
    a pass of its own). B, submitted while A is blocked (or right after A: the two take turns, and the policy may
    keep the device on A as A's data blocks), trains on that device and ends bit-identical to the plain loop; A
    cancels at once; close() returns and warns."""
    stall = Stalling(_data(4, 1), after)
    a_task, b_task = _task("A", stall, 1), _task("B", _data(4, 2), 2, epochs=6)
    rt = ht.Runtime(devices=["cpu"], device_memory=None)
    try:
        a = rt.submit(a_task)
        b = rt.submit(b_task) if b_first else None
        assert stall.blocked.wait(30), "A never reached its blocking fetch"
        b = b or rt.submit(b_task)
        assert b.wait(60), f"B did not finish while A's data iterator blocked (B is {b.status})"
        assert max_param_diff(b.model(), plain_train(b_task)[0]) == 0.0
        returned, _ = _in_thread(a.cancel, PROMPT)
        assert returned and a.wait(PROMPT), f"A is {a.status} after cancel()"
        assert a.status == "cancelled" and isinstance(a.error, TaskCancelled)
        seen = _close_promptly(rt)
        stuck = [w for w in seen if issubclass(w.category, RuntimeWarning) and "'A'" in str(w.message)]
        assert stuck and "data iterator" in str(stuck[0].message), [str(w.message) for w in seen]
    finally:
        stall.release.set()  # let the abandoned thread end
        rt.close()


def test_close_while_a_task_is_blocked_ends_it_and_runs_the_rest():
    """Two devices: A blocks after one batch, B and C train to the end exactly meanwhile; close() with A still
    blocked ends A with RuntimeClosed, returns promptly and names A in its warning."""
    stall = Stalling(_data(4, 1), 1)
    tasks = [_task("B", _data(6, 2), 2), _task("C", _data(6, 3), 3)]
    rt = ht.Runtime(devices=["cpu", "cpu"], device_memory=None)
    try:
        a = rt.submit(_task("A", stall, 1))
        assert stall.blocked.wait(30)
        handles = [rt.submit(t) for t in tasks]
        for h, t in zip(handles, tasks):
            assert h.wait(60), f"{h.name} did not finish while A blocked"
            assert max_param_diff(h.model(), plain_train(t)[0]) == 0.0
        assert a.status == "running"
        seen = _close_promptly(rt)
        assert a.wait(PROMPT) and isinstance(a.error, RuntimeClosed)
        assert any("'A'" in str(w.message) for w in seen), [str(w.message) for w in seen]
    finally:
        stall.release.set()
        rt.close()


def test_a_cancelled_task_is_freed_once_its_iterator_returns():
    """Cancelled while blocked, A ends at once; when its iterator returns at last, the batch it hands over and
    the model are let go (nothing of A stays referenced), and close() then has nothing to warn about."""
    stall = Stalling(_data(4, 1), 1)
    models: list[weakref.ref] = []

    def build() -> nn.Module:
        model = _mlp()
        models.append(weakref.ref(model))
        return model
    task = ht.ModelTask(build, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), stall, epochs=2,
                        loss=lambda out, b: F.mse_loss(out, b[1]), seed=1, name="A")
    rt = ht.Runtime(devices=["cpu"], device_memory=None)
    try:
        a = rt.submit(task)
        assert stall.blocked.wait(30)
        a.cancel()
        assert a.wait(PROMPT) and a.status == "cancelled"
        stall.release.set()
        _wait_hosts_idle(rt)
        del a, task
        gc.collect()
        assert len(stall.handed) == 3  # submit's sample batch, the first batch, the one fetched after the block
        stall.batches = None  # the test's own references to the batches
        gc.collect()
        assert [r() for r in stall.handed] == [None] * 3, "a fetched batch of the cancelled task is still held"
        assert [r() for r in models if r() is not None and not any(p.is_meta for p in r().parameters())] == []
        assert _close_promptly(rt) == []
    finally:
        stall.release.set()
        rt.close()


class ThreadRecorder:
    """Records the thread that fetches each batch."""

    def __init__(self, batches: list) -> None:
        self.batches, self.threads = batches, []

    def __iter__(self):
        for b in self.batches:
            self.threads.append(threading.current_thread().name)
            yield b

    def __len__(self) -> int:
        return len(self.batches)


def test_every_batch_of_a_task_is_fetched_in_its_own_thread():
    """As in the plain loop, one thread fetches all of a task's batches (iterators bound to the thread that made
    them keep working) and it is not a device's: two tasks taking turns on one device."""
    data = [ThreadRecorder(_data(4, i)) for i in range(2)]
    tasks = [_task(f"t{i}", d, i, epochs=3) for i, d in enumerate(data)]
    with ht.Runtime(devices=["cpu"], device_memory=None, policy="round_robin") as rt:
        handles = [rt.submit(t) for t in tasks]
        for h in handles:
            assert h.wait(60)
        models = [h.model() for h in handles]
    for t, d, m in zip(tasks, data, models):
        training = [n for n in d.threads if n != threading.main_thread().name]  # submit's sample batch: the caller's
        assert len(training) == 12 and set(training) == {f"hydra-host-{t.name}"}, d.threads
        assert max_param_diff(m, plain_train(t)[0]) == 0.0


class StallsOffMain:
    """A data iterable whose first pass made outside the main thread (the runtime's, not submit's) blocks before
    its first batch until ``release`` is set."""

    def __init__(self, batches: list) -> None:
        self.batches, self.stalled = batches, False
        self.blocked, self.release = threading.Event(), threading.Event()

    def __iter__(self):
        if not self.stalled and threading.current_thread() is not threading.main_thread():
            self.stalled = True
            self.blocked.set()
            self.release.wait()
        yield from self.batches

    def __len__(self) -> int:
        return len(self.batches)


def test_a_waiting_task_whose_build_blocks_in_its_data_holds_neither_cancel_nor_close():
    """A task that waited for host memory is built by the runtime's admission thread when memory frees up; its
    build takes a sample batch. When that blocks, cancel() ends the task at once and close() still returns (with
    a warning naming it)."""
    first = _task("first", _data(2, 1), 1, epochs=100_000)
    stall = StallsOffMain(_data(2, 2))
    later = _task("later", stall, 2, epochs=1)
    rt = ht.Runtime(devices=["cpu"], device_memory=None, host_memory="5MiB")
    try:
        assert 5 << 20 < 2 * rt.footprint(first).total  # one task at a time
        h0 = rt.submit(first)
        h1 = rt.submit(later)
        assert h1.status == "queued"
        h0.cancel()  # `later` is built in the admission thread: its sample batch blocks
        assert stall.blocked.wait(30), "the waiting task was never built"
        returned, _ = _in_thread(h1.cancel, PROMPT)
        assert returned and h1.wait(PROMPT) and h1.status == "cancelled", h1.status
        seen = _close_promptly(rt)
        assert any("'later'" in str(w.message) for w in seen), [str(w.message) for w in seen]
    finally:
        stall.release.set()
        rt.close()


def test_a_blocked_eval_iterator_holds_no_device():
    """The eval data is fetched by the same host thread: A's eval iterable blocks at its first evaluation, B trains
    meanwhile and matches the plain loop, A cancels at once."""
    stall = StallsOffMain(_data(2, 5))
    a_task = ht.ModelTask(_mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), _data(2, 1), epochs=2,
                          eval_data=stall, loss=lambda out, b: F.mse_loss(out, b[1]), seed=1, name="A")
    b_task = _task("B", _data(4, 2), 2)
    rt = ht.Runtime(devices=["cpu"], device_memory=None)
    try:
        a = rt.submit(a_task)
        assert stall.blocked.wait(30), "A never evaluated"
        b = rt.submit(b_task)
        assert b.wait(60), f"B did not finish while A's eval data blocked (B is {b.status})"
        assert max_param_diff(b.model(), plain_train(b_task)[0]) == 0.0
        a.cancel()
        assert a.wait(PROMPT) and a.status == "cancelled"
        assert any("'A'" in str(w.message) for w in _close_promptly(rt))
    finally:
        stall.release.set()
        rt.close()
