"""Check hydra_tune on a real GPU: exactness vs plain CUDA PyTorch, measured peak vs budget, H2D bandwidth, and
the throughput cost of spilling a GPT-2 into shards. Prints a table, then one JSON line with the raw numbers.

    python benchmarks/gpu_check.py            # on a CUDA machine; meant to stay under 4 min on one H200
    python benchmarks/gpu_check.py --cpu      # dry run of (a), (b), (d) on CPU stand-ins, tiny sizes
    python benchmarks/gpu_check.py | tail -1 | python -m json.tool

Sections: (a) a small tied GPT-2 trained through Runtime(devices=["cuda:0"]) in >= 3 shards vs the same loop in
plain PyTorch on CUDA, with dropout off (should agree to float noise) and on (same seed: same masks expected);
the plain-CPU-vs-plain-CUDA difference is printed as the floor set by the device change alone. (b) measured
device peak vs budget. (c) pinned vs pageable host-to-device copies of 256 MiB, and pin_memory()+copy (the path
hydra_tune takes for pageable host tensors), and device-to-host pinned vs pageable. (d) GPT-2 12x768, seq 512,
batch 8 (--quick: 8x384, vocab 8192, seq 256, batch 4), spilled under an artificial budget into >= 4 shards vs
unsharded vs plain CUDA: steady-state samples/s (epoch 2 only), peaks, kept shards, prefetched bytes. (e) from the
spilled run's trace (saved as gpu_check_sharded_trace.json): the share of prefetch copy time that overlapped a
unit on the same device. (f) the memory model unit by unit: every unit of a small GPT-2 minibatch, recomputing
and offloading, predicted bytes (profiled on the device) vs the device's measured peak. (h) keep, offload and
recompute forced on every shard of a GPT-2 with dropout: bit-identical weights between them. (g) a real
out-of-memory mid-training re-plans and still matches plain.
Without CUDA (and without --cpu) it prints "no CUDA device: skipped" and exits 0. Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from _common import Size, adamw, token_batches  # what the CPU benchmarks use (benchmarks/ is on sys.path)
from _gpu_report import report
from _perf import gpt2_factory

import hydra_tune as ht
from hydra_tune.errors import format_bytes

Batch = dict[str, torch.Tensor]


SMALL = Size(4, 64, 4, 256, 32, 4, 6, 2)          # (a): exactness
FULL = Size(12, 768, 12, 50257, 512, 8, 4, 2)     # (d) on a GPU
QUICK = Size(8, 384, 6, 8192, 256, 4, 3, 2)       # (d) with --quick
TINY = Size(4, 64, 4, 256, 64, 4, 3, 2)           # (d) with --cpu


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plain_train(task: ht.ModelTask, device: str) -> tuple[nn.Module, list[dict[str, float]]]:
    """The task's loop in plain PyTorch on ``device`` (like tests/reference.py). Returns the model on CPU and
    per-epoch {train_loss, samples, seconds} (cumulative, as hydra_tune's metrics)."""
    torch.manual_seed(task.seed)  # seeds the CPU and CUDA generators: same init (on CPU), masks, as hydra_tune
    model = task.model().to(device)
    model.train()
    opt = task.optimizer(model)
    sched = task.lr_scheduler(opt) if task.lr_scheduler else None
    k, history, samples, start = task.grad_accumulation, [], 0, time.perf_counter()

    def step() -> None:
        if task.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip_norm)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()

    for _ in range(task.epochs):
        losses, pending = [], 0
        for batch in task.train_data:
            batch = {key: t.to(device) for key, t in batch.items()}
            loss = model(**batch).loss
            (loss / k if k != 1 else loss).backward()
            losses.append(loss.item())
            samples += batch["input_ids"].shape[0]
            pending += 1
            if pending == k:
                step()
                pending = 0
        if pending:
            step()
        sync(device)
        history.append({"train_loss": sum(losses) / len(losses), "samples": samples,
                        "seconds": time.perf_counter() - start})
    return model.cpu(), history


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[n].float() - sb[n].float()).abs().max().item() for n in sa if sa[n].is_floating_point())


def device_overhead(device: str) -> int:
    """Bytes the device holds before any unit (cuBLAS workspaces of the worker and autograd threads)."""
    with ht.Runtime(devices=[device]) as rt:
        return int(rt.stats()["devices"][0]["overhead_bytes"])


