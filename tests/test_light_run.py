"""Light runs (training/light_run.py): a kept light task's minibatches trained and stepped in its device's thread,
with no segment, end bit-identical to the plain loop (CPU fp32: max abs parameter difference 0.0); what a run cannot
do exactly (a draw it did not expect, a non-finite loss, a checkpoint, a cancel) goes the general way."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from reference import max_param_diff, plain_train, trained
from test_light_path import _ce, _correct, _mlp  # the same tiny task as the light path's tests

import hydra_tune as ht
from hydra_tune.device import dispatch
from hydra_tune.runtime import picker


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # quiet units (and light runs, which need them) stop for the process once any task lent the global generator
    monkeypatch.setattr(dispatch, "_LENT", [])


def _batches(n: int = 12, seed: int = 3, nan_at: int | None = None) -> list:
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0][0, 0] = float("nan")
    return out


def _task(model=_mlp, name: str = "t", seed: int = 7, epochs: int = 3, **kw) -> ht.ModelTask:
    kw.setdefault("eval_data", _batches(3, seed=5))
    kw.setdefault("train_data", _batches())
    metrics = {"accuracy": _correct} if kw["eval_data"] is not None else None
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), loss=_ce,
                        metrics=metrics, epochs=epochs, seed=seed, name=name, **kw)


def _run(*tasks: ht.ModelTask, devices: int = 1) -> tuple[list, dict, list]:
    with ht.Runtime(devices=["cpu"] * devices) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
        return models, rt.stats(), rt.trace().units()


def test_a_kept_light_task_trains_in_runs_and_stays_exact() -> None:
    task = _task(grad_clip_norm=0.5, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, 0.5))
    [model], stats, units = _run(task)
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
    record = stats["tasks"]["t"]
    # every unit after its turn's first (a segment): most of them, here, eval units too
    assert record["inline_units"] >= 27, record
    assert sum(u.kind == "E" for u in units) == 9
    assert record["steps"] == 36 and record["residency"]["steps_on_device"] == 36
    # each minibatch trained in a run is one L unit in the trace and the unit counts, as a segment's
    assert sum(u.kind == "L" for u in units) == 36
    assert record["units"] == 36 + 9 == stats["devices"][0]["units"]


def test_runs_on_two_devices_stay_exact() -> None:
    tasks = [_task(name=f"t{i}", seed=i) for i in range(4)]
    models, stats, _ = _run(*tasks, devices=2)
    for task, model in zip(tasks, models):
        assert max_param_diff(model, plain_train(task)[0]) == 0.0, task.name
    assert sum(stats["tasks"][t.name]["inline_units"] for t in tasks) > 0


def test_a_lone_task_on_two_devices_trains_in_runs_and_its_stats_keep_up() -> None:
    # Another device idling for want of work does not end a task's turn (runtime/picker.py ``holds``): a lone
    # trial, as at the end of every search, trains in runs on a runtime of two devices (before: no run at all, a
    # segment every minibatch). The policy keeps giving it the device, so its run outlasts its turns, catching up on
    # what it deferred as it goes (light_run.py REFRESH): its unit counts move while it runs.
    task = _task(grad_clip_norm=0.5)
    [model], stats, _ = _run(task, devices=2)
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
    assert stats["tasks"]["t"]["inline_units"] >= 27, stats["tasks"]["t"]
    with ht.Runtime(devices=["cpu", "cpu"]) as rt:
        long = rt.submit(_task(name="long", epochs=None, eval_data=None))
        _once_running_inline(rt, "long")
        seen = rt.stats()["tasks"]["long"]["inline_units"]
        deadline = time.monotonic() + 30
        while rt.stats()["tasks"]["long"]["inline_units"] < seen + 100:
            assert time.monotonic() < deadline, "a run's units were not counted while it ran"
            time.sleep(0.005)
        long.cancel()
        assert long.wait(5.0) and long.status == "cancelled"


class LateNoise(nn.Module):
    """Draws nothing on its first ``quiet`` forwards, then adds noise on every other one (by its call count, Python
    state): the first unit that draws is in a light run (after the first epoch's), drawing from torch's global
    generator until the guard sees it."""

    def __init__(self, quiet: int = 20) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.quiet, self.calls = quiet, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        noisy = self.calls > self.quiet and self.calls % 2 == 1
        return self.lin(x + torch.empty_like(x).normal_(0.0, 0.1) if noisy else x)


def test_a_draw_in_a_run_gives_its_minibatch_back_and_stays_exact() -> None:
    # The run undoes the minibatch (gradients, the task's stream, the module's call counter) and the general path
    # trains it again, routed: without the undo the counter would skip a call and the weights would differ.
    task = _task(LateNoise, eval_data=None)
    [model], stats, _ = _run(task)
    assert stats["devices"][0]["unrouted"]["reruns"] == 1
    assert stats["tasks"]["t"]["inline_units"] > 0
    assert max_param_diff(model, plain_train(task)[0]) == 0.0


def test_a_nonfinite_loss_in_a_run_takes_the_tasks_policy() -> None:
    task = _task(train_data=_batches(nan_at=9), eval_data=None, nonfinite_loss="skip_step")
    [model], stats, _ = _run(task)
    assert stats["tasks"]["t"]["inline_units"] > 0
    assert stats["tasks"]["t"]["steps"] == 33  # the NaN batch skipped in each of 3 epochs
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
    with pytest.raises(Exception, match="finite"):
        _run(_task(train_data=_batches(nan_at=9), eval_data=None, nonfinite_loss="fail"))


def _once_running_inline(rt: ht.Runtime, name: str) -> None:
    deadline = time.monotonic() + 30
    while rt.stats()["tasks"][name]["inline_units"] == 0:
        assert time.monotonic() < deadline, "no light run started"
        time.sleep(0.001)


def test_a_checkpoint_asked_during_runs_resumes_exactly(tmp_path) -> None:
    def task(**kw):
        return _task(train_data=_batches(400), eval_data=None, epochs=2, **kw)
    expected = plain_train(task())[0]
    with ht.Runtime(devices=["cpu"]) as rt:
        first = rt.submit(task())
        _once_running_inline(rt, "t")
        path = first.checkpoint(tmp_path / "mid.pt", timeout=60)
        model = trained(first)
    assert max_param_diff(model, expected) == 0.0
    with ht.Runtime(devices=["cpu"]) as rt:
        resumed = trained(rt.submit(task(resume_from=path)))
    assert max_param_diff(resumed, expected) == 0.0


def test_a_task_cancelled_during_runs_ends_at_once_and_the_other_stays_exact() -> None:
    other = _task(name="other", seed=1)
    with ht.Runtime(devices=["cpu"]) as rt:
        long = rt.submit(_task(name="long", epochs=None, eval_data=None))
        _once_running_inline(rt, "long")
        start = time.monotonic()
        long.cancel()
        assert long.wait(5.0) and long.status == "cancelled"
        assert time.monotonic() - start < 5.0
        model = trained(rt.submit(other))
    assert max_param_diff(model, plain_train(other)[0]) == 0.0


def test_a_run_that_lasts_to_the_tasks_end_counts_its_units_before_the_task_ends() -> None:
    # max_steps inside an epoch: the policy keeps the lone task to its last step, so its last run ended after the
    # task did, and its units reached the trace and the device but not the task's counts (38 of 40 before)
    task = _task(epochs=10, max_steps=40, eval_data=None)
    [model], stats, units = _run(task)
    assert max_param_diff(model, plain_train(task)[0]) == 0.0
    record = stats["tasks"]["t"]
    assert record["steps"] == 40 and sum(u.kind == "L" for u in units) == 40
    assert record["units"] == 40 == stats["devices"][0]["units"]
    assert record["inline_units"] >= 30, record


def test_a_turn_starts_in_a_run_not_with_a_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    # With no turn, LRTF is asked before every minibatch of a run and gives the device to another task each time. A
    # run the policy ends hands its task over (Segment.handover): the device that takes it next trains that
    # minibatch in a run too. Before, each such minibatch became a segment of its own (a small model's costs about
    # half a minibatch more: benchmarks/small_trials.py). (FIFO and round-robin end a turn at a segment's end, where
    # the task's host thread opens its next one: no run starts there, before or now.)
    monkeypatch.setattr(picker, "TURN", 0.0)
    tasks = [_task(name=f"t{i}", seed=i) for i in range(3)]
    models, stats, units = _run(*tasks)
    for task, model in zip(tasks, models):
        assert max_param_diff(model, plain_train(task)[0]) == 0.0, task.name
    order = [u.task for u in sorted(units, key=lambda u: u.start)]
    assert sum(a != b for a, b in zip(order, order[1:])) >= 12, "the tasks did not take turns"
    for task in tasks:
        record = stats["tasks"][task.name]
        # the segments: those measured op by op (a train and an eval one), the first of each unmeasured and a few
        # more as tasks start and end (before: 13 to 16 of 45)
        assert record["units"] == 45 and record["units"] - record["inline_units"] <= 8, record
