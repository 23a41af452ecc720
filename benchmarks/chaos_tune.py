"""Usage: .venv/bin/python benchmarks/chaos_tune.py [--trials 24] [--epochs 8] [--faults node,actor,proxy,proxy]
                                                   [--quick] [--seed 0] [--json PATH]

Ray Tune chaos search: a 3-node local Ray cluster (``ray.cluster_utils.Cluster``: a head and 2 workers, 2 logical
CPUs each, every trial's proxy asking 1: at most 6 trials at once, spread over the nodes), one hydra_tune runtime
actor per node (``HydraExecutor(devices=["cpu"])``), ASHA (grace 1, reduction 2, ``max_t=--epochs``) over a grid of
``--trials`` small MLP trials (trial i: its own seeded data and learning rate), a checkpoint every epoch
(``hydra_tune.save_checkpoint`` -> ``tune.Checkpoint``), ``FailureConfig(max_failures=3)``.

The same seeded search runs twice on the cluster: fault-free, then with faults at seeded random times (spread over
15-60% of the fault-free run's time from its first result to its end), each waiting for a target training now:
  * node:  remove the worker node with the most running trials and its runtime actor on it (a replacement node
           joins, as a spot instance's would), so its trials' proxies and its runtime die at once; node faults come
           first in the plan (at the earliest times), while the most trials run;
  * actor: ``ray.kill`` a node's runtime actor under its running trials;
  * proxy: SIGKILL a running trial's proxy process (its train_fn thread in the runtime actor is left behind).

The node-removal fault lives only here (a cluster costs 35-60 s to start); tests/test_chaos_short.py (in `make
test`) reuses ``train_fn``, ``Watch``, ``orphans`` and ``orphan_count`` for a search on the tests' local Ray with
the proxy and runtime-actor faults at given reports instead of times.

Figures (a table, then one JSON line): faults injected by kind; trials lost (errored, or ended at an iteration
that is neither an ASHA rung nor ``max_t``: goal 0); trials whose metrics differ from the fault-free run at an
iteration both runs reached, repeated iterations after a restore included (goal 0: exact resume; which trials ASHA
stops where depends on the order results arrive, so the final iterations of the two runs may differ: that count is
printed apart and is no failure); orphans (goal 0): train_fn threads or hydra_tune tasks still alive in a runtime
when the experiment ends, runtime actors left after it, runtime/proxy processes alive after it, hydra_tune
checkpoint temp files anywhere under the run's folder, trial folders of train_fn left (each trial's last
incarnation removes its own; a killed one's is taken over by its restart; one whose thread died with a killed
process just after Tune stopped the trial is listed apart, uncounted); wall time of each run. Exit status 1
when a goal is missed.

    .venv/bin/python benchmarks/chaos_tune.py                  # 24 trials x 8 epochs, 4 faults (~4-6 min on 2 cores)
    .venv/bin/python benchmarks/chaos_tune.py --quick          # what tests/test_tune_chaos.py runs (opt-in)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray
import torch
import torch.nn.functional as F
from _tune_faults import Chaos  # benchmarks/ is on sys.path
from ray import cloudpickle, tune

import hydra_tune as ht

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # train_fn travels to the runtime actors by value
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


# -- the trial ------------------------------------------------------------------------------------------------------
def make_task(config: dict[str, Any], name: str, resume_from: str | None) -> ht.ModelTask:
    """Trial i: a small MLP, its own seeded data and learning rate (deterministic: equal configs train equally)."""
    i = config["i"]
    g = torch.Generator().manual_seed(1000 + i)
    data = [(torch.randn(32, 32, generator=g), torch.randn(32, 4, generator=g)) for _ in range(config["nb"])]
    lr = 10 ** (-1.0 - 2.0 * ((i * 7) % config["n"]) / config["n"])
    return ht.ModelTask(lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                                    torch.nn.Linear(64, 4)),
                        lambda m: torch.optim.AdamW(m.parameters(), lr=lr), data,
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=config["epochs"], seed=i, name=name,
                        resume_from=resume_from)


def train_fn(config: dict[str, Any]) -> None:
    """Resume from Tune's checkpoint if any; checkpoint every epoch; report the loss and where it trained. The
    trial's files live in one folder per trial id, removed when the trial ends (a killed incarnation leaves it to
    the restarted one, whose checkpoint writes remove the dead writer's temp files)."""
    ctx = tune.get_context()
    mine = os.path.join(config["scratch"], ctx.get_trial_id())
    os.makedirs(os.path.join(mine, "ckpt"), exist_ok=True)
    try:
        resume, ck = None, tune.get_checkpoint()
        if ck is not None:
            with ck.as_directory() as d:
                resume = shutil.copy(os.path.join(d, "task.pt"), os.path.join(mine, "resume.pt"))
        task = make_task(config, f"{ctx.get_trial_id()}-{time.time_ns()}", resume)
        for m in ht.train(task):
            saved = ht.save_checkpoint(os.path.join(mine, "ckpt", "task.pt"), timeout=60)   # None after the last step
            tune.report({"loss": m["train_loss"], "epoch": m["epoch"], "resumed": resume is not None,
                         "runtime_pid": os.getpid(), "runtime_node": ray.get_runtime_context().get_node_id()},
                        checkpoint=tune.Checkpoint.from_directory(os.path.join(mine, "ckpt")) if saved else None)
    finally:
        shutil.rmtree(mine, ignore_errors=True)


