"""Per-(task, shard) state entries and the lazy per-shard optimizer step through the real Runtime on CPU devices:
a task whose whole state does not fit is planned into shards whose entries fit next to their units; the entries
move in for their units, each shard's update of step t is applied just before its next use, where its entry is;
eviction goes per entry. Every path ends bit-identical to the plain loop (tests/reference.py ``plain_train``).
Budgets force each path (GPT-2 with dropout; tied weights unless said): all resident, spilled with lazy steps (2
and 4 shards), two tasks evicting each other, an unlisted optimizer falling back to one whole step."""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, trained
from test_transparency import _adamw_two_groups, _warmup

import hydra_tune as ht
from hydra_tune.training import checkpoint

SPILL_4 = 1_600_000   # tied GPT-2, grad_accumulation 2: 4 shards, about two entries fit beside the units
SPILL_2 = 1_700_000   # untied GPT-2, grad_accumulation 1: 2 shards, one entry at a time
SPILL = 1_200_000     # tied GPT-2: 6 shards; even SGD's or Adagrad's smaller state does not fit whole


def _task(seed: int = 1, name: str | None = None, tied: bool = True, n: int = 6, **kw) -> ht.ModelTask:
    kw = {"epochs": 2, "grad_clip_norm": 1.0, "grad_accumulation": 2, "lr_scheduler": _warmup,
          "optimizer": functools.partial(_adamw_two_groups, lr=1e-3), **kw}
    return ht.ModelTask(functools.partial(make_gpt2, tie_word_embeddings=tied), kw.pop("optimizer"),
                        lm_batches(n, seed=seed), seed=seed, name=name or f"gpt2-{seed}", **kw)


def _run(tasks: list[ht.ModelTask], budget: int | None, policy: str = "lrtf",
         residency: str = "auto") -> tuple[list[torch.nn.Module], list[list[dict]], dict]:
    config = ht.RuntimeConfig(devices=["cpu"], device_memory=budget, policy=policy, residency=residency)
    with ht.Runtime(config=config) as rt:
        handles = [rt.submit(t) for t in tasks]
        models = [trained(h) for h in handles]
        metrics = [list(h.metrics()) for h in handles]
        stats = rt.stats()
    return models, metrics, stats


def _exact(task: ht.ModelTask, model: torch.nn.Module, metrics: list[dict]) -> None:
    expected, history = plain_train(task)
    assert max_param_diff(expected, model) == 0.0
    assert [m["train_loss"] for m in metrics] == history


@pytest.mark.parametrize("budget,tied,accumulation,shards", [(SPILL_4, True, 2, 4), (SPILL_2, False, 1, 2)])
def test_spilled_task_steps_lazily_per_shard_where_its_entries_are_bit_identical(budget, tied, accumulation,
                                                                                  shards):
    task = _task(tied=tied, grad_accumulation=accumulation, n=4)
    (model,), (metrics,), stats = _run([task], budget)
    info = stats["tasks"][task.name]
    res = info["residency"]
    print(len(info["shards"]), {k: v for k, v in res.items() if k != "copies"})
    assert len(info["shards"]) == shards and info["replans"] == 0
    assert res["planned"].startswith("planned for per-shard entries") and res["moving_shards"] == list(range(shards))
    assert res["step_path"] == "lazy" and res["unsplit_steps"] == 0
    steps = 8 // accumulation  # 4 minibatches, 2 epochs
    assert res["lazy_steps_on_device"] + res["lazy_steps_on_host"] == steps
    assert res["lazy_steps_on_device"] >= steps - 1  # the last one is flushed at the end: where its entries are
    assert res["shard_steps_on_device"] + res["shard_steps_on_host"] == steps * shards
    assert res["evictions"] > 0 and stats["devices"][0]["peak_bytes"] <= budget
    assert res["state_on"] is None and stats["devices"][0]["current_bytes"] == 0
    moves = res["entry_moves_in"]
    if shards == 4:  # mixed: the first shard's entry (the tied embedding, read by the last shard too) stays
        assert moves[0] == 1 and min(moves[1:]) > steps, moves
    else:
        # One entry fits at a time: per minibatch (F0 L1 B0) entry 0 goes out without gradients (its update was
        # applied at F0) and comes back for B0, entry 1 comes in with step t's gradients and goes out with the
        # minibatch's. An entry is 5 parameter copies (parameters, gradients, AdamW's two moments, the step's
        # temporaries): entry 0 moves 3/5 of it each way, entry 1 4/5. From the first step to the last: 7 rounds.
        e0, e1 = res["entry_bytes"]
        predicted = (steps - 1) * 2 * (3 * e0 + 4 * e1) / 5
        moved = res["state_bytes_after_first_step"]
        print(f"state bytes per step: {moved / (steps - 1):.0f} moved, {predicted / (steps - 1):.0f} predicted")
        assert abs(moved - predicted) <= 0.1 * predicted, (moved, predicted)
        assert moves == [steps, steps] or moves == [steps + 1, steps], moves
    _exact(task, model, metrics)


