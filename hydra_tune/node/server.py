"""The node runtime server: one detached process that owns one Runtime and runs the tasks of every client.

    python -m hydra_tune.node.server '{"devices": ["cpu", "cpu"], "device_memory": 67108864, "host_memory": null,
        "policy": "lrtf", "base": "/tmp/hydra_tune-1000", "key": "0123abcd0123abcd", "linger": 10}'
    # hydra_tune.node.connect() starts it through boot.py (no -m: see there); its output goes to <base>/<key>.log

The argument is ``RuntimeConfig.as_dict()`` plus where its files are (``base``, ``key``: see files.py), its
``linger`` and ``log_bytes`` (its log rotates at that size, to ``<key>.log.1``). This module is the server's
lifetime; its parts are ``connections`` (accepting, reading and dropping clients), ``handlers`` (answering
requests), ``forward`` (streaming each task's progress) and ``wire`` (messages).

Threads: the main thread watches for the linger and SIGTERM; one thread accepts connections; one reader per client;
one short thread per slow request; one forwarder per task. Rules of the lifetime: the server retires once no client
has been connected for ``linger`` s, under the start lock, so a client starting a server meanwhile either connected
to this one first or finds its socket gone. On SIGTERM it stops accepting, closes its Runtime (unfinished tasks end
with RuntimeClosed, which their clients receive), and exits.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Listener
from typing import Any

from ..config import RUNTIME_SETTINGS, RuntimeConfig
from ..runtime.runtime import Runtime
from .connections import Clients
from .files import LOG_BYTES, locked, rotate_log_at, server_log
from .forward import Forwarders
from .handlers import Handlers

__all__ = ["Server", "main"]


class Server:
    """One server's lifetime: ``serve()`` runs it until it lingers out or gets SIGTERM, then exits the process."""

    def __init__(self, settings: dict[str, Any]) -> None:
        base, key = settings["base"], settings["key"]
        self.socket, self.lock_path = os.path.join(base, f"{key}.sock"), os.path.join(base, f"{key}.lock")
        self.log_path, self.linger = os.path.join(base, f"{key}.log"), float(settings["linger"])
        rotate_log_at(self.log_path, int(settings.get("log_bytes", LOG_BYTES)))   # weeks of clients: bounded
        self.config = RuntimeConfig(**{k: settings[k] for k in RUNTIME_SETTINGS})
        self.runtime = Runtime(config=self.config)
        self.forwarders = Forwarders(self.log_path)
        handlers = Handlers(self.runtime, self.forwarders, self.describe)
        with open(os.path.join(base, "authkey"), "rb") as f:
            authkey = f.read()
        listener = Listener(self.socket, family="AF_UNIX", backlog=64, authkey=authkey)  # last: ready now
        self.clients = Clients(listener, handlers.receive, clock=self.runtime.clock)
        self._terminated = False

    def describe(self) -> dict[str, Any]:
        """What ``stats()["server"]`` shows: pid, clients connected, socket, log and linger, and the newest clients
        that left (``departures``: when, on the trace clock, and which tasks that cancelled)."""
        return {"pid": os.getpid(), "clients": len(self.clients), "socket": self.socket, "log": self.log_path,
                "linger": self.linger, "departures": self.clients.departures()}

    def serve(self) -> None:
        """Accept clients until no client has come for ``linger`` s, or SIGTERM; then shut down and exit."""
        signal.signal(signal.SIGTERM, self._on_term)
        threading.Thread(target=self.clients.accept_forever, name="hydra-node-accept", daemon=True).start()
        server_log(f"ready on {self.socket}: {self.config}, devices {[d.name for d in self.runtime.devices]}, "
                   f"linger {self.linger} s")
        retired = False
        while not self._terminated:
            time.sleep(0.1)
            idle = self.clients.idle_for()
            if idle is not None and idle >= self.linger and self._retire():
                server_log(f"no client for {self.linger} s: exiting")
                retired = True
                break
        self._shutdown(retired)

    def _on_term(self, *_: object) -> None:
        self._terminated = True  # a flag only: taking locks in a signal handler can deadlock

    def _retire(self) -> bool:
        """Stop listening if still idle, under the start lock."""
        with locked(self.lock_path):
            if not self.clients.stop_accepting(idle_for=self.linger):
                return False
            self._remove_socket()
            # Idle and ending normally: nothing in the log to look at. Removed under the start lock, so the log a
            # new server for this configuration opens (same path) is never the one unlinked.
            for path in (self.log_path, self.log_path + ".1"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return True

    def _shutdown(self, retired: bool) -> None:
        if not retired:  # SIGTERM
            server_log("SIGTERM: exiting")
            with locked(self.lock_path):
                self.clients.stop_accepting()
                self._remove_socket()
        self.runtime.close()  # unfinished tasks end with RuntimeClosed; the forwarders tell their clients
        self.forwarders.join(5)
        self.clients.close_all()
        sys.stdout.flush()
        os._exit(0)  # daemon threads (the accept loop) stay blocked; nothing is left to clean up

    def _remove_socket(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # closing the listener usually unlinked it already
            os.unlink(self.socket)


def main(argv: list[str] | None = None) -> None:
    """Run the server until it lingers out or gets SIGTERM (see the module docstring for the argument)."""
    os.umask(0o077)  # its socket and anything it writes stay private
    settings = json.loads((argv if argv is not None else sys.argv[1:])[0])
    try:
        server = Server(settings)
    except BaseException:
        server_log(f"could not start:\n{traceback.format_exc()}")
        sys.exit(1)
    server.serve()


if __name__ == "__main__":
    main()
