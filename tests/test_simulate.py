"""The schedule simulator: exact makespans on hand-computable cases, the fast pools against the policy functions,
trace round trips, and the large heterogeneous case against its lower bound."""
from __future__ import annotations

import importlib
import random
import time

import pytest

from hydra_tune.policy.schedule import POLICIES
from hydra_tune.runtime.trace import COPY, Event, Trace
from hydra_tune.sim.pool import ListPool, make_pool
from hydra_tune.sim.simulator import (
    SimResult,
    SimTask,
    SimUnit,
    lower_bound,
    simulate,
    synthetic_tasks,
    tasks_from_trace,
)

sim = importlib.import_module("hydra_tune.sim.simulator")


def _chain(name: str, segments: int, seconds: float = 1.0) -> SimTask:
    """K = 1 training: every segment is one L unit."""
    return SimTask(name, tuple(SimUnit("L", 0, seconds, 0, s) for s in range(segments)))


def _minibatches(name: str, segments: int, f: float = 1.0, nbytes: int = 0) -> SimTask:
    """K = 2 training: F0 (f), L1 (3f), B0 (2f) per minibatch."""
    return SimTask(name, tuple(SimUnit(k, sh, x * f, nbytes, s) for s in range(segments)
                               for k, sh, x in (("F", 0, 1), ("L", 1, 3), ("B", 0, 2))))


@pytest.mark.parametrize("prefetch", [True, False])
def test_two_identical_tasks_run_side_by_side_and_keep_their_device(prefetch):
    tasks = [_minibatches("a", 3), _minibatches("b", 3)]   # chain: 3 x (1 + 3 + 2) = 18
    two = simulate(tasks, 2, "lrtf", prefetch=prefetch, record=True)
    assert two.makespan == 18.0
    assert two.busy == (18.0, 18.0) and two.utilisation() == 1.0
    assert {(e.task, e.device) for e in two.trace.units()} == {("a", 0), ("b", 1)}   # affinity
    assert simulate(tasks, 1, "lrtf", prefetch=prefetch).makespan == 36.0


def test_lower_bound_by_hand():
    tasks = [_chain("a", 10), _chain("b", 2), _chain("c", 2)]
    assert lower_bound(tasks, 2) == 10.0                                      # the longest chain binds
    assert lower_bound([_chain(n, 3) for n in "abcd"], 2) == 6.0              # the work per device binds
    res = simulate(tasks, 2, "lower_bound")
    assert res == SimResult("lower_bound", 10.0, (7.0, 7.0), None) and res.utilisation() == 0.7


def test_model_parallel_is_the_serial_sum_on_pinned_devices():
    tasks = [_minibatches("a", 2), _chain("b", 3)]   # 12 + 3
    res = simulate(tasks, 2, "model_parallel", bandwidth=1.0, record=True)   # resident shards: copies free
    assert res.makespan == 15.0
    assert res.busy == (3 * 2 + 3.0, 3 * 2.0)   # shard 0 of a (F, B) and b's only shard on 0; a's L1 on 1
    assert [e.start for e in res.trace.units()] == [0, 1, 4, 6, 7, 10, 12, 13, 14]


def test_task_parallel_puts_each_task_on_the_device_that_frees_first():
    tasks = [_chain("a", 1, 5.0), _chain("b", 1, 3.0), _chain("c", 1, 2.0)]
    res = simulate(tasks, 2, "task_parallel", record=True)
    assert res.makespan == 5.0 and res.busy == (5.0, 5.0)
    assert [(e.task, e.device, e.start) for e in res.trace.units()] == [("a", 0, 0), ("b", 1, 0), ("c", 1, 3)]


