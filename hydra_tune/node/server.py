"""The node runtime server: one detached process that owns one Runtime and runs the tasks of every client.

    python -m hydra_tune.node.server '{"devices": ["cpu", "cpu"], "device_memory": 67108864, "host_memory": null,
        "policy": "lrtf", "base": "/tmp/hydra_tune-1000", "key": "0123abcd0123abcd", "linger": 10}'
    # started by hydra_tune.node.connect(); its output goes to <base>/<key>.log

Threads: the main thread watches for the linger and SIGTERM; one thread accepts connections (the HMAC handshake
runs in ``Listener.accept``, before anything is unpickled); one reader per client; one short thread per request
(planning a task must not hold up that client's cancels); one forwarder per task streaming its metrics and end.
A client's connection ending (close, exit, kill -9) cancels all of its unfinished tasks and drops its handles.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, Listener
from typing import Any

import cloudpickle

from ..config import RUNTIME_SETTINGS, RuntimeConfig
from ..errors import RuntimeClosed, TaskCancelled, rule_error
from ..runtime.handle import ENDED, TaskHandle
from ..runtime.runtime import Runtime
from .client import TaskNotPicklable
from .files import locked

_INLINE = ("cancel", "forget")  # quick requests, answered by the reader in order


def _log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [hydra_tune node server {os.getpid()}] {msg}", flush=True)


def _renamed(exc: BaseException, old: str, new: str) -> BaseException:
    """``exc`` with the server's task name in its message replaced by the client's own."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and old in exc.args[0]:
        exc.args = (exc.args[0].replace(old, new),)
    return exc


