"""GPU speed of hydra_tune against plain PyTorch on one device, measured on the device: one command, both sides in
one process, sides alternating (A B B A ...), >= 20 steady steps per run. Prints a table, then one JSON line.

    python benchmarks/gpu_perf.py                      # one CUDA device (not yet run on one: see --time-budget)
    python benchmarks/gpu_perf.py --cpu                # dry run on a CPU stand-in, tiny sizes (< 2 min)
    python benchmarks/gpu_perf.py --sections a,c --repeats 3 --json perf.json

Sections (goals from issue 14 in brackets; they are reported, not asserted):
  (a) fits: GPT-2 12x768, seq 512, batch 8, AdamW, fp32 and bf16, and GPT-2 8x384 fp32, one unsharded task vs the
      plain loop [>= 0.95x samples/s and peak within plain + 5%; 8x384 >= 0.90x];
  (b) spills: 12x768 forced into 2 and into 4 shards (a device budget whose plan, re-cut for per-shard entries as
      the runtime does, has that many shards with entries that move: _budget.py; 2 is never one for a tied
      GPT-2, which then runs the nearest count), and GPT-2 XL
      (seq 256, batch 2) under a 12 GiB budget [>= 0.80x at 2 shards; state bytes per step within 10% of the
      prediction; copy/compute overlap >= 90%];
  (c) 4 and 8 tasks of 12x768 on the device at once, all resident, and with a budget that holds half of them
      [aggregate >= 0.95x of one plain task; the half-evicted case against the PCIe bound];
  (d) the same 4 and 8 tasks as separate plain processes sharing the device (Ray Tune's fractional GPUs);
  (e) the plain loop after ``hydra_tune.prepare(model, optimizer)`` (issue 16), GPT-2 12x768 fp32, one task: vs the
      plain loop (its ratio over (a)'s 12x768 fp32 one is prepared vs ModelTask, issue 16's >= 0.95x), and the bytes
      of the model's output and its gradient the runtime's copier moved per step (the F unit's output carry to host
      memory, the B unit's output gradient to the device; the loop's own ``.to``s of them are not counted).
Every case alternates its sides (plain first, then A B B A ...): (a) and the 2-shard case twice per side by
default, the others once (``--repeats`` caps them all). Cases run one of each section first and the heaviest last
(8 tasks, GPT-2 XL), so that ``--time-budget`` (seconds) skips those first; skipped cases are named in the output.
The runtime's counters (bytes moved per step, synchronisations, steps on the device or the host, evictions) are
read from ``Runtime.stats()`` when this version reports them, and shown as "-" when it does not (state bytes per
step then fall back to the device's prefetched bytes per step): "state B/step" is the state moved either way after
each task's first step, "entries" the runtime's predicted device bytes of the tasks' state entries. A "k shards"
case runs under the largest budget whose plan, as the runtime makes it (its re-cut for per-shard entries
included), has k shards whose entries move in for their units (_budget.py); a tied GPT-2 never spills in 2 (its
head reads the embedding's entry), so that case runs the nearest count and says so. Exit status 0 unless a case
raised.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _budget import ShardBudget
from _common import Size, write_line
from _perf import (
    Case,
    Result,
    Steps,
    adamw,
    batches,
    cuda,
    gpt2_factory,
    model_label,
    pick,
    run_hydra,
    run_plain,
    run_prepared,
    run_processes,
)

import hydra_tune as ht
from hydra_tune.errors import format_bytes

GIB = 1 << 30
FULL = Size(12, 768, 12, 50257, 512, 8)
SMALL = Size(8, 384, 6, 50257, 512, 8)
XL = Size(48, 1600, 25, 50257, 256, 2)
TINY = Size(2, 64, 2, 256, 32, 4)            # --cpu
TINY_BIG = Size(4, 96, 4, 256, 32, 4)        # --cpu stand-in for the model over its budget
GOALS = {"a": 0.95, "b": 0.80, "c": 0.95}  # by section; the 8x384 case of (a): 0.90


def cases(cpu: bool) -> list[tuple[str, Case, str, int | None]]:
    """(section, case, kind, repeats) in the order they run: one case of every section first, the heaviest last
    (a time budget then skips those). Kinds: "fits", "shards", "budget", "tasks", "half", "processes", "prepared";
    repeats None: ``--repeats``."""
    full, small, xl = (TINY, Size(2, 48, 2, 256, 32, 4), TINY_BIG) if cpu else (FULL, SMALL, XL)
    few, many = (2, 4) if cpu else (4, 8)
    over = Case("4x96 over its budget", xl, shards=3) if cpu else Case("XL under 12 GiB", xl, budget=12 * GIB)
    return [
        ("a", Case("12x768 fp32", full), "fits", None), ("a", Case("12x768 bf16", full, "bf16"), "fits", None),
        ("a", Case("8x384 fp32", small), "fits", None),
        ("b", Case("12x768 2 shards", full, shards=2), "shards", None),
        ("c", Case(f"{few} tasks resident", full, tasks=few), "tasks", 1),
        ("d", Case(f"{few} plain processes", full, tasks=few), "processes", 1),
        ("e", Case("12x768 fp32 prepared", full), "prepared", None),
        ("b", Case("12x768 4 shards", full, shards=4), "shards", 1),
        ("c", Case(f"{few} tasks, half fit", full, tasks=few), "half", 1),
        ("c", Case(f"{many} tasks resident", full, tasks=many), "tasks", 1),
        ("d", Case(f"{many} plain processes", full, tasks=many), "processes", 1),
        ("c", Case(f"{many} tasks, half fit", full, tasks=many), "half", 1),
        ("b", over, "budget", 1),
    ]


class Bench:
    def __init__(self, device: str, steps: Steps, repeats: int, deadline: float) -> None:
        self.device, self.steps, self.repeats, self.deadline = device, steps, repeats, deadline
        self.probe: dict[str, Any] | None = None
        self.predicted: dict[str, int] = {}  # case -> its entries' predicted bytes, from the budget finder

    def runtime_facts(self) -> dict[str, Any]:
        """The device's own overhead and copy rate, as every runtime plans with them (one probe runtime)."""
        if self.probe is None:
            with ht.Runtime(devices=[self.device]) as rt:
                dev = rt.devices[0]
                self.probe = {"overhead": dev.overhead, "rate": dev.copy_bandwidth, "keep": dev.releases_graphs}
        return self.probe

    def costs(self, case: Case) -> list[Any]:
        """The stage costs the runtime measures at submit (the same profile: it is kept per architecture)."""
        from hydra_tune.stages import extract_stages
        from hydra_tune.training.build import AUTOCAST_DTYPES
        from hydra_tune.training.profile import measure_costs

        batch = batches(case.size, Steps(0, 1), 0)[0]
        return measure_costs(extract_stages(gpt2_factory(case.size, case.dropout)()), batch, None, 0,
                             AUTOCAST_DTYPES[case.precision])

    def plan(self, costs: list[Any], budget: int | None) -> Any:
        from hydra_tune.policy.partition import partition

        facts = self.runtime_facts()
        return partition(costs, budget, bandwidth=facts["rate"], keep=facts["keep"])

    def budget(self, case: Case) -> int | None:
        """``case.budget``, or the largest device budget under which the runtime runs the task in ``case.shards``
        shards: its units plan and then its re-cut for per-shard entries, as the runtime plans it (_budget.py).
        The entries' predicted bytes go into ``self.predicted`` (compared with the runtime's own in the table)."""
        if case.shards is None:
            return case.budget
        task = ht.ModelTask(gpt2_factory(case.size, case.dropout), adamw, batches(case.size, Steps(0, 1), 0),
                            epochs=1, seed=0, precision=case.precision, name=case.name)
        found = ShardBudget(task, self.device).find(case.shards)
        self.predicted[case.name] = sum(found["entries"])
        print(f"  budget {format_bytes(found['budget'])}: {found['shards']} shards, entries "
              f"{[format_bytes(e) for e in found['entries']]} ({found['planned']})", flush=True)
        budget = found["budget"]
        return budget

    def half_budget(self, case: Case) -> int:
        """A budget that holds the state (parameters, gradients, AdamW's two moments) of half the tasks next to
        one unit's activations: the other half has to be evicted and reloaded."""
        params = sum(p.numel() * p.element_size() for p in gpt2_factory(case.size, case.dropout)().parameters())
        whole = self.plan(self.costs(case), None).peak  # parameters, gradients and activations of one
        return whole + 2 * params + (case.tasks // 2 - 1) * 4 * params + self.runtime_facts()["overhead"]

    def sides(self, case: Case, kind: str) -> dict[str, Callable[[], Result]]:
        d, st = self.device, self.steps
        plain = Case(case.name, case.size, case.precision, dropout=case.dropout)
        if kind == "processes":
            return {"plain 1 task": lambda: run_plain(plain, d, st),
                    f"{case.tasks} processes": lambda: run_processes(case, d, st, case.tasks)}
        budget = self.half_budget(case) if kind == "half" else self.budget(case)
        if kind == "prepared":
            return {"plain": lambda: run_plain(plain, d, st), "prepared": lambda: run_prepared(case, d, st, budget)}
        return {"plain": lambda: run_plain(plain, d, st), "hydra": lambda: run_hydra(case, d, st, budget)}

    def measure(self, case: Case, kind: str, repeats: int | None) -> dict[str, Any]:
        """Both sides ``repeats`` times in A B B A order; past the deadline, after a round of both, it stops."""
        sides = self.sides(case, kind)
        names = list(sides)
        runs: dict[str, list[Result]] = {n: [] for n in names}
        for r in range(min(repeats or self.repeats, self.repeats)):
            if r and time.perf_counter() > self.deadline:
                break
            for name in names if r % 2 == 0 else names[::-1]:
                res = sides[name]()
                runs[name].append(res)
                print(f"  ({case.name}) {name:<14} run {r + 1}: {res['steady_sps']:8.2f} samples/s, "
                      f"wall {res.get('wall_s', float('nan')):6.1f} s", flush=True)
        out = {"case": case.name, "kind": kind, "sides": names, "runs": runs, **summary(runs, names, case)}
        out["planned_state_bytes"] = self.predicted.get(case.name)
        return out


def summary(runs: dict[str, list[Result]], names: list[str], case: Case) -> dict[str, Any]:
    base, other = names
    sps = {n: statistics.median(r["steady_sps"] for r in runs[n]) for n in names}
    peaks = {n: max((r["peak"] or 0) for r in runs[n]) or None for n in names}
    last = runs[other][-1]
    found = {k: v for t in last.get("counters", {}).get("tasks", []) for k, v in t.items()}
    steps = max(last.get("steps", 0), 1)
    out = {"sps": sps, "ratio": sps[other] / sps[base], "peaks": peaks,
           "peak_ratio": peaks[other] / peaks[base] if peaks[other] and peaks[base] else None,
           "shards": last.get("shards"), "overlap": last.get("overlap"),
           "prefetched_bytes": last.get("prefetched_bytes"),
           "counters": last.get("counters")}
    after_first = max(steps - case.tasks, 1)  # every step but each task's first
    out["state_bytes_per_step"] = last["state_moved"] / after_first if "state_moved" in last else (
        last["prefetched_bytes"] / steps if last.get("prefetched_bytes") else None)
    out["predicted_state_bytes"] = last.get("entry_bytes")  # the runtime's own prediction of its entries
    out["syncs_per_step"] = pick(found, "sync")
    out["device_steps"] = pick(found, "device", "step")
    out["evictions"] = pick(found, "evict")
    out["output_bytes_per_step"] = last.get("output_bytes_per_step")  # (e) only
    return out


def pcie_bound(device: str, case: Case, res: dict[str, Any]) -> float | None:
    """Aggregate samples/s if the half of the tasks that does not fit moved its whole state in and out every
    step at the measured pinned host->device rate (the counters' bytes per step when reported)."""
    if not cuda(device):
        return None
    nbytes = 256 << 20
    host, dev = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8,
                                                                                    device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    rate = nbytes / best
    params = sum(p.numel() * p.element_size() for p in gpt2_factory(case.size, case.dropout)().parameters())
    moved = res.get("state_bytes_per_step") or 2 * 4 * params * (case.tasks // 2) / case.tasks
    return case.size.batch * rate / moved


def report(results: list[dict[str, Any]]) -> None:
    print(f"\n{'section':<8}{'case':<22}{'base sps':>10}{'sps':>10}{'ratio':>7}{'goal':>6}{'peak':>11}{'vs base':>8}"
          f"{'shards':>7}{'overlap':>8}{'state B/step':>13}{'entries':>11}{'syncs/step':>11}{'dev steps':>10}{'evict':>6}")
    for r in results:
        base, other = r["sides"]
        goal = r.get("goal")
        cells = [f"{r['section']:<8}", f"{r['case']:<22}", f"{r['sps'][base]:>10.2f}", f"{r['sps'][other]:>10.2f}",
                 f"{r['ratio']:>7.3f}", f"{goal if goal else '-':>6}",
                 f"{format_bytes(r['peaks'][other]) if r['peaks'][other] else '-':>11}",
                 f"{r['peak_ratio']:>8.3f}" if r["peak_ratio"] else f"{'-':>8}", f"{r['shards'] or '-':>7}",
                 f"{r['overlap']:>8.2f}" if r["overlap"] is not None else f"{'-':>8}",
                 f"{format_bytes(r['state_bytes_per_step']) if r['state_bytes_per_step'] is not None else '-':>13}",
                 f"{format_bytes(r['predicted_state_bytes']) if r['predicted_state_bytes'] else '-':>11}",
                 f"{r['syncs_per_step'] if r['syncs_per_step'] is not None else '-':>11}",
                 f"{r['device_steps'] if r['device_steps'] is not None else '-':>10}",
                 f"{r['evictions'] if r['evictions'] is not None else '-':>6}"]
        print("".join(cells))
        if r.get("pcie_bound_sps"):
            print(f"{'':<8}{'':<22}PCIe bound {r['pcie_bound_sps']:.2f} samples/s; measured {r['sps'][other]:.2f}")
        if r.get("output_bytes_per_step") is not None:
            print(f"{'':<8}{'':<22}the model's output and its gradient moved by the runtime: "
                  f"{format_bytes(int(r['output_bytes_per_step']))} a step")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on a CPU stand-in, tiny sizes")
    p.add_argument("--sections", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    p.add_argument("--repeats", type=int, default=None, help="runs per side, alternating (default 2, the many-task "
                   "and spill cases 1; --cpu 1)")
    p.add_argument("--steps", type=int, default=20, help="steady steps per run (default 20)")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps per run (default 5; --cpu 2)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cases that would start later skip")
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.cpu else 2)
    args.warm = args.warm if args.warm is not None else (2 if args.cpu else 5)
    return args


def _measure_all(bench: Bench, args: argparse.Namespace, device: str, deadline: float
                 ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Every chosen case, in order; a case that fails is reported and the others still run."""
    results, skipped, failed = [], [], []
    chosen = args.sections.split(",")
    for section, case, kind, repeats in cases(args.cpu):
        if section not in chosen:
            continue
        if time.perf_counter() > deadline:
            skipped.append(f"({section}) {case.name}")
            print(f"({section}) {case.name}: skipped (time budget)")
            continue
        print(f"({section}) {case.name}: {model_label(case.size)}, {case.tasks} task(s), {case.precision}", flush=True)
        try:
            res = bench.measure(case, kind, repeats)
        except Exception as exc:  # noqa: BLE001  (reported; the other cases still run)
            failed.append(f"({section}) {case.name}: {type(exc).__name__}: {str(exc)[:300]}")
            print(f"  FAILED {failed[-1]}")
            continue
        res["section"], res["model"] = section, model_label(case.size)
        res["goal"] = 0.90 if case.name.startswith("8x384") else GOALS.get(section)
        if kind == "half":
            res["pcie_bound_sps"] = pcie_bound(device, case, res)
        results.append(res)
    results.sort(key=lambda r: r["section"])
    return results, skipped, failed


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: skipped (use --cpu for a dry run)")
        print(json.dumps({"benchmark": "gpu_perf", "skipped": "no CUDA device"}))
        return 0
    if args.cpu:
        torch.set_num_threads(1)  # the stand-in device's one core, as the runtime gives it
    device = "cpu" if args.cpu else "cuda:0"
    t0 = time.perf_counter()
    deadline = t0 + args.time_budget if args.time_budget else float("inf")
    name = "CPU stand-in" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_perf on {name}: torch {torch.__version__}, hydra_tune {ht.__version__}; {args.warm} warm-up + "
          f"{args.steps} steady steps per run, {args.repeats} runs per side, alternating")
    bench = Bench(device, Steps(args.warm, args.steps), args.repeats, deadline)
    results, skipped, failed = _measure_all(bench, args, device, deadline)
    report(results)
    for line in skipped:
        print(f"skipped: {line}")
    for line in failed:
        print(f"failed: {line}")
    out = {"benchmark": "gpu_perf", "device": device, "device_name": name, "torch": torch.__version__,
           "steps": {"warm": args.warm, "steady": args.steps}, "repeats": args.repeats, "results": results,
           "skipped": skipped, "failed": failed, "seconds": time.perf_counter() - t0}
    write_line(out, args.json, out["seconds"])
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
