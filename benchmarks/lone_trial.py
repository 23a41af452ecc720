"""Usage: .venv/bin/python benchmarks/lone_trial.py [--epochs 6] [--rounds 3] [--json out.json]

One small trial alone on a runtime, as at the end of every search or with fewer trials than devices (issue 15):
small_trials.py's digits MLP, ``--epochs`` epochs with an accuracy evaluation after each, on a runtime of 1 CPU
device and on one of 2 (the second idles), against the plain loop. Each side's fastest of 3 runs a round (other
load inflates a run, never deflates it), ``--rounds`` rounds alternating the sides; the runtime's wall counts the
submit, the result and everything between (not the runtime's start). Prints seconds per side, plain / hydra, and
how many of the trial's units ran in light runs (``stats()["tasks"][name]["inline_units"]``, training/light_run.py),
then one JSON line.
"""
from __future__ import annotations

import argparse
import time

import torch
from _common import write_line
from small_trials import digits, plain_trial, trial_task

import hydra_tune as ht


def _hydra(devices: int, train: list, val: list, epochs: int) -> tuple[float, int, int]:
    """(fastest of 3 seconds, inline units, units) for one trial alone on a runtime of ``devices`` CPU devices."""
    best, inline, units = float("inf"), 0, 0
    with ht.Runtime(devices=["cpu"] * devices) as rt:
        rt.submit(trial_task(0, train, val, 1)).result()  # the runtime's first task: the process's first calls
        for i in range(3):
            start = time.perf_counter()
            handle = rt.submit(trial_task(i, train, val, epochs))
            handle.result()
            best = min(best, time.perf_counter() - start)
            record = rt.stats()["tasks"][handle.name]
            inline, units = record["inline_units"], record["units"]
    return best, inline, units


def _plain(train: list, val: list, epochs: int) -> float:
    best = float("inf")
    for i in range(3):
        start = time.perf_counter()
        plain_trial(trial_task(i, train, val, epochs))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, val = digits()
    plain, one, two = [], [], []
    for _ in range(args.rounds):
        plain.append(_plain(train, val, args.epochs))
        one.append(_hydra(1, train, val, args.epochs))
        two.append(_hydra(2, train, val, args.epochs))
    best_plain = min(plain)
    print(f"one digits-MLP trial of {args.epochs} epochs alone, fastest of {3 * args.rounds} runs a side:")
    print(f"  plain loop {best_plain:.3f} s")
    for name, runs in (("1 CPU device", one), ("2 CPU devices", two)):
        secs, inline, units = min(runs)
        print(f"  hydra, {name}: {secs:.3f} s (plain/hydra {best_plain / secs:.3f}x), {inline} of {units} units in "
              "light runs")
    write_line({"benchmark": "lone_trial", "epochs": args.epochs, "plain_s": plain,
                "one_device": one, "two_devices": two}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
