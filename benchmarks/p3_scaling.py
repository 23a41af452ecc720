"""Usage: .venv/bin/python benchmarks/p3_scaling.py [--quick] [--json out.json] [--trace trace.json] [--spilled]

P3, scaling over devices: 4 GPT-2 tasks (seeds 0..3, learning rates 1e-4..3e-3) submitted at once to a runtime
with 2 CPU devices, against the same 4 tasks on a runtime with 1 CPU device; both unsharded (device_memory=None),
and with --spilled also both with a budget that cuts each task into >= 2 shards. Runs alternate 2-dev, 1-dev,
1-dev, 2-dev, ... after one untimed warm-up of each; medians are reported (default 2 runs per side). Headline:
throughput(2 devices) / throughput(1 device) over the steady state (all 4 tasks past epoch 1, none finished);
total samples/s (incl. build, planning and the tail) alongside, and each device's busy share (busy_seconds / run
wall). The machine's own ceiling is measured in the same alternation: the 4 tasks in the plain loop on 2 threads
(2 tasks each, one after another) vs on 1 thread.
Prints tables, the headline, then one JSON line with every raw number.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from _common import (SIDE_HEADERS, Result, Spec, alternate, emit, find_budget, gpt2_factory, hydra_run, median,
                     mib, plain_run, print_table, setup, side_rows, token_batches)

GOAL = 1.8
LRS = (1e-4, 3e-4, 1e-3, 3e-3)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spilled", action="store_true", help="also compare 2 vs 1 device with every task in >= 2 "
                   "shards (about doubles the run time)")


def compare(specs: list[Spec], budget: int | None, repeats: int, trace: str | None, ceiling: bool
            ) -> dict[str, Any]:
    warm = [replace(s, batches=s.batches[:2], epochs=2) for s in specs]
    hydra_run(warm, 2, budget)
    hydra_run(warm, 1, budget)
    sides = {"2 devices": lambda: hydra_run(specs, 2, budget), "1 device": lambda: hydra_run(specs, 1, budget)}
    if ceiling:  # what this machine gives 2 threads of plain training right now (others' load included)
        plain_run(warm, threads=2)
        sides.update({"plain, 2 threads": lambda: plain_run(specs, threads=2),
                      "plain, 1 thread": lambda: plain_run(specs)})
    runs = alternate(sides, repeats)
    if trace:
        hydra_run(specs, 2, budget, trace=trace)
    two, one = runs["2 devices"], runs["1 device"]
    print()
    print_table(SIDE_HEADERS, side_rows(runs))
    rows = []
    for name, rs in runs.items():
        for i in range(len(rs[0].get("devices", []))):
            busy = [r["devices"][i]["busy_share"] for r in rs]
            rows.append([f"{name} / cpu:{i}", sorted(busy)[len(busy) // 2], " ".join(f"{b:.2f}" for b in busy),
                         sum(r["devices"][i]["units"] for r in rs) // len(rs)])
    print_table(("device", "busy share", "per run", "units/run"), rows)
    diff = max(abs(a - b) for r2 in two for r1 in one for a, b in zip(r2["final_loss"], r1["final_loss"]))
    print(f"shards per task {two[0]['shards']}; submit (build + plan, 4 tasks) {median(two, 'submit_s'):.2f} s; "
          f"final-epoch loss |2 dev - 1 dev| max {diff:.2e}")
    out: dict[str, Any] = {}
    if ceiling:
        p2, p1 = runs["plain, 2 threads"], runs["plain, 1 thread"]
        out = {"plain_ratio": median(p2, "steady_sps") / median(p1, "steady_sps"),
               "plain_total_ratio": median(p2, "total_sps") / median(p1, "total_sps")}
        print(f"machine ceiling: plain loop 2 threads / 1 thread = {out['plain_ratio']:.3f}x steady, "
              f"{out['plain_total_ratio']:.3f}x total")
    return {**out, "ratio": median(two, "steady_sps") / median(one, "steady_sps"),
            "total_ratio": median(two, "total_sps") / median(one, "total_sps"), "budget": budget,
            "shards": two[0]["shards"], "final_loss_max_diff": diff, "runs": runs}


def main() -> int:
    t_start = time.perf_counter()
    args = setup(__doc__, options)
    size = args.size = replace(args.size, batches=3 if args.quick else 4)
    if not args.quick and "--repeats" not in sys.argv:
        args.repeats = 2  # 4 sides of 4 tasks each: 3 repeats would take over 3 minutes on 2 cores
    specs = [Spec(f"lr{lr:g}", gpt2_factory(size), lr, seed, token_batches(size, seed=seed), size.epochs)
             for seed, lr in enumerate(LRS)]
    print(f"P3 scaling: 4 tasks of {size.label()}, AdamW, dropout 0.1, 1 thread per device; "
          f"{args.repeats} runs per side")
    results: dict[str, Result] = {"benchmark": "p3_scaling", "goal": GOAL}
    print("\n== unsharded (device_memory=None)")
    results["unsharded"] = compare(specs, None, args.repeats, None if args.spilled else args.trace, True)
    if args.spilled:
        budget, shards = find_budget(specs[0].factory, specs[0].batches[0], 2)
        print(f"\n== spilled: budget {mib(budget)} per device, {shards} shards")
        results["spilled"] = compare(specs, budget, args.repeats, args.trace, False)
    print()
    for kind in ("unsharded", "spilled"):
        if kind in results:
            r = results[kind]
            print(f"P3 {kind}: 2-dev/1-dev total throughput (incl. build+plan+tail) = {r['total_ratio']:.3f}x")
    for kind in ("spilled", "unsharded"):
        if kind in results:
            print(f"P3 {kind}: 2-dev/1-dev throughput = {results[kind]['ratio']:.3f}x (steady state, median of "
                  f"{args.repeats}; goal >= {GOAL}x)")
    results["ratio"] = results["unsharded"]["ratio"]
    emit(results, args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
