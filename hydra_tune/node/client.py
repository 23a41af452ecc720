"""The client side of the node runtime server: ``connect``, the connection (``NodeRuntime``) and the handles of
the tasks it runs (``RemoteHandle``).

    rt = connect(devices=["cpu", "cpu"], device_memory="64MiB")    # or connect(config=RuntimeConfig(...))
    handle = rt.submit(task); handle.result(); rt.close()

Rules: one starter at a time (the server's start lock); a server that does not accept within ``START_TIMEOUT`` s,
or exits, fails ``connect`` with its log's tail; one whose ``import hydra_tune`` would load another package (a
``hydra_tune.py`` on its ``PYTHONPATH``) exits at once, and ``connect`` raises ImportError naming that file
(boot.py). One reader thread per connection routes replies to the waiting call and task events to their handles;
when the connection ends, every waiting call and unfinished handle ends with RuntimeClosed naming the server's log.
A handle collected here is forgotten by the server on the next send.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any

from ..config import RuntimeConfig
from ..errors import HydraError, RuntimeClosed, rule_error
from ..runtime.handle import TaskHandle
from ..runtime.trace import Trace
from ..task import ModelTask
from ..training import host_rng
from ..training.boundary import Snapshot
from ..shipping import dump as ship, load as unship
from .boot import SHADOWED_EXIT, package_dir, script, shadowing_error
from .files import LOG_BYTES, locked, log_tail, server_env, server_files
from .wire import RemoteError, TaskNotPicklable, unpack_error

__all__ = ["connect", "NodeRuntime", "RemoteHandle", "RemoteError", "TaskNotPicklable"]

START_TIMEOUT = 120.0   # seconds a new server may take to import torch and set up its devices
_TASK_FIELDS = ("model", "optimizer", "train_data", "loss", "eval_data", "lr_scheduler", "stages")


def connect(devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None, *,
            policy: str = "lrtf", host_memory: int | str | None = None,
            config: RuntimeConfig | None = None) -> "NodeRuntime":
    """Connect to this node's runtime server for these settings (a ``RuntimeConfig``, or its four keywords),
    starting it (detached) if none answers.

        rt = node.connect(devices=["cpu", "cpu"], device_memory="64MiB", policy="lrtf")
        handles = [rt.submit(t) for t in tasks]          # one Runtime for every process of this user and config
        print([h.result() for h in handles]); rt.close()
    """
    return join(server_files(devices, device_memory, policy=policy, host_memory=host_memory, config=config))


def join(files: dict[str, Any], env: dict[str, str] | None = None) -> "NodeRuntime":
    """A connection to the server of ``files`` (``server_files``), started with ``env`` over this environment if
    none answers."""
    with open(files["authkey"], "rb") as f:
        key = f.read()
    node = _open(files, key)
    if node is not None:
        return node
    with locked(files["lock"]):  # one starter at a time; a stopping server holds it while it removes its socket
        return _open(files, key) or _start(files, key, env)


class RemoteHandle(TaskHandle):
    """A task running in the node server: a TaskHandle (metrics, result, done, status, cancel) fed by the server.

        handle = rt.submit(task)
        for m in handle.metrics(): print(m["epoch"], m["train_loss"])   # raises the task's error at the end
        model = handle.model()                                          # shipped from the server on request

    ``snapshot()`` is served by the server's handle (its loop, at a step boundary) and shipped here; ``model()``
    follows TaskHandle's rule (the task has ended, else it raises at once).
    """

    def __init__(self, call: Callable[..., Any], tid: int, name: str) -> None:
        super().__init__(name, lambda handle: None)   # cancel() is this class's own; the state lives in the server
        self._call, self._tid = call, tid             # call(op, *args): a request to the server, its reply
        self.server_name: str | None = None    # its name in the server's stats() and trace(): "c<client>/<name>"
        self._fetch = threading.Lock()
        self._fetched: list[Any] = []          # the model, once fetched

    def _trained(self) -> Any:
        """The done task's model (CPU), fetched from the server once; the server then drops its copy."""
        with self._fetch:
            if not self._fetched:
                self._fetched.append(unship(self._call("model", self._tid)))
        return self._fetched[0]

    def snapshot(self, timeout: float | None = None) -> Snapshot:
        """``TaskHandle.snapshot`` served by the server's handle and shipped here; a done task's from its model."""
        if self.done():
            return super().snapshot(timeout)
        return unship(self._call("snapshot", self._tid, timeout))

    def checkpoint(self, path: str, timeout: float | None = None) -> str:
        """``TaskHandle.checkpoint`` run in the server (same node, same filesystem); returns the absolute path."""
        if self.done():
            raise self.not_running_error()
        return self._call("checkpoint", self._tid, os.path.abspath(os.fspath(path)), timeout)

    def cancel(self) -> None:
        """Stop the task at its next unit boundary; a finished task is left as it is."""
        if self.done():
            return
        try:
            ended = self._call("cancel", self._tid)
        except RuntimeClosed:
            return  # the connection ended, and with it this handle
        if ended:  # it was queued and ended at once, as with TaskHandle: wait for its end event
            self.wait(30)

    def event(self, kind: str, *args: Any) -> None:
        """What the server streamed for this task: "status" (it started), "metrics" or "end"."""
        if kind == "end":
            self.finish(args[0], unpack_error(args[1]) if args[1] is not None else None)
            return
        self.started()
        if kind == "metrics":
            self.emit(args[0])  # labelled with this handle's name: the client's own, as the server sent it


