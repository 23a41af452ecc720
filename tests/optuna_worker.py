"""One Optuna worker process for tests/test_optuna_processes.py: joins a study in a shared storage and optimizes.

    python tests/optuna_worker.py sqlite:///s.db study 3 run out.json    # 3 trials, writes what it saw
    python tests/optuna_worker.py sqlite:///s.db study 1 hang -          # one trial that trains until killed

The tasks are the small MLP of tests/test_optuna.py; every process uses the same device configuration, so all of
them share the node's runtime server.
"""
from __future__ import annotations

import json
import os
import sys

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht

DEVICES, BUDGET = ["cpu", "cpu"], "64KiB"


def data(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def task(lr: float, epochs: int) -> ht.ModelTask:
    return ht.ModelTask(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=lr), data(6), eval_data=data(2, 9),
                        loss=lambda out, batch: F.mse_loss(out, batch[1]), epochs=epochs)


def kill_mid_trial(proc) -> dict:
    """For the tests: ``proc`` (a ``hang`` worker) has said RUNNING; SIGKILL it, connect to this machine's node
    server as a second client and wait until the server has cancelled the dead worker's task. Returns the
    server's ``stats()`` then."""
    import signal
    import time

    from hydra_tune import node

    line = proc.stdout.readline()
    assert line.startswith("RUNNING"), (line, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
    rt = node.connect(devices=DEVICES, device_memory=BUDGET)
    try:
        running = [n for n, s in rt.stats()["tasks"].items() if s["state"] == "running"]
        assert len(running) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 15

        def settled(stats: dict) -> bool:  # cancelled, and its device bytes freed (the thread that held its state
            # inside a unit or step frees them as it lets the task go: a few milliseconds after the state changes)
            return (stats["tasks"][running[0]]["state"] != "running"
                    and all(d["current_bytes"] == 0 for d in stats["devices"]))
        while not settled(rt.stats()) and time.time() < deadline:
            time.sleep(0.1)
        stats = rt.stats()
        assert stats["tasks"][running[0]]["state"] == "cancelled"
        return stats
    finally:
        rt.close()


def main(storage: str, study_name: str, n_trials: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = ht.optuna_study(direction="minimize", storage=storage, study_name=study_name, load_if_exists=True,
                            sampler=optuna.samplers.TPESampler(seed=os.getpid()), heartbeat_interval=1,
                            devices=DEVICES, device_memory=BUDGET)

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 0.01, 0.1)
        for m in ht.train(task(lr, 100_000 if mode == "hang" else 3)):
            if mode == "hang" and m["epoch"] == 1:
                print(f"RUNNING {trial.number}", flush=True)
            trial.report(m["eval_loss"], m["epoch"])
        return m["eval_loss"]

    study.optimize(objective, n_trials=n_trials)
    stats = study.runtime_stats()
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "server_pid": stats["server"]["pid"],
                   "trials": [(t.number, t.params["lr"], t.value) for t in study.trials
                              if t.state == optuna.trial.TrialState.COMPLETE]}, f)
    study.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