# -- the driver -----------------------------------------------------------------------------------------------------
class Watch(tune.Callback):
    """What the chaos needs to aim (running trials: proxy pid and node) and what the orphan count needs."""

    def __init__(self, ex: ht.HydraExecutor) -> None:
        self.ex = ex
        self.running: dict[str, tuple[int, str]] = {}   # trial id -> (proxy pid, node id)
        self.pids: set[int] = set()                      # every proxy and runtime process seen
        self.recoveries: list[tuple[str, float]] = []   # (trial id, time.time()) of each restart Tune decided
        self.first_result: float | None = None          # perf_counter of the search's first result
        self.last_result: dict[str, float] = {}          # trial id -> time.time() of its latest result
        self.at_end: dict[str, Any] = {}
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:   # the Tuner pickles its callbacks (a lock does not pickle)
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        with self.lock:
            self.first_result = self.first_result or time.perf_counter()
            self.last_result[trial.trial_id] = time.time()
            self.running[trial.trial_id] = (result["pid"], result["proxy_node"])
            self.pids |= {result["pid"], result["runtime_pid"]}

    def _ended(self, trial: Any) -> None:
        with self.lock:
            self.running.pop(trial.trial_id, None)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        with self.lock:
            self.recoveries.append((trial.trial_id, time.time()))
        self._ended(trial)

    @property
    def recovered(self) -> int:
        """Restarts Tune decided."""
        return len(self.recoveries)

    def restarted_after(self, trial_id: str, at: float) -> bool:
        """Whether Tune decided to restart ``trial_id`` at or after ``at`` (a new incarnation of it runs then)."""
        return any(t == trial_id and when >= at for t, when in self.recoveries)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        """Before the executor's own hook stops the runtimes (it comes after this one): what is still alive. A
        trial's thread that has sent its last result may still be returning: it gets up to 10 s to end (one that
        never ends is still counted)."""
        deadline = time.time() + 10
        stats = self.ex.runtime_stats()
        while time.time() < deadline and any(s == "running" for st in stats.values() for s in st["trials"].values()):
            time.sleep(0.2)
            stats = self.ex.runtime_stats()
        self.at_end = {
            "threads": sorted(t for st in stats.values() for t, s in st["trials"].items() if s == "running"),
            "tasks": sorted(n for st in stats.values() for n, t in st["tasks"].items()
                            if t["state"] not in ("done", "cancelled", "failed")),
            "runtime_pids": sorted(st["pid"] for st in stats.values())}
        self.pids |= set(self.at_end["runtime_pids"])


