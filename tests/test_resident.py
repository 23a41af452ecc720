"""Task state that stays on the device (training/resident.py): a task's parameters, gradients and optimizer state
stay on the CPU device it runs on and its own optimizer steps them there; training ends bit-identical to the plain
loop whichever path it takes (resident, in host memory, evicted and brought back mid-epoch, re-planned after an
out-of-memory), and the copy counters show what moved (0 state bytes after the first step while resident)."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained
from test_transparency import _adamw_two_groups, _warmup

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.training import checkpoint
from hydra_tune.training.state import TaskState
from hydra_tune.training.state_cache import StateCache


def _gpt2_task(seed: int, name: str | None = None, **kw) -> ht.ModelTask:
    """GPT-2 with dropout, AdamW (two groups), global clipping, a warmup schedule, grad_accumulation 2."""
    kw = {"epochs": 2, "grad_clip_norm": 1.0, "grad_accumulation": 2, "lr_scheduler": _warmup, **kw}
    return ht.ModelTask(kw.pop("model", make_gpt2), functools.partial(_adamw_two_groups, lr=1e-3),
                        lm_batches(6, seed=seed), seed=seed, name=name or f"gpt2-{seed}", **kw)


def _slow(out, batch):
    time.sleep(0.02)  # a task that trains a while: the caller asks for checkpoints and snapshots meanwhile
    return out.loss


def _config(residency: str = "auto", budget: int | None = None, policy: str = "lrtf") -> ht.RuntimeConfig:
    return ht.RuntimeConfig(devices=["cpu"], device_memory=budget, residency=residency, policy=policy)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("residency", ["auto", "off"])
def test_state_stays_on_the_device_and_steps_there_bit_identical(residency):
    model, twin = (make_gpt2() for _ in range(2))  # the model object itself is trained (its own host tensors)
    twin.load_state_dict(model.state_dict())
    homes = [p.data_ptr() for p in model.parameters()]
    task = _gpt2_task(1, model=model)
    expected, history = plain_train(_gpt2_task(1, model=twin))
    with ht.Runtime(config=_config(residency)) as rt:
        h = rt.submit(task)
        got, metrics = trained(h), list(h.metrics())
        stats = rt.stats()
    res, device = stats["tasks"][task.name]["residency"], stats["devices"][0]
    params, steps, minibatches = _param_bytes(expected), 6, 12
    copies = res["copies"]
    print(f"residency={residency}: per step h2d state {copies['h2d']['state'] / steps:.0f} B, d2h state "
          f"{copies['d2h']['state'] / steps:.0f} B, syncs {copies['syncs'] / steps:.1f}; after the first step "
          f"{res['state_bytes_after_first_step']} state bytes; {res}")
    assert got is model and max_param_diff(expected, got) == 0.0
    assert [m["train_loss"] for m in metrics] == history
    assert [p.data_ptr() for p in got.parameters()] == homes  # the model holds its own host tensors again
    assert device["current_bytes"] == 0 and device["resident_tasks"] == 0 and res["state_on"] is None
    assert copies["h2d"]["batches"] > 0 and copies == device["copies"]  # one task: its copies are the device's
    if residency == "auto":
        assert res["why"] == "its state fits on cpu:0"
        assert (res["steps_on_device"], res["steps_on_host"]) == (steps, 0)
        assert res["state_bytes_after_first_step"] == 0
        assert copies["h2d"]["state"] == params  # in once, before its first step (no optimizer state yet)
        assert copies["d2h"]["state"] == 3 * params  # back once at its end: parameters and AdamW's two moments
        assert copies["syncs"] == minibatches + 1  # a loss read per minibatch, the wait for the write-back
        assert res["syncs_per_step"] == (minibatches + 1) / steps
    else:
        assert (res["steps_on_device"], res["steps_on_host"]) == (0, steps)
        assert copies["h2d"]["state"] == steps * params  # the parameters, once per step (unchanged in between)
        assert copies["d2h"]["state"] == minibatches * params  # every minibatch's gradients...
        assert copies["syncs"] == minibatches * 2  # ... behind one wait (one shard), and the loss read
        assert res["state_bytes_after_first_step"] == (steps - 1) * 3 * params
        assert res["why"].startswith("residency='off'")


def test_two_tasks_whose_state_fits_one_at_a_time_are_evicted_and_brought_back_exactly():
    with ht.Runtime(config=_config("off")) as rt:  # the plan's peak and one task's state bytes
        rt.submit(_gpt2_task(1, name="probe")).result()
        one = rt.stats()["tasks"]["probe"]
    budget = one["predicted_peak"] + one["residency"]["state_bytes"] * 3 // 2  # room for one task's state, not two
    tasks = [_gpt2_task(1), _gpt2_task(2)]
    with ht.Runtime(config=_config(budget=budget, policy="round_robin")) as rt:  # they alternate on the device
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
        stats = rt.stats()
    device = stats["devices"][0]
    print({t.name: stats["tasks"][t.name]["residency"] for t in tasks}, device)
    assert device["evictions"] >= 2 and device["peak_bytes"] <= budget and device["current_bytes"] == 0
    for task, model in zip(tasks, models):
        res = stats["tasks"][task.name]["residency"]
        # Evicted, and every step taken where its state was. Which side a step lands on is a race: the other
        # task's first unit evicts this one's state as soon as this one's segment ends, unless its host thread
        # took its step first (a step holds the state; eviction waits for it).
        assert res["evictions"] >= 1 and res["steps_on_device"] + res["steps_on_host"] == 6, res
        assert res["state_bytes_after_first_step"] > 0  # brought back after an eviction
        assert max_param_diff(plain_train(task)[0], model) == 0.0


@pytest.mark.parametrize("scaler_steps_there", [True, False])
def test_fp16_loss_scaling_over_device_gradients_matches_plain(scaler_steps_there):
    task = _gpt2_task(3, precision="fp16", grad_accumulation=1)
    with ht.Runtime(config=_config()) as rt:
        rt.devices[0].steps_loss_scaler = scaler_steps_there  # False: as CUDA devices (device/devices.py)
        h = rt.submit(task)
        model, metrics = trained(h), list(h.metrics())
        res = rt.stats()["tasks"][task.name]["residency"]
    expected, history = plain_train(task)
    if scaler_steps_there:
        assert res["steps_on_device"] == 12 and res["state_bytes_after_first_step"] == 0
    else:  # its state stays in host memory, visibly
        assert res["steps_on_host"] == 12 and res["why"].startswith("fp16 loss scaling: its GradScaler")
    assert max_param_diff(expected, model) == 0.0
    assert [m["train_loss"] for m in metrics] == history
    assert metrics[-1]["loss_scale"] == expected.final_loss_scale


def test_checkpoint_and_snapshot_taken_while_resident_are_exact(tmp_path):
    task = _gpt2_task(4, loss=_slow, epochs=3)
    with ht.Runtime(config=_config()) as rt:
        h = rt.submit(task)
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        snap = h.snapshot(timeout=60)
        during = rt.stats()["tasks"][task.name]["residency"]
        final = trained(h)
    # still resident after both (they read host copies, the state stayed), which took copies of its values out
    assert during["state_on"] == "cpu:0" and during["steps_on_host"] == 0 and during["evictions"] == 0, during
    assert during["copies"]["d2h"]["state"] >= 2 * _param_bytes(final)
    assert all(p.device.type == "cpu" for p in snap.model.parameters())
    assert max_param_diff(plain_train(_gpt2_task(4, epochs=3, max_steps=snap.steps))[0], snap.model) == 0.0
    assert max_param_diff(plain_train(_gpt2_task(4, epochs=3))[0], final) == 0.0
    steps = checkpoint.load(path)["position"]["steps"]
    assert 1 <= steps <= snap.steps
    with ht.Runtime(config=_config()) as rt:
        resumed = trained(rt.submit(_gpt2_task(4, epochs=3, resume_from=str(path))))
    assert max_param_diff(final, resumed) == 0.0


def _wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _wide_task() -> ht.ModelTask:
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(512, 32, generator=g), torch.randn(512, 4, generator=g)) for _ in range(4)]
    return ht.ModelTask(_wide_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2, seed=5, name="wide")


def test_out_of_memory_with_state_resident_replans_and_brings_the_state_back():
    with ht.Runtime(config=_config()) as rt:  # what a resident run of it peaks at
        rt.submit(_wide_task()).result()
        peak = rt.stats()["devices"][0]["peak_bytes"]
    task = _wide_task()
    with ht.Runtime(config=_config()) as rt:
        rt.devices[0].limit_memory(int(0.8 * peak))  # the device holds less than its budget said
        h = rt.submit(task)
        model = trained(h)
        stats = rt.stats()
    res = stats["tasks"][task.name]["residency"]
    print(stats["tasks"][task.name]["replans"], res)
    assert stats["tasks"][task.name]["replans"] >= 1 and len(stats["tasks"][task.name]["shards"]) >= 2
    assert res["copies"]["h2d"]["state"] >= 2 * _param_bytes(model)  # in, out at the out-of-memory, in again
    assert res["steps_on_device"] == 8 and res["steps_on_host"] == 0, res
    assert stats["devices"][0]["current_bytes"] == 0
    assert max_param_diff(plain_train(task)[0], model) == 0.0


def test_cancelled_resident_task_gives_its_state_back():
    model = make_gpt2()
    homes = [p.data_ptr() for p in model.parameters()]
    task = _gpt2_task(6, model=model, loss=_slow, epochs=20)
    with ht.Runtime(config=_config()) as rt:
        h = rt.submit(task)
        for m in h.metrics():
            h.cancel()
            break
        h.wait(60)
        stats = rt.stats()
    res = stats["tasks"][task.name]["residency"]
    assert h.status == "cancelled" and res["state_on"] is None and res["steps_on_device"] >= 1
    assert stats["devices"][0]["current_bytes"] == 0 and stats["devices"][0]["resident_tasks"] == 0
    assert [p.data_ptr() for p in model.parameters()] == homes


def _tiny_state(name: str) -> TaskState:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))]
    task = ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                        lambda m: torch.optim.Adam(m.parameters()), data, loss=lambda o, b: F.mse_loss(o, b[1]),
                        name=name)
    return TaskState.build(task, budget=None)


def test_eviction_takes_the_task_that_runs_latest_never_the_one_picked_next():
    states = {n: _tiny_state(n) for n in "abcd"}
    homes = {n: s.home for n, s in states.items()}
    one = homes["a"].state_bytes
    order: list[str] = []
    device = CpuDevice("cpu:0", budget=3 * one + 100)  # room for units of 100 bytes and three tasks' state
    cache = StateCache(device, 0, lambda: order)
    before = {n: [p.detach().clone() for p in s.model.parameters()] for n, s in states.items()}
    host = {n: [p.data_ptr() for p in s.model.parameters()] for n, s in states.items()}
    for n in "abc":
        cache.begin(homes[n], 100)
        cache.end(homes[n])
    assert [n for n in "abc" if homes[n].cache is cache] == ["a", "b", "c"]
    assert all(p.data_ptr() not in host["a"] for p in states["a"].model.parameters())  # on the device
    order[:] = ["c", "a", "b"]  # b runs latest
    cache.begin(homes["d"], 100)
    cache.end(homes["d"])
    assert [n for n in "abcd" if homes[n].cache is cache] == ["a", "c", "d"] and homes["b"].evictions == 1
    assert [p.data_ptr() for p in states["b"].model.parameters()] == host["b"]  # back in its own host tensors
    assert all(torch.equal(p, q) for p, q in zip(states["b"].model.parameters(), before["b"]))
    order[:] = ["d", "c", "a"]  # a runs latest, but it was picked to run next here: c goes
    cache.prefetched(homes["a"])
    cache.begin(homes["b"], 100)
    assert [n for n in "abcd" if homes[n].cache is cache] == ["a", "b", "d"] and cache.evictions == 2
    cache.end(homes["b"])
    cache.clear()
    assert device.current_bytes() == 0 and cache.total() == 0
    assert all([p.data_ptr() for p in s.model.parameters()] == host[n] for n, s in states.items())


def test_residency_setting_is_checked():
    with pytest.raises(ValueError, match=r"`residency` in \['auto', 'off'\] must hold, but got \(residency='gpu'\)"):
        ht.RuntimeConfig(residency="gpu")


def test_task_ended_while_its_host_thread_is_in_its_step_frees_its_state_when_the_step_returns():
    entered, gate = threading.Event(), threading.Event()

    def gated(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if next(model.parameters()).device.type != "meta":  # the footprint's meta build steps too
            opt.register_step_pre_hook(lambda *a: (entered.set(), gate.wait(60)))
        return opt

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    task = ht.ModelTask(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), gated, data,
                        loss=lambda o, b: F.mse_loss(o, b[1]), name="stuck")
    with ht.Runtime(config=_config()) as rt:
        h = rt.submit(task)
        assert entered.wait(60)
        t0 = time.monotonic()
        h.cancel()  # its host thread holds its state (in the step): the end does not wait for it
        assert h.wait(30) and h.status == "cancelled" and time.monotonic() - t0 < 10
        assert rt.stats()["devices"][0]["resident_tasks"] == 1
        gate.set()  # the step returns: its host thread lets the task go and writes its state back
        deadline = time.monotonic() + 30
        while rt.stats()["devices"][0]["resident_tasks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.stats()["devices"][0]["resident_tasks"] == 0 and rt.devices[0].current_bytes() == 0


@pytest.mark.parametrize("mode", ["recompute", "keep", "offload"])
def test_resident_shards_in_every_backward_mode_match_plain(mode):
    """A task cut into shards whose state all stays on one device: kept forwards keep the parameters (they are its
    state: not released), offloading ones leave them referenced, recomputing ones read them again."""
    import dataclasses

    from hydra_tune.training.residency import ShardCache

    task = _gpt2_task(7)
    state = TaskState.build(task, budget=500 * 1024)
    k = len(state.execs)
    assert k >= 3
    flags = tuple(i < k - 1 for i in range(k))
    state.plan = dataclasses.replace(state.plan, keep=flags if mode == "keep" else (False,) * k,
                                     offload=flags if mode == "offload" else (False,) * k)
    device = CpuDevice("cpu:0", None)
    device.resident, device.states = ShardCache(), StateCache(device, 0, lambda: [])
    for seg in state.segments(lambda m: None):
        device.states.begin(state.home, state.plan.peak)
        assert all(state.home.where(i) is device for i in range(k))
        for unit in seg.units:
            unit.run(device)
        device.states.end(state.home)
    device.resident.clear()
    assert (state.home.steps_on_device, state.home.steps_on_host) == (6, 0)
    assert state.home.counts.snapshot()["h2d"]["state"] == _param_bytes(state.model)  # in once, never again
    assert device.current_bytes() == 0 and state.home.cache is None  # written back when the loop ended
    assert max_param_diff(plain_train(task)[0], state.model) == 0.0


def test_no_copy_ahead_of_a_shard_whose_state_is_on_another_device():
    from hydra_tune.training.residency import ShardCache

    state = _tiny_state("t")
    here, there = CpuDevice("cpu:0", None), CpuDevice("cpu:1", None)
    for device in (here, there):
        device.resident, device.states = ShardCache(), StateCache(device, 0, lambda: [])
    there.states.begin(state.home, 100)
    there.states.end(state.home)
    ex = state.execs[0]
    assert ex.prefetch(here, state.store, "F") == 0 and len(here.resident) == 0  # its tensors are cpu:1's now
    state.home.release()
    assert ex.prefetch(here, state.store, "F") > 0 and len(here.resident) == 1