class NodeRuntime:
    """A connection to the node's runtime server: ``submit`` like Runtime, plus the server's stats and trace.

        with node.connect(devices=["cpu", "cpu"], device_memory="64MiB") as rt:
            handle = rt.submit(task); handle.result()
            print(rt.devices, rt.stats()["server"])      # {"pid": ..., "clients": ..., "socket": ...}
    """

    def __init__(self, conn: Connection, files: dict[str, Any]) -> None:
        self._conn = conn
        self.socket, self.log = files["socket"], files["log"]
        self.pid: int | None = None
        self._lock = threading.Lock()        # guards _pending, _handles, _gone
        self._send_lock = threading.Lock()   # one message on the wire at a time
        self._pending: dict[int, list[Any]] = {}
        self._handles: weakref.WeakValueDictionary[int, RemoteHandle] = weakref.WeakValueDictionary()
        self._forgotten: collections.deque[int] = collections.deque()  # handles collected here: the server drops them
        self._ids = itertools.count(1)
        self._gone: str | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="hydra-node-client", daemon=True)
        self._reader.start()
        try:
            info = self._call("hello", os.getpid(), list(sys.path), os.getcwd())
        except BaseException:
            self.close()
            raise
        self.pid, self.devices, self.client_id = info["pid"], info["devices"], info["client"]

    def submit(self, task: ModelTask) -> RemoteHandle:
        """Ship ``task`` (cloudpickle, each tensor storage once: hydra_tune/shipping.py) to the server, which plans
        it (errors raise here) and queues it."""
        if not isinstance(task, ModelTask):
            raise rule_error("`task` is a hydra_tune.ModelTask", "wrap the job in ModelTask(model, optimizer, "
                             "train_data, ...)", kind=TypeError, task=type(task).__name__)
        blob = _dump_task(task)
        tid = next(self._ids)
        handle = RemoteHandle(self._call, tid, task.name)
        with self._lock:
            self._handles[tid] = handle
        try:
            # the client's Python and numpy generators: the server's builds draw what the factory would draw here
            handle.server_name = self._call("submit", tid, blob, host_rng.states())
        except BaseException:
            with self._lock:
                self._handles.pop(tid, None)
            raise
        weakref.finalize(handle, self._forgotten.append, tid)
        return handle

    def stats(self) -> dict[str, Any]:
        """The server's ``Runtime.stats()`` (tasks under their server names) plus ``{"server": {pid, clients,
        socket, log, linger}}``."""
        return self._call("stats")

    def trace(self) -> Trace:
        """The server's ``Runtime.trace()``."""
        return self._call("trace")

    def close(self) -> None:
        """Disconnect; the server cancels this client's unfinished tasks. Idempotent."""
        with self._lock:
            self._closing = True
        with contextlib.suppress(OSError, ValueError):  # wake the reader: its recv sees the end of the stream
            with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not threading.current_thread():
            self._reader.join(10)
        self._conn.close()

    def __enter__(self) -> "NodeRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodeRuntime(pid={self.pid}, socket={self.socket!r}{', closed' if self._gone else ''})"

    # -- wire -----------------------------------------------------------------------------------------------
    def _call(self, op: str, *args: Any) -> Any:
        rid = next(self._ids)
        slot: list[Any] = [threading.Event(), None, None]   # done, ok, value or error
        with self._lock:
            if self._gone:
                raise RuntimeClosed(self._gone)
            self._pending[rid] = slot
        self._send((op, rid, *args))
        slot[0].wait()
        if slot[1]:
            return slot[2]
        raise slot[2]

    def _send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                while self._forgotten:
                    self._conn.send_bytes(pickle.dumps(("forget", 0, self._forgotten.popleft())))
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:
                raise RuntimeClosed(self._gone or self._why_gone()) from exc

    def _read(self) -> None:
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                if msg[0] == "reply":
                    with self._lock:
                        slot = self._pending.pop(msg[1], None)
                    if slot is not None:
                        slot[1], slot[2] = msg[2], msg[3] if msg[2] else unpack_error(msg[3])
                        slot[0].set()
                    continue
                with self._lock:
                    handle = self._handles.get(msg[1])
                if handle is not None:
                    handle.event(msg[0], *msg[2:])
        except Exception:  # noqa: BLE001  (EOF, a reset, a closed handle: the connection is over either way)
            pass
        finally:
            self._dead()

    def _why_gone(self, task: str | None = None) -> str:
        what = "the node connection was closed" if self._closing else \
            f"the hydra_tune node server (pid {self.pid}) ended"
        return f"{what}{f' before task {task!r} finished' if task else ''}; server log: {self.log}"

    def _dead(self) -> None:
        with self._lock:
            self._gone = self._why_gone() + ". Fix: node.connect() again (it starts a new server if needed)"
            pending, self._pending = list(self._pending.values()), {}
            handles = list(self._handles.values())
        for slot in pending:
            slot[1], slot[2] = False, RuntimeClosed(self._gone)
            slot[0].set()
        for h in handles:
            h.finish("cancelled", RuntimeClosed(self._why_gone(h.name)))