def test_whole_state_that_fits_stays_resident_and_moves_nothing_after_its_first_step():
    task = _task(tied=False, grad_accumulation=1, n=2)
    (model,), (metrics,), stats = _run([task], 2_100_000)  # re-cut into 2 shards whose entries all fit
    res = stats["tasks"][task.name]["residency"]
    assert len(stats["tasks"][task.name]["shards"]) == 2 and res["planned"]
    assert res["step_path"] == "resident" and (res["steps_on_device"], res["steps_on_host"]) == (4, 0)
    assert res["state_bytes_after_first_step"] == 0 and res["shard_steps_on_device"] == 0
    _exact(task, model, metrics)


class _MyAdamW(torch.optim.AdamW):
    """A subclass: not on the lazy-step allowlist (its step could read parameters together)."""


def _my_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return _MyAdamW(model.parameters(), lr=1e-3)


def _hooked_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.register_step_post_hook(lambda *a: None)
    return opt


_UNLISTED = [(_my_adamw, "is a subclass of torch.optim.AdamW")] + (
    [(_hooked_sgd, "step post-hook")] if os.environ.get("HYDRA_TUNE_LAZY_MATRIX") else [])


@pytest.mark.parametrize("make,why", _UNLISTED)
def test_unlisted_optimizer_takes_one_whole_step_on_the_host_and_stays_exact(make, why):
    task = _task(optimizer=make, grad_accumulation=1, n=4)
    (model,), (metrics,), stats = _run([task], SPILL)
    res = stats["tasks"][task.name]["residency"]
    print({k: v for k, v in res.items() if k != "copies"})
    assert why in res["lazy"] and why in res["why"] and why in res["step_why"]
    assert res["step_path"] == "whole-host" and res["steps_on_host"] == 8 and res["shard_steps_on_device"] == 0
    assert res["planned"] == ""  # not re-cut for entries: its state stays whole
    _exact(task, model, metrics)


def test_two_tasks_that_fit_one_at_a_time_both_step_on_the_device():
    """The evicted task's imminent step goes first: a segment's end leaves its state until its host thread has
    flushed its gradients and stepped (before the fix, the other task's first unit evicted it at once and it
    usually stepped on the host)."""
    budget = 3_400_000  # one task's units (1.64 MB peak, one shard) and state (1.2 MB), not two tasks' state
    tasks = [_task(1, tied=False, grad_accumulation=1, n=3), _task(2, tied=False, grad_accumulation=1, n=3)]
    models, metrics, stats = _run(tasks, budget, policy="round_robin")
    assert stats["devices"][0]["evictions"] >= 2
    for task, model, ms in zip(tasks, models, metrics):
        res = stats["tasks"][task.name]["residency"]
        assert res["step_path"] == "resident" and len(stats["tasks"][task.name]["shards"]) == 1, res
        assert res["evictions"] >= 1 and (res["steps_on_device"], res["steps_on_host"]) == (6, 0), res
        _exact(task, model, ms)


def test_two_spilled_tasks_evict_each_others_entries_mid_epoch_and_stay_exact():
    tasks = [_task(1, grad_accumulation=1, n=3), _task(2, grad_accumulation=1, n=3)]
    models, metrics, stats = _run(tasks, SPILL_4, policy="round_robin")
    for task, model, ms in zip(tasks, models, metrics):
        res = stats["tasks"][task.name]["residency"]
        assert res["step_path"] == "lazy" and res["evictions"] > 0 and res["shard_steps_on_device"] > 0, res
        _exact(task, model, ms)


def _onecycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=12, cycle_momentum=True)


