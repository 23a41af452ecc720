"""Usage: .venv/bin/python benchmarks/small_trials.py [--quick] [--json out.json] [--repeats N]

Small and short trials (issue 15), three numbers, each hydra_tune against what a user would run without it:
  1. Small-model search: ``--trials`` trials (default 40; --quick 8) of a ~117k-parameter MLP (64-256-256-128-10)
     on sklearn's bundled 8x8 digits (offline: 1437 train / 360 eval images, batch 64), ``--epochs`` epochs each
     (default 10; --quick 3) with an accuracy evaluation after every epoch (``metrics={"accuracy": ...}``).
     hydra_tune: all trials submitted at once to one runtime with 2 CPU devices (wall counts runtime start, every
     submit and every result). Plain: the same trials as plain PyTorch loops, 2 at a time (two threads, as Optuna's
     ``n_jobs=2``). Ratio = plain wall / hydra wall (>= 1.0: hydra at least as fast; the issue's goal). Beside it
     the same trials through 2 node servers of one CPU device each (``hydra_tune.node.spread``: a process each,
     so the devices share no GIL; each task to the server with the fewest unfinished; the servers started once, as
     a node server outlives a search), whose accuracies must equal the in-process runtime's; and that ratio with
     the servers' start (connecting to them, timed once before the runs) added to the wall, as a search whose
     servers are not running yet pays it. Then the share of the devices' busy time their units spent off the CPU
     (``stats()``: ``busy_seconds`` less ``unit_cpu_seconds``), in one process and through the servers.
  2. Short trials: 4 GPT-2 tasks (4 layers x 128) of 6 minibatches, 1 epoch, on 2 CPU devices vs 1, wall counting
     submit (runtime start to the last result). Goal >= 1.6x. Beside it the same through node servers of one CPU
     device each, 2 servers vs 1 (each submit to the last result; the servers started once, not counted). Then
     the submit of 4 such trials over data of their own (seeds not seen: the profile cache checks each batch whose
     token ids stick out of those profiled), and of the same 4 again.
  3. Per-unit runtime overhead: one MLP trial alone on 1 device, traced. ``unit`` = (sum of its units' wall times -
     the plain loop's time in the same computations: forward, loss, backward; eval forward, loss, accuracy) / units:
     what running a unit costs beyond its compute; ``gap`` = (runtime wall from first to last unit - the whole plain
     loop's time, optimizer steps and data included) / units: also the host work and hand-offs between units.
     In microseconds; aim under 200 us on CPU (each side's fastest of 3 runs: the machine's other load inflates
     a run, never deflates it).
  4. Torch's default intra-op threads (what a script that never calls torch.set_num_threads gets), in a fresh
     interpreter: one MLP trial of ``--epochs`` epochs on a runtime of 1 CPU device vs the plain loop in the
     script's thread, and the same runtime with the waiting thread's OpenMP team kept (``release_idle_pool``
     switched off, as before it existed); and the plain loop while a runtime of 1 CPU device idles in the same
     process, with and without the idle device releasing its team. The fastest of 3 runs a side.
Parts 1-3 use one intra-op thread per device (torch.set_num_threads(1)). Prints the numbers, then one JSON line.
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import Size, adamw, emit, gpt2_factory, setup, token_batches

import hydra_tune as ht

Batch = tuple[torch.Tensor, torch.Tensor]
LRS = (0.3, 0.1, 0.03, 0.01, 0.003)
SHORT = Size(4, 128, 4, 2048, 64, 8, batches=6, epochs=1)


def digits(batch: int = 64) -> tuple[list[Batch], list[Batch]]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))

    def batches(xs: torch.Tensor, ys: torch.Tensor) -> list[Batch]:
        return [(xs[i:i + batch], ys[i:i + batch]) for i in range(0, len(ys), batch)]
    return batches(x[:cut], y[:cut]), batches(x[cut:], y[cut:])


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(out: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
    return (out.argmax(-1) == batch[1]).sum(), batch[1].numel()


def trial_task(i: int, train: list[Batch], val: list[Batch], epochs: int) -> ht.ModelTask:
    lr = LRS[i % len(LRS)]
    return ht.ModelTask(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), train, eval_data=val,
                        loss=lambda out, b: F.cross_entropy(out, b[1]), metrics={"accuracy": accuracy},
                        epochs=epochs, seed=i, name=f"t{i}")


def plain_trial(task: ht.ModelTask, compute: list[float] | None = None,
                after_unit: Callable[[], None] | None = None) -> float:
    """The user's loop: train, then accuracy over the eval set after every epoch; returns the last accuracy.
    ``compute`` (a one-item list) adds up the seconds of what hydra's units run: forward, loss, backward (train)
    and forward, loss, accuracy (eval); not the optimizer step or the data. ``after_unit()`` runs after every step
    and every eval batch (gil_budget.py's added Python work)."""
    clock = time.perf_counter
    torch.manual_seed(task.seed)
    model = task.model()
    opt = task.optimizer(model)
    acc = 0.0
    for _ in range(task.epochs):
        model.train()
        for x, y in task.train_data:
            t0 = clock()
            F.cross_entropy(model(x), y).backward()
            if compute is not None:
                compute[0] += clock() - t0
            opt.step()
            opt.zero_grad()
            if after_unit is not None:
                after_unit()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in task.eval_data:
                t0 = clock()
                out = model(x)
                F.cross_entropy(out, y).item()
                correct += (out.argmax(-1) == y).sum().item()
                if compute is not None:
                    compute[0] += clock() - t0
                total += y.numel()
                if after_unit is not None:
                    after_unit()
        acc = correct / total
    return acc


def plain_search(tasks: list[ht.ModelTask], threads: int = 2, after_unit: Callable[[], None] | None = None,
                 trial: Callable[..., float] = plain_trial) -> tuple[float, list[float]]:
    """The tasks as ``trial`` loops (the plain one by default), ``threads`` at a time; (wall, accuracies)."""
    accs = [0.0] * len(tasks)

    def work(idx: list[int]) -> None:
        for i in idx:
            accs[i] = trial(tasks[i], after_unit=after_unit)
    start = time.perf_counter()
    pool = [threading.Thread(target=work, args=(list(range(t, len(tasks), threads)),)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return time.perf_counter() - start, accs


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def off_cpu(devices: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> float:
    """The share of the devices' busy seconds their units spent off the CPU (``stats()``' ``busy_seconds`` less
    ``unit_cpu_seconds``: waiting for the interpreter lock, or for other processes), since ``before``."""
    def total(key: str, ds: list[dict[str, Any]] | None) -> float:
        return sum(d[key] for d in ds or [])
    busy = total("busy_seconds", devices) - total("busy_seconds", before)
    return 1.0 - (total("unit_cpu_seconds", devices) - total("unit_cpu_seconds", before)) / busy if busy else 0.0


def hydra_search(tasks: list[ht.ModelTask], devices: int = 2,
                 waits: list[float] | None = None) -> tuple[float, list[float]]:
    """The tasks on one in-process runtime of ``devices`` CPU devices; (wall, accuracies). ``waits``: gets the
    devices' off-CPU share (``off_cpu``)."""
    start = time.perf_counter()
    with ht.Runtime(devices=["cpu"] * devices) as rt:
        handles = [rt.submit(t) for t in tasks]
        accs = [h.result()["accuracy"] for h in handles]
        if waits is not None:
            waits.append(off_cpu(rt.stats()["devices"]))
    return time.perf_counter() - start, accs


def start_servers(count: int = 2) -> tuple[Any, float]:
    """``node.spread``: ``count`` node servers of one CPU device each (a process each, so no shared GIL), and the
    seconds connecting took (with their start if they were not running)."""
    import os

    from hydra_tune import node

    os.environ.setdefault("HYDRA_TUNE_NODE_LINGER", "600")  # alive between the runs; gone 10 min after the last
    # one intra-op thread per server, as in-process (a lone server would take both cores: README, Performance)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    pool = node.spread(["cpu"] * count)
    return pool, time.perf_counter() - start


def servers_search(tasks: list[ht.ModelTask], pool: Any,
                   waits: list[float] | None = None) -> tuple[float, list[float]]:
    """The search through the servers (wall: every submit and every result). ``waits``: as ``hydra_search``'s."""
    before = pool.stats()["devices"] if waits is not None else None
    start = time.perf_counter()
    handles = [pool.submit(t) for t in tasks]
    accs = [h.result()["accuracy"] for h in handles]
    wall = time.perf_counter() - start
    if waits is not None:
        waits.append(off_cpu(pool.stats()["devices"], before))
    return wall, accs


def _traced_units(train: list[Batch], val: list[Batch], epochs: int) -> list[Any]:
    """The trace's units of the fastest of three runs of one trial alone on one device (first to last unit)."""
    runs = []
    for _ in range(3):
        with ht.Runtime(devices=["cpu"]) as rt:
            rt.submit(trial_task(0, train, val, epochs)).result()
            runs.append(rt.trace().units())
    return min(runs, key=lambda units: max(u.end for u in units) - min(u.start for u in units))


def unit_overhead(train: list[Batch], val: list[Batch], epochs: int) -> dict[str, Any]:
    units = _traced_units(train, val, epochs)
    best: tuple[float, float] | None = None
    for _ in range(3):   # the fastest of three plain runs: (units' compute, whole loop)
        compute = [0.0]
        start = time.perf_counter()
        plain_trial(trial_task(0, train, val, epochs), compute)
        run = (compute[0], time.perf_counter() - start)
        best = run if best is None or run[1] < best[1] else best
    assert best is not None
    busy = sum(u.seconds for u in units)
    span = max(u.end for u in units) - min(u.start for u in units)
    n = len(units)
    return {"units": n, "unit_busy_s": busy, "span_s": span, "plain_compute_s": best[0], "plain_s": best[1],
            "unit_us": (busy - best[0]) / n * 1e6, "gap_us": (span - best[1]) / n * 1e6,
            "plain_per_unit_us": best[0] / n * 1e6}


def short_tasks(seeds: range = range(4)) -> list[ht.ModelTask]:
    return [ht.ModelTask(gpt2_factory(SHORT), adamw(1e-3), token_batches(SHORT, seed=i), epochs=1, seed=i,
                         name=f"s{i}") for i in seeds]


def own_data_submits(first_seed: int = 1000, trials: int = 4) -> dict[str, Any]:
    """Submits of short trials over data of their own (seeds this process has not seen: each first batch's token
    ids stick out of those profiled before, so the profile cache checks the batch), one after another on one
    device, each waited for; then the same trials again (their ranges known: plain hits). Milliseconds each."""
    from hydra_tune.training.profile_cache import PROFILES

    def submits() -> list[float]:
        out = []
        with ht.Runtime(devices=["cpu"]) as rt:
            for task in short_tasks(range(first_seed, first_seed + trials)):
                start = time.perf_counter()
                handle = rt.submit(task)
                out.append((time.perf_counter() - start) * 1e3)
                handle.result()
        return out

    before = PROFILES.info()
    own = submits()
    counts = {k: v - before[k] for k, v in PROFILES.info().items() if k in ("hits", "checked", "misses")}
    return {"own_data_ms": own, "again_ms": submits(), "profile_lookups": counts}


def short_trials(repeats: int) -> dict[str, Any]:
    def run(devices: int) -> float:
        start = time.perf_counter()   # runtime start, each build/profile/plan (submit) and training
        with ht.Runtime(devices=["cpu"] * devices) as rt:
            handles = [rt.submit(t) for t in short_tasks()]
            for h in handles:
                h.result()
        return time.perf_counter() - start

    def served(devices: int) -> float:
        start = time.perf_counter()   # each submit (the build, profile and plan run in the servers) and training
        handles = [pools[devices].submit(t) for t in short_tasks()]
        for h in handles:
            h.result()
        return time.perf_counter() - start

    run(1)   # warm-up (transformers' import, first model build)
    walls: dict[int, list[float]] = {1: [], 2: []}
    served_walls: dict[int, list[float]] = {1: [], 2: []}
    for r in range(repeats):   # in-process runs before the servers start: a server tidying up after its warm-up
        for devices in ((1, 2) if r % 2 == 0 else (2, 1)):   # (or its last result) takes a core from them
            walls[devices].append(run(devices))
    pools = {n: start_servers(n)[0] for n in (1, 2)}
    served(1), served(2)   # warm-up in each server
    for r in range(repeats):
        for devices in ((1, 2) if r % 2 == 0 else (2, 1)):
            served_walls[devices].append(served(devices))
    for pool in pools.values():
        pool.close()
    one, two = statistics.median(walls[1]), statistics.median(walls[2])
    s_one, s_two = statistics.median(served_walls[1]), statistics.median(served_walls[2])
    return {"wall_1dev_s": one, "wall_2dev_s": two, "speedup": one / two, "walls": walls,
            "servers_1_s": s_one, "servers_2_s": s_two, "servers_speedup": s_one / s_two,
            "servers_walls": served_walls}


_DEFAULT_THREADS = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import hydra_tune as ht
import hydra_tune.runtime.handle as handle
import hydra_tune.runtime.worker as worker
from small_trials import digits, plain_trial, trial_task
epochs, release = int(sys.argv[2]), handle.release_idle_pool
train, val = digits()   # the script's own torch work: its thread's OpenMP team

def releasing(keep_team):   # our two call sites: the waiting caller's, the idle device's
    handle.release_idle_pool = worker.release_idle_pool = (lambda: False) if keep_team else release

def hydra(keep_team):
    releasing(keep_team)
    with ht.Runtime(devices=["cpu"]) as rt:
        start = time.perf_counter()
        rt.submit(trial_task(0, train, val, epochs)).result()
        return time.perf_counter() - start

def plain():
    start = time.perf_counter()
    plain_trial(trial_task(0, train, val, epochs))
    return time.perf_counter() - start

def plain_beside(keep_team):   # the plain loop while a runtime of one CPU device idles in the same process
    releasing(keep_team)
    with ht.Runtime(devices=["cpu"]) as rt:
        rt.submit(trial_task(0, train, val, 1)).result()
        return plain()

sides = {"plain": plain, "hydra": lambda: hydra(False), "hydra_team_kept": lambda: hydra(True),
         "plain_beside_idle": lambda: plain_beside(False), "plain_beside_idle_team_kept": lambda: plain_beside(True)}
for fn in sides.values():
    fn()   # warm-up: imports, first calls
walls = {name: [] for name in sides}
for r in range(3):
    for name in list(sides)[r:] + list(sides)[:r]:
        walls[name].append(sides[name]())
print("RESULT", json.dumps({"threads": torch.get_num_threads(), "walls": walls}))
"""


def default_threads(epochs: int) -> dict[str, Any]:
    """Part 4 (module docstring) in a fresh interpreter, which calls no torch.set_num_threads."""
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()   # torch's own default: none of the thread settings set here
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HYDRA_TUNE_CPU_THREADS")}
    proc = subprocess.run([sys.executable, "-c", _DEFAULT_THREADS, here, str(epochs)], capture_output=True,
                          text=True, check=True, env=env)
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    best = {name: min(walls) for name, walls in out["walls"].items()}
    return {"threads": out["threads"], "best_s": best, "ratio": best["plain"] / best["hydra"],
            "ratio_team_kept": best["plain"] / best["hydra_team_kept"], "walls": out["walls"],
            "beside_idle": best["plain"] / best["plain_beside_idle"],
            "beside_idle_team_kept": best["plain"] / best["plain_beside_idle_team_kept"]}


def main() -> int:
    t_start = time.perf_counter()

    def extra(p: Any) -> None:
        p.add_argument("--trials", type=int, default=None, help="MLP trials (default 40, --quick 8)")
        p.add_argument("--epochs", type=int, default=None, help="epochs per MLP trial (default 10, --quick 3)")
    args = setup(__doc__, extra)
    n, epochs = args.trials or (8 if args.quick else 40), args.epochs or (3 if args.quick else 10)
    train, val = digits()
    params = sum(p.numel() for p in mlp().parameters())
    print(f"1. {n} trials x {epochs} epochs of a {params}-parameter MLP on 8x8 digits ({len(train)} train / "
          f"{len(val)} eval batches of 64), accuracy every epoch; {args.repeats} runs per side", flush=True)
    hydra_search([trial_task(0, train, val, 1)], 2)   # warm-up of each side (imports, allocator)
    plain_search([trial_task(0, train, val, 1)])
    servers, server_start = start_servers()
    servers_search([trial_task(i, train, val, 1) for i in range(2)], servers)
    runs: dict[str, list[float]] = {"hydra": [], "plain": [], "servers": []}
    cpu: dict[str, list[float]] = {"hydra": [], "plain": []}  # process CPU seconds: less swayed by other load
    accs: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {"hydra": [], "servers": []}  # the devices' off-CPU share of their busy time
    sides = ["hydra", "plain", "servers"]
    for r in range(args.repeats):
        for side in sides[r % 3:] + sides[:r % 3]:
            tasks = [trial_task(i, train, val, epochs) for i in range(n)]
            c0 = _cpu_seconds()
            wall, accs[side] = (hydra_search(tasks, 2, waits["hydra"]) if side == "hydra" else plain_search(tasks)
                                if side == "plain" else servers_search(tasks, servers, waits["servers"]))
            runs[side].append(wall)
            if side in cpu:  # (the servers' CPU is theirs, not this process's)
                cpu[side].append(_cpu_seconds() - c0)
            print(f"   {side:<7} run {r + 1}: {wall:6.2f} s" + (f" ({cpu[side][-1]:.2f} CPU s)" if side in cpu else ""),
                  flush=True)
    servers.close()
    hydra, plain = statistics.median(runs["hydra"]), statistics.median(runs["plain"])
    cpu_ratio = statistics.median(cpu["plain"]) / statistics.median(cpu["hydra"])
    # (the plain threads share torch's global generator, so their dropout masks interleave: means, not equality)
    mean = {side: sum(a) / len(a) for side, a in accs.items()}
    print(f"   search ratio plain/hydra = {plain / hydra:.3f}x (hydra {hydra:.2f} s, plain 2 at a time {plain:.2f} s; "
          f"goal >= 1.0x); mean final accuracy hydra {mean['hydra']:.3f}, plain {mean['plain']:.3f}", flush=True)
    served = statistics.median(runs["servers"])
    same = "equal" if accs["servers"] == accs["hydra"] else "DIFFER FROM"
    print(f"   through 2 node servers of 1 CPU device each (node.spread; a process each: no shared GIL; connecting, "
          f"{server_start:.2f} s with their start if they were not running, not counted): plain/servers = "
          f"{plain / served:.3f}x ({served:.2f} s); counting that connecting once, as a search started now would: "
          f"{plain / (served + server_start):.3f}x; hydra's accuracies {same} the in-process runtime's", flush=True)
    print(f"   CPU seconds, plain/hydra = {cpu_ratio:.3f}x (what each side spent, all threads; compare across runs "
          "when the machine's load differs)", flush=True)
    print(f"   the devices' units off the CPU (stats: busy_seconds less unit_cpu_seconds; the interpreter lock, or "
          f"other processes): in one process {statistics.median(waits['hydra']):.0%} of their busy time, through the "
          f"servers {statistics.median(waits['servers']):.0%}", flush=True)

    print("2. short trials: 4 GPT-2 4x128 tasks x 6 minibatches, 2 devices vs 1, counting submit", flush=True)
    short = short_trials(args.repeats)
    print(f"   2 devices vs 1 = {short['speedup']:.3f}x ({short['wall_1dev_s']:.2f} s vs {short['wall_2dev_s']:.2f} s; "
          "goal >= 1.6x)", flush=True)
    print(f"   through node servers of 1 CPU device each (node.spread), 2 servers vs 1 = "
          f"{short['servers_speedup']:.3f}x ({short['servers_1_s']:.2f} s vs {short['servers_2_s']:.2f} s)", flush=True)
    own = short["own_data"] = own_data_submits()
    print(f"   submit of a trial over data of its own (token ids this process has not profiled): "
          f"{statistics.median(own['own_data_ms']):.0f} ms median ({', '.join(f'{x:.0f}' for x in own['own_data_ms'])}"
          f"; profile lookups {own['profile_lookups']}); the same trials again "
          f"{statistics.median(own['again_ms']):.0f} ms", flush=True)

    print("3. per-unit runtime overhead (one MLP trial alone, 1 device, traced)", flush=True)
    over = unit_overhead(train, val, epochs)
    print(f"   {over['units']} units; unit overhead {over['unit_us']:.0f} us/unit, with hand-offs and host work "
          f"{over['gap_us']:.0f} us/unit, plain compute {over['plain_per_unit_us']:.0f} us/unit (aim < 200 us)")
    print(f"4. torch's default intra-op threads, 1 CPU device vs the plain loop, one trial of {epochs} epochs "
          "(a fresh interpreter)", flush=True)
    dflt = default_threads(epochs)
    best = dflt["best_s"]
    print(f"   {dflt['threads']} threads: plain/hydra = {dflt['ratio']:.3f}x (hydra {best['hydra']:.3f} s, plain "
          f"{best['plain']:.3f} s); with the waiting thread's OpenMP team kept {dflt['ratio_team_kept']:.3f}x "
          f"({best['hydra_team_kept']:.3f} s)", flush=True)
    print(f"   the plain loop beside an idle runtime of 1 CPU device: {best['plain_beside_idle']:.3f} s "
          f"({dflt['beside_idle']:.3f}x of alone; with the idle device's team kept "
          f"{best['plain_beside_idle_team_kept']:.3f} s, {dflt['beside_idle_team_kept']:.3f}x)", flush=True)
    emit({"benchmark": "small_trials", "default_threads": dflt, "search_ratio": plain / hydra, "search": runs,
          "search_cpu": cpu, "off_cpu": waits,
          "servers_ratio": plain / served, "server_start_s": server_start,
          "servers_ratio_with_start": plain / (served + server_start),
          "search_cpu_ratio": cpu_ratio, "mean_accuracy": mean,
          "short": short, "overhead": over, "trials": n, "epochs": epochs, "mlp_params": params}, args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
