"""A task's host thread: the plain loop's host work between segments (the optimizer step, the next batch) runs here.

    host = HostThread("t0", work)      # work(): open the task's next segment (advance its chain)
    host.start(); host.request()       # run work() once more in the thread
    host.stop()                        # the thread ends once idle (a work() in progress finishes first)
    host.join(1.0); host.alive         # whether it is still running (e.g. stuck in a data iterator)

Rules: one thread per admitted task, so a data iterator that blocks holds that thread only, never a device or
another task; and every batch of a task is fetched in the same thread, as in the plain loop (iterators that belong
to the thread that made them keep working). ``work`` never runs twice at once: a request made while it runs is
served after it, and every request is served, even one made after ``stop``. A thread stuck in ``work`` cannot be
interrupted (Python has no way to): it is a daemon, left behind when the runtime closes (the runtime warns, naming
the task).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from ..device.threads import adopt_thread_count


class HostThread:
    """The thread that runs ``work`` on request for task ``name`` (see the module docstring)."""

    def __init__(self, name: str, work: Callable[[], None]) -> None:
        self.name = name
        self._work: Callable[[], None] | None = work
        self._cv = threading.Condition()
        self._pending = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"hydra-host-{name}", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """Run ``work`` once more (after the one in progress, if any)."""
        with self._cv:
            self._pending = True
            self._cv.notify()

    def stop(self) -> None:
        """End the thread once every request so far is served."""
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def join(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end (a thread never started counts as ended);
        whether it ended."""
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self.alive

    def _run(self) -> None:
        adopt_thread_count()  # (the optimizer's step and the data run here: torch's count, as in the plain loop)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._stopped)
                if not self._pending:  # stopped, every request served (the last one lets an ended task go)
                    self._work = None  # the task's board entry (and through it its state) is not kept here
                    return
                self._pending = False
                work = self._work
            if work is not None:
                work()
            del work  # waiting must not keep the task alive
