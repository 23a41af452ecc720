"""Usage: .venv/bin/python benchmarks/soak.py [--tasks 200] [--quick] [--seed 0] [--default-malloc] [--json PATH]

Cancellation soak: one Runtime (2 CPU devices, a 6 MiB budget that cuts every model here into >= 3 shards) runs
N small tasks (MLPs and tiny GPT-2s of seeded, varied sizes, some with eval data) in waves of 4, so some wait in
the queue. Each task is cancelled at a seeded kind of moment, seen in the runtime's real state:
  queued    right after submit (it counts as queued when cancel() ended it at once);
  loss      from inside its loss function: mid L unit, on the device's worker thread;
  unit      from a watcher thread while a worker's stack is inside one of its units (F, L, B, E);
  prefetch  from the watcher while a copy thread's stack is inside a copy of one of its shards made ahead of use
            (a prefetch, or a kept forward's refill); "confirmed" when the copy was still running after cancel();
  data      from its data iterable while a batch is fetched (host work, on the task's host thread);
  epoch     after its k-th epoch's metrics;
  finish    not cancelled.
Measured after a warm-up wave of each kind and again after all tasks (both once every worker waits for work, after
gc and malloc_trim): process RSS, bytes malloc has handed out, every device's accounted bytes and live storages,
resident shard copies, tasks still tracked; and that every model built was collected. Prints a table and one JSON
line (--json PATH saves it); exit status 1 when a check fails.

RSS: glibc raises its mmap and trim thresholds as large blocks are freed (up to 32 and 64 MiB), and a thread's
arena keeps free memory below the trim threshold resident; malloc_trim does not return a thread arena's top. That
made RSS wobble by 30-70 MiB here at equal live memory, so by default this script fixes both thresholds at 128 KiB
(mallopt) before it starts, and RSS then follows live memory; --default-malloc keeps glibc's behaviour.
MKL's own memory manager keeps the GEMM buffers of the shapes it has seen (4.6-4.8 MiB more in use after the first
20 tasks' widths, then flat, on one CI machine: a step past the fixed tolerance with nothing of hydra_tune's kept),
so the script runs with it off (``MKL_DISABLE_FAST_MM=1``, set before torch loads MKL; malloc's in-use bytes then
moved by 0.12 MiB); --default-malloc keeps it too.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import threading
import time
import weakref
from collections import Counter
from typing import Any

if __name__ == "__main__" and "--default-malloc" not in sys.argv:  # (before torch loads MKL: the docstring's end)
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _checks import finish  # noqa: E402
from _memory import deep_size, fix_malloc_thresholds, malloc_in_use, rss, trim  # noqa: E402

import hydra_tune as ht  # noqa: E402
from hydra_tune.errors import TaskCancelled  # noqa: E402

BUDGET = 6 << 20
WAVE = 4
ACTIONS = {"queued": 3, "loss": 2, "unit": 2, "prefetch": 3, "data": 2, "epoch": 2, "finish": 2}  # weights
# Kept by design per task: its record in stats() and its units' and copies' trace events (about 5 KiB measured).
# Besides, malloc's in-use bytes moved by 0.05-2 MiB between runs at any task count (caches of the math libraries
# and per-thread buffers), so the fixed part is twice the largest move seen.
MALLOC_TOLERANCE = (4 << 20, 16 << 10)   # fixed bytes, bytes per task
# With fixed malloc thresholds RSS ended 0.5-7 MiB above its baseline after 32-200 tasks: about 2 MiB at once (the
# malloc steps above) and ~17 KiB per task, the trace events the runtime keeps (flat with recording disabled); with
# glibc's defaults 30-70 MiB (see the module docstring).
RSS_TOLERANCE = {True: (16 << 20, 64 << 10), False: (128 << 20, 256 << 10)}  # keyed by "thresholds fixed"


# -- the tasks ------------------------------------------------------------------------------------------------------
def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 4))


def _gpt2(n_layer: int, n_embd: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=1024, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


class Data:
    """A task's batches, iterable once per epoch; ``hook`` (when set) runs as each batch is fetched."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.hook = batches, None

    def __iter__(self):
        for b in self.batches:
            if self.hook is not None:
                self.hook()
            yield b

    def __len__(self) -> int:
        return len(self.batches)


