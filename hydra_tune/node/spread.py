"""A search's tasks dealt out to several node servers, one device each: devices that share no interpreter lock.

    pool = node.spread(["cpu", "cpu"])                  # two servers of one CPU device each (joined if running)
    handles = [pool.submit(task) for task in tasks]     # each to the server with the fewest unfinished tasks
    print([h.result()["eval_loss"] for h in handles]); pool.close()
    study = hydra_tune.optuna_study(runtime=pool)       # or an Optuna study's runtime
    study = hydra_tune.optuna_study(share="spread", devices=["cpu", "cpu"])  # a study that spreads its own

Why: an in-process Runtime's devices are threads of one Python process. A small model's unit is mostly Python
and short torch calls, which hold the GIL: two CPU devices in one process ran two such trials as slowly as one
device ran both (benchmarks/small_trials.py), where one process per device runs them side by side.

Rules: server ``i`` of ``n`` is the node server of ``RuntimeConfig(devices=[devices[i]], ...)`` in slot
"i/n" (``server_files``): calling ``spread`` again with the same settings joins the same servers, and none of them
is the server ``node.connect`` gives for those settings. A CPU server starts with ``OMP_NUM_THREADS`` = the cores
divided among the CPU servers (at least 1) unless this environment sets it. A task stays on the server it was
given: it is cut to that one device's budget, never sharded over the others, and the others do not take over its
work when they run out of their own (a task larger than one device needs ``node.connect`` or ``Runtime``).
``host_memory`` is each server's own bound; with None each measures the machine's free memory as it admits.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

from ..config import RuntimeConfig
from ..device.resolve import device_names
from ..errors import RuntimeClosed, rule_error
from ..task import ModelTask
from .client import NodeRuntime, RemoteHandle, join
from .files import server_files


def spread(devices: Sequence[str] | None = None, device_memory: int | str | None = None, *, policy: str = "lrtf",
           host_memory: int | str | None = None, config: RuntimeConfig | None = None) -> NodePool:
    """Connect to (starting if needed) one node server per entry of ``devices`` and return the pool of them.
    ``config``: a ``RuntimeConfig`` instead of the keywords (its ``devices`` as the machine resolves them: "auto"
    is every visible GPU, else one CPU device); each server gets it with its one device."""
    if config is not None:
        if devices is not None:
            raise rule_error("either `config=` or `devices` is given, not both", "put the devices into the "
                             "RuntimeConfig or drop `config=`", kind=TypeError, devices=devices)
        config = RuntimeConfig.of(config, device_memory=device_memory, policy=policy, host_memory=host_memory)
        devices = device_names(config.devices)
    elif isinstance(devices, str) or not isinstance(devices, Sequence) or not devices or \
            not all(isinstance(d, str) for d in devices):
        raise rule_error("`devices` is a non-empty list of device names, one server each", "pass e.g. ['cpu', "
                         "'cpu'] or ['cuda:0', 'cuda:1']", kind=TypeError, devices=devices)
    else:  # (each server's own: servers of different kinds may serve one pool)
        config = RuntimeConfig(devices=[devices[0]], device_memory=device_memory, policy=policy,
                               host_memory=host_memory)
    # each server's config validated here, before any server starts
    configs = [dataclasses.replace(config, devices=[d]) for d in devices]
    n_cpu = sum(d.startswith("cpu") for d in devices)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, cores // max(n_cpu, 1)))}
    files = [server_files(config=config, slot=f"{i}/{len(configs)}") for i, config in enumerate(configs)]
    return NodePool(_join_all(files, [env if d.startswith("cpu") else None for d in devices]))


def _join_all(files: list[dict[str, Any]], envs: list[dict[str, str] | None]) -> list[NodeRuntime]:
    """``join`` each server at once, so that those not running start side by side (a server's start is mostly
    its ``import torch``: one at a time, n servers took n times as long). Any failure closes the connections made
    and raises the first server's error (in the order of ``files``)."""
    results: list[Any] = [None] * len(files)

    def one(i: int) -> None:
        try:
            results[i] = join(files[i], envs[i])
        except BaseException as exc:  # re-raised below, in this thread
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"hydra-spread-join-{i}", daemon=True)
               for i in range(1, len(files))]
    for thread in threads:
        thread.start()
    one(0)
    for thread in threads:
        thread.join()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for node in results:
            if isinstance(node, NodeRuntime):
                node.close()
        raise failed[0]
    return results


class NodePool:
    """Node servers of one device each, used as one runtime (see the module docstring): ``submit``, ``stats``,
    ``close``; ``devices`` is their number."""

    def __init__(self, nodes: list[NodeRuntime]) -> None:
        self.nodes = nodes
        self.devices = sum(node.devices for node in nodes)
        self._lock = threading.Lock()
        self._running: list[list[Any]] = [[] for _ in nodes]  # per server: its unfinished handles (or reservations)
        self._gone: set[int] = set()  # servers whose connection ended: no more tasks go there

    def submit(self, task: ModelTask) -> RemoteHandle:
        """Ship ``task`` to the live server with the fewest unfinished tasks (the first of those tied) and return
        its handle; the server plans it (errors raise here). A server whose connection ended gets no more tasks
        (its unfinished ones ended with RuntimeClosed); with none left this raises RuntimeClosed."""
        while True:
            index, slot = self._reserve()
            try:
                handle = self.nodes[index].submit(task)
            except RuntimeClosed:
                with self._lock:
                    self._gone.add(index)
                    self._running[index].remove(slot)
                continue
            except BaseException:
                with self._lock:
                    self._running[index].remove(slot)
                raise
            with self._lock:  # the reservation becomes the handle (submits to other servers went on meanwhile)
                running = self._running[index]
                running[running.index(slot)] = handle
            return handle

    def _reserve(self) -> tuple[int, object]:
        with self._lock:
            live = [i for i in range(len(self.nodes)) if i not in self._gone]
            if not live:
                raise RuntimeClosed("every node server of this pool has ended; see their logs: " +
                                    ", ".join(node.log for node in self.nodes))
            for i in live:
                self._running[i][:] = [h for h in self._running[i] if not isinstance(h, RemoteHandle)
                                       or not h.done()]
            index = min(live, key=lambda i: len(self._running[i]))
            slot = object()
            self._running[index].append(slot)
        return index, slot

    def stats(self) -> dict[str, Any]:
        """Each server's ``stats()`` under ``"servers"``, with their ``"devices"`` in one list (each named
        ``<name>@<server index>``: every server's is "cpu:0") and their ``"tasks"`` in one dict (a name two servers
        both hold gets ``@<server index>`` on the later one); the shape a progress line reads (runtime/progress.py)."""
        servers = [node.stats() for node in self.nodes]
        tasks: dict[str, Any] = {}
        for i, s in enumerate(servers):
            for name, record in s.get("tasks", {}).items():
                tasks[name if name not in tasks else f"{name}@{i}"] = record
        devices = [dict(d, name=f"{d['name']}@{i}") for i, s in enumerate(servers) for d in s.get("devices", [])]
        return {"servers": servers, "devices": devices, "tasks": tasks}

    def close(self) -> None:
        """Disconnect from every server (each cancels this client's unfinished tasks). Idempotent."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> NodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NodePool({', '.join(f'pid={n.pid}' for n in self.nodes)})"
