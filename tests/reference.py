"""Plain PyTorch training loops: what hydra_tune must reproduce exactly."""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import torch


def plain_train(task: Any) -> tuple[torch.nn.Module, list[float]]:
    """Train ``task`` the way a user's own loop would, alone, in this thread. Returns (model, epoch losses).
    With ``precision`` "bf16"/"fp16": the forward and loss under ``torch.autocast``; "fp16" with a GradScaler."""
    torch.manual_seed(task.seed)
    model = task.model() if not isinstance(task.model, torch.nn.Module) else task.model
    model.train()
    opt = task.optimizer(model)
    sched = task.lr_scheduler(opt) if task.lr_scheduler else None
    factory = callable(task.train_data) and not hasattr(task.train_data, "__iter__")  # called once per epoch
    precision = getattr(task, "precision", "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    k, steps, history = task.grad_accumulation, 0, []

    def step() -> None:
        nonlocal steps
        if task.grad_clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        steps += 1

    for _ in range(task.epochs):
        losses, pending = [], 0
        for batch in task.train_data() if factory else task.train_data:
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                out = model(**batch) if isinstance(batch, dict) else model(
                    batch[0] if isinstance(batch, (list, tuple)) else batch)
                loss = task.loss(out, batch) if task.loss else out.loss
            if getattr(task, "nonfinite_loss", None) == "skip_step" and not torch.isfinite(loss):
                opt.zero_grad()  # drop the batch and its accumulation window's gradients; the window restarts
                pending = 0
                continue
            scaled = loss / k if k != 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            losses.append(loss.item())
            pending += 1
            if pending == k:
                step()
                pending = 0
                if task.max_steps and steps >= task.max_steps:
                    break
        if pending:
            step()
        history.append(sum(losses) / len(losses))
        if task.max_steps and steps >= task.max_steps:
            break
    if scaler is not None:
        model.final_loss_scale = scaler.get_scale()  # type: ignore[assignment]
    return model, history


def sgd_loop(make: Any, x: torch.Tensor, y: torch.Tensor, runtime: Any = None, batch: int = 8) -> torch.nn.Module:
    """The classifier loop the prepared-loop tests share: ``torch.manual_seed(0)``, ``make()``, SGD (lr 0.1) on the
    cross-entropy of ``x``/``y`` in minibatches of ``batch``; with ``runtime``, the model and optimizer prepared on
    it first (the one adoption line). Returns the model (prepared or not)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if runtime is not None:
        import hydra_tune as ht

        model, opt = ht.prepare(model, opt, runtime=runtime)
    for i in range(0, len(y), batch):
        loss = F.cross_entropy(model(x[i:i + batch]), y[i:i + batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    diffs = [(p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values())
             if p.is_floating_point()]
    return max(diffs) if diffs else math.nan


def assert_stages_match_model(model: torch.nn.Module, batch: dict, names: list[str], seed: int = 1,
                              on_carry: Any = None) -> Any:
    """Run ``model(**batch)`` and then its stages (hydra_tune.stages.extract_stages), both from ``seed``; the
    stage names must be ``names``, and the loss, the logits and every parameter gradient equal bit for bit.
    ``on_carry(i, carry)`` may inspect the carry after stage i. Returns the cut."""
    from hydra_tune.stages import extract_stages

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(seed)
    ref = model(**batch)
    ref.loss.backward()
    expected = grads()
    model.zero_grad()
    cut = extract_stages(model)
    assert [s.name for s in cut.stages] == names
    torch.manual_seed(seed)
    carry = cut.prepare(batch)
    for i, stage in enumerate(cut.stages):
        carry = stage.module(carry)
        if on_carry is not None:
            on_carry(i, carry)
    carry.loss.backward()
    assert torch.equal(carry.loss, ref.loss) and torch.equal(carry.logits, ref.logits)
    got = grads()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    return cut


def trained(handle: Any) -> torch.nn.Module:
    """The trained model of ``handle``'s task, waiting for its end (``TaskHandle.model()`` raises at once on a
    task that has not ended)."""
    handle.result()
    return handle.model()


def smallest_plan(task: Any, start_kib: int = 200, stop_kib: int = 2000) -> Any:
    """``task`` built (a TaskState) for the tightest device budget that plans, in steps of 25 KiB: the most shards."""
    import hydra_tune as ht
    from hydra_tune.training.state import TaskState

    for kib in range(start_kib, stop_kib, 25):
        try:
            return TaskState.build(task, kib * 1024)
        except ht.PlanError:
            continue
    raise AssertionError(f"no budget from {start_kib} up to {stop_kib} KiB plans this model")


def run_in_mode(state: Any, mode: str, device: Any = None) -> Any:
    """Run all of ``state``'s segments on one fresh CPU device (or ``device``) with every shard but the last in
    ``mode`` (recompute, keep or offload: the last shard's L unit never recomputes); the device, its resident copies
    cleared (``device.account.current`` is then what the run left behind)."""
    import dataclasses

    from hydra_tune.device.devices import CpuDevice
    from hydra_tune.training.residency import ShardCache

    k = len(state.execs)
    flags = tuple(i < k - 1 for i in range(k))
    state.plan = dataclasses.replace(state.plan, keep=flags if mode == "keep" else (False,) * k,
                                     offload=flags if mode == "offload" else (False,) * k)
    device = device or CpuDevice("cpu:0", None)
    device.resident = ShardCache()
    for seg in state.segments(lambda m: None):
        for unit in seg.units:
            unit.run(device)
    device.resident.clear()
    return device


def check_device_peaks(stats: dict, trace: Any, predicted: int, budget: int | None = None, prefetch: int = 0) -> None:
    """The devices' measured peaks against the plan, whichever device ran what (under load one device may take every
    unit, or none): each device's peak is within its budget; each device that ran units measured a peak > 0; each
    device that ran a last-shard L unit (forward + loss + backward: the largest unit in the tests that call this)
    peaks within 10% of ``predicted``, or of ``predicted - prefetch`` (the next shard's prefetch, on the device at
    that peak or not, depending on thread timing); at least one device ran one."""
    ran_largest = {e.device for e in trace.units() if e.kind == "L"}
    assert ran_largest, "no device ran an L unit"
    for i, d in enumerate(stats["devices"]):
        assert d["peak_bytes"] <= (budget if budget is not None else d["budget"]), d
        assert d["units"] == 0 or d["peak_bytes"] > 0, d
        if i in ran_largest:
            off = min(abs(d["peak_bytes"] - predicted), abs(d["peak_bytes"] + prefetch - predicted)) / predicted
            assert off <= 0.10, (d["name"], d["peak_bytes"], predicted, prefetch)


class SqueezingLoss:
    """A task's loss that takes ``device``'s memory away at a defined point, for out-of-memory tests: in the first
    training unit on ``device`` that computes a loss (every forward of that minibatch ran, its backward has not),
    the device gets no room beyond what it holds, so that unit's backward runs out of memory whatever the copy
    thread does; from that out-of-memory on (``Device.after_oom``, before the re-plan) it has ``share`` of the
    predicted peak given to ``arm``, which the re-planned task must fit.

        loss = SqueezingLoss(my_loss, rt.devices[0], 0.7)           # the task's ``loss=``
        h = rt.submit(task); loss.arm(rt.stats()["tasks"][task.name]["predicted_peak"])

    Why not ``device.limit_memory(int(share * peak))`` after submit: the predicted peak counts the copy thread's
    prefetch of the next shard next to the largest unit, and whether the device really goes past ``share`` of it
    depends on when that copy lands (a unit alone can stay under it; a late copy, or one refused by the limit and
    dropped as designed, leaves nothing out of memory), and where the task is when the limit comes depends on
    timing too. The unit that squeezes waits for ``arm`` (the test reads the plan's peak first). The build's calls
    (in the submitting thread) and evaluation's (no autograd) pass through, as does every call after the first."""

    def __init__(self, loss: Any, device: Any, share: float) -> None:
        self.loss, self.device, self.share = loss, device, share
        self.peak: int | None = None
        self.squeezed = False
        self._armed = threading.Event()
        self._thread = f"hydra-{device.name}"  # the device's worker (runtime/worker.py), where its units run

    def arm(self, peak: int) -> None:
        self.peak = peak
        self._armed.set()

    def __call__(self, out: Any, batch: Any) -> Any:
        value = self.loss(out, batch)
        if (not self.squeezed and torch.is_grad_enabled()
                and threading.current_thread().name == self._thread and self._armed.wait(60)):
            self.squeezed = True
            device, limit = self.device, int(self.share * self.peak)  # type: ignore[operator]
            device.limit_memory(device.current_bytes())
            device.after_oom = lambda: device.limit_memory(limit)
        return value
