"""What ``ModelTask(eval_fn=fn)`` costs per evaluation point, on one CPU device.

    python benchmarks/eval_fn_cost.py 256     # MLP 64-256-256-10 (85k parameters); 1024: 1.1M parameters

Prints, for a task whose state stays on the device (one shard) and one sharded with its state in host memory:
``fn`` timed inside hydra_tune, ``run_eval_fn`` as a whole (a device-resident state copied to host memory, eval
mode, the task's RNG routing, ``fn``), the same ``fn`` called directly (one thread, as the runtime's CPU devices
use), and the task's wall time with and without ``eval_fn`` (best of 3) per evaluation point.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
import hydra_tune.training.loop as loop

WIDTH = int(sys.argv[1]) if len(sys.argv) > 1 else 256
torch.manual_seed(0)
TRAIN = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(20)]
VAL = [(torch.randn(256, 64), torch.randint(0, 10, (256,))) for _ in range(8)]
inside: list[float] = []
whole: list[float] = []


def make() -> nn.Module:
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def accuracy(model: nn.Module) -> dict[str, float]:
    correct = total = 0
    for x, y in VAL:
        correct += (model(x).argmax(-1) == y).sum().item()
        total += y.numel()
    return {"acc": correct / total}


def timed(model: nn.Module) -> dict[str, float]:
    t0 = time.perf_counter()
    out = accuracy(model)
    inside.append(time.perf_counter() - t0)
    return out


_run_eval_fn = loop.run_eval_fn


def timed_run(state, reported):   # the loop's call, timed as a whole
    t0 = time.perf_counter()
    out = _run_eval_fn(state, reported)
    if state.task.eval_fn is not None:
        whole.append(time.perf_counter() - t0)
    return out


def wall(fn, memory) -> float:
    best = []
    for _ in range(3):
        task = ht.ModelTask(make, lambda m: torch.optim.Adam(m.parameters()), TRAIN,
                            loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=1, eval_every=1, eval_fn=fn)
        with ht.Runtime(devices=["cpu"], device_memory=memory) as rt:
            t0 = time.perf_counter()
            rt.submit(task).result()
            best.append(time.perf_counter() - t0)
    return min(best)


def main() -> None:
    loop.run_eval_fn = timed_run
    for memory, label in ((None, "state resident on the device"), (16 * WIDTH * WIDTH, "sharded, state on host")):
        inside.clear()
        whole.clear()
        without, with_fn = wall(None, memory), wall(timed, memory)
        torch.set_num_threads(1)
        model = make().eval()
        direct = []
        with torch.no_grad():
            for _ in range(10):
                t0 = time.perf_counter()
                accuracy(model)
                direct.append(time.perf_counter() - t0)
        evals = len(inside) // 3
        ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        print(f"{label}: {sum(p.numel() for p in model.parameters())} parameters, {evals} evaluation points: "
              f"fn inside {ms(inside):.2f} ms, run_eval_fn {ms(whole):.2f} ms, fn direct {ms(direct):.2f} ms; "
              f"task wall {without:.2f} s without, {with_fn:.2f} s with "
              f"({(with_fn - without) / evals * 1e3:.1f} ms per evaluation point)")


if __name__ == "__main__":
    main()
