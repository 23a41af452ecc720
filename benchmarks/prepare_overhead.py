"""Throughput of prepared loops (the user's own loop after ``hydra_tune.prepare``) vs the same tasks as ModelTasks.

    nice -n 5 python benchmarks/prepare_overhead.py         # 4 MLP tasks, then 3 GPT-2 in shards; 2 CPU devices
    nice -n 5 python benchmarks/prepare_overhead.py --model mlp --device-memory 64MiB   # state resident: light path
    nice -n 5 python benchmarks/prepare_overhead.py --model gpt2 --tasks 3 --steps 20 --device-memory 600KiB

Both sides train the same tasks on one fresh runtime each (same devices and budget, so the same shard plans): N
ModelTasks submitted at once and waited for, vs N threads each running the plain loop over a prepared model. Time
counts everything from the first submit / thread start to the last task's end (set-up included: build, measure,
plan). Prints samples/s of each and the ratio prepared / ModelTask (the goal: >= 0.95), and beside it the
steady-state ratio: set-up and the first quarter of the steps excluded (from the moment every task has handed out
its warm-up batches to the last task's end, the batches handed out in that window). ``--runs`` runs of both sides
(default 3: one run's ratio is noisy on a shared machine): each run's ratios, then their medians and ranges. Read
the ratios, not the absolute times.

Where the difference comes from: a prepared loop hands each forward and backward to the runtime and waits (two
calls per minibatch, run in the loop's own thread on a lent device or through the task's host thread, and the loss
computed on the host), while a ModelTask's training segment (F.. L B..) is one round trip with the loss inside the
last unit. The "device work" line prints each side's device busy seconds and units: a prepared minibatch is two
segments (F.., then B..); its last shard's F keeps its graph for B where the device has room beside what it holds
(prepare/driver.py ``_train_forward``; else B recomputes that forward), so both sides run about the same compute.

Two workloads by default, each side on fresh runtimes: 4 MLP tasks x 200 steps at 1536KiB (steps of about 1.5 ms:
the ratio reads a prepared loop's per-call cost) and 3 GPT-2 tasks x 20 steps at 600KiB (in shards, their state
spilled to the host: the mission's kind of trial); ``--model`` runs one, and ``--tasks``/``--steps``/
``--device-memory`` replace its defaults. Set-up is counted the same way on both sides at any ``--steps`` (from the
first submit / thread start; the steady window excludes it). Both sides first run ``--warmup`` steps untimed
(default 20; 0: none), so that the side timed first does not pay the process's one-time costs (torch's lazy imports
and first calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import hydra_tune as ht  # noqa: E402


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def mlp_batches(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(n)]


def setup(model: str, steps: int, seed: int):
    """(model factory, batches, the loss of a batch's output, how the model is called on a batch)."""
    if model == "gpt2":
        from conftest import lm_batches, make_gpt2

        return make_gpt2, lm_batches(steps, seed=seed), (lambda out, b: out.loss), (lambda m, b: m(**b))
    return make_mlp, mlp_batches(steps, seed), (lambda out, b: F.cross_entropy(out, b[1])), (lambda m, b: m(b[0]))


def user_loop(model: nn.Module, opt: torch.optim.Optimizer, batches, loss_of, call) -> None:
    """The user's training loop, the same for a plain and a prepared model."""
    for b in batches:
        loss = loss_of(call(model, b), b)
        opt.zero_grad()
        loss.backward()
        opt.step()


class Stamped:
    """The batches, each hand-out time noted in ``stamps`` (a ModelTask's data, or the prepared loop's)."""

    def __init__(self, batches: list, stamps: list[float]) -> None:
        self.batches, self.stamps = batches, stamps

    def __iter__(self):
        for b in self.batches:
            self.stamps.append(time.perf_counter())
            yield b

    def __len__(self) -> int:
        return len(self.batches)


def steady(stamps: list[list[float]], end: float, steps: int) -> tuple[int, float]:
    """(batches handed out in the steady window, its seconds): from when every task handed out its first
    ``steps // 4`` batches (a profile pass's hand-outs come first, so the last ``steps`` are the epoch's)."""
    warm = max(1, steps // 4)
    start = max(s[-steps + warm - 1] for s in stamps)
    return sum(1 for s in stamps for t in s[-steps:] if t >= start), end - start


def device_work(rt: ht.Runtime) -> tuple[float, int]:
    """(busy seconds, units) summed over the runtime's devices."""
    devices = rt.stats()["devices"]
    return sum(d["busy_seconds"] for d in devices), sum(d["units"] for d in devices)


def as_model_tasks(args: argparse.Namespace) -> tuple[float, tuple[int, float], tuple[float, int]]:
    stamps: list[list[float]] = [[] for _ in range(args.tasks)]
    with ht.Runtime(devices=args.devices, device_memory=args.device_memory) as rt:
        t0 = time.perf_counter()
        handles = []
        for i in range(args.tasks):
            make, batches, loss, _ = setup(args.model, args.steps, i)
            handles.append(rt.submit(ht.ModelTask(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                                                  Stamped(batches, stamps[i]), loss=loss, epochs=1, seed=i,
                                                  name=f"task-{i}")))
        for h in handles:
            h.result()
        end = time.perf_counter()
        return end - t0, steady(stamps, end, args.steps), device_work(rt)


def as_prepared(args: argparse.Namespace) -> tuple[float, tuple[int, float], tuple[float, int]]:
    errors: list[BaseException] = []
    stamps: list[list[float]] = [[] for _ in range(args.tasks)]

    def loop(i: int, rt: ht.Runtime) -> None:
        try:
            make, batches, loss_of, call = setup(args.model, args.steps, i)
            model = make()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, opt = ht.prepare(model, opt, seed=i, runtime=rt, name=f"prepared-{i}")
            user_loop(model, opt, Stamped(batches, stamps[i]), loss_of, call)
            model.release()
        except BaseException as exc:  # noqa: BLE001  (reported after the run)
            errors.append(exc)

    with ht.Runtime(devices=args.devices, device_memory=args.device_memory) as rt:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=loop, args=(i, rt)) for i in range(args.tasks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.perf_counter()
        work = device_work(rt)
    if errors:
        raise errors[0]
    return end - t0, steady(stamps, end, args.steps), work


def alone(args: argparse.Namespace) -> None:
    """``--alone``: one task by itself on one device (no other task to share it with, nor the two cores): the
    microseconds a step costs, plain loop / ModelTask / prepared, each the fastest of 3 differences between a run
    of ``--steps`` + 50 steps and one of 50 (set-up and warm-up cancel out)."""
    make, _, loss_of, call = setup(args.model, 1, 0)

    def plain(n: int) -> None:
        model = make()
        user_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), setup(args.model, n, 0)[1], loss_of, call)

    def task(rt: ht.Runtime, n: int) -> None:
        rt.submit(ht.ModelTask(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), setup(args.model, n, 0)[1],
                               loss=loss_of, epochs=1, seed=0, name=f"alone-task-{time.perf_counter_ns()}")).result()

    def prepared(rt: ht.Runtime, n: int) -> None:
        model = make()
        model, opt = ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), seed=0, runtime=rt,
                                name=f"alone-prepared-{time.perf_counter_ns()}")
        user_loop(model, opt, setup(args.model, n, 0)[1], loss_of, call)
        model.release()

    def per_step(run) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            run(50)
            t1 = time.perf_counter()
            run(50 + args.steps)
            best = min(best, (time.perf_counter() - t1 - (t1 - t0)) / args.steps)
        return best * 1e6

    with ht.Runtime(devices=args.devices[:1], device_memory=args.device_memory) as rt:
        for run in (plain, lambda n: task(rt, n), lambda n: prepared(rt, n)):
            run(5)  # the process's first calls of each
        us = [per_step(plain), per_step(lambda n: task(rt, n)), per_step(lambda n: prepared(rt, n))]
    print(f"one {args.model} task alone on {args.devices[0]}, us per step: plain loop {us[0]:.0f}, ModelTask "
          f"{us[1]:.0f}, prepared {us[2]:.0f} (prepared / ModelTask throughput {us[1] / us[2]:.2f}x)")