def make_task(i: int, rng: random.Random, built: list[weakref.ref]) -> tuple[ht.ModelTask, dict[str, Any]]:
    """Task ``i`` of a seeded family and size; ``ctl`` holds what its action arms after submit."""
    g = torch.Generator().manual_seed(i)
    action = rng.choice([a for a, w in ACTIONS.items() for _ in range(w)])
    epochs = 8 if action in ("prefetch", "unit") else 2  # more moments for the watcher to see
    if rng.random() < 0.5:
        width, depth = rng.choice((512, 576, 640, 704)), rng.randint(3, 5)
        desc, factory = f"mlp {width}x{depth}", lambda: _mlp(width, depth)
        batches: list[Any] = [(torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]

        def base_loss(out, b):
            return F.mse_loss(out, b[1])
    else:
        n_layer = rng.randint(2, 4)
        desc, factory = f"gpt2 {n_layer}x128", lambda: _gpt2(n_layer, 128)
        batches = [{"input_ids": (ids := torch.randint(0, 1024, (4, 32), generator=g)), "labels": ids}
                   for _ in range(4)]

        def base_loss(out, b):
            return out.loss
    ctl: dict[str, Any] = {"action": action, "desc": desc, "data": Data(batches), "in_loss": None, "calls": 0,
                           "at": rng.randint(1, 6), "epoch_at": rng.randint(1, epochs - 1)}

    def build() -> nn.Module:
        model = factory()
        if not any(p.is_meta for p in model.parameters()):  # admission also builds it on the meta device
            built.append(weakref.ref(model))
        return model

    def loss(out, batch):
        if ctl["in_loss"] is not None:  # armed after submit: planning calls the loss too
            ctl["calls"] += 1
            if ctl["calls"] == ctl["at"]:
                ctl["in_loss"]()
        return base_loss(out, batch)

    task = ht.ModelTask(build, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), ctl["data"], loss=loss,
                        eval_data=batches[:2] if rng.random() < 0.3 else None, epochs=epochs, seed=i,
                        name=f"soak{i}")
    return task, ctl


# -- watching the runtime's threads ---------------------------------------------------------------------------------
_UNIT_FRAMES = {"forward", "_forward_keep", "forward_loss_backward", "backward", "evaluate"}   # ShardExec's units
_COPY_FRAMES = {"copy_in", "refill"}                                          # ShardExec's copies in


def _moment(frame: Any, copying: bool) -> tuple[Any, str, str, bool] | None:
    """(innermost frame of the moment, task, unit, whether the copy thread is preparing the device's next task)
    when the stack from ``frame`` is inside a unit (worker) or a shard copy made ahead of use (copy thread)."""
    inner, found, f = None, None, frame
    wanted, outer = (_COPY_FRAMES, "_prefetch") if copying else (_UNIT_FRAMES, "_run_unit")
    while f is not None:
        code = f.f_code
        if inner is None and code.co_name in wanted and code.co_filename.endswith("shard.py"):
            inner = f
        elif inner is not None and found is None and code.co_name == outer and code.co_filename.endswith("worker.py"):
            unit = f.f_locals.get("unit")
            if unit is None:
                return None
            found = (inner, unit.task, str(unit))
        elif found is not None and code.co_name == "_next_segment":
            return (*found, True)
        f = f.f_back
    return None if found is None else (*found, False)


