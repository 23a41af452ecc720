"""The node server's answers to its clients: hello, submit, cancel, forget, model, snapshot, checkpoint, stats
and trace.

    handlers = Handlers(runtime, forwarders, describe=server.describe)
    handlers.receive(client, "cancel", 7, [3])     # from the client's reader: (op, request_id, *args)

Rules: every request gets one ``("reply", request_id, ok, value)``, except ``forget`` (none); an error, or a value
that does not pickle, goes back packed (``wire.pack_error``) and the client raises it. ``cancel`` and ``forget``
are answered by the client's reader, in order; every other request in a short thread of its own, so planning a
task never holds up that client's cancels. A task runs in the server as "c<client>/<name>" (unique among
clients); its errors and metrics go back with the client's own name.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..device.threads import adopt_thread_count
from ..errors import RuntimeClosed, rule_error
from ..runtime.runtime import Runtime
from ..training import host_rng
from .connections import Client
from .files import server_log
from .forward import Forwarders
from ..shipping import dump, load
from .wire import TaskNotPicklable, pack_error, renamed

__all__ = ["Handlers"]

_INLINE = ("cancel", "forget")  # quick requests, answered by the reader in order


class Handlers:
    """The request handlers of one server: its Runtime, its task forwarders, and ``describe()`` for stats."""

    def __init__(self, runtime: Runtime, forwarders: Forwarders, describe: Callable[[], dict[str, Any]]) -> None:
        self._runtime, self._forwarders, self._describe = runtime, forwarders, describe
        self._ops: dict[str, Callable[..., Any]] = {
            "hello": self._hello, "submit": self._submit, "cancel": self._cancel, "forget": self._forget,
            "model": self._model, "snapshot": self._snapshot, "checkpoint": self._checkpoint, "stats": self._stats,
            "trace": self._trace}

    def receive(self, client: Client, op: str, rid: int, args: list[Any]) -> None:
        """Answer one request: now if it is quick, else in a thread of its own."""
        if op in _INLINE:
            self._answer(client, op, rid, args)
        else:
            threading.Thread(target=self._answer, args=(client, op, rid, args), daemon=True).start()

    def _answer(self, client: Client, op: str, rid: int, args: list[Any]) -> None:
        adopt_thread_count()  # (a submit builds the client's model here: the server's count, as its devices use)
        try:
            handler = self._ops.get(op)
            if handler is None:
                raise rule_error("the request is one the node server knows", "connect with the hydra_tune that "
                                 "started this server", op=op, known=sorted(self._ops))
            value = handler(client, *args)
        except BaseException as exc:  # noqa: BLE001  (the caller re-raises it)
            client.send(("reply", rid, False, pack_error(exc)))
            return
        if op == "forget":
            return
        try:
            client.send(("reply", rid, True, value))
        except Exception as exc:  # noqa: BLE001  (the value did not pickle)
            client.send(("reply", rid, False, pack_error(exc)))

    def _hello(self, client: Client, pid: int, path: list[str], cwd: str) -> dict[str, Any]:
        client.pid = pid
        added = False
        for entry in path:  # so factories pickled by reference (functions in the client's modules) import here
            entry = os.path.join(cwd, entry) if not os.path.isabs(entry) else entry
            if entry not in sys.path:
                sys.path.append(entry)
                added = True
        if added:
            importlib.invalidate_caches()
        server_log(f"client {client.cid} (pid {pid}, cwd {cwd}) connected")
        return {"pid": os.getpid(), "devices": len(self._runtime.devices), "client": client.cid}

    def _submit(self, client: Client, tid: int, blob: bytes, host: dict[str, Any] | None = None) -> str:
        try:
            task = load(blob)
        except Exception as exc:  # noqa: BLE001
            raise rule_error("the node server can load the task", "make the module of its factories importable "
                             f"from the server (it has the client's sys.path; its cwd is {os.getcwd()}), or define "
                             "them in the script itself so cloudpickle ships them by value", kind=TaskNotPicklable,
                             error=f"{type(exc).__name__}: {exc}") from None
        if host is not None:
            host_rng.start_from(task, host)  # the factory draws from the client's generators, not this process's
        user = task.name
        task.name = f"c{client.cid}/{user}"
        try:
            handle = self._runtime.submit(task)
        except BaseException as exc:
            raise renamed(exc, task.name, user) from None
        if not client.hold(tid, handle):  # the client left while this task was being planned
            handle.cancel()
            raise RuntimeClosed("the client disconnected")
        self._forwarders.start(client, tid, handle, user)
        return task.name

    def _cancel(self, client: Client, tid: int) -> bool:
        handle = client.task(tid)
        if handle is None:
            return False
        handle.cancel()
        return handle.done()

    def _forget(self, client: Client, tid: int) -> None:
        client.forget(tid)

    def _model(self, client: Client, tid: int) -> bytes:
        handle = client.task(tid)
        if handle is None:
            raise RuntimeError(f"the node server no longer holds task {tid}'s model (it was fetched or forgotten)")
        blob = dump(handle.model())   # by value where the client's task was: the same classes there
        client.release(tid)                        # shipped: the client keeps the only copy
        return blob

    def _snapshot(self, client: Client, tid: int, timeout: float | None) -> bytes:
        handle = client.task(tid)
        if handle is None:
            raise RuntimeError(f"the node server no longer holds task {tid} (its model was fetched or it was "
                               "forgotten): a snapshot needs a task it runs")
        try:
            snap = handle.snapshot(timeout)
        except BaseException as exc:  # its message names the task as the client does
            raise renamed(exc, handle.name, handle.name.split("/", 1)[-1]) from exc.__cause__
        return dump(snap)   # the model by value, as for "model"

    def _checkpoint(self, client: Client, tid: int, path: str, timeout: float | None) -> str:
        handle = client.task(tid)
        if handle is None:
            raise RuntimeError(f"task {tid} is not running in the node server: a checkpoint needs a running task")
        return handle.checkpoint(path, timeout)

    def _stats(self, client: Client) -> dict[str, Any]:
        return dict(self._runtime.stats(), server=self._describe())

    def _trace(self, client: Client) -> Any:
        return self._runtime.trace()
