"""The node server's per-task forwarding: one thread per submitted task streams its progress to its client.

    forwarders = Forwarders(log_path)
    forwarders.start(client, tid, handle, user="trial-3")   # once the server's Runtime accepted the task
    forwarders.join(5)                                       # at exit, after Runtime.close() ended every task

Rules: a task's metrics go out in order, labelled with the client's name for the task; a metric value that does not
pickle goes as its repr. ``("status", tid, "running")`` goes once, only when the task started without a metric that
shows it. Last comes ``("end", tid, status, packed error or None)``: a cancelled task's error says only that, with
the client's name; one ended by the server stopping names the server's log; any other carries the server's
traceback as a note. A task the client forgot is dropped once its end went out.
"""
from __future__ import annotations

import os
import pickle
import threading

from ..errors import RuntimeClosed, TaskCancelled
from ..runtime.handle import ENDED, TaskHandle
from .connections import Client
from .wire import PackedError, pack_error, renamed

__all__ = ["Forwarders"]


class Forwarders:
    """The forwarding threads of the tasks the server runs (finished ones are pruned as new ones start)."""

    def __init__(self, log_path: str) -> None:
        self._log_path = log_path
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, client: Client, tid: int, handle: TaskHandle, user: str) -> None:
        """Forward task ``tid`` (``handle`` in the server, ``user`` in the client) until it ends."""
        thread = threading.Thread(target=self._forward, args=(client, tid, handle, user),
                                  name=f"hydra-node-{handle.name}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for each forwarder (their tasks have ended: they are sending the end)."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _forward(self, client: Client, tid: int, handle: TaskHandle, user: str) -> None:
        status = _stream(client, tid, handle, user)
        client.send(("end", tid, status, self._end_error(handle, status, user)))
        client.ended(tid)

    def _end_error(self, handle: TaskHandle, status: str, user: str) -> PackedError | None:
        error = handle.error
        if error is None:
            return None
        if isinstance(error, TaskCancelled):
            error = TaskCancelled(f"task {user!r} was cancelled")
        elif isinstance(error, RuntimeClosed):  # the server is stopping
            error = RuntimeClosed(f"the hydra_tune node server (pid {os.getpid()}) stopped before task {user!r} "
                                  f"finished; server log: {self._log_path}")
        where = None if status == "cancelled" else f"the hydra_tune node server (pid {os.getpid()})"
        return pack_error(renamed(error, handle.name, user), where)


def _stream(client: Client, tid: int, handle: TaskHandle, user: str) -> str:
    """Send the task's metrics and its start until it ends; returns its final status."""
    sent, status, told_running = 0, "queued", False
    while True:
        progress = handle.watch(sent, status)
        fresh, status = progress.fresh, progress.status
        sent += len(fresh)
        for m in fresh:
            m = dict(m, task=user)
            try:
                client.send(("metrics", tid, m))
            except Exception:  # noqa: BLE001  (a value that does not pickle: send what it looks like)
                client.send(("metrics", tid, {k: v if _picklable(v) else repr(v) for k, v in m.items()}))
        if status in ENDED:
            return status
        if status == "running" and not told_running and not fresh:
            client.send(("status", tid, "running"))
        told_running = told_running or status == "running"


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True
