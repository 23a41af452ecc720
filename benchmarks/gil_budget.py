"""Usage: .venv/bin/python benchmarks/gil_budget.py [--trials 10] [--epochs 3] [--repeats 3] [--json out.json]

What Python work per step costs a search whose two CPU devices share one interpreter (issue 15): small_trials.py's
digits-MLP trials as plain loops, two threads (its ``plain_search``), with X microseconds of pure-Python work added
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
import time

import torch
from _common import write_line
from small_trials import digits, hydra_search, plain_search, trial_task

import hydra_tune as ht

EXTRA_US = (0, 100, 200, 350, 500)


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


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
    def plain(x: int, threads: int) -> float:
        return plain_search(tasks(args.trials, args.epochs), threads, after_unit=lambda: _spin(x))[0]
    plain(0, 1)   # warm-up: imports, allocator
    runs: dict[tuple[int, int], list[float]] = {(x, th): [] for x in EXTRA_US for th in (1, 2)}
    for _ in range(args.repeats):   # every setting once a round: the machine's drift reaches each alike
        for key in runs:
            runs[key].append(plain(*key))
    walls = {key: min(w) for key, w in runs.items()}
    print(f"{args.trials} trials x {args.epochs} epochs of small_trials.py's MLP ({units} units), plain loops, "
          f"fastest of {args.repeats}:")
    for x in EXTRA_US:
        print(f"  +{x:3d} us a unit: 1 thread {walls[(x, 1)]:6.3f} s, 2 threads {walls[(x, 2)]:6.3f} s "
              f"(2 threads vs 1: {walls[(x, 1)] / walls[(x, 2)]:.2f}x; vs +0 us on 2 threads: "
              f"{walls[(0, 2)] / walls[(x, 2)]:.2f}x)", flush=True)
    hydra_search(tasks(1, 1), 1)
    one = tasks(1, args.epochs * 4)
    alone: dict[str, float] = {"hydra": float("inf"), "plain": float("inf")}
    for _ in range(args.repeats):   # the two sides in turn, as the table's settings
        alone["hydra"] = min(alone["hydra"], hydra_search(one, 1)[0])
        alone["plain"] = min(alone["plain"], plain_search(one, 1)[0])
    per_unit = (alone["hydra"] - alone["plain"]) / (args.epochs * 4 * (len(train) + len(val))) * 1e6
    print(f"hydra's excess, one trial of {args.epochs * 4} epochs alone on 1 CPU device: {per_unit:.0f} us a unit "
          f"(hydra {alone['hydra']:.3f} s, plain {alone['plain']:.3f} s, set-up included)")
    write_line({"benchmark": "gil_budget", "walls": {f"{x}us_{th}t": w for (x, th), w in walls.items()},
                "alone": alone, "hydra_excess_us": per_unit, "trials": args.trials, "epochs": args.epochs}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
