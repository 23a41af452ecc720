"""The node server's connected clients: accepting them, reading their requests, and dropping them when they go.

    clients = Clients(listener, on_request=handlers.receive, clock=runtime.clock)
    threading.Thread(target=clients.accept_forever, daemon=True).start()
    if clients.stop_accepting(idle_for=10): ...      # none for 10 s: no client is accepted from now on

Rules: the HMAC handshake runs in ``Listener.accept``, before any byte from the peer is unpickled. One reader
thread per client hands each ``(op, request_id, *args)`` to ``on_request``; anything else drops that client. A
client whose connection ends (close, exit, kill -9) is dropped at once: its unfinished tasks are cancelled and its
handles forgotten; the moment the server saw it go (on ``clock``: the runtime's trace clock) is kept in
``departures()``, the newest ``DEPARTURES`` of them. Once accepting stopped, a connection that still arrives is
closed, so that client's hello fails and it starts (or finds) the next server.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any

from ..runtime.handle import TaskHandle
from .files import server_log

__all__ = ["Client", "Clients", "DEPARTURES"]
DEPARTURES = 64   # clients whose departure stats()["server"]["departures"] shows: the newest (bounded: weeks of churn)


class Client:
    """One connected process: its connection, and its tasks by the ids it chose.

        client.send(("status", tid, "running"))       # safe from any thread
        if not client.hold(tid, handle): handle.cancel()   # the client left meanwhile

    Rules: a task is held from its submit until the client fetched its model, forgot it, or left; ``forget`` of a
    running task keeps it (still cancelled if the client leaves) until ``ended`` says its end went out.
    """

    def __init__(self, cid: int, conn: Connection) -> None:
        self.cid, self.conn = cid, conn
        self.pid: int | None = None             # the client's process, from its hello
        self._send_lock = threading.Lock()      # several threads send on one connection
        self._lock = threading.Lock()           # guards _handles, _forgotten, _gone
        self._handles: dict[int, TaskHandle] = {}
        self._forgotten: set[int] = set()       # running tasks whose client handle was collected
        self._gone = False

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send one message; pickling errors raise to the caller, a client that is gone is ignored."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                pass  # the client is gone; its reader notices and drops it

    def hold(self, tid: int, handle: TaskHandle) -> bool:
        """Keep ``handle`` as task ``tid``; False, keeping nothing, if the client has left."""
        with self._lock:
            if not self._gone:
                self._handles[tid] = handle
            return not self._gone

    def task(self, tid: int) -> TaskHandle | None:
        """Task ``tid``'s handle, or None if it is not held (fetched, forgotten, or never submitted)."""
        with self._lock:
            return self._handles.get(tid)

    def release(self, tid: int) -> None:
        """Stop holding task ``tid`` (its model was shipped: the client has the only copy)."""
        with self._lock:
            self._handles.pop(tid, None)

    def forget(self, tid: int) -> None:
        """The client's handle for ``tid`` was collected: drop the task now, or once it ends if it is running."""
        with self._lock:
            handle = self._handles.get(tid)
            if handle is not None and not handle.done():
                self._forgotten.add(tid)
            else:
                self._handles.pop(tid, None)

    def ended(self, tid: int) -> None:
        """Task ``tid``'s end was sent: drop it if the client forgot it."""
        with self._lock:
            if tid in self._forgotten:
                self._forgotten.discard(tid)
                self._handles.pop(tid, None)

    def leave(self) -> list[TaskHandle] | None:
        """Mark the client gone and hand over the tasks it held; None if it had already left."""
        with self._lock:
            if self._gone:
                return None
            self._gone = True
            handles, self._handles = list(self._handles.values()), {}
        return handles


class Clients:
    """The registry of connected clients and the clock of how long there has been none."""

    def __init__(self, listener: Listener, on_request: Callable[[Client, str, int, list[Any]], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._listener, self._on_request, self._clock = listener, on_request, clock
        self._departures: deque[dict[str, Any]] = deque(maxlen=DEPARTURES)
        self._lock = threading.Lock()           # guards _clients, _idle_since, _closing
        self._clients: dict[int, Client] = {}
        self._ids = itertools.count(1)
        self._idle_since = time.monotonic()
        self._closing = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def idle_for(self) -> float | None:
        """Seconds since the last client left (or since the start); None while any client is connected."""
        with self._lock:
            return None if self._clients else time.monotonic() - self._idle_since

    def departures(self) -> list[dict[str, Any]]:
        """The newest clients that left, oldest first: ``client``, ``pid``, ``at`` (when the server saw the
        connection end, on its clock), ``cancelled`` (the names of the unfinished tasks it cancelled then)."""
        with self._lock:
            return [dict(d) for d in self._departures]

    def stop_accepting(self, idle_for: float | None = None) -> bool:
        """Accept no client from now on and close the listener; with ``idle_for``, only if no client has been
        connected for that many seconds (else False, and nothing changes)."""
        with self._lock:
            if idle_for is not None and (self._clients or time.monotonic() - self._idle_since < idle_for):
                return False
            self._closing = True
        with contextlib.suppress(OSError):
            self._listener.close()
        return True

    def close_all(self) -> None:
        """Close every client's connection (the server is exiting)."""
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.conn.close()

    def accept_forever(self) -> None:
        """Accept clients and start a reader for each, until ``stop_accepting`` (a daemon thread's target)."""
        while True:
            try:
                conn = self._listener.accept()
            except Exception as exc:  # noqa: BLE001  (a failed handshake, a client gone mid-handshake)
                if self._closing:
                    return
                server_log(f"refused a connection: {exc!r}")
                time.sleep(0.01)
                continue
            with self._lock:
                if self._closing:
                    conn.close()
                    continue
                client = Client(next(self._ids), conn)
                self._clients[client.cid] = client
            threading.Thread(target=self._read, args=(client,), name=f"hydra-node-c{client.cid}",
                             daemon=True).start()

    def _read(self, client: Client) -> None:
        try:
            while True:
                op, rid, *args = pickle.loads(client.conn.recv_bytes())
                self._on_request(client, op, rid, args)
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, (EOFError, OSError)):
                server_log(f"client {client.cid}: bad message, dropping it: {exc!r}")
        finally:
            self._drop(client)

    def _drop(self, client: Client) -> None:
        at = self._clock()   # the detection moment: before anything else is done about it
        handles = client.leave()
        if handles is None:
            return
        with self._lock:
            self._clients.pop(client.cid, None)
            if not self._clients:
                self._idle_since = time.monotonic()
        unfinished = [h for h in handles if not h.done()]
        # Recorded before the cancels: whoever sees a task of this client cancelled also finds its departure.
        with self._lock:
            self._departures.append({"client": client.cid, "pid": client.pid, "at": at,
                                     "cancelled": [h.name for h in unfinished]})
        for h in unfinished:
            h.cancel()
        client.conn.close()
        server_log(f"client {client.cid} (pid {client.pid}) left; cancelled {len(unfinished)} unfinished task(s)")
