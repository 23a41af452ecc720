"""The faults of benchmarks/chaos_tune.py, injected into a running Tune search on a local Ray cluster.

    chaos = Chaos(cluster, watch, kinds=["node", "proxy"], times=[3.0, 7.5], seed=0)   # watch: chaos_tune.Watch
    threading.Thread(target=lambda: (tuner.fit(), chaos.stop.set())).start()
    chaos.run()                     # in the main thread: a replacement node can only be started there
    chaos.done                      # [{"kind", "at_s", "node", "trials", ...}] what it did

Rules: times count from the search's first result; each fault waits until a target trains (a running trial on a
live node; for ``node``, a worker node with a runtime actor), then hits it once: ``node`` removes the busiest
worker node and adds a replacement, ``actor`` kills a node's runtime actor, ``proxy`` SIGKILLs a trial's proxy.
The choices are seeded.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import ray
from hydra_tune.integrations import _tune_proxy


class Chaos:
    """Injects ``kinds`` at ``times`` (seconds after start), each once a target trains; records what it did. Runs
    in the main thread (a replacement node can only be started there: Ray sets signal handlers), the search in
    another."""

    def __init__(self, cluster: Any, watch: Any, kinds: list[str], times: list[float], seed: int) -> None:
        self.cluster, self.watch, self.rng = cluster, watch, random.Random(seed)
        self.plan = list(zip(times, kinds))
        self.done: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while self.watch.first_result is None:   # times count from the first result (runtimes start slowly)
            if self.stop.wait(0.2):
                return
        t0 = self.watch.first_result
        for at, kind in self.plan:
            if self.stop.wait(max(0.0, at - (time.perf_counter() - t0))):
                return
            while not self.stop.is_set():
                hit = getattr(self, f"_{kind}")()
                if hit is not None:
                    self.done.append(dict(hit, kind=kind, at_s=round(time.perf_counter() - t0, 2)))
                    break
                self.stop.wait(0.2)

    def killed_threads(self) -> list[tuple[str, float]]:
        """(trial id, time.time()) of each train_fn thread that was alive in a process a fault killed."""
        return [(t, f["killed_at"]) for f in self.done for t in f.get("threads", [])]

    def _targets(self, workers_only: bool = False) -> list[tuple[str, int, str]]:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        workers = {n.node_id for n in self.cluster.worker_nodes}
        with self.watch.lock:
            out = [(t, pid, node) for t, (pid, node) in sorted(self.watch.running.items()) if node in alive]
        return [x for x in out if x[2] in workers] if workers_only else out

    def _node(self) -> dict[str, Any] | None:
        targets = [t for t in self._targets(workers_only=True) if _runtime(t[2]) is not None]
        if not targets:
            return None
        per_node: dict[str, int] = {}
        for _, _, n in targets:
            per_node[n] = per_node.get(n, 0) + 1
        nid = self.rng.choice(sorted(n for n, k in per_node.items() if k == max(per_node.values())))   # the busiest
        node = next(n for n in self.cluster.worker_nodes if n.node_id == nid)
        threads = _threads(_runtime(nid))
        self.cluster.remove_node(node, allow_graceful=False)
        killed_at = time.time()
        self.cluster.add_node(num_cpus=2)   # the replacement, as a spot instance's would join
        return {"node": nid, "trials": sorted(t for t, _, n in targets if n == nid), "threads": threads,
                "killed_at": killed_at}

    def _actor(self) -> dict[str, Any] | None:
        targets = self._targets()
        if not targets:
            return None
        _, _, nid = self.rng.choice(targets)
        actor = _runtime(nid)
        if actor is None:
            return None
        threads = _threads(actor)
        ray.kill(actor, no_restart=True)
        return {"node": nid, "trials": sorted(t for t, _, n in targets if n == nid), "threads": threads,
                "killed_at": time.time()}

    def _proxy(self) -> dict[str, Any] | None:
        targets = self._targets()
        if not targets:
            return None
        trial, pid, nid = self.rng.choice(targets)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return {"node": nid, "trials": [trial], "pid": pid}


def _threads(actor: Any) -> list[str]:
    """The trial ids whose train_fn thread is alive in the runtime ``actor`` (none when it does not answer)."""
    try:
        return list(ray.get(actor.stats.remote(), timeout=10)["threads"])
    except Exception:  # noqa: BLE001  (an actor dying already: nothing of it can be read)
        return []


def _runtime(node_id: str) -> Any:
    try:
        return ray.get_actor(_tune_proxy.actor_name(node_id), namespace=_tune_proxy.NAMESPACE)
    except ValueError:
        return None