def budget_for(factory: Callable[[], nn.Module], batch: Batch, min_shards: int, device: str = "cpu") -> int:
    """The largest budget (a whole percent of the unsharded peak) whose plan has >= min_shards shards, else the one
    with the most shards, plus the device's own overhead (the runtime plans with budget - overhead). Peeks at
    hydra_tune's planner, which measures stage costs on CPU as Runtime.submit does."""
    return _plan_budget(factory, batch, min_shards) + device_overhead(device)


def _plan_budget(factory: Callable[[], nn.Module], batch: Batch, min_shards: int) -> int:
    from hydra_tune.errors import PlanError
    from hydra_tune.policy.partition import partition
    from hydra_tune.stages import extract_stages
    from hydra_tune.training.profile import measure_costs

    torch.manual_seed(0)
    costs = measure_costs(extract_stages(factory()), batch)
    whole = partition(costs, None).peak
    most: tuple[int, int] = (1, whole)  # (shards, budget)
    for pct in range(99, 0, -1):
        budget = whole * pct // 100
        try:
            shards = len(partition(costs, budget).shards)
        except PlanError:  # below what the largest stage needs: smaller budgets fail too
            break
        if shards >= min_shards:
            return budget
        most = max(most, (shards, budget), key=lambda sb: sb[0])
    print(f"note: at most {most[0]} shards (< {min_shards}) for any budget; using {format_bytes(most[1])}")
    return most[1]


def steady_rate(history: list[dict[str, Any]]) -> float:
    """Samples/s over the last epoch only (the first warms up kernels, allocators and pinned buffers)."""
    a, b = (history[-2] if len(history) > 1 else {"samples": 0, "seconds": 0.0}), history[-1]
    return (b["samples"] - a["samples"]) / (b["seconds"] - a["seconds"])


def device_run(device: str, budget: int | None, tasks: list[ht.ModelTask], trace: str | None = None
               ) -> tuple[list[Any], dict[str, Any]]:
    """Train ``tasks`` on one device; returns [(model, metrics)] and the runtime's stats (with the trace's
    per-device copy/compute overlap; the trace is saved to ``trace`` when given)."""
    free_cuda()
    with ht.Runtime(devices=[device], device_memory=budget) as rt:
        handles = [rt.submit(t) for t in tasks]
        for h in handles:
            h.result()   # model() is the trained model once the task ended
        out = [(h.model(), list(h.metrics())) for h in handles]
        stats = rt.stats()
        timeline = rt.trace()
    stats["overlap"] = timeline.overlap()[0]
    stats["copy_seconds"] = sum(e.seconds for e in timeline.copies())
    if trace:
        timeline.save(trace)
    return out, stats


def exactness(device: str) -> dict[str, Any]:
    """(a) and (b): two small GPT-2 tasks (dropout 0.0 and 0.1) co-scheduled on one device, >= 3 shards."""
    data = token_batches(SMALL, seed=1)
    tasks = [ht.ModelTask(gpt2_factory(SMALL, p), adamw(1e-3), data, epochs=2, lr_scheduler=warmup,
                          grad_clip_norm=1.0, seed=7, name=f"exact-p{p}") for p in (0.0, 0.1)]
    budget = budget_for(tasks[0].model, data[0], 3, device)
    runs, stats = device_run(device, budget, tasks)
    dev = stats["devices"][0]
    out: dict[str, Any] = {"budget": budget, "peak": dev["peak_bytes"], "resident_after": dev["current_bytes"],
                           "predicted_peak": stats["tasks"][tasks[0].name]["predicted_peak"]}
    for task, (model, metrics) in zip(tasks, runs):
        ref, hist = plain_train(task, device)
        cpu_ref, _ = plain_train(task, "cpu")
        out[task.name] = {"shards": len(stats["tasks"][task.name]["shards"]), "diff": max_param_diff(model, ref),
                          "floor": max_param_diff(cpu_ref, ref), "diff_vs_cpu": max_param_diff(model, cpu_ref),
                          "loss_diff": max(abs(m["train_loss"] - h["train_loss"]) for m, h in zip(metrics, hist))}
    return out


def bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> dict[str, float]:
    """(c) GB/s (best of ``reps``) host-to-device and device-to-host: pinned and pageable host memory (CUDA
    events), and pin_memory() + copy (wall clock: the path hydra_tune takes for a pageable host tensor)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    out = {}
    for kind in ("H2D pinned", "H2D pageable", "H2D pin+copy", "D2H pinned", "D2H pageable"):
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory="pinned" in kind)  # ones: pages touched
        best = float("inf")
        for i in range(reps + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            if kind.startswith("H2D"):
                dev.copy_(host.pin_memory() if "pin+copy" in kind else host, non_blocking="pageable" not in kind)
            else:
                host.copy_(dev, non_blocking="pinned" in kind)
            end.record()
            end.synchronize()
            seconds = time.perf_counter() - t0 if "pin+copy" in kind else start.elapsed_time(end) / 1e3
            if i:
                best = min(best, seconds)
        out[kind] = nbytes / best / 1e9
        del host
    del dev
    free_cuda()
    return out


def throughput(device: str, size: Size) -> dict[str, Any]:
    """(d) sharded (>= 4 shards) vs unsharded vs plain PyTorch: steady samples/s and peak bytes."""
    data = token_batches(size, seed=2)

    def task(name: str) -> ht.ModelTask:
        return ht.ModelTask(gpt2_factory(size, 0.1), adamw(1e-4), data, epochs=2, grad_clip_norm=1.0, seed=3,
                            name=name)

    budget = budget_for(task("probe").model, data[0], 4, device)
    out: dict[str, Any] = {"model": size.label()}
    for name, limit in (("sharded", budget), ("unsharded", None)):
        [(_, metrics)], stats = device_run(device, limit, [task(name)], trace=f"gpu_check_{name}_trace.json")
        dev = stats["devices"][0]
        out[name] = {"samples_per_s": steady_rate(metrics), "peak": dev["peak_bytes"], "budget": dev["budget"],
                     "shards": len(stats["tasks"][name]["shards"]), "kept": stats["tasks"][name]["kept"],
                     "prefetched_bytes": dev["prefetched_bytes"], "copy_seconds": stats["copy_seconds"],
                     "overlap": stats["overlap"]}
    free_cuda()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    _, hist = plain_train(task("plain"), device)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    out["plain"] = {"samples_per_s": steady_rate(hist), "peak": peak, "budget": None, "shards": 1, "kept": [],
                    "prefetched_bytes": 0, "copy_seconds": 0.0, "overlap": 0.0}
    out["ratio"] = out["sharded"]["samples_per_s"] / out["unsharded"]["samples_per_s"]
    return out


def unit_memory(device: str, size: Size) -> list[dict[str, Any]]:
    """(f) The memory model unit by unit on this device: every unit of one minibatch of a GPT-2 cut into >= 4
    shards, each run alone (no prefetch beside it), predicted bytes vs measured peak."""
    import dataclasses

    from hydra_tune.device.resolve import resolve_devices
    from hydra_tune.training.state import TaskState

    data = token_batches(size, seed=4)[:1]
    task = ht.ModelTask(gpt2_factory(size, 0.1), adamw(1e-4), data, seed=5, name="memory-model")
    [probe] = resolve_devices([device], None)
    # >= 4 shards when the model allows; measured on the device, as the runtime measures for GPUs
    state = TaskState.build(task, _plan_budget(task.model, data[0], 4), device=probe)
    rows = []
    for mode in ("recompute", "offload") if probe.releases_graphs else ("recompute",):
        k = len(state.execs)
        flags = tuple(i < k - 1 for i in range(k))
        state.plan = dataclasses.replace(state.plan, keep=(False,) * k,
                                         offload=flags if mode == "offload" else (False,) * k)
        [dev] = resolve_devices([device], None)
        dev.start()
        segment = next(iter(state.segments(lambda m: None)))
        for unit in segment.units:
            sync(device)
            start = dev.current_bytes()
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(device)
            else:
                dev.account.reset_peak()
            unit.run(dev)
            sync(device)
            predicted = state.plan.shards[unit.shard].unit_peak(unit.kind, mode)
            rows.append({"mode": mode, "unit": f"{unit.kind}{unit.shard}", "predicted": predicted,
                         "measured": dev.peak_bytes() - start})
        state.store.clear()
    return rows


def backward_modes(device: str) -> dict[str, Any]:
    """(h) keep, offload and recompute, each forced on every shard but the last of a small GPT-2 with dropout on
    (SDPA saves its dropout seed as CPU scalars on CUDA: the tensors the first CUDA run crashed on), trained on
    this device: the three must give the same weights (bit-identical: same kernels, same draws), each close to
    the plain loop on the device. HYDRA_TUNE_CUDA_RECOMPUTE=1 forces recompute in the runtime if this fails."""
    import dataclasses

    from hydra_tune.device.resolve import resolve_devices
    from hydra_tune.training.residency import ShardCache
    from hydra_tune.training.state import TaskState

    data = token_batches(SMALL, seed=6)

    def task() -> ht.ModelTask:
        return ht.ModelTask(gpt2_factory(SMALL, 0.1), adamw(1e-3), data, epochs=1, grad_clip_norm=1.0, seed=13,
                            name="modes")
    models: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for mode in ("recompute", "keep", "offload"):
        free_cuda()
        [dev] = resolve_devices([device], None)
        dev.start()
        dev.resident = ShardCache()
        state = TaskState.build(task(), _plan_budget(task().model, data[0], 3), device=dev)
        k = len(state.execs)
        flags = tuple(i < k - 1 for i in range(k))
        state.plan = dataclasses.replace(state.plan, keep=flags if mode == "keep" else (False,) * k,
                                         offload=flags if mode == "offload" else (False,) * k)
        try:
            for seg in state.segments(lambda m: None):
                for unit in seg.units:
                    dev.copier.wait_prefetched()
                    unit.run(dev)
            sync(device)
            models[mode] = state.model
        except Exception as exc:  # noqa: BLE001  (reported: the check fails)
            errors[mode] = f"{type(exc).__name__}: {str(exc)[:300]}"
        dev.resident.clear()
    ref, _ = plain_train(task(), device)
    diffs = {m: max_param_diff(models[m], models["recompute"]) for m in models if "recompute" in models}
    return {"shards": k, "vs_recompute": diffs, "vs_plain": {m: max_param_diff(x, ref) for m, x in models.items()},
            "errors": errors}


def oom_replan(device: str) -> dict[str, Any]:
    """(g) a real out-of-memory mid-training (CUDA: the allocator capped by set_per_process_memory_fraction; CPU:
    the test-only accounting limit) at 60% of the plan's peak: the task re-plans smaller and still matches plain."""
    data = token_batches(SMALL, seed=3)

    def task() -> ht.ModelTask:
        return ht.ModelTask(gpt2_factory(SMALL, 0.0), adamw(1e-3), data, epochs=2, lr_scheduler=warmup,
                            grad_clip_norm=1.0, seed=9, name="oom")
    free_cuda()
    cuda = device.startswith("cuda")
    with ht.Runtime(devices=[device], device_memory=budget_for(task().model, data[0], 2, device)) as rt:
        h = rt.submit(task())
        first = rt.stats()["tasks"]["oom"]["predicted_peak"]
        limit = int(0.6 * first)
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + limit) / total, device)
        else:
            rt.devices[0].limit_memory(limit)
        try:
            h.result()
            model, error = h.model(), None
        except Exception as exc:  # noqa: BLE001  (reported: the check fails)
            model, error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        st = rt.stats()["tasks"]["oom"]
    diff = None if model is None else max_param_diff(model, plain_train(task(), device)[0])
    return {"first_peak": first, "limit": limit, "replans": st["replans"], "peak": st["predicted_peak"],
            "shards": len(st["shards"]), "diff": diff, "error": error}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model for (d)")
    p.add_argument("--cpu", action="store_true", help="dry run on CPU stand-ins, tiny sizes, no (c)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    device = "cpu" if args.cpu else "cuda:0"
    name = "CPU stand-in" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check on {name}: torch {torch.__version__}, CUDA {torch.version.cuda}, hydra_tune {ht.__version__}")
    t0 = time.perf_counter()
    res: dict[str, Any] = {"device": device, "device_name": name}
    res["exact"] = exactness(device)
    res["copy_gbps"] = None if args.cpu else bandwidth()
    res["throughput"] = throughput(device, TINY if args.cpu else QUICK if args.quick else FULL)
    res["unit_memory"] = unit_memory(device, SMALL)
    res["modes"] = backward_modes(device)
    res["oom"] = oom_replan(device)
    ok = report(res)
    res["seconds"] = time.perf_counter() - t0
    res["ok"] = ok
    print(f"\ntotal {res['seconds']:.0f} s: {'all checks PASS' if ok else 'some checks FAIL'}")
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
