"""P5: simulated makespans of a large heterogeneous search: Sharded-LRTF vs FIFO, round robin, task and model
parallelism, against the lower bound, on two workloads. Prints a table per workload, the headline, then one JSON
line with the raw numbers.

    python benchmarks/p5_simulator.py                                  # 1000 tasks on 512, then on 128 devices
    python benchmarks/p5_simulator.py --tasks 200 --devices 64 --devices2 16 --json p5.json
    python benchmarks/p5_simulator.py | tail -1 | python -m json.tool

The headline workload (--devices) has so many devices that the longest task's chain binds: most schedules that
start the longest tasks early meet it. The second (--devices2, the same tasks) has few enough that total work /
devices binds, which only a schedule that keeps every device busy to the end meets: it tells the policies apart.
The policies see free copies (bandwidth None): the lower bound counts compute only, so that is the schedule's
own quality. Below them, LRTF again with copies at --bandwidth bytes/s (the workload's units take half their
compute time to copy at 16 GB/s), with and without prefetch.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hydra_tune.sim.simulator import SimTask, lower_bound, simulate, synthetic_tasks

POLICIES = ("lrtf", "fifo", "round_robin", "task_parallel", "model_parallel", "lower_bound")
GOAL = 1.05


def table(tasks: list[SimTask], devices: int, bandwidth: float, title: str) -> dict[str, Any]:
    lb = lower_bound(tasks, devices)
    work = sum(u.seconds for t in tasks for u in t.units)
    chain = max(sum(u.seconds for u in t.units) for t in tasks)
    binds = "work / devices" if work / devices >= chain else "longest chain"
    print(f"\n{title}: {len(tasks)} tasks on {devices} devices; lower bound {lb:.1f} s = max(work / devices "
          f"{work / devices:.1f} s, longest chain {chain:.1f} s): {binds} binds")
    runs: list[tuple[str, str, dict[str, Any]]] = [(p, p, {}) for p in POLICIES]
    runs += [("lrtf", "lrtf+copies prefetch", {"bandwidth": bandwidth, "prefetch": True}),
             ("lrtf", "lrtf+copies serial", {"bandwidth": bandwidth, "prefetch": False})]
    rows = []
    print(f"{'policy':<22}{'makespan s':>12}{'/ bound':>9}{'util':>7}{'wall s':>8}")
    for policy, label, kw in runs:
        t0 = time.perf_counter()
        res = simulate(tasks, devices, policy, **kw)
        wall = time.perf_counter() - t0
        row = {"policy": label, "makespan": res.makespan, "ratio": res.makespan / lb,
               "utilisation": res.utilisation(), "wall_s": wall, **kw}
        rows.append(row)
        print(f"{label:<22}{res.makespan:>12.1f}{row['ratio']:>9.3f}{row['utilisation']:>7.3f}{wall:>8.2f}")
    return {"title": title, "tasks": len(tasks), "devices": devices, "lower_bound": lb,
            "work_per_device": work / devices, "longest_chain": chain, "binds": binds, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=512, help="devices of the headline workload")
    ap.add_argument("--devices2", type=int, default=128, help="devices of the second workload (same tasks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth", type=float, default=16e9, help="bytes/s for the copy rows")
    ap.add_argument("--json", help="also write the JSON to this path")
    args = ap.parse_args()

    t0 = time.perf_counter()
    tasks = synthetic_tasks(args.tasks, seed=args.seed)
    gen_s = time.perf_counter() - t0
    units = sum(len(t.units) for t in tasks)
    print(f"{args.tasks} tasks ({units} units, generated in {gen_s:.1f} s), seed {args.seed}")
    loads = [table(tasks, args.devices, args.bandwidth, "headline"),
             table(tasks, args.devices2, args.bandwidth, "work-bound")]

    ratios = [{r["policy"]: r["ratio"] for r in w["rows"]} for w in loads]
    head = ratios[0]["lrtf"]
    print(f"\nP5 Sharded-LRTF makespan / lower bound = {head:.3f} (goal <= {GOAL})"
          f"{'' if head <= GOAL else '  MISSED'}")
    for w, r in zip(loads, ratios):
        print(f"   {w['title']} ({w['devices']} devices): " + ", ".join(
            f"{p} {r[p]:.3f}" for p in POLICIES[:-1]))
    out = {"benchmark": "p5_simulator", "tasks": args.tasks, "seed": args.seed, "units": units, "generate_s": gen_s,
           "lrtf_ratio": head, "goal": GOAL, "workloads": loads}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