def test_lrtf_beats_fifo_when_the_long_task_arrives_last():
    # 2 devices; s1, s2: 2 one-second segments each; long: 4, listed last. Without prefetch devices ask when a
    # segment ends, their running task competing. lrtf starts `long` at once and device 0 keeps it while it has
    # the most work left; at 3 s s2 ties it and has waited longer, so device 0 takes s2 and device 1 (s1 done)
    # runs long's last segment: 4 s (= the lower bound). fifo runs s1, s2 first, so `long` runs 1..5.
    tasks = [_chain("s1", 2), _chain("s2", 2), _chain("long", 4)]
    lrtf = simulate(tasks, 2, "lrtf", prefetch=False, record=True)
    fifo = simulate(tasks, 2, "fifo", prefetch=False, record=True)
    assert (lrtf.makespan, fifo.makespan, lower_bound(tasks, 2)) == (4.0, 5.0, 4.0)
    assert [(e.device, e.start) for e in lrtf.trace.units() if e.task == "long"] == [(0, 0), (0, 1), (0, 2),
                                                                                      (1, 3)]
    assert [(e.device, e.start) for e in fifo.trace.units() if e.task == "long"] == [(0, 1), (1, 2), (1, 3),
                                                                                      (1, 4)]
    assert simulate(tasks, 2, "round_robin", prefetch=False).makespan == 5.0


def test_the_running_task_competes_for_its_device():
    # One device, one-unit segments; `long` (3 segments) is listed first. lrtf keeps the device on `long` while it
    # has more work left than `short` (on a tie the one waiting longer wins); fifo and round_robin hand the device
    # to `short` after long's first turn.
    tasks = [_chain("long", 3), _chain("short", 1)]
    order = {p: [e.task for e in simulate(tasks, 1, p, record=True).trace.units()] for p in POLICIES}
    assert order == {"lrtf": ["long", "long", "short", "long"], "fifo": ["long", "short", "long", "long"],
                     "round_robin": ["long", "short", "long", "long"]}
    # 1 s units copying 100 B at 100 B/s. Continuing with the same task: its next segment's host work (and so
    # its first copy) waits for the segment's end: 1 + 1, then 1 + 1. Another task's first shard copies during
    # the last unit: 1 + 1, then 1.
    same = [SimTask("a", (SimUnit("E", 0, 1.0, 100, 0), SimUnit("E", 1, 1.0, 100, 1)))]
    other = [SimTask("a", (SimUnit("E", 0, 1.0, 100, 0),)), SimTask("b", (SimUnit("E", 1, 1.0, 100, 0),))]
    assert simulate(same, 1, bandwidth=100.0).makespan == 4.0
    assert simulate(other, 1, bandwidth=100.0).makespan == 3.0


def test_prefetch_hides_copies_behind_compute():
    # One device, 100 B per unit at 100 B/s: every copy takes 1 s, every unit 1 s. Serial: 3 x (copy + unit) for
    # the first minibatch; the second's F0 finds shard 0 still resident (B0 just ran): 6 + 1 + 2 + 2 = 11.
    # Prefetch: each copy runs during the previous unit, so only the very first one is exposed: 4, then 3.
    task = [SimTask("a", tuple(SimUnit(k, sh, 1.0, 100, s) for s in range(2) for k, sh in (("F", 0), ("L", 1),
                                                                                            ("B", 0))))]
    on = simulate(task, 1, bandwidth=100.0, prefetch=True, record=True)
    off = simulate(task, 1, bandwidth=100.0, prefetch=False, record=True)
    assert (on.makespan, off.makespan, simulate(task, 1).makespan) == (7.0, 11.0, 6.0)
    assert [(c.shard, c.start, c.end) for c in on.trace.copies()] == [(0, 0, 1), (1, 1, 2), (0, 2, 3), (1, 4, 5),
                                                                      (0, 5, 6)]
    assert all(c.kind == "H2D" and c.bytes == 100 and c.lane == COPY for c in off.trace.copies())
    assert len(off.trace.copies()) == 5


def test_fast_pools_choose_exactly_what_the_policy_functions_choose():
    rng = random.Random(7)
    names = [f"t{i}" for i in range(40)]
    for name, fn in POLICIES.items():
        outcomes = set()   # (the running task competed, it won)
        for case in range(150):
            fast, ref = make_pool(name, names, True), ListPool(fn, names)
            assert type(fast) is not ListPool
            seq, live = 0, set()
            for _ in range(rng.randint(1, 60)):
                if rng.random() < 0.45:   # a device asks, half the time with its running task competing
                    device = rng.randrange(6)
                    idle = tuple(rng.sample([d for d in range(6) if d != device], rng.randint(0, 5)))
                    spare = [i for i in range(40) if i not in live]
                    cur = ((rng.choice(spare), seq, device, float(rng.randint(0, 4)), rng.randint(0, 3))
                           if spare and (not live or rng.random() < 0.5) else None)
                    if cur is None and not live:
                        continue
                    got, want = fast.take(device, idle, cur), ref.take(device, idle, cur)
                    assert got == want, (name, case)
                    outcomes.add((cur is not None, cur is not None and got == cur[0]))
                    live.discard(got)
                    assert len(fast) == len(ref) == len(live)
                else:
                    tid = rng.choice([i for i in range(40) if i not in live])
                    args = (tid, seq, rng.choice([None, 0, 1, 2, 3, 4, 5]), float(rng.randint(0, 4)),
                            rng.randint(0, 3))
                    fast.push(*args)
                    ref.push(*args)
                    live.add(tid)
                    seq += 1
        assert outcomes == {(False, False), (True, False), (True, True)}, name


