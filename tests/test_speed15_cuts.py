"""Issue 15's per-segment cuts stay exact and stay cut: a task whose whole state is resident on its device is not
moved in again at each segment, and its state is counted twice per step (not three times, one pass each); a unit's
RandomRouter makes one UnitMode for its random calls; the board reuses a waiting task's policy record; batches of
a list are fetched without routing. Each compares the trained weights with the plain loop's (max abs diff 0.0)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.training.resident import StateHome


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _data(n: int = 5, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _task(seed: int = 0, train_data=None, **kw) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        _data() if train_data is None else train_data, loss=lambda out, b: F.cross_entropy(out, b[1]),
                        epochs=2, seed=seed, name=f"m{seed}", **kw)


def test_a_resident_task_moves_in_once_not_at_every_segment_and_stays_exact(monkeypatch):
    calls = []
    real = StateHome.move_in

    def counting(self, cache, shards=None):
        calls.append(self.name)
        return real(self, cache, shards)

    monkeypatch.setattr(StateHome, "move_in", counting)
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(_task(eval_data=_data(2, seed=4)))
        model = trained(handle)
        stats = rt.stats()["tasks"]["m0"]["residency"]
    assert stats["step_path"] == "resident"
    assert calls == ["m0"], f"moved in at {len(calls)} segments, not once"
    assert max_param_diff(model, plain_train(_task())[0]) == 0.0


def test_a_resident_step_counts_its_state_twice_not_three_times_and_stays_exact(monkeypatch):
    """After each step the resident state's bytes are counted once more (the gradients' flush, the step); an
    idle lazy flush (nothing pending) counts nothing."""
    calls = [0]
    real = StateHome.hold_now

    def counting(self):
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(StateHome, "hold_now", counting)
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(_task())
        model = trained(handle)
        stats = rt.stats()["tasks"]["m0"]
    steps = stats["steps"]
    assert stats["residency"]["step_path"] == "resident" and steps == 10
    assert calls[0] <= 2 * steps + 2, f"{calls[0]} counts for {steps} steps"
    assert max_param_diff(model, plain_train(_task())[0]) == 0.0


def test_track_many_counts_like_track():
    from hydra_tune.device.dispatch import MemoryAccount

    a, b = MemoryAccount(), MemoryAccount()
    ts = [torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(0)]
    storages = [t.untyped_storage() for t in ts + ts[:1]]
    for s in storages:
        a.track(s, enforce=False)
    b.track_many(storages)
    assert (a.current, a.peak) == (b.current, b.peak) == (64, 64)
    del ts, storages, s
    import gc

    gc.collect()
    assert a.current == b.current == 0 and b.peak == 64


def test_the_random_router_makes_one_unit_mode_for_its_calls_and_draws_as_plain(monkeypatch):
    """A unit's RandomRouter routes its CPU random calls through one UnitMode (made at its first random call, not at
    every one); the draws are those the plain loop's seeded global generator makes."""
    import hydra_tune.device.dispatch as dispatch

    made = [0]
    real_init = dispatch.UnitMode.__init__

    def counting(self, *args, **kwargs):
        made[0] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(dispatch.UnitMode, "__init__", counting)
    x, probs = torch.ones(4, 32), torch.full((4, 32), 0.3)
    torch.manual_seed(7)
    expected = [torch.bernoulli(probs) for _ in range(3)] + [nn.Dropout(0.5)(x)]
    with dispatch.RandomRouter(torch.Generator().manual_seed(7)):
        got = [torch.bernoulli(probs) for _ in range(3)] + [nn.Dropout(0.5)(x)]
    # (nn.Dropout's common case makes its own four calls with the generator, no UnitMode: device/dropout.py)
    assert made[0] == 1, f"{made[0]} UnitModes for 3 random calls"
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_board_reuses_a_waiting_tasks_policy_record_and_every_task_stays_exact(monkeypatch):
    """With many ready tasks, a device's pick builds a policy record only for the tasks whose fields changed
    since the last pick (most only waited), not one per ready task at every pick. Only picks among 4 or more ready
    tasks count: under load, tasks arrive one by one and the first picks see only new ones."""
    import hydra_tune.runtime.picker as picker

    made, offered, inside = [0], [0], [False]
    real_ready, real_records = picker.Ready, picker.Picker.records

    def counting_ready(*args, **kwargs):
        made[0] += inside[0]
        return real_ready(*args, **kwargs)

    def counting_records(self, index, cands, current):
        if len(cands) < 4:   # picks while tasks still arrive (each one new) say nothing about reuse
            return real_records(self, index, cands, current)
        offered[0] += len(cands)
        inside[0] = True
        try:
            return real_records(self, index, cands, current)
        finally:
            inside[0] = False

    monkeypatch.setattr(picker, "Ready", counting_ready)
    monkeypatch.setattr(picker.Picker, "records", counting_records)
    monkeypatch.setattr(picker, "TURN", 0.0)  # a pick at every segment (LRTF's turns would skip most of them)

    def wide() -> nn.Module:  # units long enough that the other tasks wait ready meanwhile
        return nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 3))

    def task(seed: int) -> ht.ModelTask:
        return ht.ModelTask(wide, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), _data(4, seed=seed),
                            loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=1, seed=seed, name=f"w{seed}")

    tasks = [task(seed) for seed in range(8)]
    with ht.Runtime(devices=["cpu"]) as rt:
        handles = [rt.submit(task(seed)) for seed in range(8)]
        models = [trained(h) for h in handles]
    assert offered[0] > 30
    assert made[0] < 0.8 * offered[0], f"{made[0]} records made for {offered[0]} offered"
    for model, task in zip(models, tasks):
        assert max_param_diff(model, plain_train(task)[0]) == 0.0


def test_batches_of_a_list_are_fetched_without_routing_and_a_dataloader_still_draws_from_the_task():
    """next() over a list or tuple runs no code, so no UnitMode is made per fetch; a shuffling DataLoader's
    order still comes from the task's stream (as ``torch.manual_seed(seed)`` then the plain loop gives)."""
    import hydra_tune.device.dispatch as dispatch

    made = [0]
    real_init = dispatch.UnitMode.__init__

    def counting(self, *args, **kwargs):  # in the task's host thread (a unit's router makes its own)
        made[0] += threading.current_thread().name.startswith("hydra-host")
        real_init(self, *args, **kwargs)

    data = _data(8, seed=5)
    loader = torch.utils.data.DataLoader([(x[i], y[i]) for x, y in data for i in range(4)], batch_size=4,
                                         shuffle=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch.UnitMode, "__init__", counting)
        with ht.Runtime(devices=["cpu"]) as rt:
            model = trained(rt.submit(_task(train_data=data)))
    fetches = 2 * (len(data) + 1)
    assert made[0] < fetches / 2, f"{made[0]} UnitModes in its host thread for {fetches} fetches"
    assert max_param_diff(model, plain_train(_task(train_data=data))[0]) == 0.0
    with ht.Runtime(devices=["cpu"]) as rt:
        model = trained(rt.submit(_task(train_data=loader)))
    assert max_param_diff(model, plain_train(_task(train_data=loader))[0]) == 0.0