def one_run(args: argparse.Namespace) -> tuple[float, float]:
    """Both sides once, ModelTasks first; prints them and returns (ratio with set-up, steady ratio)."""
    samples = args.tasks * args.steps * (4 if args.model == "gpt2" else 64)
    per_batch = samples // (args.tasks * args.steps)
    tasks_s, (tasks_n, tasks_w), (tasks_busy, tasks_units) = as_model_tasks(args)
    prepared_s, (prep_n, prep_w), (prep_busy, prep_units) = as_prepared(args)
    tasks_ss, prep_ss = tasks_n * per_batch / tasks_w, prep_n * per_batch / prep_w
    print(f"  ModelTask: {tasks_s:.2f} s ({samples / tasks_s:.0f} samples/s with set-up; steady "
          f"{tasks_ss:.0f} samples/s over {tasks_n} batches)")
    print(f"  prepared:  {prepared_s:.2f} s ({samples / prepared_s:.0f} samples/s with set-up; steady "
          f"{prep_ss:.0f} samples/s over {prep_n} batches)")
    print(f"  device work: ModelTask {tasks_busy:.2f} busy s in {tasks_units} units, prepared {prep_busy:.2f} busy s "
          f"in {prep_units} units")
    print(f"  ratio prepared / ModelTask: {tasks_s / prepared_s:.2f}x with set-up, {prep_ss / tasks_ss:.2f}x steady")
    return tasks_s / prepared_s, prep_ss / tasks_ss


