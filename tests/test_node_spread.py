"""node.spread: one node server per device, a search's tasks dealt out to them (real server processes)."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import node_sandbox, process_alive
from reference import max_param_diff, trained

import hydra_tune as ht
from hydra_tune import node
from hydra_tune.errors import RuntimeClosed
from hydra_tune.runtime.progress import status_line

_PIDS: list[int] = []  # every server these tests started: all are gone at the end


@pytest.fixture(scope="module", autouse=True)
def node_dir():
    with node_sandbox("htp", "3", _PIDS) as (base, _):
        yield base


def _spread(*args, **kw) -> node.NodePool:
    pool = node.spread(*args, **kw)
    _PIDS.extend(n.pid for n in pool.nodes)
    return pool


def _data(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(48, 16, generator=g), torch.randn(48, 4, generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)]


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


def _task(seed: int, **kw) -> ht.ModelTask:
    return ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), _data(seed), eval_data=_data(99),
                        loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2, seed=seed, name=f"t{seed}", **kw)


def test_tasks_dealt_out_to_one_server_per_device_train_as_in_process():
    with ht.Runtime(devices=["cpu"]) as rt:
        expected = [trained(rt.submit(_task(s))) for s in range(4)]
    with _spread(["cpu", "cpu"]) as pool:
        assert pool.devices == 2 and len({n.pid for n in pool.nodes}) == 2
        handles = [pool.submit(_task(s)) for s in range(4)]
        got = [trained(h) for h in handles]
        stats = pool.stats()
    assert [max_param_diff(a, b) for a, b in zip(expected, got)] == [0.0] * 4
    assert [len(s["devices"]) for s in stats["servers"]] == [1, 1]
    assert [d["name"] for d in stats["devices"]] == [f'{s["devices"][0]["name"]}@{i}'
                                                    for i, s in enumerate(stats["servers"])]
    assert "devices busy" in status_line(stats, None, 1.0)  # the progress line's input (optuna_study(progress=))
    # each server took tasks: the one with fewer unfinished gets the next
    assert all(any(name.endswith(f"/t{s}") for s in range(4) for name in server["tasks"])
               for server in stats["servers"])
    assert sorted(name.split("/")[-1] for name in stats["tasks"]) == ["t0", "t1", "t2", "t3"]


def test_spread_joins_its_servers_again_and_they_are_not_connects_server():
    first = _spread(["cpu", "cpu"])
    again = _spread(["cpu", "cpu"])
    alone = node.connect(config=ht.RuntimeConfig(devices=["cpu"]))
    _PIDS.append(alone.pid)
    try:
        assert [n.pid for n in first.nodes] == [n.pid for n in again.nodes]
        assert alone.pid not in {n.pid for n in first.nodes}
    finally:
        for c in (first, again, alone):
            c.close()


def test_cpu_servers_divide_the_cores_between_them():
    cores = len(os.sched_getaffinity(0))
    want = int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else max(1, cores // 2)
    with _spread(["cpu", "cpu"]) as pool:
        # eval_fn runs in the server's process: what its torch uses there
        task = _task(0, eval_fn=lambda model: {"threads": float(torch.get_num_threads())})
        assert pool.submit(task).result()["threads"] == min(want, cores)


def test_a_killed_server_gets_no_more_tasks_and_the_others_go_on():
    pool = _spread(["cpu", "cpu"])
    try:
        victim, other = pool.nodes
        os.kill(victim.pid, signal.SIGKILL)
        assert _wait_dead(victim.pid)
        handles = [pool.submit(_task(s)) for s in range(3)]  # the first tries the killed one, then the other
        assert [h.result()["epoch"] for h in handles] == [2, 2, 2]
        assert {h.server_name.split("/")[0] for h in handles} == {f"c{other.client_id}"}
        assert all(name in other.stats()["tasks"] for name in (h.server_name for h in handles))
    finally:
        pool.close()
    with pytest.raises(RuntimeClosed, match="every node server of this pool has ended"):
        pool.submit(_task(0))


def _wait_dead(pid: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _started(pid: int) -> float:
    """The process's start, in seconds since boot (/proc/<pid>/stat field 22, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def test_servers_not_running_start_side_by_side():
    begin = time.monotonic()
    with _spread(["cpu", "cpu"], device_memory="5MiB") as pool:  # settings no other test's servers have
        took = time.monotonic() - begin
        first, second = (_started(n.pid) for n in pool.nodes)
    # one at a time, the second server's process began only once the first accepted (its import of torch alone
    # is most of `took`); side by side both began at once
    assert abs(second - first) * 4 < took, (first, second, took)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where a CUDA server cannot start")
def test_a_server_that_cannot_start_fails_the_spread_and_the_others_are_let_go():
    with pytest.raises(ht.HydraError, match="node server .* exited with code"):
        node.spread(["cpu", "cuda:0"], device_memory="6MiB")
    config = ht.RuntimeConfig(devices=["cpu"], device_memory="6MiB")
    with open(node.server_files(config=config, slot="0/2")["log"]) as f:
        pid = int(re.search(r"\[hydra_tune node server (\d+)\]", f.read()).group(1))
    _PIDS.append(pid)
    assert _wait_dead(pid)  # the CPU server started, its connection was closed: it lingers (3 s) and ends


