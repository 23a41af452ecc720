"""Usage: .venv/bin/python benchmarks/node_churn.py [--tasks 2000] [--quick] [--clients 3] [--per-client 10]
                                                   [--seed 0] [--json PATH]

Churn soak of the node runtime server (a server that runs for weeks): client processes, several at a time, connect,
submit small tasks, train a little, then finish, cancel, or leave them running and disconnect (some close, some exit
without closing), until N tasks went through one server. The server keeps ended tasks' records and trace events in
bounded buffers (RuntimeConfig ``history``, ``trace_events``; small here so the soak reaches them early). Measured
in the server process (/proc) after a warm-up round and after every round, once the server holds no task: RSS,
open file descriptors, threads; and its ``stats()["history"]``. Exit status 1 when a check fails: fds and threads
back to baseline, RSS growth within tolerance, every task accounted for, the buffers at their bounds.

    .venv/bin/python benchmarks/node_churn.py --tasks 2000     # the long run (the issue's 2,000 tasks)
    .venv/bin/python benchmarks/node_churn.py --quick          # what tests/test_long_running.py runs
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from _checks import finish  # benchmarks/ is on sys.path

HISTORY, TRACE_EVENTS = 50, 2000     # the server's bounds in this soak (the defaults are 1000, 200,000)
QUICK_HISTORY = 8                    # --quick: reached within its few tasks
CONFIG = dict(devices=["cpu", "cpu"], device_memory=None, history=HISTORY, trace_events=TRACE_EVENTS)
ACTIONS = ("finish", "cancel_running", "cancel_at_once", "leave")
# RSS may rise while the server's allocator and the bounded buffers fill, then stays: the fixed part is what a
# warm server moved by between rounds here (measured: see the report), the per-task part 1 KiB (a leak of one
# stats record per task, ~2-5 KiB, fails it over 2,000 tasks).
RSS_TOLERANCE = (24 << 20, 1 << 10)


# -- a client process -----------------------------------------------------------------------------------------------
def client(seed: int, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """Submit ``n`` tasks, act on each as seeded, then disconnect (close, or exit at once); prints what happened."""
    import torch

    import hydra_tune as ht
    from hydra_tune import node
    from hydra_tune.config import RuntimeConfig
    from hydra_tune.errors import TaskCancelled

    rng = random.Random(seed)
    rt = node.connect(config=RuntimeConfig(**config))
    handles, outcome = [], {a: 0 for a in ACTIONS}
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        data = [(torch.randn(4, 16, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]
        action = rng.choice(ACTIONS)
        task = ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                        torch.nn.Linear(32, 2)),
                            lambda m: torch.optim.SGD(m.parameters(), lr=0.05), data,
                            loss=lambda o, b: torch.nn.functional.mse_loss(o, b[1]),
                            epochs=200 if action in ("leave", "cancel_running") else rng.randint(1, 3),
                            seed=i, name=f"k{i}")
        h = rt.submit(task)
        handles.append((action, h))
        if action == "cancel_at_once":
            h.cancel()
        elif action == "cancel_running":
            next(iter(h.metrics()), None)  # one epoch's metrics: it has trained a little
            h.cancel()
        outcome[action] += 1
    ended = 0
    for action, h in handles:
        if action == "leave":
            continue
        try:
            h.result(timeout=300)
        except TaskCancelled:
            pass
        ended += 1
    print(json.dumps({"seed": seed, "tasks": n, "actions": outcome, "ended_here": ended}), flush=True)
    if rng.random() < 0.5:
        rt.close()
        return outcome
    os._exit(0)  # no goodbye: the server notices the connection drop and cancels what this client left running


# -- the soak (the driving process: no torch here) -----------------------------------------------------------------
def server_figures(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _clients() -> Any:
    """Client processes forked from a server of forks that imported torch and hydra_tune once (a fresh interpreter
    per client would spend seconds importing torch: the churn is in connections, not imports)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hydra_tune", "hydra_tune.node"])
    return ctx


