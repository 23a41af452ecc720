"""Scheduling policies over plain records: exact expected choices."""
from __future__ import annotations

import pytest

from hydra_tune.policy.schedule import POLICIES, Estimator, Ready, fifo, lrtf, round_robin


def test_fifo_picks_longest_waiting_then_affinity():
    ready = [Ready("a", 5, 0), Ready("b", 2, 1), Ready("c", 2, 0)]
    assert fifo(ready, 0) == 2  # b and c waited equally; c last ran on device 0
    assert fifo(ready, 1) == 1
    assert fifo([Ready("a", 1, None)], 3) == 0


def test_lrtf_picks_longest_remaining_first():
    ready = [Ready("a", 1, None, remaining=5.0), Ready("b", 2, None, remaining=9.0),
             Ready("c", 3, None, remaining=7.0)]
    assert lrtf(ready, 0) == 1
    # Equal remaining: the one that became ready first.
    assert lrtf([Ready("a", 4, None, 3.0), Ready("b", 2, None, 3.0)], 0) == 1


def test_lrtf_affinity_only_within_the_tasks_that_start_now():
    ready = [Ready("long", 1, 1, remaining=9.0), Ready("mid", 2, 0, remaining=5.0),
             Ready("short", 3, 0, remaining=1.0)]
    # Device 0 alone is free: only the longest task starts now, whatever device it last ran on.
    assert lrtf(ready, 0, idle=()) == 0
    # Devices 0 and 2 are free: "long" and "mid" both start now; device 0 takes "mid", which last ran on it.
    assert lrtf(ready, 0, idle=(2,)) == 1
    # Device 2 asks while 0 is also free: nothing last ran on 2; "long" did not last run on an idle device.
    assert lrtf(ready, 2, idle=(0,)) == 0
    # Device 2 asks while 1 is free: "long" last ran on idle device 1, which will take it; 2 takes "mid".
    assert lrtf(ready, 2, idle=(1,)) == 1


def test_lrtf_never_skips_the_longest_task_for_affinity_when_it_would_wait():
    ready = [Ready("long", 1, 1, remaining=9.0), Ready("here", 2, 0, remaining=8.0)]
    # Only device 0 is free and "long" last ran on busy device 1: LRTF runs "long" now rather than wait.
    assert lrtf(ready, 0, idle=()) == 0


def test_round_robin_gives_every_task_a_turn():
    ready = [Ready("a", 1, 0, turns=2, admitted=1), Ready("b", 2, 1, turns=1, admitted=2),
             Ready("c", 3, 0, turns=1, admitted=3)]
    assert round_robin(ready, 0) == 1  # fewest turns, then admission order
    assert round_robin(ready[:1] + ready[2:], 0) == 1


def test_policies_table_names_all_three():
    assert sorted(POLICIES) == ["fifo", "lrtf", "round_robin"]


def test_estimator_smooths_per_task_and_kind():
    est = Estimator(alpha=0.5)
    assert est.remaining("a", {"F": 3}) == 0.0          # nothing measured anywhere yet
    est.observe("a", "F", 5.0)   # warm-up: replaced by the second observation
    est.observe("a", "F", 0.2)
    est.observe("a", "F", 0.4)
    assert est.unit_time("a", "F") == pytest.approx(0.3)
    est.observe("a", "B", 0.9)
    est.observe("a", "B", 0.9)
    assert est.remaining("a", {"F": 10, "B": 2}) == pytest.approx(10 * 0.3 + 2 * 0.9)
    # An unmeasured kind of a measured task: that task's mean unit time.
    assert est.unit_time("a", "L") == pytest.approx((0.3 + 0.9) / 2)
    # A new task: the mean over every measured (task, kind).
    est.observe("b", "F", 0.6)
    assert est.unit_time("c", "F") == pytest.approx((0.3 + 0.9 + 0.6) / 3)
    est.forget("a")
    assert est.unit_time("a", "F") == pytest.approx(0.6)