class Watcher(threading.Thread):
    """Cancels armed tasks at a moment seen in the stacks of the runtime's threads (``sys._current_frames``)."""

    def __init__(self) -> None:
        super().__init__(name="soak-watcher", daemon=True)
        # task -> (handle, its outcome, where): "unit", "prefetch", or "next" (a prefetch of the task's first
        # shard by a device's copy thread while that device finishes another segment)
        self.armed: dict[str, tuple[Any, dict, str]] = {}
        self.lock = threading.Lock()
        self.stop = False

    def arm(self, handle: Any, out: dict, where: str) -> None:
        with self.lock:
            self.armed[handle.name] = (handle, out, where)

    def disarm(self, name: str) -> None:
        with self.lock:
            self.armed.pop(name, None)

    def run(self) -> None:
        while not self.stop:
            time.sleep(0.0002)
            with self.lock:
                armed = dict(self.armed)
            if armed:
                self._scan(armed)
            del armed

    def _scan(self, armed: dict[str, tuple[Any, dict, str]]) -> None:
        # A function of its own: frames must not outlive the scan (a finished frame object still referenced keeps
        # its locals, device tensors included, alive).
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            thread = names.get(ident, "")
            copying = thread.startswith("hydra-copy-")
            if not (copying or thread.startswith("hydra-cpu")):
                continue
            seen = _moment(frame, copying)
            where = armed[seen[1]][2] if seen is not None and seen[1] in armed else None
            if where is None or (where == "unit") == copying or (where == "next" and not seen[3]):
                continue
            self.disarm(seen[1])
            handle, out, _ = armed[seen[1]]
            handle.cancel()
            still, f = False, sys._current_frames().get(ident)
            while f is not None and not still:
                still, f = f is seen[0], f.f_back
            out.update(moment=where, detail=f"{seen[2]} on {thread}" + (" (device's next task)" if seen[3] else ""),
                       confirmed=still)


# -- measuring ------------------------------------------------------------------------------------------------------
def quiesce(rt: ht.Runtime, timeout: float = 60.0) -> None:
    """Wait until every device's worker waits for work and no task's host thread runs: a handle reports its end
    from inside a worker or a host thread, whose frames let go of the task's host state (model, optimizer) a moment
    later."""
    deadline = time.monotonic() + timeout
    while True:
        counts = rt.scheduler.counts()
        if counts["idle_devices"] == len(rt.devices) and counts["ready"] == 0 and counts["host_busy"] == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the runtime's workers were still busy {timeout} s after the last task ended")
        time.sleep(0.005)


def snapshot(rt: ht.Runtime) -> dict[str, Any]:
    quiesce(rt)
    trim()
    counts, trace = rt.scheduler.counts(), rt.trace()
    return {"rss": rss(), "malloc_in_use": malloc_in_use(), "gc_objects": len(gc.get_objects()),
            "device_bytes": [d.current_bytes() for d in rt.devices],
            "live_storages": [len(d.account._live) for d in rt.devices],
            "resident_shards": [len(d.resident) for d in rt.devices], "tasks": counts["admitted"],
            "ready": counts["ready"], "finished_records": counts["finished"], "trace_events": len(trace.events),
            "records_bytes": deep_size([rt.scheduler.task_stats(), trace.events])}  # kept by design: stats(), trace()


# -- the soak -------------------------------------------------------------------------------------------------------
def _arm(h: Any, ctl: dict[str, Any], out: dict[str, Any], watcher: Watcher) -> threading.Thread | None:
    """Set up the task's cancel at its action's moment (right after its submit)."""
    action = ctl["action"]
    if action == "queued":
        h.cancel()
        out["moment"] = "queued" if h.done() else "running"  # running: a device took it before cancel()
    elif action == "loss":
        def in_loss() -> None:
            h.cancel()
            out.update(moment="loss", detail=f"L on {threading.current_thread().name}")
        ctl["in_loss"] = in_loss
    elif action in ("unit", "prefetch"):
        watcher.arm(h, out, action)
    elif action == "data":
        def fetching() -> None:
            ctl["calls"] += 1
            if ctl["calls"] == ctl["at"]:
                h.cancel()
                out.update(moment="data", detail=f"batch fetch on {threading.current_thread().name}")
        ctl["data"].hook = fetching
    elif action == "epoch":
        def after(k: int = ctl["epoch_at"]) -> None:
            for m in h.metrics():
                if m["epoch"] == k:
                    h.cancel()
                    out.update(moment="epoch", detail=f"after epoch {k}")
                    return
        thread = threading.Thread(target=after, daemon=True)
        thread.start()
        return thread
    return None