# -- tasks on the wire and the server's start -------------------------------------------------------------------
def _dump_task(task: ModelTask) -> bytes:
    try:
        import cloudpickle
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("hydra_tune.node ships tasks with cloudpickle, which is not installed. Fix: pip "
                                  "install 'hydra_tune[optuna]' (or cloudpickle).") from exc
    if task.resume_from is not None and not os.path.isabs(task.resume_from):
        task = copy.copy(task)  # the server's cwd may differ: resolve the checkpoint path here
        task.resume_from = os.path.abspath(task.resume_from)
    try:
        return ship(task)  # each tensor storage once (hydra_tune/shipping.py)
    except Exception as exc:  # noqa: BLE001  (TypeError, PicklingError, AttributeError, RecursionError, ...)
        field = next((f for f in _TASK_FIELDS if not _pickles(cloudpickle, getattr(task, f, None))), "?")
        raise rule_error("the task pickles with cloudpickle (the node server runs it in its own process)",
                         "define its factories at module level, or let them capture no locks, open files, "
                         "sockets or threads; or train in this process with hydra_tune.Runtime",
                         kind=TaskNotPicklable, task=task.name, field=field, error=f"{type(exc).__name__}: {exc}"
                         ) from exc


def _pickles(cloudpickle: Any, value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


def _open(files: dict[str, Any], key: bytes) -> NodeRuntime | None:
    """A connection to a live server, or None when none answers (no socket, refused, or it is stopping)."""
    try:
        conn = Client(files["socket"], family="AF_UNIX", authkey=key)
    except AuthenticationError as exc:
        raise rule_error("the node server accepts this user's authkey", f"stop the server listening on the socket "
                         f"(its pid is in {files['log']}) so a new one starts with {files['authkey']}",
                         kind=HydraError, socket=files["socket"]) from exc
    except (OSError, EOFError):
        return None
    try:
        return NodeRuntime(conn, files)
    except RuntimeClosed:
        return None


def _start(files: dict[str, Any], key: bytes, env: dict[str, str] | None = None) -> NodeRuntime:
    """Spawn the server (caller holds the lock) and connect once it accepts; fail early with its log's tail."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(files["socket"])  # nobody answered on it: left by a server that was killed
    linger = os.environ.get("HYDRA_TUNE_NODE_LINGER", "10")
    if not re.fullmatch(r"\d+(\.\d*)?", linger.strip()):
        raise rule_error("`HYDRA_TUNE_NODE_LINGER` is a number of seconds >= 0", "unset it (10 s) or set e.g. 30",
                         HYDRA_TUNE_NODE_LINGER=linger)
    log_bytes = os.environ.get("HYDRA_TUNE_NODE_LOG_BYTES", str(LOG_BYTES))
    if not log_bytes.strip().isdigit() or int(log_bytes) < 1024:
        raise rule_error("`HYDRA_TUNE_NODE_LOG_BYTES` is a number of bytes >= 1024 (the node server's log rotates "
                         "at that size)", f"unset it ({LOG_BYTES}) or set e.g. 4194304",
                         HYDRA_TUNE_NODE_LOG_BYTES=log_bytes)
    arg = json.dumps(dict(files["config"], base=files["base"], key=files["key"], linger=float(linger),
                          log_bytes=int(log_bytes), package=package_dir()))
    log = os.open(files["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:  # own session: it outlives this process and its Ctrl-C. Run by path, not -m: the cwd is not on its path,
        # so a hydra_tune.py there cannot shadow the package in the server (boot.py checks what it imports)
        proc = subprocess.Popen([sys.executable, script(), arg], cwd=os.getcwd(),
                                env=server_env(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    threading.Thread(target=proc.wait, name="hydra-node-reaper", daemon=True).start()  # no zombie once it exits
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        node = _open(files, key)
        if node is not None:
            return node
        if proc.returncode == SHADOWED_EXIT:
            shadowed = shadowing_error(log_tail(files["log"]))
            if shadowed is not None:
                raise shadowed
        if proc.returncode is not None or time.monotonic() > deadline:
            why = f"exited with code {proc.returncode}" if proc.returncode is not None else \
                f"did not accept connections within {START_TIMEOUT:.0f} s"
            raise HydraError(f"the hydra_tune node server (pid {proc.pid}) {why}. Its log {files['log']} ends "
                             f"with:\n{log_tail(files['log'])}")
        time.sleep(0.05)