# per model, what an argument left out means: (tasks, steps, device memory). The MLP's steps take about 1.5 ms, so
# its ratio reads the per-call cost of a prepared loop; GPT-2 in shards (spilled state) is the mission's kind of trial
DEFAULTS = {"mlp": (4, 200, "1536KiB"), "gpt2": (3, 20, "600KiB")}


def workload(args: argparse.Namespace) -> tuple[float, float]:
    """``--runs`` runs of both sides on ``args.model`` (after the warm-up); prints them and returns the medians
    (with set-up, steady)."""
    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "steps": args.warmup})
        as_model_tasks(warm)
        as_prepared(warm)
    print(f"{args.tasks} {args.model} tasks x {args.steps} steps on {args.devices} ({args.device_memory}):")
    ratios = []
    for i in range(args.runs):
        print(f" run {i + 1}:")
        ratios.append(one_run(args))
    setup_r, steady_r = (statistics.median(r[k] for r in ratios) for k in (0, 1))
    print(f"throughput ratio prepared / ModelTask, {args.model}, median of {args.runs}: {setup_r:.2f}x with set-up "
          f"({min(r[0] for r in ratios):.2f}-{max(r[0] for r in ratios):.2f}), {steady_r:.2f}x steady "
          f"({min(r[1] for r in ratios):.2f}-{max(r[1] for r in ratios):.2f}) (goal >= 0.95x)")
    return setup_r, steady_r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["mlp", "gpt2"], default=None, help="one workload (default: both)")
    ap.add_argument("--tasks", type=int, default=None, help="per model by default: mlp 4, gpt2 3")
    ap.add_argument("--steps", type=int, default=None, help="per model by default: mlp 200, gpt2 20")
    ap.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    ap.add_argument("--device-memory", default=None, help="per model by default: mlp 1536KiB, gpt2 600KiB")
    ap.add_argument("--warmup", type=int, default=20, help="steps each side runs untimed first (0: none)")
    ap.add_argument("--runs", type=int, default=3, help="runs of both sides; the medians are the result")
    ap.add_argument("--alone", action="store_true", help="only one task alone on one device: us per step")
    args = ap.parse_args()
    results = {}
    for model in [args.model] if args.model else list(DEFAULTS):
        tasks, steps, memory = DEFAULTS[model]
        one = argparse.Namespace(**{**vars(args), "model": model, "tasks": args.tasks or tasks,
                                    "steps": args.steps or steps, "device_memory": args.device_memory or memory})
        if args.alone:
            torch.set_num_threads(1)
            alone(one)
        else:
            results[model] = workload(one)
    if len(results) > 1:
        print("summary, prepared / ModelTask (with set-up, steady): " + "; ".join(
            f"{model} {r[0]:.2f}x, {r[1]:.2f}x" for model, r in results.items()) + " (goal >= 0.95x)")


if __name__ == "__main__":
    main()