def run_wave(rt: ht.Runtime, watcher: Watcher, jobs: list[tuple[ht.ModelTask, dict[str, Any]]]) -> list[dict]:
    """Submit the wave's tasks, arm each one's cancel, wait for all to end."""
    handles, outcomes, threads = [], [], []
    for task, ctl in jobs:
        out: dict[str, Any] = {"task": task.name, "model": ctl["desc"], "action": ctl["action"], "moment": None}
        t0 = time.perf_counter()
        h = rt.submit(task)
        out["submit_s"] = time.perf_counter() - t0
        threads.append(_arm(h, ctl, out, watcher))
        handles.append(h)
        outcomes.append(out)
    for h, out in zip(handles, outcomes):
        try:
            h.result(timeout=300)
        except TaskCancelled:
            pass
        except Exception as exc:  # noqa: BLE001  (reported as a failure)
            out["error"] = f"{type(exc).__name__}: {exc}"
        watcher.disarm(h.name)
        out["status"] = h.status
        if out["moment"] is None:
            out["moment"] = "finished" if out["action"] == "finish" else f"missed ({h.status})"
    for t in threads:
        if t is not None:
            t.join(60)
    return outcomes


def soak(tasks: int, seed: int = 0) -> dict[str, Any]:
    """Run the soak on a fresh Runtime; returns every number (``failures`` checks them)."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    built: list[weakref.ref] = []
    watcher = Watcher()
    watcher.start()
    t_start = time.perf_counter()
    outcomes: list[dict] = []
    series: list[list[int]] = []
    # every task's record is read at the end (its shards): the history bound (RuntimeConfig) keeps them all
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], device_memory=BUDGET, history=max(1000, tasks + 64))
    with ht.Runtime(config=config) as rt:
        warm = []  # a task of each action and of each family, so one-off caches fill before the baseline
        while {c["action"] for _, c in warm} != set(ACTIONS) or len({c["desc"][:3] for _, c in warm}) < 2:
            task, ctl = make_task(10_000 + len(warm), rng, [])
            if ctl["action"] not in {c["action"] for _, c in warm} or ctl["desc"][:3] not in {c["desc"][:3]
                                                                                          for _, c in warm}:
                warm.append((task, ctl))
        for j in range(0, len(warm), WAVE):
            run_wave(rt, watcher, warm[j:j + WAVE])
        del warm, task, ctl
        before = snapshot(rt)
        t0 = time.perf_counter()
        for start in range(0, tasks, WAVE):
            outcomes += run_wave(rt, watcher, [make_task(i, rng, built) for i in range(start, min(tasks,
                                                                                                start + WAVE))])
            if len(outcomes) % (WAVE * 5) == 0:  # along the way: a leak keeps growing, allocator slack does not
                quiesce(rt)
                trim()
                series.append([len(outcomes), rss(), malloc_in_use()])
        soak_s = time.perf_counter() - t0
        stats = rt.stats()["tasks"]
        after = snapshot(rt)
        alive = sum(r() is not None for r in built)
    watcher.stop = True
    watcher.join()
    for o in outcomes:
        o["shards"] = len(stats[o["task"]]["shards"])
    return {"tasks": tasks, "seed": seed, "budget": BUDGET, "before": before, "after": after,
            "rss_delta": after["rss"] - before["rss"],
            "malloc_delta": after["malloc_in_use"] - before["malloc_in_use"], "series": series,
            "models_built": len(built), "models_alive": alive, "moments": dict(Counter(o["moment"] for o in outcomes)),
            "prefetch_confirmed": sum(bool(o.get("confirmed")) for o in outcomes if o["moment"] == "prefetch"),
            "outcomes": outcomes, "soak_s": soak_s, "wall_s": time.perf_counter() - t_start}


def failures(r: dict[str, Any], fixed_thresholds: bool = True) -> list[str]:
    """What the soak must show: accounted device state exactly back to baseline, nothing tracked, every model
    collected, malloc and RSS growth within their tolerances, every task cut into >= 2 shards, no task error."""
    b, a, n = r["before"], r["after"], r["tasks"]
    out = [f"{k}: {b[k]} -> {a[k]}" for k in ("device_bytes", "live_storages", "resident_shards") if a[k] != b[k]]
    out += [f"{k} = {a[k]}" for k in ("tasks", "ready") if a[k]]
    if r["models_alive"]:
        out.append(f"{r['models_alive']} of {r['models_built']} models still alive")
    for what, (fixed, per) in (("malloc_delta", MALLOC_TOLERANCE), ("rss_delta", RSS_TOLERANCE[fixed_thresholds])):
        if r[what] > fixed + per * n:
            out.append(f"{what} {r[what] / 2**20:.1f} MiB > {(fixed + per * n) / 2**20:.1f} MiB")
    out += [f"{o['task']} cut into {o['shards']} shard(s)" for o in r["outcomes"] if o["shards"] < 2]
    out += [f"{o['task']} ({o['action']}): {o['error']}" for o in r["outcomes"] if "error" in o]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=None, help="tasks after the warm-up (default 200, --quick 32)")
    p.add_argument("--quick", action="store_true", help="32 tasks (what tests/test_soak.py runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--default-malloc", action="store_true", help="keep glibc's moving malloc thresholds")
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = p.parse_args()
    fixed = not args.default_malloc and fix_malloc_thresholds()
    n = args.tasks or (32 if args.quick else 200)
    print(f"soak: {n} tasks, 2 CPU devices, budget {BUDGET >> 20} MiB, waves of {WAVE}, seed {args.seed}, malloc "
          f"thresholds {'fixed at 128 KiB' if fixed else 'glibc defaults'}")
    r = soak(n, args.seed)
    r["fixed_malloc_thresholds"] = fixed
    b, a = r["before"], r["after"]
    print(f"\n{'':18}{'baseline':>14}{'after':>14}{'delta':>12}{'per task':>11}")
    for k in ("rss", "malloc_in_use", "gc_objects", "device_bytes", "live_storages", "resident_shards", "tasks",
              "ready", "finished_records", "trace_events", "records_bytes"):
        bv, av = (sum(b[k]), sum(a[k])) if isinstance(b[k], list) else (b[k], a[k])
        print(f"{k:18}{bv:>14,}{av:>14,}{av - bv:>12,}{(av - bv) / n:>11,.1f}")
    print(f"models built {r['models_built']}, alive after {r['models_alive']}; shards per task "
          f"{min(o['shards'] for o in r['outcomes'])}-{max(o['shards'] for o in r['outcomes'])}; "
          f"soak {r['soak_s']:.1f} s (wall {r['wall_s']:.1f} s)")
    print("RSS - baseline along the way (MiB):", ", ".join(f"{k}: {(v - b['rss']) / 2**20:+.1f}"
                                                         for k, v, _ in r["series"]))
    print("cancelled at:", ", ".join(f"{k} {v}" for k, v in sorted(r["moments"].items())),
          f"(prefetches still copying when cancel() returned: {r['prefetch_confirmed']})")
    bad = failures(r, fixed)
    return finish(r, bad, args.json, echo=True)


if __name__ == "__main__":
    sys.exit(main())
