"""Classes of equal tasks (training/measure_class.py): a CPU device counts a segment op by op once for all the tasks
whose units allocate and draw alike, and every task still ends bit-identical to its plain loop (CPU fp32)."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained
from test_light_path import _ce, _correct, _mlp

import hydra_tune as ht
from hydra_tune.device import devices, dispatch


@pytest.fixture(autouse=True)
def no_lending_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # quiet units (which a class needs) stop for the process once any task lent the global generator
    monkeypatch.setattr(dispatch, "_LENT", [])


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """The segments CPU devices counted op by op, by whom they were counted for: a task's name, or a class."""
    counts: collections.Counter = collections.Counter()
    real = devices.CpuDevice.measure

    def measure(self: devices.CpuDevice, key: object, task: str | None = None) -> bool:
        counted = real(self, key, task)
        if counted:
            counts[key[0]] += 1  # type: ignore[index]
        return counted
    monkeypatch.setattr(devices.CpuDevice, "measure", measure)
    return counts


def _batches(n: int, seed: int, marked: tuple[int, ...] = ()) -> list:
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]
    for i in marked:
        out[i][0][0, 0] = 100.0
    return out


def _task(name: str, seed: int, lr: float = 0.1, model=_mlp, loss=_ce, metrics=None, marked=()) -> ht.ModelTask:
    return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
                        _batches(8, seed, marked), eval_data=_batches(2, 50 + seed), loss=loss,
                        metrics=metrics or {"accuracy": _correct}, epochs=2, seed=seed, name=name)


def _run(tasks: list[ht.ModelTask], devices: int = 1) -> list[nn.Module]:
    with ht.Runtime(devices=["cpu"] * devices) as rt:
        handles = [rt.submit(t) for t in tasks]
        return [trained(h) for h in handles]


def _exact(tasks: list[ht.ModelTask], models: list[nn.Module]) -> None:
    for task, model in zip(tasks, models):
        assert max_param_diff(model, plain_train(task)[0]) == 0.0, task.name


def test_equal_tasks_are_measured_once_between_them(measured: collections.Counter) -> None:
    # four trials of one search: other seeds, data and learning rates, the same model, loss and metric. Before, each
    # was counted op by op for its own train and eval segment (8 in all); now the first one's serve the others
    tasks = [_task(f"t{i}", seed=i, lr=0.1 * (i + 1)) for i in range(4)]
    _exact(tasks, _run(tasks))
    assert sum(measured.values()) == 2, measured


def test_tasks_that_differ_are_measured_apart(measured: collections.Counter) -> None:
    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def smoothed(out: torch.Tensor, batch: tuple) -> torch.Tensor:
        return F.cross_entropy(out, batch[1], label_smoothing=0.1)

    tasks = [_task("base", 1), _task("wide", 2, model=wide), _task("loss", 3, loss=smoothed),
             _task("metric", 4, metrics={"hits": _correct}), _task("same", 5)]
    _exact(tasks, _run(tasks))
    # a width, a loss or a metric of its own: a class of its own, measured (train and eval); "same" shares "base"'s
    assert sum(measured.values()) == 8, measured


def _draws_on_marked(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    loss = F.cross_entropy(out, batch[1])
    if batch[0][0, 0] == 100.0:  # (which the class key cannot see: a value of the data)
        loss = loss + 0.0 * torch.randn(())  # a draw outside every stage, from the stream the plain loop reads
    return loss


def test_a_task_that_draws_where_its_class_did_not_is_rerun_exactly(measured: collections.Counter) -> None:
    # the first task's data never takes the drawing branch: its class's units run quiet. The second task's does:
    # its unit moves torch's global generator, the guard sees it and the segment runs again routed; its class is not
    # shared with it from then on (measured as its own), and both end exactly as their plain loops
    first = _task("first", 1, loss=_draws_on_marked)
    second = _task("second", 2, loss=_draws_on_marked, marked=(3, 6))
    with ht.Runtime(devices=["cpu"]) as rt:
        model1 = trained(rt.submit(first))
        model2 = trained(rt.submit(second))
        reruns = rt.stats()["devices"][0]["unrouted"]["reruns"]
    _exact([first, second], [model1, model2])
    assert reruns >= 1
    assert measured["second"] >= 1, measured  # by its own name once its class's record no longer held


def test_two_devices_measure_a_class_once_between_them(measured: collections.Counter) -> None:
    # a runtime's CPU devices share what they counted (device/measured.py): a train and an eval segment in all, where
    # each device used to count both (4); a device that starts a segment the other is counting runs it guarded
    tasks = [_task(f"t{i}", seed=i) for i in range(6)]
    _exact(tasks, _run(tasks, devices=2))
    assert sum(measured.values()) == 2, measured


def test_prepared_loops_of_one_architecture_are_measured_once(measured: collections.Counter) -> None:
    # two trials' own loops after hydra_tune.prepare, one after the other on one runtime: the second runs on what the
    # first one's segments measured, and both equal the loop without prepare
    from test_prepare_exactness import _diff, mlp_loop

    want, want_history, _ = mlp_loop()
    with ht.Runtime(devices=["cpu"]) as rt:
        first = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt))
        alone = sum(measured.values())
        second = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt))
    for got, history, _ in (first, second):
        assert _diff(want, got) == 0.0 and history == want_history
    assert alone >= 2 and sum(measured.values()) == alone, measured


def test_a_task_whose_class_cannot_be_shared_is_counted_once(measured: collections.Counter,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # once any task lent torch's global generator its state, quiet units stop for the process: a class's count is
    # not shared (its units would run unguarded), each task is counted as its own, and the task a class key was
    # counted for goes on with it rather than being counted again under its name (CI caught the double count)
    monkeypatch.setattr(dispatch, "_LENT", [True])
    tasks = [_task(f"t{i}", seed=i) for i in range(3)]
    _exact(tasks, _run(tasks))
    assert sum(measured.values()) == 2 * 3, measured  # a train and an eval segment per task, as before classes