def test_bad_devices_and_settings_fail_before_any_server_starts():
    before = set(os.listdir(os.environ["HYDRA_TUNE_NODE_DIR"]))
    with pytest.raises(TypeError, match="non-empty list of device names"):
        node.spread("cpu")
    with pytest.raises(TypeError, match="non-empty list of device names"):
        node.spread([])
    with pytest.raises(ValueError, match="policy"):
        node.spread(["cpu", "cpu"], policy="nope")
    assert set(os.listdir(os.environ["HYDRA_TUNE_NODE_DIR"])) <= before  # no server's socket, log or lock


def test_an_optuna_study_runs_its_trials_on_the_pool():
    optuna = pytest.importorskip("optuna")
    lrs = {0: 0.01, 1: 0.05, 2: 0.1}

    def objective(trial):
        lr = lrs[trial.number]
        task = ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=lr), _data(trial.number),
                            eval_data=_data(99), loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2,
                            seed=trial.number)
        for m in ht.train(task):
            trial.report(m["eval_loss"], m["epoch"])
        return m["eval_loss"]
    with _spread(["cpu", "cpu"]) as pool:
        study = ht.optuna_study(runtime=pool, direction="minimize")
        study.optimize(objective, n_trials=3, n_jobs=2)
        served = {t.number: t.value for t in study.trials}
        assert sum(len(s["tasks"]) for s in pool.stats()["servers"]) >= 3
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    with ht.Runtime(devices=["cpu"]) as rt:
        for number, lr in lrs.items():
            task = ht.ModelTask(_mlp, lambda m, lr=lr: torch.optim.SGD(m.parameters(), lr=lr), _data(number),
                                eval_data=_data(99), loss=lambda out, b: F.mse_loss(out, b[1]), epochs=2,
                                seed=number)
            assert served[number] == rt.submit(task).result()["eval_loss"]


def _lr_objective(lrs: dict[int, float]):
    def objective(trial):
        lr = lrs[trial.number]   # (the factories ship to a server: they capture no trial, whose study holds locks)
        task = ht.ModelTask(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=lr),
                            _data(trial.number), eval_data=_data(99), loss=lambda out, b: F.mse_loss(out, b[1]),
                            epochs=2, seed=trial.number)
        for m in ht.train(task):
            trial.report(m["eval_loss"], m["epoch"])
        return m["eval_loss"]
    return objective


def test_a_study_with_share_spread_trains_on_a_server_per_device_and_lets_them_go():
    pytest.importorskip("optuna")
    lrs = {0: 0.01, 1: 0.05, 2: 0.1, 3: 0.2}
    study = ht.optuna_study(share="spread", devices=["cpu", "cpu"], device_memory="9MiB", direction="minimize")
    pool = study.runtime
    _PIDS.extend(n.pid for n in pool.nodes)
    try:
        assert isinstance(pool, node.NodePool) and len({n.pid for n in pool.nodes}) == 2
        assert study.concurrency == 4   # trials_per_device (2) x 2 servers of one device each
        study.optimize(_lr_objective(lrs), n_trials=4)
        served = {t.number: t.value for t in study.trials}
        assert [len(s["tasks"]) > 0 for s in pool.stats()["servers"]] == [True, True]
    finally:
        study.close()
    with pytest.raises(RuntimeClosed):
        pool.submit(_task(0))   # the study made the pool: closing it let go of every server
    study = ht.optuna_study(share="process", devices=["cpu", "cpu"], device_memory="9MiB", direction="minimize")
    with study:
        study.optimize(_lr_objective(lrs), n_trials=4)
        assert {t.number: t.value for t in study.trials} == served


def test_a_prepared_model_in_a_spread_study_trains_here_and_says_so():
    optuna = pytest.importorskip("optuna")
    from test_prepare_exactness import _diff
    from test_prepare_streams import seeded_trial

    want, got = seeded_trial(5), {}
    study = ht.optuna_study(share="spread", devices=["cpu"], device_memory="24KiB",
                            sampler=optuna.samplers.RandomSampler(seed=0))
    _PIDS.extend(n.pid for n in study.runtime.nodes)
    try:
        def objective(trial):
            got["result"] = seeded_trial(5, ht.prepare)
            return 0.0
        with pytest.warns(RuntimeWarning, match=r"a node server per device \(share='spread'\)"):
            study.optimize(objective, n_trials=1, n_jobs=1)
    finally:
        study.close()
    assert _diff(want[0], got["result"][0]) == 0.0 and want[1] == got["result"][1]


def test_spread_takes_a_runtime_config_whole():
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], device_memory="7MiB", residency="off", history=10)
    one = dataclasses.replace(config, devices=["cpu"])
    with _spread(config=config) as pool:
        for i in range(2):  # each server is the one of the config with its one device (every setting in its key)
            assert os.path.exists(node.server_files(config=one, slot=f"{i}/2")["socket"])
        assert pool.submit(_task(3)).result()["epoch"] == 2
    with pytest.raises(TypeError, match="either `config=` or `devices`"):
        node.spread(["cpu"], config=config)
    with pytest.raises(ValueError, match="either `config=` or the settings"):
        node.spread(config=config, device_memory="1MiB")