_OPTIMIZERS = {
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adamw-foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5),
}
_SCENARIOS = {
    "clip": {"grad_clip_norm": 0.5, "grad_accumulation": 1, "lr_scheduler": None},
    "accumulate": {"grad_clip_norm": None, "grad_accumulation": 2, "lr_scheduler": None},
    "warmup": {"grad_clip_norm": None, "grad_accumulation": 1, "lr_scheduler": _warmup},
    "onecycle": {"grad_clip_norm": None, "grad_accumulation": 1, "lr_scheduler": _onecycle},
}
# One scenario per optimizer in make test (the pure-algorithm tests, test_lazy_step*.py, cover the full matrix);
# HYDRA_TUNE_LAZY_MATRIX=1 runs every pair through the runtime.
_PAIRS = ([(o, s) for o in _OPTIMIZERS for s in _SCENARIOS] if os.environ.get("HYDRA_TUNE_LAZY_MATRIX") else
          [("sgd-nesterov", "onecycle"), ("adam", "clip"), ("adamw-foreach", "accumulate"), ("adagrad", "warmup"),
           ("rmsprop", "onecycle")])


@pytest.mark.parametrize("opt,scenario", _PAIRS)
def test_allowlisted_optimizers_step_lazily_through_the_runtime_bit_identical(opt, scenario):
    task = _task(optimizer=_OPTIMIZERS[opt], n=3, epochs=3 if scenario == "onecycle" else 2, **_SCENARIOS[scenario])
    (model,), (metrics,), stats = _run([task], SPILL)
    res = stats["tasks"][task.name]["residency"]
    assert res["step_path"] == "lazy" and res["shard_steps_on_device"] > 0, res
    _exact(task, model, metrics)


def _overflow_once(out, batch):
    """The minibatch starting with token 120 (the third of lm_batches(4, seed=1)) has a huge loss: scaled by the
    GradScaler its gradients overflow (inf) and that step is skipped, in both loops."""
    return out.loss * (1e34 if int(batch["input_ids"][0, 0]) == 120 else 1.0)


def test_fp16_loss_scaling_with_an_overflow_step_steps_lazily_and_matches_plain():
    task = _task(precision="fp16", grad_accumulation=1, n=4, loss=_overflow_once)
    (model,), (metrics,), stats = _run([task], SPILL_4)
    res = stats["tasks"][task.name]["residency"]
    expected, history = plain_train(task)
    assert res["step_path"] == "lazy" and res["shard_steps_on_device"] > 0, res
    assert expected.final_loss_scale < 65536.0  # steps overflowed: every shard skipped them, the scale went down
    assert metrics[-1]["loss_scale"] == expected.final_loss_scale
    assert max_param_diff(expected, model) == 0.0 and [m["train_loss"] for m in metrics] == history


def _slow(out, batch):
    time.sleep(0.02)  # a task that trains a while: checkpoints and snapshots are asked meanwhile
    return out.loss


def test_checkpoint_and_snapshot_taken_with_updates_pending_are_exact(tmp_path):
    task = _task(4, loss=_slow, epochs=2, grad_accumulation=1, n=4)
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=SPILL_4)) as rt:
        h = rt.submit(task)
        path = h.checkpoint(tmp_path / "c.pt", timeout=60)
        snap = h.snapshot(timeout=60)
        final = trained(h)
        res = rt.stats()["tasks"][task.name]["residency"]
    assert res["step_path"] == "lazy", res
    assert max_param_diff(plain_train(_task(4, epochs=2, grad_accumulation=1, n=4, max_steps=snap.steps))[0],
                          snap.model) == 0.0
    assert 1 <= checkpoint.load(path)["position"]["steps"] <= snap.steps
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=SPILL_4)) as rt:
        resumed = trained(rt.submit(_task(4, epochs=2, grad_accumulation=1, n=4, resume_from=str(path))))
    assert max_param_diff(final, resumed) == 0.0
    assert max_param_diff(plain_train(_task(4, epochs=2, grad_accumulation=1, n=4))[0], final) == 0.0


def _plain_eval(model: torch.nn.Module, data: list[dict]) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model(**b).loss.item() for b in data]
    model.train()
    return sum(losses) / len(losses)


def test_eval_right_after_a_step_sees_the_updated_weights():
    eval_data = lm_batches(2, seed=9)
    task = _task(5, eval_data=eval_data, grad_accumulation=1, n=4, epochs=2)
    (model,), (metrics,), stats = _run([task], SPILL_4)
    assert stats["tasks"][task.name]["residency"]["step_path"] == "lazy"
    for epoch, m in enumerate(metrics, start=1):
        plain, _ = plain_train(_task(5, grad_accumulation=1, n=4, epochs=epoch))
        assert m["eval_loss"] == _plain_eval(plain, eval_data), epoch
    _exact(task, model, metrics)


