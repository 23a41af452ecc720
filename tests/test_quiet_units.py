"""Units that run with no random-number routing (device/quiet.py): segments measured to draw nothing run unrouted;
a unit that draws after all is detected by the global generator's state and its segment runs again, routed, so the
task still ends bit-identical to the plain loop (CPU fp32: max abs parameter difference 0.0)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.device import dispatch
from hydra_tune.device.quiet import QuietUnits, UnroutedDraw
from hydra_tune.device.rng import TaskRNG


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Quiet units stop for the process once any task lent the global generator (a random op with no generator
    # argument, such as randn_like, in another test of this worker): each test starts as a fresh process would.
    monkeypatch.setattr(dispatch, "_LENT", [])


def _batches(n: int = 8) -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _mse(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


class LateNoise(nn.Module):
    """Draws no random numbers on its first ``calls_quiet`` calls, then adds noise on every call (``normal_``,
    which takes a generator, so no lending stops quiet units): a draw the measured (first) segment never saw."""

    def __init__(self, calls_quiet: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.calls_quiet = calls_quiet
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.calls_quiet:
            x = x + torch.empty_like(x).normal_(0.0, 0.1)
        return self.lin(x)


def _task(model, **kw) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _batches(), loss=_mse, epochs=2,
                        seed=7, **kw)


def _run(task: ht.ModelTask) -> tuple[nn.Module, dict]:
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(task)
        handle.result()
        return trained(handle), rt.stats()["devices"][0]


def test_drawless_model_runs_unrouted_and_exact() -> None:
    task = _task(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    model, device = _run(task)
    plain, _ = plain_train(task)
    assert max_param_diff(model, plain) == 0.0
    assert device["unrouted"]["quiet"] >= 10  # every unit after the measured first one
    assert device["unrouted"]["reruns"] == 0


def test_late_draw_reruns_routed_and_stays_exact() -> None:
    # The first segment (measured) draws nothing; from the 4th forward on, every one draws: the first unrouted
    # unit that draws moves the global generator, raises UnroutedDraw inside the worker, and its minibatch runs
    # again routed (from its start: RNG, buffers, Python state put back). Without the guard the noise would come
    # from the global stream and the weights would differ from the plain loop's.
    task = _task(lambda: LateNoise(calls_quiet=3))
    model, device = _run(task)
    plain, _ = plain_train(task)
    assert max_param_diff(model, plain) == 0.0
    assert device["unrouted"]["reruns"] == 1


def _measured_quiet(key: tuple) -> QuietUnits:
    """A QuietUnits that measured one unit of ``key`` drawing nothing."""
    quiet = QuietUnits()
    quiet.begin_segment()
    with dispatch.UnitMode(torch.Generator().manual_seed(0)) as mode, quiet.measuring(key, mode):
        torch.ones(3).add_(1)
    return quiet


def test_guard_raises_on_a_draw_and_routes_the_key_from_then_on() -> None:
    key = ("t", "train")
    quiet = _measured_quiet(key)
    assert quiet.allows(key)
    with quiet.guarded(key, TaskRNG(0)):
        torch.ones(3).add_(1)  # no draw: no error
    with pytest.raises(UnroutedDraw, match="drew from torch's global CPU generator"):
        with quiet.guarded(key, TaskRNG(0)):
            torch.rand(2)
    assert not quiet.allows(key)
    assert quiet.counts == {"quiet": 1, "reruns": 1, "fast_path_reruns": 0}


def test_a_unit_that_fails_keeps_its_own_error_and_its_key_quiet() -> None:
    """A quiet unit that raises (an out-of-memory, say) is retried for that error: the guard neither replaces it
    with UnroutedDraw (even when the unit also drew) nor counts the unit, and its stage routing ends with it."""
    key = ("t", "train")
    quiet = _measured_quiet(key)
    with pytest.raises(torch.OutOfMemoryError, match="test"):
        with quiet.guarded(key, TaskRNG(0)):
            torch.rand(2)  # a draw too: the error in flight is what the caller sees
            raise torch.OutOfMemoryError("test")
    assert quiet.allows(key) and quiet.counts == {"quiet": 0, "reruns": 0, "fast_path_reruns": 0}
    assert quiet.scoped_stages() == frozenset()  # no unit running: nothing routed


def test_dropout_stage_alone_is_routed_and_the_task_stays_exact() -> None:
    # A dropout model cut into stages: its training units draw only inside the Dropout stage, which is routed;
    # the Linear stages and the eval units run with no router. Same weights as the plain loop.
    task = _task(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2)), eval_data=_batches(3))
    model, device = _run(task)
    plain, _ = plain_train(task)
    assert max_param_diff(model, plain) == 0.0
    assert device["unrouted"]["quiet"] >= 14  # all but the first (measured) train and eval segments
    assert device["unrouted"]["reruns"] == 0


def test_a_draw_outside_every_stage_keeps_the_segment_on_the_router() -> None:
    # The loss draws (noise added to the target): not inside any stage, so training units stay routed; the eval
    # segment (whose loss draws too) as well. Exact either way.
    def noisy_mse(out: torch.Tensor, batch: tuple) -> torch.Tensor:
        return F.mse_loss(out, batch[1] + torch.empty_like(batch[1]).normal_(0.0, 0.01))

    task = ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 2)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        _batches(), loss=noisy_mse, epochs=2, seed=7)
    model, device = _run(task)
    plain, _ = plain_train(task)
    assert max_param_diff(model, plain) == 0.0
    assert device["unrouted"] == {"quiet": 0, "reruns": 0, "fast_path_reruns": 0}


def test_foreign_draw_during_an_unrouted_unit_costs_a_rerun_not_exactness() -> None:
    # Another thread of the process draws from the global generator while a quiet unit runs: the guard cannot
    # tell whose draw it was, so the minibatch runs again (routed); the result is still the plain loop's.
    started, drawn = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 2)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 4 and torch.is_grad_enabled() and not started.is_set():
                started.set()
                drawn.wait(10)
            return self.lin(x)

    def other_thread() -> None:
        started.wait(30)
        torch.rand(1)  # user code outside any task, on torch's global generator
        drawn.set()

    th = threading.Thread(target=other_thread)
    th.start()
    task = _task(Waits)
    model, device = _run(task)
    th.join(30)
    drawn.set()
    started.set()
    plain, _ = plain_train(_task(Waits))
    assert max_param_diff(model, plain) == 0.0
    assert device["unrouted"]["reruns"] == 1


def test_lending_the_global_generator_stops_quiet_units() -> None:
    # randn_like takes no generator argument: a routed unit lends it the task's state under the global lock;
    # a quiet unit's stray draw in that window would move the lent stream unseen, so quiet units stop for good.
    key = ("t", "eval")
    quiet = _measured_quiet(key)
    assert quiet.allows(key)
    with dispatch.UnitMode(torch.Generator().manual_seed(0)):
        torch.randn_like(torch.ones(2))
    assert not quiet.allows(key)


def test_a_lend_that_starts_during_a_quiet_unit_counts_as_a_move():
    """The guard reads the global generator without the lending lock: a read that may have fallen in a task's lent
    window (``_LENT`` marked meanwhile) cannot vouch for an unmoved generator, so the unit runs again routed."""
    quiet = QuietUnits()
    key = ("t", "segment")
    quiet._stages[key] = frozenset()  # as after a measured segment that drew nothing
    assert dispatch.global_rng_state() is not None and quiet.allows(key)
    with pytest.raises(UnroutedDraw):
        with quiet.guarded(key, TaskRNG(0)):
            dispatch._LENT.append(True)  # another task lends the global generator its state now
    assert dispatch.global_rng_state() is None and not quiet.allows(key)
    assert quiet.counts == {"quiet": 0, "reruns": 1, "fast_path_reruns": 0}
