"""Usage: .venv/bin/python benchmarks/unit_breakdown.py [--epochs N] [--runs N] [--json out.json] [--calls]

Where a small trial's time goes on a CPU device, minibatch by minibatch (issue 15): one trial of small_trials.py's
MLP (117k parameters, 8x8 digits, batch 64, accuracy every epoch) alone on a runtime of one CPU device, and the same
trial as the plain loop, in one process (one intra-op thread).

How: the device thread's calls of the runtime's per-unit and per-minibatch functions (worker, board, loop, light
path, optimizer step, state home; ``SITES`` below) are wrapped to stamp ``time.perf_counter_ns()`` on entry and
exit, in that thread only. Between two consecutive stamps the thread ran one piece of code: the time from stamp a
to stamp b is charged to the pair (a, b). Pairs inside the forward, the backward or the optimizer's update are the
compute (what the plain loop runs too); every other pair is the runtime's own work around it. A stamp costs
~0.3 us, ~100 a minibatch: the total includes ~30 us a minibatch of the probe itself. Times are per training
minibatch (the eval batches' share included), each pair's sum over the run divided by the minibatches; the plain
loop's parts are summed the same way (its eval forwards in its forward). The fastest of ``--runs`` runs a side
(the machine's other load inflates a run, never deflates it).

A name in ``SITES`` that the code no longer has fails the script at once (a renamed function would otherwise
drop out of the breakdown and read as time saved).

``--calls`` counts Python function calls instead (``sys.setprofile`` in every thread), which the machine's load
does not change: per training minibatch in the steady state (the difference between a run of ``--epochs`` and one
of a third as many, divided by the minibatches between them), hydra against the plain loop (small_trials.py's
``plain_trial``), the functions that differ most, and the calls per task that do not grow with its length.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from small_trials import digits, plain_trial, trial_task

import hydra_tune as ht
from hydra_tune.device import devices, quiet, streams
from hydra_tune.runtime import scheduler, trace, worker
from hydra_tune.training import direct, home_steps, loop, optstep, shard, state

SITES: list[tuple[Any, tuple[str, ...]]] = [
    (worker.DeviceWorker, ("_run_segment", "_run_open", "_run_units", "_run_unit", "_next_task", "_inline")),
    (scheduler.Scheduler, ("open_here", "choose_next", "observe", "_open", "_advance", "_opened", "_off_device")),
    (trace.Recorder, ("add",)),
    (loop.TrainingLoop, ("_step", "_train_segment", "_begin", "_train_units", "_segment")),
    (state.TaskState, ("reach_boundary", "leave_boundary", "check_frozen")),
    (home_steps.HomeSteps, ("land_grads", "use", "settle", "hold_now", "step_started", "step_ended")),
    (optstep.OptimizerStep, ("_whole", "_update")),
    (direct.DirectPath, ("forward_loss_backward", "evaluate", "_inputs", "_run", "applies")),
    (streams.HostCopier, ("read",)),
    (shard.ShardExec, ("python_state",)),
    (devices.CpuDevice, ("unit_scope",)),
    (quiet._Guarded, ("__enter__", "__exit__")),
]
# the pairs that are the plain loop's own compute: inside the forward, the backward and the optimizer's update
COMPUTE = {("DirectPath._run>", "<DirectPath._run"): "forward, train and eval (the model's stages)",
           ("backward>", "<backward"): "backward",
           ("OptimizerStep._update>", "<OptimizerStep._update"): "optimizer step + zero_grad"}


class Probe:
    """Entry/exit stamps of ``SITES`` (and ``Tensor.backward``) in one thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.thread: int | None = None
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for cls, names in SITES:
            for name in names:
                owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
                if owner is None:
                    raise SystemExit(f"unit_breakdown: {cls.__qualname__}.{name} is gone; update SITES")
                self._wrap(owner, name, f"{cls.__name__}.{name}")
        self._wrap(torch.Tensor, "backward", "backward")

    def remove(self) -> None:
        for cls, name, raw in reversed(self._undo):
            setattr(cls, name, raw)
        self._undo.clear()

    def _wrap(self, cls: Any, name: str, label: str) -> None:
        raw = inspect.getattr_static(cls, name)
        fn = getattr(cls, name)
        events, clock, probe = self.events, time.perf_counter_ns, self

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != probe.thread:
                return fn(*args, **kwargs)
            events.append((label + ">", clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                events.append(("<" + label, clock()))
        self._undo.append((cls, name, raw))
        setattr(cls, name, staticmethod(stamped) if isinstance(raw, staticmethod) else stamped)

    def pairs(self) -> dict[tuple[str, str], list[int]]:
        out: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        for (a, ta), (b, tb) in zip(self.events, self.events[1:]):
            out[(a, b)].append(tb - ta)
        return out


def hydra_run(probe: Probe, rt: ht.Runtime, task: ht.ModelTask) -> dict[tuple[str, str], list[int]]:
    probe.events.clear()
    rt.submit(task).result()
    return probe.pairs()


def plain_parts(task: ht.ModelTask) -> dict[str, float]:
    """The plain loop's parts (us) per training minibatch, summed over the run as the runtime's pairs are (the eval
    batches' forwards counted in ``forward``): forward, loss, backward, step + zero_grad; and its whole run."""
    clock = time.perf_counter_ns
    torch.manual_seed(task.seed)
    model, parts = task.model(), collections.defaultdict(list)
    opt = task.optimizer(model)
    start = clock()
    for _ in range(task.epochs):
        model.train()
        for x, y in task.train_data:
            t0 = clock()
            out = model(x)
            t1 = clock()
            loss = F.cross_entropy(out, y)
            t2 = clock()
            loss.backward()
            t3 = clock()
            opt.step()
            opt.zero_grad()
            t4 = clock()
            loss.item()
            for k, d in (("forward", t1 - t0), ("loss", t2 - t1), ("backward", t3 - t2), ("step", t4 - t3)):
                parts[k].append(d)
        model.eval()
        with torch.no_grad():
            for x, y in task.eval_data:
                t0 = clock()
                out = model(x)
                parts["forward"].append(clock() - t0)
                F.cross_entropy(out, y).item()
                (out.argmax(-1) == y).sum().item()
    mb = task.epochs * len(task.train_data)
    return {**{k: sum(v) / mb / 1e3 for k, v in parts.items()}, "whole": (clock() - start) / mb / 1e3}


Site = tuple[str, str, int]  # a function: file, name, first line
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CallCounter:
    """Python function calls per function, in every thread, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter[Site] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event == "call":
            code = frame.f_code
            self.calls[(code.co_filename.rsplit("site-packages/", 1)[-1], code.co_name, code.co_firstlineno)] += 1

    def count(self, run: Any) -> collections.Counter[Site]:
        self.calls = collections.Counter()
        sys.setprofile(self)
        self.on = True
        try:
            run()
        finally:
            self.on = False
            sys.setprofile(None)
        return self.calls


def steady_calls(runs: dict[int, collections.Counter[Site]], short: int, long: int,
                 per: int) -> dict[Site, float]:
    """Calls per minibatch (or step) in the steady state: the run of ``long`` less the run of ``short``, over
    ``per`` minibatches between them."""
    return {k: (runs[long][k] - runs[short].get(k, 0)) / per for k in runs[long]}


def print_differences(side: dict[Site, float], plain: dict[Site, float], top: int) -> None:
    """The ``top`` functions whose steady calls differ most between ``side`` and the plain loop."""
    diff = {k: side.get(k, 0.0) - plain.get(k, 0.0) for k in set(side) | set(plain)}
    for (f, name, line), v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"  {v:8.2f}  {os.path.relpath(f, ROOT) if f.startswith(ROOT) else f}:{line} {name}")


def count_calls(train: list[Any], val: list[Any], epochs: int, top: int) -> dict[str, float]:
    """``--calls``: Python calls per steady minibatch, hydra and plain, and hydra's per task."""
    short = max(epochs // 3, 1)
    if short == epochs:
        raise SystemExit("unit_breakdown --calls: --epochs must be at least 2")
    counter = CallCounter()
    plain_trial(trial_task(0, train, val, 1))
    plain = {n: counter.count(lambda n=n: plain_trial(trial_task(0, train, val, n))) for n in (short, epochs)}
    threading.setprofile(counter)  # (the runtime's threads start after this)
    try:
        with ht.Runtime(devices=["cpu"]) as rt:
            rt.submit(trial_task(0, train, val, 1)).result()
            hydra = {n: counter.count(lambda n=n: rt.submit(trial_task(0, train, val, n)).result())
                     for n in (short, epochs)}
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    mb = (epochs - short) * len(train)
    h, p = steady_calls(hydra, short, epochs, mb), steady_calls(plain, short, epochs, mb)
    per_task = sum(hydra[short].values()) - short * len(train) * sum(h.values())
    print(f"Python calls per training minibatch (steady, eval share included): hydra {sum(h.values()):.0f}, "
          f"plain loop {sum(p.values()):.0f}; hydra per task, not per minibatch: {per_task:.0f}")
    print_differences(h, p, top)
    out = {"benchmark": "unit_breakdown_calls", "hydra_calls": sum(h.values()), "plain_calls": sum(p.values()),
           "hydra_calls_per_task": per_task}
    print(json.dumps(out))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=25, help="runtime pairs (or functions, with --calls) to print")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--calls", action="store_true", help="count Python calls instead of timing")
    args = p.parse_args()
    torch.set_num_threads(1)
    train, val = digits()
    if args.calls:
        line = count_calls(train, val, args.epochs, args.top)
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(line) + "\n")
        return
    plain_parts(trial_task(0, train, val, 1))   # torch's one-time costs, outside the timed runs
    probe = Probe()
    probe.install()
    with ht.Runtime(devices=["cpu"]) as rt:
        probe.thread = next(t.ident for t in threading.enumerate() if t.name.startswith("hydra-cpu"))
        hydra_run(probe, rt, trial_task(0, train, val, 1))
        runs, plains = [], []
        for _ in range(args.runs):
            plains.append(plain_parts(trial_task(0, train, val, args.epochs)))
            runs.append(hydra_run(probe, rt, trial_task(0, train, val, args.epochs)))
    probe.remove()
    mb = args.epochs * len(train)
    pairs = min(runs, key=lambda r: sum(sum(v) for v in r.values()))
    plain = min(plains, key=lambda r: r["whole"])
    report(pairs, plain, mb, args.top, args.json)


def report(pairs: dict[tuple[str, str], list[int]], plain: dict[str, float], mb: int, top: int,
           path: str | None) -> None:
    per = {k: sum(v) / mb / 1e3 for k, v in pairs.items()}   # us per training minibatch
    total = sum(per.values())
    compute = {COMPUTE[k]: per.get(k, 0.0) for k in COMPUTE}
    runtime = {k: v for k, v in per.items() if k not in COMPUTE}
    rest = total - sum(compute.values())
    print(f"one MLP trial alone on 1 CPU device, {mb} training minibatches (eval share included), us per minibatch:")
    print(f"  device thread, all: {total:.0f} us; plain loop, whole: {plain['whole']:.0f} us "
          f"(ratio plain/hydra {plain['whole'] / total:.2f})")
    for name, v in compute.items():
        print(f"  compute  {v:7.0f} us  {name}")
    print(f"  plain loop, the same way:  forward {plain['forward']:.0f}, loss {plain['loss']:.0f}, backward "
          f"{plain['backward']:.0f}, step + zero_grad {plain['step']:.0f} us")
    print(f"  runtime  {rest:7.0f} us  everything else, in {len(runtime)} pairs of stamps; the largest:")
    for (a, b), v in sorted(runtime.items(), key=lambda kv: -kv[1])[:top]:
        print(f"           {v:7.1f} us  {a} -> {b}  ({len(pairs[(a, b)]) / mb:.2f} a minibatch)")
    line = {"benchmark": "unit_breakdown", "minibatches": mb, "device_us": total, "plain_us": plain["whole"],
            "compute_us": compute, "runtime_us": rest, "pairs": len(runtime), "plain_parts_us": plain}
    print(json.dumps(line))
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    sys.exit(main())