def pack_error(exc: BaseException, where: str | None = None) -> tuple[bytes | None, str, str, str]:
    """(pickled error or None, type name, message, traceback text): the error, or what is left of it. With
    ``where``, the pickled error carries a note "raised in <where>" and its traceback text."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if where is not None:
        exc.__notes__ = [*getattr(exc, "__notes__", []), f"raised in {where}:\n{tb}"]
    try:
        blob: bytes | None = cloudpickle.dumps(exc)  # a class the client's task brought by value goes back so
        pickle.loads(blob)  # some errors pickle but do not unpickle (a required argument not in .args)
    except Exception:  # noqa: BLE001
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


class _Client:
    """One connected process: its connection, its send lock, and its tasks by the ids it chose."""

    def __init__(self, cid: int, conn: Connection) -> None:
        self.cid, self.conn = cid, conn
        self.pid: int | None = None
        self.lock = threading.Lock()   # several threads send on one connection
        self.handles: dict[int, TaskHandle] = {}
        self.forgotten: set[int] = set()   # running tasks whose client handle was collected: dropped when they end
        self.gone = False

    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)   # pickling errors raise to the caller
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                pass  # the client is gone; its reader notices and cancels its tasks


class _Server:
    def __init__(self, config: dict[str, Any]) -> None:
        base, key = config["base"], config["key"]
        self.socket, self.lock_path = os.path.join(base, f"{key}.sock"), os.path.join(base, f"{key}.lock")
        self.log_path, self.linger = os.path.join(base, f"{key}.log"), float(config["linger"])
        self.runtime = Runtime(config=RuntimeConfig(**{k: config[k] for k in RUNTIME_SETTINGS}))
        with open(os.path.join(base, "authkey"), "rb") as f:
            authkey = f.read()
        self.listener = Listener(self.socket, family="AF_UNIX", backlog=64, authkey=authkey)  # last: ready now
        self.lock = threading.Lock()   # guards clients, idle_since, closing
        self.clients: dict[int, _Client] = {}
        self.ids = itertools.count(1)
        self.idle_since = time.monotonic()
        self.closing = False
        self.terminated = False
        self.forwarders: list[threading.Thread] = []

    # -- lifetime -------------------------------------------------------------------------------------------
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)  # sets a flag only: locks in a signal handler can deadlock
        threading.Thread(target=self._accept, name="hydra-node-accept", daemon=True).start()
        _log(f"ready on {self.socket}: devices={[d.name for d in self.runtime.devices]}, policy="
             f"{self.runtime.policy}, linger={self.linger} s")
        while not self.terminated:
            time.sleep(0.1)
            with self.lock:
                idle = not self.clients and time.monotonic() - self.idle_since >= self.linger
            if idle and self._retire():
                _log(f"no client for {self.linger} s: exiting")
                break
        self._shutdown()

    def _on_term(self, *_: object) -> None:
        self.terminated = True

    def _retire(self) -> bool:
        """Stop listening if still idle. Under the start lock: a client starting a server meanwhile either
        connected to this one first, or finds the socket gone and starts a new one after we removed ours."""
        with locked(self.lock_path):
            with self.lock:
                if self.clients or time.monotonic() - self.idle_since < self.linger:
                    return False
                self.closing = True
            self._close_listener()
            # Idle and ending normally: nothing in the log to look at. Removed under the start lock, so the log a
            # new server for this configuration opens (same path) is never the one unlinked.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log_path)
        return True

    def _shutdown(self) -> None:
        if not self.closing:  # SIGTERM
            _log("SIGTERM: exiting")
            with locked(self.lock_path):
                with self.lock:
                    self.closing = True
                self._close_listener()
        self.runtime.close()  # unfinished tasks end with RuntimeClosed; the forwarders tell their clients
        for t in list(self.forwarders):
            t.join(5)
        with self.lock:
            clients = list(self.clients.values())
        for c in clients:
            c.conn.close()
        sys.stdout.flush()
        os._exit(0)  # daemon threads (the accept loop) stay blocked; nothing is left to clean up

    def _close_listener(self) -> None:
        try:
            self.listener.close()  # also unlinks the socket
        except OSError:
            pass
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    # -- connections ----------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception as exc:  # noqa: BLE001  (a failed handshake, a client gone mid-handshake)
                if self.closing:
                    return
                _log(f"refused a connection: {exc!r}")
                time.sleep(0.01)
                continue
            with self.lock:
                if self.closing:
                    conn.close()  # its hello fails, so that client starts (or finds) the next server
                    continue
                client = _Client(next(self.ids), conn)
                self.clients[client.cid] = client
            threading.Thread(target=self._read, args=(client,), name=f"hydra-node-c{client.cid}",
                             daemon=True).start()

    def _read(self, client: _Client) -> None:
        try:
            while True:
                op, rid, *args = pickle.loads(client.conn.recv_bytes())
                if op in _INLINE:
                    self._serve(client, op, rid, args)
                else:
                    threading.Thread(target=self._serve, args=(client, op, rid, args), daemon=True).start()
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, (EOFError, OSError)):
                _log(f"client {client.cid}: bad message, dropping it: {exc!r}")
        finally:
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        """The connection ended: cancel the client's unfinished tasks at once and forget its handles."""
        with self.lock:
            if client.gone:
                return
            client.gone = True
            self.clients.pop(client.cid, None)
            if not self.clients:
                self.idle_since = time.monotonic()
            handles, client.handles = list(client.handles.values()), {}
        unfinished = [h for h in handles if not h.done()]
        for h in unfinished:
            h.cancel()
        client.conn.close()
        _log(f"client {client.cid} (pid {client.pid}) left; cancelled {len(unfinished)} unfinished task(s)")

    def _serve(self, client: _Client, op: str, rid: int, args: list[Any]) -> None:
        try:
            value = getattr(self, f"_op_{op}")(client, *args)
        except BaseException as exc:  # noqa: BLE001  (the caller re-raises it)
            client.send(("reply", rid, False, pack_error(exc)))
            return
        if op == "forget":
            return
        try:
            client.send(("reply", rid, True, value))
        except Exception as exc:  # noqa: BLE001  (the value did not pickle)
            client.send(("reply", rid, False, pack_error(exc)))

    # -- requests -------------------------------------------------------------------------------------------
    def _op_hello(self, client: _Client, pid: int, path: list[str], cwd: str) -> dict[str, Any]:
        client.pid = pid
        added = False
        for entry in path:  # so factories pickled by reference (functions in the client's modules) import here
            entry = os.path.join(cwd, entry) if not os.path.isabs(entry) else entry
            if entry not in sys.path:
                sys.path.append(entry)
                added = True
        if added:
            importlib.invalidate_caches()
        _log(f"client {client.cid} (pid {pid}, cwd {cwd}) connected")
        return {"pid": os.getpid(), "devices": len(self.runtime.devices), "client": client.cid}

    def _op_submit(self, client: _Client, tid: int, blob: bytes) -> str:
        try:
            task = cloudpickle.loads(blob)
        except Exception as exc:  # noqa: BLE001
            raise rule_error("the node server can load the task", "make the module of its factories importable "
                             f"from the server (it has the client's sys.path; its cwd is {os.getcwd()}), or define "
                             "them in the script itself so cloudpickle ships them by value", kind=TaskNotPicklable,
                             error=f"{type(exc).__name__}: {exc}") from None
        user = task.name
        task.name = f"c{client.cid}/{user}"  # unique among clients; metrics still carry the client's name
        try:
            handle = self.runtime.submit(task)
        except BaseException as exc:
            raise _renamed(exc, task.name, user) from None
        with self.lock:
            gone = client.gone
            if not gone:
                client.handles[tid] = handle
        if gone:  # the client left while this task was being planned
            handle.cancel()
            raise RuntimeClosed("the client disconnected")
        forwarder = threading.Thread(target=self._forward, args=(client, tid, handle, user),
                                     name=f"hydra-node-{task.name}", daemon=True)
        with self.lock:
            self.forwarders = [t for t in self.forwarders if t.is_alive()] + [forwarder]
        forwarder.start()
        return task.name

    def _op_cancel(self, client: _Client, tid: int) -> bool:
        handle = client.handles.get(tid)
        if handle is None:
            return False
        handle.cancel()
        return handle.done()

    def _op_forget(self, client: _Client, tid: int) -> None:
        handle = client.handles.get(tid)
        if handle is not None and not handle.done():
            client.forgotten.add(tid)   # still cancelled if the client leaves; dropped by its forwarder at the end
        else:
            client.handles.pop(tid, None)

    def _op_model(self, client: _Client, tid: int) -> bytes:
        handle = client.handles.get(tid)
        if handle is None:
            raise RuntimeError(f"the node server no longer holds task {tid}'s model (it was fetched or forgotten)")
        blob = cloudpickle.dumps(handle.model())   # by value where the client's task was: the same classes there
        client.handles.pop(tid, None)              # shipped: the client keeps the only copy
        return blob

    def _op_checkpoint(self, client: _Client, tid: int, path: str, timeout: float | None) -> str:
        handle = client.handles.get(tid)
        if handle is None:
            raise RuntimeError(f"task {tid} is not running in the node server: a checkpoint needs a running task")
        return handle.checkpoint(path, timeout)

    def _op_stats(self, client: _Client) -> dict[str, Any]:
        with self.lock:
            n = len(self.clients)
        server = {"pid": os.getpid(), "clients": n, "socket": self.socket, "log": self.log_path,
                  "linger": self.linger}
        return dict(self.runtime.stats(), server=server)

    def _op_trace(self, client: _Client) -> Any:
        return self.runtime.trace()

    # -- per task -------------------------------------------------------------------------------------------
    def _forward(self, client: _Client, tid: int, handle: TaskHandle, user: str) -> None:
        """Stream the task's metrics (as the client named it), its start, and finally its end and error."""
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
                break
            if status == "running" and not told_running and not fresh:
                client.send(("status", tid, "running"))
            told_running = told_running or status == "running"
        error = handle.error
        if isinstance(error, TaskCancelled):
            error = TaskCancelled(f"task {user!r} was cancelled")
        elif isinstance(error, RuntimeClosed):  # the server is stopping
            error = RuntimeClosed(f"the hydra_tune node server (pid {os.getpid()}) stopped before task {user!r} "
                                  f"finished; server log: {self.log_path}")
        packed = None
        if error is not None:
            where = None if status == "cancelled" else f"the hydra_tune node server (pid {os.getpid()})"
            packed = pack_error(_renamed(error, handle.name, user), where)
        client.send(("end", tid, status, packed))
        if tid in client.forgotten:
            client.handles.pop(tid, None)


def main(argv: list[str] | None = None) -> None:
    """Run the server until it lingers out or gets SIGTERM (see the module docstring for the argument)."""
    os.umask(0o077)  # its socket and anything it writes stay private
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    try:
        server = _Server(config)
    except BaseException:
        _log(f"could not start:\n{traceback.format_exc()}")
        sys.exit(1)
    server.serve()


if __name__ == "__main__":
    main()
