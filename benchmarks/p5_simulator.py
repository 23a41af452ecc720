"""P5: simulated makespans of a large heterogeneous search: Sharded-LRTF vs FIFO, round robin, task and model
parallelism, against the lower bound. Prints a table, the headline, then one JSON line with the raw numbers.

    python benchmarks/p5_simulator.py                                  # 1000 tasks on 512 devices, seed 0
    python benchmarks/p5_simulator.py --tasks 200 --devices 64 --json p5.json
    python benchmarks/p5_simulator.py | tail -1 | python -m json.tool

The table's policies see free copies (bandwidth None): the lower bound counts compute only, so that is the
schedule's own quality. Below it, LRTF again with copies at --bandwidth bytes/s (the workload's units take
half their compute time to copy at 16 GB/s), with and without prefetch.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hydra_tune.simulate import lower_bound, simulate, synthetic_tasks

POLICIES = ("lrtf", "fifo", "round_robin", "task_parallel", "model_parallel", "lower_bound")
GOAL = 1.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth", type=float, default=16e9, help="bytes/s for the copy rows")
    ap.add_argument("--json", help="also write the JSON to this path")
    args = ap.parse_args()

    t0 = time.perf_counter()
    tasks = synthetic_tasks(args.tasks, seed=args.seed)
    gen_s = time.perf_counter() - t0
    lb = lower_bound(tasks, args.devices)
    work = sum(u.seconds for t in tasks for u in t.units)
    chain = max(sum(u.seconds for u in t.units) for t in tasks)
    print(f"{args.tasks} tasks ({sum(len(t.units) for t in tasks)} units, generated in {gen_s:.1f} s) on "
          f"{args.devices} devices, seed {args.seed}")
    print(f"lower bound {lb:.1f} s = max(work / devices {work / args.devices:.1f} s, longest chain {chain:.1f} s)")

    runs: list[tuple[str, str, dict[str, Any]]] = [(p, p, {}) for p in POLICIES]
    runs += [("lrtf", "lrtf+copies prefetch", {"bandwidth": args.bandwidth, "prefetch": True}),
             ("lrtf", "lrtf+copies serial", {"bandwidth": args.bandwidth, "prefetch": False})]
    rows = []
    print(f"\n{'policy':<22}{'makespan s':>12}{'/ bound':>9}{'util':>7}{'wall s':>8}")
    for policy, label, kw in runs:
        t0 = time.perf_counter()
        res = simulate(tasks, args.devices, policy, **kw)
        wall = time.perf_counter() - t0
        row = {"policy": label, "makespan": res.makespan, "ratio": res.makespan / lb,
               "utilisation": res.utilisation(), "wall_s": wall, **kw}
        rows.append(row)
        print(f"{label:<22}{res.makespan:>12.1f}{row['ratio']:>9.3f}{row['utilisation']:>7.3f}{wall:>8.2f}")

    head = rows[0]["ratio"]
    print(f"\nP5 Sharded-LRTF makespan / lower bound = {head:.3f} (goal <= {GOAL})"
          f"{'' if head <= GOAL else '  MISSED'}")
    out = {"benchmark": "p5_simulator", "tasks": args.tasks, "devices": args.devices, "seed": args.seed,
           "units": sum(len(t.units) for t in tasks), "generate_s": gen_s, "lower_bound": lb,
           "work_per_device": work / args.devices, "longest_chain": chain, "lrtf_ratio": head, "goal": GOAL,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