@pytest.mark.parametrize("policy", list(POLICIES))
def test_fast_and_reference_simulations_are_identical(policy):
    tasks = synthetic_tasks(30, seed=3, minibatches=(2, 12))
    for devices, bandwidth, prefetch in ((4, None, True), (7, 16e9, True), (5, 8e9, False), (40, None, False)):
        fast = sim._run(tasks, devices, policy, bandwidth, prefetch, True, fast=True)
        ref = sim._run(tasks, devices, policy, bandwidth, prefetch, True, fast=False)
        assert fast == ref


def test_trace_round_trip_reproduces_the_tasks_and_the_makespan():
    tasks = synthetic_tasks(6, seed=1, minibatches=(2, 5))
    res = simulate(tasks, 3, "lrtf", record=True)
    back = tasks_from_trace(res.trace)
    assert sorted(t.name for t in back) == sorted(t.name for t in tasks)
    by_name = {t.name: t for t in back}
    for t in tasks:
        got = by_name[t.name].units
        assert [(u.kind, u.shard, u.segment) for u in got] == [(u.kind, u.shard, u.segment) for u in t.units]
        assert [u.seconds for u in got] == pytest.approx([u.seconds for u in t.units])
    assert simulate(back, 3, "lrtf").makespan == pytest.approx(res.makespan)


def test_tasks_from_a_hand_built_trace():
    ev = [Event(0, "a", 1, "L", 1.0, 4.0, segment=0), Event(0, "a", 0, "F", 0.0, 0.8, segment=0),
          Event(0, "a", 0, "B", 4.0, 6.0, segment=0), Event(1, "a", 0, "F", 6.5, 7.0, segment=1),
          Event(0, "a", 1, "H2D", 0.5, 1.0, 50, COPY),       # prefetched during F0: goes to L1
          Event(1, "a", 0, "H2D", 6.0, 6.4, 30, COPY, 1),    # the next minibatch's F0, on device 1
          Event(0, "a", 0, "D2H", 6.0, 6.1, 99, COPY),       # copies out are not inputs
          Event(1, "a", 3, "H2D", 9.0, 9.5, 77, COPY),       # no unit follows it: ignored
          Event(1, "b", 0, "E", 0.0, 0.25), Event(1, "b", 0, "E", 0.25, 0.5)]   # segment -1: one unit each
    trace = Trace(["cpu", "cpu"], ev)
    a, b = tasks_from_trace(trace, gaps=False)
    assert a == SimTask("a", (SimUnit("F", 0, 0.8, 0, 0), SimUnit("L", 1, 3.0, 50, 0), SimUnit("B", 0, 2.0, 0, 0),
                              SimUnit("F", 0, 0.5, 30, 1)))
    assert b == SimTask("b", (SimUnit("E", 0, 0.25, 0, 0), SimUnit("E", 0, 0.25, 0, 1)))
    # gaps: F0 held device 0 until L1 started (1.0); the second F0 waited 0.5 s after device 1 and task a were
    # both free (6.0): host work, counted as its time.
    a, b2 = tasks_from_trace(trace)
    assert [u.seconds for u in a.units] == [1.0, 3.0, 2.0, 1.0] and b2 == b
    assert simulate([a, b2], 2, "lrtf", prefetch=False).makespan == 7.0