def _settle(stats_of: Any, pid: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the server holds no running task and no client, then measure it."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats_of()
        busy = [n for n, t in s["tasks"].items() if t["state"] not in ("done", "cancelled", "failed")]
        if not busy and s["server"]["clients"] <= 1:
            time.sleep(0.3)  # forwarders and readers of the clients that left end a moment later
            return dict(server_figures(pid), history=s["history"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server still runs {busy} {timeout} s after its clients left")
        time.sleep(0.1)


def soak(tasks: int, clients: int, per_client: int, seed: int) -> dict[str, Any]:
    """Rounds of ``clients`` concurrent client processes of ``per_client`` tasks each, through one node server."""
    base = tempfile.mkdtemp(prefix="htc", dir="/tmp")  # short: socket paths are limited to 107 bytes
    os.environ.update(HYDRA_TUNE_NODE_DIR=base, HYDRA_TUNE_NODE_LINGER="60",
                      PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    ctx = _clients()
    from hydra_tune import node
    from hydra_tune.config import RuntimeConfig

    watcher = node.connect(config=RuntimeConfig(**CONFIG))   # this process's connection: reads stats only
    pid, rounds, done, series, failed_clients = watcher.pid, 0, 0, [], []
    t0 = time.perf_counter()
    try:
        baseline = None
        total = tasks + clients * per_client   # the first round warms the server up
        while done < total:
            procs = [ctx.Process(target=client, args=(seed * 100_000 + rounds * clients + c, per_client,
                                                              CONFIG))
                     for c in range(clients)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
                if p.exitcode != 0:
                    failed_clients.append(f"client pid {p.pid} exit code {p.exitcode}")
            done += clients * per_client
            rounds += 1
            figures = _settle(watcher.stats, pid)
            if baseline is None:
                baseline = figures
            series.append(dict(figures, tasks=done - clients * per_client))
        final = watcher.stats()
    finally:
        watcher.close()
        os.kill(pid, signal.SIGTERM)
        shutil.rmtree(base, ignore_errors=True)
    after = series[-1]
    counted = final["history"]["ended_kept"] + final["history"]["ended_dropped"]
    return {"tasks": tasks, "clients": clients, "per_client": per_client, "rounds": rounds, "seed": seed,
            "baseline": baseline, "after": after, "series": series, "tasks_counted": counted,
            "tasks_total": done, "failed_clients": failed_clients, "wall_s": time.perf_counter() - t0,
            "rss_delta": after["rss"] - baseline["rss"],
            "rss_max_delta": max(s["rss"] for s in series) - baseline["rss"]}


def failures(r: dict[str, Any]) -> list[str]:
    b, a, h = r["baseline"], r["after"], r["after"]["history"]
    out = [f"{k}: {b[k]} -> {a[k]}" for k in ("fds", "threads") if a[k] > b[k]]
    fixed, per = RSS_TOLERANCE
    if r["rss_delta"] > fixed + per * r["tasks"]:
        out.append(f"rss grew {r['rss_delta'] / 2**20:.1f} MiB > {(fixed + per * r['tasks']) / 2**20:.1f} MiB")
    if r["tasks_counted"] != r["tasks_total"]:
        out.append(f"{r['tasks_counted']} tasks ended in the server's records of {r['tasks_total']} submitted")
    if h["ended_kept"] > CONFIG["history"] or h["trace_events"] > CONFIG["trace_events"]:
        out.append(f"buffers past their bounds: {h}")
    out += [f"a client failed: {e}" for e in r["failed_clients"]]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=None, help="tasks after the warm-up round (default 2000, --quick 24)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--clients", type=int, default=3, help="client processes at a time")
    p.add_argument("--per-client", type=int, default=None, help="tasks per client process (default 10, --quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--history", type=int, default=None, help=f"the server's history bound (default {HISTORY})")
    p.add_argument("--trace-events", type=int, default=None, help=f"its trace bound (default {TRACE_EVENTS})")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    per = args.per_client or (4 if args.quick else 10)
    n = args.tasks or (24 if args.quick else 2000)
    if args.quick:
        CONFIG["history"] = QUICK_HISTORY   # before the forkserver starts: its clients connect with this config
    CONFIG["history"] = args.history if args.history is not None else CONFIG["history"]
    CONFIG["trace_events"] = args.trace_events if args.trace_events is not None else CONFIG["trace_events"]
    print(f"node churn: {n} tasks, {args.clients} client processes at a time, {per} tasks each, server history "
          f"{CONFIG['history']}, trace_events {CONFIG['trace_events']}, seed {args.seed}")
    r = soak(n, args.clients, per, args.seed)
    b, a = r["baseline"], r["after"]
    print(f"{'':10}{'baseline':>14}{'after':>14}{'delta':>12}")
    for k in ("rss", "fds", "threads"):
        print(f"{k:10}{b[k]:>14,}{a[k]:>14,}{a[k] - b[k]:>12,}")
    print("RSS - baseline by tasks (MiB):", ", ".join(f"{s['tasks']}: {(s['rss'] - b['rss']) / 2**20:+.1f}"
                                                    for s in r["series"]))
    print("fds by tasks:", ", ".join(f"{s['tasks']}: {s['fds']}" for s in r["series"]))
    print(f"server history: {a['history']}; tasks counted {r['tasks_counted']} of {r['tasks_total']}; "
          f"{r['rounds']} rounds, wall {r['wall_s']:.1f} s")
    bad = failures(r)
    return finish(r, bad, args.json)


if __name__ == "__main__":
    sys.exit(main())
