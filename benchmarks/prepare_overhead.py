"""Throughput of prepared loops (the user's own loop after ``hydra_tune.prepare``) vs the same tasks as ModelTasks.

    nice -n 5 python benchmarks/prepare_overhead.py                       # 4 MLP tasks, 2 CPU devices
    nice -n 5 python benchmarks/prepare_overhead.py --model gpt2 --tasks 3 --steps 20 --device-memory 600KiB

Both sides train the same tasks on one fresh runtime each (same devices and budget, so the same shard plans): N
ModelTasks submitted at once and waited for, vs N threads each running the plain loop over a prepared model. Time
counts everything from the first submit / thread start to the last task's end (set-up included: build, measure,
plan). Prints samples/s of each and the ratio prepared / ModelTask (the goal: >= 0.95). One run's ratio, on a
shared machine: read it, not the absolute times.

Where the difference comes from: a prepared loop hands each forward and backward to the runtime and waits (two
round trips through the task's host thread per minibatch, and the loss computed on the host), while a ModelTask's
training segment (F.. L B..) is one round trip with the loss inside the last unit.
"""
from __future__ import annotations

import argparse
import os
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


def as_model_tasks(args: argparse.Namespace) -> float:
    with ht.Runtime(devices=args.devices, device_memory=args.device_memory) as rt:
        t0 = time.perf_counter()
        handles = []
        for i in range(args.tasks):
            make, batches, loss, _ = setup(args.model, args.steps, i)
            handles.append(rt.submit(ht.ModelTask(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                                                  batches, loss=loss, epochs=1, seed=i, name=f"task-{i}")))
        for h in handles:
            h.result()
        return time.perf_counter() - t0


def as_prepared(args: argparse.Namespace) -> float:
    errors: list[BaseException] = []

    def loop(i: int, rt: ht.Runtime) -> None:
        try:
            make, batches, loss_of, call = setup(args.model, args.steps, i)
            model = make()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, opt = ht.prepare(model, opt, seed=i, runtime=rt, name=f"prepared-{i}")
            for b in batches:
                loss = loss_of(call(model, b), b)
                opt.zero_grad()
                loss.backward()
                opt.step()
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
        seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    ap.add_argument("--device-memory", default="1536KiB")
    args = ap.parse_args()
    samples = args.tasks * args.steps * (4 if args.model == "gpt2" else 64)
    tasks_s = as_model_tasks(args)
    prepared_s = as_prepared(args)
    print(f"{args.tasks} {args.model} tasks x {args.steps} steps on {args.devices} ({args.device_memory}):")
    print(f"  ModelTask: {tasks_s:.2f} s ({samples / tasks_s:.0f} samples/s)")
    print(f"  prepared:  {prepared_s:.2f} s ({samples / prepared_s:.0f} samples/s)")
    print(f"throughput ratio prepared / ModelTask: {tasks_s / prepared_s:.2f}x (goal >= 0.95x)")


if __name__ == "__main__":
    main()
