"""The scheduler's affinity weighs what a device already holds (policy/schedule.py, runtime/scheduler.py).

Pure policy records first (exact expected choices): within the window of tasks that start now anyway, a device
takes a task whose state it holds (the most bytes first), then one that last ran on it, and leaves a task whose
state another idle device holds to that device; beyond the window nothing is reordered. Then the runtime: two
resident tasks on two CPU devices whose host work sometimes outlasts the keep wait (both devices idle) train
bit-identical to the plain loop, and their state does not move between the devices.
"""
from __future__ import annotations

import functools
import time

import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.policy.schedule import Ready, defers, fifo, lrtf


def test_lrtf_prefers_the_task_whose_state_this_device_holds_over_one_that_only_last_ran_here():
    # Both last ran on device 0; "evicted" was written back since, "held" is still there. Devices 0 and 1 are
    # free, so both start now: 0 takes "held" (nothing moves), 1 takes "evicted" (copied in either way).
    ready = [Ready("evicted", 1, 0, remaining=9.0), Ready("held", 2, 0, remaining=5.0, held_on=0, held_bytes=800)]
    assert lrtf(ready, 0, idle=(1,)) == 1
    assert lrtf(ready[:1], 1, idle=()) == 0


def test_lrtf_of_two_tasks_held_here_keeps_the_larger_state():
    ready = [Ready("small", 1, 0, remaining=9.0, held_on=0, held_bytes=100),
             Ready("large", 2, 0, remaining=5.0, held_on=0, held_bytes=1000)]
    assert lrtf(ready, 0, idle=(1,)) == 1  # the other one moves to device 1: the fewer bytes


def test_lrtf_leaves_a_task_held_by_another_idle_device_to_it():
    # Device 2 asks while device 1 is free too. Both last ran on 1; "held" still has its state there.
    ready = [Ready("held", 1, 1, remaining=9.0, held_on=1, held_bytes=800), Ready("evicted", 2, 1, remaining=5.0)]
    assert lrtf(ready, 2, idle=(1,)) == 1
    assert lrtf(ready, 1, idle=(2,)) == 0


def test_lrtf_never_reorders_beyond_the_window_for_what_a_device_holds():
    # Only device 0 is free: the longest task starts now, although device 0 holds the other one's state and
    # the longest one's state is on busy device 1.
    ready = [Ready("long", 1, 1, remaining=9.0, held_on=1, held_bytes=800),
             Ready("held", 2, 0, remaining=5.0, held_on=0, held_bytes=800)]
    assert lrtf(ready, 0, idle=()) == 0
    # A third task outside the window of two: never taken for affinity.
    three = ready + [Ready("short", 3, 2, remaining=1.0, held_on=2, held_bytes=9000)]
    assert lrtf(three, 2, idle=(0,)) == 0


def test_fifo_breaks_ties_by_what_a_device_holds():
    ready = [Ready("ran", 2, 0), Ready("held", 2, 0, held_on=0, held_bytes=10), Ready("first", 1, 1)]
    assert fifo(ready, 0) == 2  # the longest waiting first, whatever it holds
    assert fifo(ready[:2], 0) == 1


def test_a_device_defers_only_when_every_ready_task_is_held_by_another_idle_device():
    held = Ready("a", 1, 1, held_on=1, held_bytes=8)
    assert defers([held], 0, idle=(1,))
    assert not defers([held], 0, idle=())            # device 1 is busy: device 0 takes it now (LRTF never waits)
    assert not defers([held, Ready("b", 2, None)], 0, idle=(1,))  # something here to take
    assert not defers([Ready("c", 1, 1)], 0, idle=(1,))           # last ran there but holds nothing now
    assert not defers([], 0, idle=(1,))


class _Bursty:
    """A task's batches; every other one takes ``pause`` seconds to produce (longer than the board's keep wait:
    the device that ran the task goes idle meanwhile)."""

    def __init__(self, batches: list[dict], pause: float) -> None:
        self.batches, self.pause = batches, pause

    def __iter__(self):
        for i, b in enumerate(self.batches):
            if i % 2:
                time.sleep(self.pause)
            yield b


def _task(seed: int, pause: float) -> ht.ModelTask:
    opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    return ht.ModelTask(make_gpt2, lambda m: opt(m.parameters()), _Bursty(lm_batches(10, seed=seed), pause),
                        seed=seed, name=f"gpt2-{seed}", epochs=1)


def test_resident_tasks_stay_on_the_device_holding_them_and_match_plain():
    tasks = [_task(1, 0.1), _task(2, 0.1)]
    cfg = ht.RuntimeConfig(devices=["cpu", "cpu"], residency="auto", policy="lrtf")
    with ht.Runtime(config=cfg) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
        stats = rt.stats()
    moved = {}
    for task, model in zip(tasks, models):
        res = stats["tasks"][task.name]["residency"]
        assert res["steps_on_device"] == 10 and res["steps_on_host"] == 0, res
        moved[task.name] = res["state_bytes_after_first_step"]
        print(task.name, "entry moves in:", res["entry_moves_in"], "h2d state:", res["copies"]["h2d"]["state"])
        assert max_param_diff(plain_train(_task(task.seed, 0.0))[0], model) == 0.0
    print("state bytes moved after the first step:", moved,
          "evictions:", [d["evictions"] for d in stats["devices"]])
    assert all(v == 0 for v in moved.values()), moved