def search(cluster: Any, args: argparse.Namespace, root: str, name: str, faults: list[str]) -> dict[str, Any]:
    """One run of the seeded search (with ``faults`` injected when given); its figures' raw material."""
    from ray.tune.schedulers import ASHAScheduler

    scratch = os.path.join(root, f"{name}-scratch")
    os.makedirs(scratch)
    ex = ht.HydraExecutor(devices=["cpu"], proxy_cpus=1, report_proxy_modules=True)
    watch = Watch(ex)
    space = {"i": tune.grid_search(list(range(args.trials))), "n": args.trials, "nb": args.batches,
             "epochs": args.epochs, "scratch": scratch}
    asha = ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=2)
    tuner = tune.Tuner(ex.wrap(train_fn), param_space=space,
                       tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=asha, max_concurrent_trials=6),
                       run_config=tune.RunConfig(name=name, storage_path=os.path.join(root, "storage"), verbose=0,
                                                 callbacks=[watch, ex],
                                                 failure_config=tune.FailureConfig(max_failures=3)))
    chaos, out = None, {}
    if faults:
        rng = random.Random(args.seed)
        times = sorted(rng.uniform(0.15, 0.6) * args.span for _ in faults)
        rest = [f for f in faults if f != "node"]   # node losses first, while the most trials run
        kinds = [f for f in faults if f == "node"] + rng.sample(rest, len(rest))
        chaos = Chaos(cluster, watch, kinds, times, args.seed)
    t0 = time.perf_counter()
    if chaos is None:
        results = tuner.fit()
    else:
        def fit() -> None:
            try:
                out["results"] = tuner.fit()
            finally:
                chaos.stop.set()

        search_thread = threading.Thread(target=fit, daemon=True)
        search_thread.start()
        chaos.run()
        search_thread.join()
        results = out["results"]
    wall = time.perf_counter() - t0
    print(f"{name}: first result after {(watch.first_result or t0) - t0:.1f} s, wall {wall:.1f} s, proxy/runtime "
          f"pids seen {len(watch.pids)}", flush=True)
    trials = {}
    for r in results:
        df = r.metrics_dataframe
        rows = [] if df is None else [(int(e), float(v)) for e, v in zip(df["epoch"], df["loss"])]
        trials[r.config["i"]] = {"nodes": [] if df is None else sorted(set(df["proxy_node"].str[:8])),
                                 "error": None if r.error is None else f"{type(r.error).__name__}: {r.error}"[:300],
                                 "iteration": (r.metrics or {}).get("training_iteration"), "rows": rows}
    return {"wall_s": wall, "first_result_s": (watch.first_result or t0) - t0, "trials": trials,
            "faults": [] if chaos is None else chaos.done,
            "planned": len(faults), "recovered": watch.recovered, "at_end": watch.at_end,
            "orphans": orphans(watch, root, scratch, [] if chaos is None else chaos.killed_threads())}


def orphans(watch: Watch, root: str, scratch: str, killed: Iterable[tuple[str, float]] = ()) -> dict[str, Any]:
    """After the experiment: runtime actors left, processes alive (given 15 s to exit), checkpoint temp files, trial
    folders. ``killed``: (trial id, time.time()) of each train_fn thread alive in a process the chaos killed. Such a
    trial that Tune did not restart after the kill (it had stopped the trial, or the trial had sent its last result,
    so no incarnation followed) could not run train_fn's ``finally``: its folder is listed apart, under
    ``folders_of_killed_threads``, and not counted. (Tune's restart decisions, not the arrival of results: a result
    sent before the kill may reach the driver after it.)"""
    deadline = time.time() + 15
    alive = sorted(watch.pids)
    while alive and time.time() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _alive(p)]
    temp = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(".hydra-ckpt-")]
    died = {t for t, at in killed if not watch.restarted_after(t, at)}
    folders = sorted(os.listdir(scratch))   # train_fn's: each trial's last incarnation removes its own
    return {"threads": watch.at_end.get("threads", []), "tasks": watch.at_end.get("tasks", []),
            "actors": [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith("hydra_rt_")],
            "processes": alive, "checkpoint_temp_files": temp,
            "trial_folders": [f for f in folders if f not in died],
            "folders_of_killed_threads": [f for f in folders if f in died]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not reaped by the raylet that died with its node) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- figures --------------------------------------------------------------------------------------------------------