def test_synthetic_workload_is_heterogeneous_and_deterministic():
    tasks = synthetic_tasks(50, seed=4)
    assert tasks == synthetic_tasks(50, seed=4) and tasks != synthetic_tasks(50, seed=5)
    shards = {max(u.shard for u in t.units) + 1 for t in tasks}
    assert min(shards) == 1 and max(shards) == 8
    firsts = [t.units[0].seconds for t in tasks if t.units[0].kind == "F"]
    assert max(firsts) / min(firsts) > 4   # model sizes differ
    steps = [sum(u.kind == "L" for u in t.units) for t in tasks]
    assert 20 <= min(steps) and max(steps) <= 200


def test_heterogeneous_case_is_near_its_lower_bound():
    # 200 tasks (1000 x 512 and x 128 are benchmarks/p5_simulator.py: ~12 s with the workload's generation).
    tasks = synthetic_tasks(200, seed=0)
    t0 = time.perf_counter()
    # 64 devices: the longest chain binds. Measured (seed 0, free copies): lrtf 1.000, task_parallel 1.161.
    lb = lower_bound(tasks, 64)
    lrtf, tp = simulate(tasks, 64, "lrtf").makespan, simulate(tasks, 64, "task_parallel").makespan
    assert lb * (1 - 1e-9) <= lrtf <= 1.05 * lb < tp
    # With copies at 16 GB/s (each takes half its unit's compute) prefetch hides most of them: measured 1.041.
    assert simulate(tasks, 64, "lrtf", bandwidth=16e9).makespan <= 1.10 * lb
    assert simulate(tasks, 64, "lrtf", bandwidth=16e9, prefetch=False).makespan > 1.2 * lb
    # 32 devices: work / devices binds, and only lrtf keeps every device busy to the end. Measured: lrtf 1.000,
    # round_robin 1.176, fifo 1.311, task_parallel 1.504.
    lb = lower_bound(tasks, 32)
    got = {p: simulate(tasks, 32, p).makespan / lb for p in ("lrtf", "round_robin", "fifo", "task_parallel")}
    assert 1 - 1e-9 <= got["lrtf"] <= 1.01 and 1.1 < got["round_robin"] < got["fifo"] < got["task_parallel"], got
    assert time.perf_counter() - t0 < 10


def test_bad_input_fails_early_with_the_rule_and_the_fix():
    tasks = [_chain("a", 1)]
    with pytest.raises(ValueError, match=r"`policy` in \[.*'task_parallel'.*\] must hold, but got \(policy='x'\)"):
        simulate(tasks, 2, "x")
    with pytest.raises(ValueError, match=r"`devices` is an int >= 1 must hold, but got \(devices=0\)\. Fix"):
        simulate(tasks, 0)
    with pytest.raises(ValueError, match="bandwidth=0"):
        simulate(tasks, 1, bandwidth=0)
    with pytest.raises(ValueError, match="unique names"):
        simulate(tasks * 2, 1)
    with pytest.raises(ValueError, match="kind in"):
        simulate([SimTask("x", (SimUnit("Q", 0, 1.0),))], 1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        lower_bound([SimTask("x", (SimUnit("F", 0, float("nan")),))], 1)


@pytest.mark.serial   # a measured makespan: another test beside it would stretch it
@pytest.mark.skipif(not hasattr(__import__("hydra_tune").Runtime, "trace"), reason="Runtime.trace() not there yet")
def test_simulator_reproduces_measured_run():
    import torch
    from conftest import lm_batches, make_gpt2

    import hydra_tune as ht

    tasks = [ht.ModelTask(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lm_batches(6, seed=i),
                          epochs=1, seed=i, name=f"gpt2-{i}") for i in range(4)]
    with ht.Runtime(["cpu", "cpu"], "600KiB", policy="lrtf") as rt:
        for h in [rt.submit(t) for t in tasks]:
            h.result()
        trace = rt.trace()
    simulated = simulate(tasks_from_trace(trace), 2, "lrtf").makespan
    assert simulated == pytest.approx(trace.makespan(), rel=0.15), (simulated, trace.makespan())


def test_public_names_are_the_functions():
    import hydra_tune as ht
    import hydra_tune.sim.simulator  # noqa: F401  (loading the submodule must not shadow the function)

    assert callable(ht.simulate) and ht.simulate.__name__ == "simulate"
    assert callable(ht.plot_timeline) and ht.plot_timeline.__name__ == "plot_timeline"