def test_out_of_memory_with_entries_on_the_device_replans_turns_entries_off_and_stays_exact():
    task = _task(6, grad_accumulation=1, n=4)
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=SPILL_4)) as rt:
        rt.devices[0].limit_memory(int(0.7 * SPILL_4))  # the device holds less than its budget says
        h = rt.submit(task)
        model, metrics = trained(h), list(h.metrics())
        info = rt.stats()["tasks"][task.name]
    res = info["residency"]
    print(info["replans"], {k: v for k, v in res.items() if k != "copies"})
    assert info["replans"] >= 1 and "per-shard entries are off on cpu:0 since it ran out of memory" in res["why"]
    _exact(task, model, metrics)


def _nan_once(out, batch):
    return out.loss * (float("nan") if int(batch["input_ids"][0, 0]) == 21 else 1.0)  # the second minibatch


def test_a_skipped_minibatch_with_updates_pending_is_dropped_as_in_the_plain_loop():
    """nonfinite_loss="skip_step" zeroes the gradients: pending per-shard updates are applied first (its units
    applied them already; a flush makes sure), so the skipped window's gradients go and step t's update stays."""
    task = _task(grad_accumulation=2, n=4, loss=_nan_once, nonfinite_loss="skip_step")
    (model,), (metrics,), stats = _run([task], SPILL_4)
    res = stats["tasks"][task.name]["residency"]
    assert res["step_path"] == "lazy" and [m["skipped_batches"] for m in metrics] == [1, 1], (res, metrics)
    _exact(task, model, metrics)


def test_shards_whose_entries_do_not_fit_keep_the_host_path_next_to_moving_ones():
    """The plan's peak leaves room for the small entries (embedding, head) but not for a block's: the blocks keep
    the host path (copied in per unit, updated in host memory), the others move in and are updated there."""
    from hydra_tune.device.devices import CpuDevice
    from hydra_tune.training.residency import ShardCache
    from hydra_tune.training.state import TaskState
    from hydra_tune.training.state_cache import StateCache

    task = _task(7, grad_accumulation=1, n=3)
    state = TaskState.build(task, budget=500 * 1024)
    sizes = state.home.entry_list()
    small, block = max(sizes[0], sizes[0] + sizes[-1]), max(sizes[1:-1])
    assert small < block
    device = CpuDevice("cpu:0", budget=state.plan.peak + (small + block) // 2)
    device.resident, device.states = ShardCache(), StateCache(device, 0, lambda: [])
    for seg in state.segments(lambda m: None):
        device.states.begin(state.home, state.plan.peak)
        for j, unit in enumerate(seg.units):
            device.states.using(state.home, [u.shard for u in seg.units[j:]])
            unit.run(device)
        device.states.end(state.home)
    device.resident.clear()
    res = state.home.stats()
    last = len(sizes) - 1
    assert res["moving_shards"] == [0, last] and f"shards {list(range(1, last))} keep the host path" in res["why"]
    assert res["shard_steps_on_device"] > 0 and res["shard_steps_on_host"] > 0, res
    assert device.current_bytes() == 0 and state.home.cache is None
    assert max_param_diff(plain_train(task)[0], state.model) == 0.0


def test_eval_fn_of_a_spilled_task_sees_the_weights_after_the_step():
    """eval_fn reads the whole model on the host: a spilled task's pending per-shard updates are applied first
    (without eval_data, nothing else flushes them at the epoch's end)."""
    def weight_sum(model: torch.nn.Module) -> dict:
        return {"weight_sum": float(sum(p.double().sum() for p in model.parameters()))}

    task = _task(tied=False, grad_accumulation=1, n=4, eval_fn=weight_sum)
    (model,), (metrics,), stats = _run([task], SPILL_2)
    assert stats["tasks"][task.name]["residency"]["step_path"] == "lazy"
    expected = [weight_sum(plain_train(_task(tied=False, grad_accumulation=1, n=4, epochs=e))[0])["weight_sum"]
                for e in (1, 2)]
    assert [m["weight_sum"] for m in metrics] == expected
    _exact(task, model, metrics)
