"""A one-line status of a runtime every N seconds, logged at INFO on the ``hydra_tune.progress`` logger.

    rt = hydra_tune.Runtime(devices=["cpu", "cpu"], progress=30)    # or HYDRA_TUNE_PROGRESS=30 in the environment
    # hydra_tune: tasks 2 running, 1 queued, 3 done | devices busy 2/2 (cpu0 97%, cpu1 88%) | 659.2 samples/s,
    #   41.2 steps/s
    # ... devices busy 2/2 (cpu:0 99% (off-CPU 34%), cpu:1 98% (off-CPU 33%)) | ...   (CPU devices that waited)

Rules: off by default (``progress=None`` and no ``HYDRA_TUNE_PROGRESS``); ``progress`` is a number of seconds > 0.
Each line covers the interval since the previous one: a device's busy share is its compute time in that interval
over the interval, and a CPU device whose units spent at least ``OFF_CPU_SHOWN`` of that time off the CPU (its
``busy_seconds`` less its ``unit_cpu_seconds``: waiting for the interpreter lock beside this process's other
threads, or for other processes) shows that share (a process per CPU device, ``node.spread``, shares no lock);
samples/s counts the samples of the minibatches every task trained in it (the first dimension of a batch's first
tensor; a minibatch skipped for a non-finite loss not), steps/s the optimizer steps they took (a step is one
minibatch, or ``grad_accumulation`` of them); both from the tasks' counters in ``stats()`` (``samples_trained``,
``steps``). Tasks are counted by state ("queued" includes those waiting for host memory). The lines go through
``logging``: when nothing is set up to receive them (no handler on the logger or its parents), one stderr handler is
added to this logger, so that asking for progress always shows it.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import rule_error

__all__ = ["ProgressLog", "progress_seconds", "status_line"]

LOGGER = logging.getLogger("hydra_tune.progress")
OFF_CPU_SHOWN = 0.1  # below this share of a CPU device's busy time off the CPU: the clocks' and the OS's noise
ENV = "HYDRA_TUNE_PROGRESS"
STATES = ("running", "queued", "done", "failed", "cancelled")


def progress_seconds(progress: float | None) -> float | None:
    """The interval asked for: ``progress`` itself, else ``HYDRA_TUNE_PROGRESS`` (seconds), else None (off)."""
    source = "progress"
    if progress is None:
        text = os.environ.get(ENV, "").strip()
        if not text or text == "0":
            return None
        source = ENV
        try:
            progress = float(text)
        except ValueError:
            raise rule_error(f"`{ENV}` is a number of seconds > 0 (or unset / 0: off)", f"set e.g. {ENV}=30",
                             **{ENV: text}) from None
    if isinstance(progress, bool) or not isinstance(progress, (int, float)) or not progress > 0 \
            or progress == float("inf"):
        raise rule_error(f"`{source}` is None (off) or a number of seconds > 0", "pass e.g. progress=30 to log a "
                         "status line every 30 s", **{source: progress})
    return float(progress)


def status_line(now: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> str:
    """The line for ``now`` (a ``Runtime.stats()``) after ``before`` (the previous one, None at the start),
    ``seconds`` apart."""
    counts = {s: 0 for s in STATES}
    for task in now["tasks"].values():
        counts[task["state"]] = counts.get(task["state"], 0) + 1
    tasks = ", ".join(f"{n} {s}" for s, n in counts.items() if n or s in ("running", "queued"))
    prev_dev = {d["name"]: d for d in (before or {}).get("devices", [])}
    shares, waits = [], {}
    for d in now["devices"]:
        prev = prev_dev.get(d["name"], {})
        busy = d["busy_seconds"] - prev.get("busy_seconds", 0.0)
        shares.append((d["name"], min(1.0, max(0.0, busy / seconds)) if seconds > 0 else 0.0))
        if busy > 0 and d["name"].startswith("cpu") and "unit_cpu_seconds" in d:
            waits[d["name"]] = 1.0 - (d["unit_cpu_seconds"] - prev.get("unit_cpu_seconds", 0.0)) / busy
    busy_now = sum(share > 0 for _, share in shares)
    devices = ", ".join(f"{name} {100 * share:.0f}%" + (f" (off-CPU {100 * waits[name]:.0f}%)"
                                                        if waits.get(name, 0.0) >= OFF_CPU_SHOWN else "")
                        for name, share in shares)
    prev_tasks = (before or {}).get("tasks", {})

    def rate(counter: str) -> float:   # per second over the interval, from every task's counter
        done = sum(max(0, t.get(counter, 0) - prev_tasks.get(name, {}).get(counter, 0))
                   for name, t in now["tasks"].items())
        return done / seconds if seconds > 0 else 0.0

    return (f"hydra_tune: tasks {tasks} | devices busy {busy_now}/{len(shares)} ({devices}) | "
            f"{rate('samples_trained'):.1f} samples/s, {rate('steps'):.1f} steps/s")


class ProgressLog:
    """Logs ``status_line`` of ``stats()`` every ``seconds`` from a daemon thread until ``stop()``.

        log = ProgressLog(runtime.stats, 30)     # Runtime(progress=30) makes one; close() stops it
        log.stop()
    """

    def __init__(self, stats: Callable[[], dict[str, Any]], seconds: float,
                 logger: logging.Logger = LOGGER) -> None:
        self._stats, self.seconds, self.logger = stats, seconds, logger
        self._stop = threading.Event()
        if not logger.hasHandlers():   # asked for progress, nothing receives it: show it on stderr
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        self._thread = threading.Thread(target=self._run, name="hydra_tune-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        before, t0 = None, time.perf_counter()
        while not self._stop.wait(self.seconds):
            t1 = time.perf_counter()
            try:
                now = self._stats()
            except Exception as exc:  # noqa: BLE001  (a status line never ends the runtime it watches)
                self.logger.warning("hydra_tune: progress status unavailable (%s: %s)", type(exc).__name__, exc)
                continue
            self.logger.info(status_line(now, before, t1 - t0))
            before, t0 = now, t1

    def stop(self) -> None:
        """Stop logging; returns once the thread has ended (at most one line later)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
