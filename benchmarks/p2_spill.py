"""Usage: .venv/bin/python benchmarks/p2_spill.py [--quick] [--json out.json] [--trace trace.json] [--min-shards 4]

P2, the cost of spilling: one GPT-2 task on one CPU device cut into >= 4 shards by a memory budget, against the
same task unsharded (device_memory=None) on one CPU device. The budget is the largest one (bisection through
Runtime.submit + stats()) whose plan still has >= --min-shards shards. Runs alternate spilled, unsharded,
unsharded, spilled, ... after one untimed warm-up of each; medians are reported. Headline: spilled / unsharded
steady-state samples/s (after epoch 1); total samples/s (incl. build and planning) alongside, and the measured
device peak against the budget. Prints tables, the headline, then one JSON line with every raw number.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from _common import (SIDE_HEADERS, Spec, alternate, emit, find_budget, gpt2_factory, hydra_run, median, mib,
                     print_table, setup, side_rows, token_batches)

GOAL = 0.90


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-shards", type=int, default=4, help="shards the spilled plan must have (default 4)")


def main() -> int:
    t_start = time.perf_counter()
    args = setup(__doc__, options)
    size = args.size
    spec = Spec("p2", gpt2_factory(size), 1e-3, 0, token_batches(size, seed=0), size.epochs)
    print(f"P2 spill: {size.label()}, AdamW, dropout 0.1, 1 CPU device, 1 thread; {args.repeats} runs per side")

    t0 = time.perf_counter()
    budget, shards = find_budget(spec.factory, spec.batches[0], args.min_shards)
    search_s = time.perf_counter() - t0
    print(f"budget {mib(budget)} ({budget} bytes): {shards} shards (search {search_s:.1f} s)")

    warm = replace(spec, batches=spec.batches[:2], epochs=2)
    hydra_run([warm], 1, budget)
    hydra_run([warm], 1, None)
    label_s, label_u = f"spilled ({shards} shards)", "unsharded"
    runs = alternate({label_s: lambda: hydra_run([spec], 1, budget),
                      label_u: lambda: hydra_run([spec], 1, None)}, args.repeats)
    if args.trace:
        hydra_run([spec], 1, budget, trace=args.trace)
    spilled, whole = runs[label_s], runs[label_u]

    print()
    print_table(SIDE_HEADERS, side_rows(runs))
    for plan in sorted({" | ".join("+".join(s) for s in r["plan"]) + f"  kept {r['kept']} offloaded {r['offloaded']}"
                        for r in spilled}):
        print(f"spilled plan: {plan}")
    print()
    rows = []
    for name, rs in runs.items():
        d = rs[0]["devices"][0]
        peak = max(r["devices"][0]["peak_bytes"] for r in rs)
        over = "" if d["budget"] is None else ("OVER" if peak > d["budget"] else "ok")
        rows.append([name, rs[0]["shards"][0], mib(rs[0]["predicted_peak"]), mib(peak), mib(d["budget"]),
                     "-" if d["budget"] is None else f"{100 * peak / d['budget']:.0f}% {over}",
                     median(rs, "submit_s"), d["units"]])
    print_table(("side", "shards", "predicted peak", "measured peak", "budget", "peak/budget", "submit s",
                 "units"), rows)
    ratio = median(spilled, "steady_sps") / median(whole, "steady_sps")
    total_ratio = median(spilled, "total_sps") / median(whole, "total_sps")
    loss_diff = max(abs(a - b) for s, w in zip(spilled, whole) for a, b in zip(s["final_loss"], w["final_loss"]))
    print(f"final-epoch loss |spilled - unsharded| max {loss_diff:.2e}")
    print(f"P2 spilled/unsharded total throughput (incl. build+plan) = {total_ratio:.3f}x")
    print(f"P2 spilled/unsharded throughput = {ratio:.3f}x with {shards} shards (steady state, median of "
          f"{args.repeats}; goal >= {GOAL}x)")
    peak = max(r["devices"][0]["peak_bytes"] for r in spilled)
    emit({"benchmark": "p2_spill", "ratio": ratio, "total_ratio": total_ratio, "goal": GOAL, "budget": budget,
          "shards": shards, "budget_search_s": search_s, "spilled_peak_max": peak, "peak_within_budget":
          peak <= budget, "final_loss_max_diff": loss_diff, "runs": runs}, args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
