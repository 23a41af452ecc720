"""Usage: .venv/bin/python benchmarks/gil_budget.py [--trials 10] [--epochs 3] [--repeats 3] [--json out.json]

What Python work per step costs a search whose two CPU devices share one interpreter (issue 15): small_trials.py's
digits-MLP trials as plain loops, two threads (as its plain side), with X microseconds of pure-Python work added
after every step and every eval batch (a busy loop that holds the GIL, as the runtime's bookkeeping does). Prints
the wall time for each X with one thread and with two, and each two-thread time against X = 0's: the ratio a
runtime would reach at most if X were all it added. Beside it, hydra's own excess: one trial alone on a runtime of
one CPU device against its plain loop, in microseconds per unit (minibatch or eval batch), set-up included. Read
the two together: the search's ratio (small_trials.py part 1) is about what the table gives at hydra's excess.
Each number is the fastest of ``--repeats`` runs, every setting once a round (other load inflates a run, never
deflates it; this machine's speed drifts within minutes, so read one run's table, not two runs' numbers).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import torch
import torch.nn.functional as F
from _common import write_line
from small_trials import digits, hydra_search, plain_search, trial_task

import hydra_tune as ht

EXTRA_US = (0, 100, 200, 350, 500)


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _trial(task: ht.ModelTask, extra_us: float) -> None:
    """small_trials.plain_trial's loop with ``extra_us`` of Python after each step and each eval batch."""
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    for _ in range(task.epochs):
        model.train()
        for x, y in task.train_data:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            _spin(extra_us)
        model.eval()
        with torch.no_grad():
            for x, y in task.eval_data:
                out = model(x)
                F.cross_entropy(out, y).item()
                (out.argmax(-1) == y).sum().item()
                _spin(extra_us)


def _search(tasks: list[ht.ModelTask], extra_us: float, threads: int) -> float:
    def work(idx: list[int]) -> None:
        for i in idx:
            _trial(tasks[i], extra_us)
    pool = [threading.Thread(target=work, args=(list(range(t, len(tasks), threads)),)) for t in range(threads)]
    start = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    train, val = digits()
    units = args.trials * args.epochs * (len(train) + len(val))

    def tasks(n: int, epochs: int) -> list[ht.ModelTask]:
        return [trial_task(i, train, val, epochs) for i in range(n)]
    _search(tasks(1, 1), 0, 1)   # warm-up: imports, allocator
    runs: dict[tuple[int, int], list[float]] = {(x, th): [] for x in EXTRA_US for th in (1, 2)}
    for _ in range(args.repeats):   # every setting once a round: the machine's drift reaches each alike
        for key in runs:
            runs[key].append(_search(tasks(args.trials, args.epochs), *key))
    walls = {key: min(w) for key, w in runs.items()}
    print(f"{args.trials} trials x {args.epochs} epochs of small_trials.py's MLP ({units} units), plain loops, "
          f"fastest of {args.repeats}:")
    for x in EXTRA_US:
        print(f"  +{x:3d} us a unit: 1 thread {walls[(x, 1)]:6.3f} s, 2 threads {walls[(x, 2)]:6.3f} s "
              f"(2 threads vs 1: {walls[(x, 1)] / walls[(x, 2)]:.2f}x; vs +0 us on 2 threads: "
              f"{walls[(0, 2)] / walls[(x, 2)]:.2f}x)", flush=True)
    hydra_search(tasks(1, 1), 1)
    one = tasks(1, args.epochs * 4)
    sides = {"hydra": lambda: hydra_search(one, 1)[0], "plain": lambda: plain_search(one, 1)[0]}
    alone = {side: min(run() for run in [sides[side]] * args.repeats) for side in sides}
    per_unit = (alone["hydra"] - alone["plain"]) / (args.epochs * 4 * (len(train) + len(val))) * 1e6
    print(f"hydra's excess, one trial of {args.epochs * 4} epochs alone on 1 CPU device: {per_unit:.0f} us a unit "
          f"(hydra {alone['hydra']:.3f} s, plain {alone['plain']:.3f} s, set-up included)")
    write_line({"benchmark": "gil_budget", "walls": {f"{x}us_{th}t": w for (x, th), w in walls.items()},
                "alone": alone, "hydra_excess_us": per_unit, "trials": args.trials, "epochs": args.epochs}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
