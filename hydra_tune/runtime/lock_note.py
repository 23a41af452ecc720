"""A one-time RuntimeWarning when a runtime's in-process CPU devices spend much of their busy time off the CPU.

    note = LockNote(["cpu:0", "cpu:1"], seconds)   # seconds(): each CPU device's (busy, unit CPU) seconds
    note.check()          # after each task ends: warns once, when the evidence is in (``off_cpu_verdict``)

Why: the CPU devices of one runtime are threads of one Python process. A small model's unit is mostly Python and
short torch calls, which hold the interpreter lock those threads share, so two such devices can train hardly faster
than one (README, Performance: small and short trials), and nothing else tells the user why. Their units' own
clocks do: ``busy_seconds`` less ``unit_cpu_seconds`` (the units' threads' CPU time) is the time they waited off the
CPU. Once the runtime's CPU devices have ``MIN_BUSY`` busy seconds between them, this checks once: at least
``SHARE`` of it off the CPU warns, naming the share and the fix (a process per CPU device: ``share="spread"`` /
``hydra_tune.node.spread``, whose devices share no lock). Waiting for other processes on a loaded machine reads the
same, which the message says. A runtime with fewer than two CPU devices never warns: its waits are not the lock's.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

SHARE = 0.25     # off-CPU share of the busy time that warns
MIN_BUSY = 10.0  # busy seconds, all CPU devices together, before the one check


def off_cpu_verdict(seconds: Sequence[tuple[float, float]]) -> float | None:
    """The off-CPU share to warn about, from each CPU device's (busy seconds, unit CPU seconds); None: no warning
    (fewer than two devices, under ``MIN_BUSY`` busy seconds, or under ``SHARE``)."""
    busy = _busy(seconds)
    if len(seconds) < 2 or busy < MIN_BUSY:
        return None
    share = 1.0 - sum(c for _, c in seconds) / busy
    return share if share >= SHARE else None


def _busy(seconds: Sequence[tuple[float, float]]) -> float:
    return sum(b for b, _ in seconds)


class LockNote:
    """Warns once per runtime (see the module docstring); ``seconds()`` gives each CPU device's (busy seconds,
    unit CPU seconds)."""

    def __init__(self, names: Sequence[str], seconds: Callable[[], list[tuple[float, float]]]) -> None:
        self.names, self._seconds = list(names), seconds
        self._lock = threading.Lock()
        self.done = len(self.names) < 2  # checked once the evidence was in (or nothing to check)

    def check(self) -> None:
        if self.done:
            return
        seconds = self._seconds()
        if _busy(seconds) < MIN_BUSY:
            return
        with self._lock:
            if self.done:
                return
            self.done = True
        share = off_cpu_verdict(seconds)
        if share is None:
            return
        try:
            self._warn(share, _busy(seconds))
        except Exception:  # noqa: BLE001  (warnings made errors: this runs where a task ends, which must go on)
            pass

    def _warn(self, share: float, busy: float) -> None:
        warnings.warn(
            f"hydra_tune: this runtime's CPU devices ({', '.join(self.names)}) spent {share:.0%} of their "
            f"{busy:.1f} busy seconds off the CPU: waiting for the interpreter lock that threads of one Python "
            "process share (or for other processes on this machine). For small models, run a process per CPU "
            "device: hydra_tune.optuna_study(share='spread', ...) or a hydra_tune.node.spread(devices) pool "
            "(stats()['devices'][i]: busy_seconds, unit_cpu_seconds).",
            RuntimeWarning, stacklevel=3)