def compare(clean: dict[str, Any], chaos: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Trials lost, trials whose metrics differ from the fault-free run at an iteration both reached."""
    ends = {1 << k for k in range(epochs.bit_length()) if 1 << k < epochs} | {epochs}   # ASHA rungs (grace 1, rf 2)
    lost = sorted(i for i, t in chaos["trials"].items() if t["error"] or t["iteration"] not in ends)
    lost += sorted(set(clean["trials"]) - set(chaos["trials"]))
    differ, compared = [], 0
    for i, t in chaos["trials"].items():
        ref = dict(clean["trials"].get(i, {}).get("rows", []))
        seen: dict[int, float] = {}
        bad = False
        for epoch, loss in t["rows"]:
            bad |= seen.setdefault(epoch, loss) != loss            # an iteration run again after a restore
            if epoch in ref:
                compared += 1
                bad |= ref[epoch] != loss
        if bad:
            differ.append(i)
    stopped_elsewhere = sorted(i for i, t in chaos["trials"].items()
                               if t["iteration"] != clean["trials"].get(i, {}).get("iteration"))
    return {"lost": lost, "differ": sorted(differ), "rows_compared": compared, "stopped_elsewhere": stopped_elsewhere}


def orphan_count(o: dict[str, Any]) -> int:
    return sum(len(o[k]) for k in ("threads", "tasks", "actors", "processes", "checkpoint_temp_files", "trial_folders"))


def failures(r: dict[str, Any]) -> list[str]:
    out = [f"trials lost: {r['lost']}"] if r["lost"] else []
    out += [f"trials differing from the fault-free run: {r['differ']}"] if r["differ"] else []
    out += [f"{r['faults_injected']} faults injected of {r['faults_planned']} planned"] \
        if r["faults_injected"] < r["faults_planned"] else []
    for run in ("clean", "chaos"):
        if orphan_count(r[f"orphans_{run}"]):
            out.append(f"orphans after the {run} run: {r[f'orphans_{run}']}")
    return out


def report(clean: dict[str, Any], chaos: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    for f in chaos["faults"]:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    r = {"trials": args.trials, "epochs": args.epochs, "seed": args.seed, "faults_planned": chaos["planned"],
         "faults_injected": len(chaos["faults"]), "faults_by_kind": by_kind, "faults": chaos["faults"],
         "trial_restarts": chaos["recovered"], **compare(clean, chaos, args.epochs),
         "orphans_clean": clean["orphans"], "orphans_chaos": chaos["orphans"],
         "wall_clean_s": round(clean["wall_s"], 1), "wall_chaos_s": round(chaos["wall_s"], 1),
         # the runtime actors' start (torch imports on 3 nodes sharing the cores) varies by tens of seconds
         "search_clean_s": round(clean["wall_s"] - clean["first_result_s"], 1),
         "search_chaos_s": round(chaos["wall_s"] - chaos["first_result_s"], 1),
         "errors": {i: t["error"] for i, t in chaos["trials"].items() if t["error"]}}
    rows = [("faults injected (by kind)", f"{r['faults_injected']}/{r['faults_planned']} {by_kind}"),
            ("trial restarts (FailureConfig)", r["trial_restarts"]),
            ("trials lost (goal 0)", len(r["lost"])),
            ("trials differing from fault-free (goal 0)",
             f"{len(r['differ'])} ({r['rows_compared']} reports compared)"),
            ("trials ASHA stopped elsewhere (timing)", len(r["stopped_elsewhere"])),
            ("orphans after the chaos run (goal 0)", orphan_count(r["orphans_chaos"])),
            ("orphans after the fault-free run (goal 0)", orphan_count(r["orphans_clean"])),
            ("wall fault-free / chaos (s)", f"{r['wall_clean_s']} / {r['wall_chaos_s']}"),
            ("  of which from the first result (s)", f"{r['search_clean_s']} / {r['search_chaos_s']}")]
    per_node: dict[str, int] = {}
    for t in chaos["trials"].values():
        for n in t["nodes"]:
            per_node[n] = per_node.get(n, 0) + 1
    rows.append(("trials per proxy node (chaos run)", per_node))
    print(f"\nTune chaos search: {args.trials} trials x {args.epochs} epochs, ASHA, 3 nodes, seed {args.seed}")
    for k, v in rows:
        print(f"  {k:<46} {v}")
    for f in chaos["faults"]:
        print(f"  fault {f['at_s']:>6.1f} s after the first result: {f['kind']:<6} node {f['node'][:8]} "
              f"trials {f['trials']}")
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=None, help="grid size (default 24, --quick 8)")
    p.add_argument("--epochs", type=int, default=None, help="ASHA max_t (default 8, --quick 4)")
    p.add_argument("--batches", type=int, default=None, help="batches per epoch (default 64, --quick 48)")
    p.add_argument("--faults", default=None, help="comma list of node, actor, proxy (default node,actor,proxy,proxy; "
                                                  "--quick node,actor,proxy)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    args.trials = args.trials or (8 if args.quick else 24)
    args.epochs = args.epochs or (4 if args.quick else 8)
    args.batches = args.batches or (48 if args.quick else 64)
    faults = (args.faults or ("node,actor,proxy" if args.quick else "node,actor,proxy,proxy")).split(",")
    if not set(faults) <= {"node", "actor", "proxy"}:
        p.error(f"--faults: node, actor or proxy, got {faults}")
    torch.set_num_threads(1)
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="htchaos")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "_system_config": FAST_HEALTH})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        clean = search(cluster, args, root, "clean", [])
        args.span = clean["wall_s"] - clean["first_result_s"]   # from the first result to the end
        chaos = search(cluster, args, root, "chaos", faults)
        r = report(clean, chaos, args)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    bad = failures(r)
    r["failures"] = bad
    print(json.dumps(r, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, default=str)
    for b in bad:
        print("FAIL:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
