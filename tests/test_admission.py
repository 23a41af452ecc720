"""Host-memory admission: footprints against what tasks really hold, waiting, rejection, cancel and close."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train
from reference import trained as _trained

import hydra_tune as ht
from hydra_tune.errors import RuntimeClosed, TaskCancelled
from hydra_tune.policy.admission import HostAdmission, available_host_memory, host_reserve
from hydra_tune.training.footprint import state_footprint

OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3),
}


def _data(n: int, seed: int = 0, width: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _mse(out, batch):
    return F.mse_loss(out, batch[1])


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _is_meta(model: nn.Module) -> bool:
    return next(model.parameters()).is_meta


def _observed(optimizer, name: str, rt_box: list, seen: dict):
    """The optimizer factory, plus a hook recording after every real step the gradient and optimizer-state bytes
    and the host bytes the runtime reports for the task."""
    def make(m):
        opt = optimizer(m)

        def after_step(o, args, kwargs):
            if _is_meta(m):  # the footprint estimate's own step on the meta model
                return
            seen["grads"] = max(seen.get("grads", 0), _nbytes(p.grad for p in m.parameters() if p.grad is not None))
            seen["optimizer"] = _nbytes(v for st in o.state.values() for v in st.values() if torch.is_tensor(v))
            seen["host"].append(rt_box[0].stats()["tasks"][name]["host_bytes"])

        opt.register_step_post_hook(after_step)
        return opt
    return make


def _observed_loss(loss, name: str, rt_box: list, seen: dict):
    """The loss, recording the task's host bytes while its last shard runs (every boundary carry is held)."""
    def wrapped(out, batch):
        entry = rt_box[0].stats()["tasks"].get(name) if rt_box else None
        if entry is not None and "host_bytes" in entry:  # not while the task is measured at submit
            seen["host"].append(entry["host_bytes"])
        return loss(out, batch) if loss is not None else out.loss
    return wrapped


CASES = [(f"mlp-{k}", _mlp, opt, _mse, _data(3), 18_000) for k, opt in OPTIMIZERS.items()]
CASES.append(("gpt2-adamw", make_gpt2, OPTIMIZERS["adamw"], None, lm_batches(3), "600KiB"))


@pytest.mark.parametrize("name,model,optimizer,loss,data,device_memory", CASES, ids=[c[0] for c in CASES])
def test_footprint_matches_what_the_task_holds(name, model, optimizer, loss, data, device_memory):
    # Parameters, gradients and optimizer state are estimated exactly (the optimizer's state measured by building
    # and stepping it on the meta device); the activations are bounded. Every host-bytes reading the runtime
    # reports while the task trains stays within the footprint less its fixed allowance.
    seen: dict = {"host": []}
    rt_box: list = []
    task = ht.ModelTask(model, _observed(optimizer, name, rt_box, seen), data,
                        loss=_observed_loss(loss, name, rt_box, seen), name=name)
    with ht.Runtime(devices=["cpu"], device_memory=device_memory, host_memory="1GiB") as rt:
        rt_box.append(rt)
        estimate = rt.footprint(task)
        trained = _trained(rt.submit(task))
        stats = rt.stats()["tasks"][name]
    admitted = stats["host_footprint"]  # built at submit: the activations of its own plan
    assert len(stats["shards"]) > 1 and len(seen["host"]) > 3
    params = _nbytes(list(trained.parameters()) + list(trained.buffers()))
    assert estimate.params == admitted["params"] == params
    assert estimate.grads == admitted["grads"] == seen["grads"] == _nbytes(trained.parameters())
    assert estimate.optimizer_measured and estimate.optimizer == admitted["optimizer"] == seen["optimizer"]
    assert admitted["activations"] <= estimate.activations
    assert max(seen["host"]) <= admitted["total"] - admitted["overhead"]
    assert estimate.total == sum(v for k, v in estimate.parts().items() if k != "total")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


BIG_DEVICE = 24 << 20


def _big_task(i: int) -> ht.ModelTask:
    def big():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 4))

    return ht.ModelTask(big, OPTIMIZERS["adamw"], _data(3, seed=i, width=1024), loss=_mse, name=f"big{i}")


def _rss_growth() -> None:
    """In a child process (see the test): print the footprint of a task and the peak growth of the process's
    resident set while it trains, as JSON."""
    import gc
    import json

    torch.set_num_threads(1)
    with ht.Runtime(devices=["cpu"], device_memory=BIG_DEVICE, host_memory="1GiB") as rt:
        rt.submit(_big_task(0)).result()  # the process's one-time costs: BLAS buffers, thread stacks and arenas
        task = _big_task(1)
        estimate = rt.footprint(task)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set (VmHWM) restarts from the current one
        before = _status()["VmRSS"]
        rt.submit(task).result()
        growth = _status()["VmHWM"] - before
    print(json.dumps(dict(estimate.parts(), growth=growth)))


def test_process_memory_grows_by_at_most_the_footprint():
    # The resident set of a process training a task with 67 MB of state (4.2M parameters, AdamW) grows by at most
    # the task's footprint plus its device's budget (a CPU device's memory is host memory too). The child process
    # runs with glibc's mmap threshold fixed at 1 MiB, so freed tensors go back to the system and the resident set
    # follows the live bytes: with the default dynamic threshold, glibc keeps freed blocks in per-thread arenas
    # (the same process then peaked at up to 2x the footprint; see hydra_tune/footprint.py).
    import json
    import os
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "from test_admission import _rss_growth; _rss_growth()"],
                           cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
                           env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), timeout=300)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["params"] + got["grads"] + got["optimizer"] > 64 << 20
    assert got["growth"] <= got["total"] + BIG_DEVICE, got


def _gated(optimizer, gate: threading.Event, builds: list | None = None):
    """The optimizer factory; its first real step waits for ``gate`` (the task cannot end before it opens)."""
    def make(m):
        opt = optimizer(m)
        if not _is_meta(m):
            if builds is not None:
                builds.append(m)
            opt.register_step_pre_hook(lambda o, args, kwargs: None if gate.wait(60) else None)
        return opt
    return make


def _spans(trace) -> dict[str, tuple[float, float]]:
    spans: dict[str, tuple[float, float]] = {}
    for e in trace.units():
        lo, hi = spans.get(e.task, (e.start, e.end))
        spans[e.task] = (min(lo, e.start), max(hi, e.end))
    return spans


def test_only_tasks_that_fit_run_the_rest_wait_in_order_and_all_match_alone():
    gate = threading.Event()
    tasks = [ht.ModelTask(_mlp, _gated(OPTIMIZERS["adamw"], gate), _data(4, seed=i), loss=_mse, epochs=2, seed=i,
                          name=f"t{i}") for i in range(4)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=18_000) as probe:
        one = probe.footprint(tasks[0]).total
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=18_000, host_memory=2 * one + one // 2) as rt:
        handles = [rt.submit(t) for t in tasks]
        host = rt.host_memory()
        assert list(host["admitted"]) == ["t0", "t1"] and list(host["waiting"]) == ["t2", "t3"]
        assert [h.status for h in handles[2:]] == ["queued", "queued"]
        assert rt.stats()["tasks"]["t3"] == {"state": "queued", "waiting_for_host_memory": True,
                                             "host_footprint": rt.footprint(tasks[3]).parts()}
        gate.set()
        models = [_trained(h) for h in handles]
        trace = rt.trace()
        host = rt.host_memory()
    assert host["admitted"] == {} and host["waiting"] == {} and host["admitted_bytes"] == 0
    spans = _spans(trace)
    assert sorted(spans) == ["t0", "t1", "t2", "t3"]
    at_once = max(sum(lo <= t < hi for lo, hi in spans.values()) for t, _ in spans.values())
    assert at_once <= 2, spans
    for task, model in zip(tasks, models):
        ref, _ = plain_train(task)
        assert max_param_diff(model, ref) == 0.0


def test_task_that_could_never_fit_is_rejected_with_its_numbers_and_never_built():
    builds: list = []

    def huge():
        m = nn.Sequential(nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 4))
        if not _is_meta(m):
            builds.append(m)
        return m

    task = ht.ModelTask(huge, OPTIMIZERS["adam"], _data(2), loss=_mse, name="huge")
    with ht.Runtime(devices=["cpu"], device_memory="64MiB", host_memory="16MiB") as rt:
        fp = rt.footprint(task)
        with pytest.raises(ValueError) as err:
            rt.submit(task)
        assert rt.stats()["tasks"] == {} and rt.host_memory()["admitted"] == {}
    assert str(err.value) == (
        f"`task host footprint <= host_memory` must hold, but got (task='huge', footprint={fp.total}, "
        f"params={fp.params}, grads={fp.grads}, optimizer={fp.optimizer}, activations={fp.activations}, "
        f"overhead={fp.overhead}, host_memory={16 << 20}, measured=False). Fix: train a smaller model or smaller "
        "batches, use an optimizer with less state (SGD keeps none, SGD with momentum one copy of the parameters, "
        "Adam two), or give the runtime more host memory (Runtime(host_memory=...), or free memory on the machine).")
    assert fp.optimizer == 2 * fp.params + 3 * 4 * 2  # Adam: two fp32 copies, one step counter per parameter
    assert builds == []


def test_task_whose_activations_tip_it_over_is_rejected_after_its_build():
    # Its parameters, gradients and optimizer state fit the budget (measured on the meta device), so it is built
    # at submit; its plan's activations then do not: the build is dropped and the task rejected, with its numbers.
    builds: list = []
    task = ht.ModelTask(_mlp, _gated(OPTIMIZERS["adam"], threading.Event(), builds), _data(2), loss=_mse,
                        name="tipped")
    state_part = state_footprint(task).total
    with ht.Runtime(devices=["cpu"], device_memory=18_000, host_memory=state_part) as rt:
        fp = rt.footprint(task)
        with pytest.raises(ValueError, match=rf"\(task='tipped', footprint={fp.total}, .*activations="
                                             rf"{fp.activations}, .*host_memory={state_part}, measured=False\)"):
            rt.submit(task)
        assert rt.host_memory()["admitted"] == {} and rt.stats()["tasks"] == {}
    assert fp.total == state_part + fp.activations and len(builds) == 1


def test_cancelling_a_waiting_task_ends_it_unbuilt_and_the_next_one_runs():
    gate = threading.Event()
    builds: dict[str, list] = {"t0": [], "t1": [], "t2": []}
    tasks = [ht.ModelTask(_mlp, _gated(OPTIMIZERS["sgd_momentum"], gate, builds[f"t{i}"]), _data(3, seed=i),
                          loss=_mse, seed=i, name=f"t{i}") for i in range(3)]
    with ht.Runtime(devices=["cpu"], device_memory=18_000, host_memory="5MiB") as rt:
        one = rt.footprint(tasks[0]).total
        assert 5 << 20 < 2 * one  # one task at a time
        h0, h1, h2 = (rt.submit(t) for t in tasks)
        assert list(rt.host_memory()["waiting"]) == ["t1", "t2"]
        h1.cancel()
        assert h1.status == "cancelled" and list(rt.host_memory()["waiting"]) == ["t2"]
        with pytest.raises(TaskCancelled):
            h1.result()
        gate.set()
        h0.result(), h2.result()
        trace = rt.trace()
    assert len(builds["t1"]) == 0 and len(builds["t0"]) == len(builds["t2"]) == 1
    assert "t1" not in trace.tasks()


def test_close_cancels_waiting_tasks_unbuilt():
    builds: list = []
    forever = ht.ModelTask(_mlp, OPTIMIZERS["sgd_momentum"], _data(4), loss=_mse, epochs=100_000, name="forever")
    waiting = [ht.ModelTask(_mlp, _gated(OPTIMIZERS["sgd_momentum"], threading.Event(), builds), _data(2),
                            loss=_mse, name=f"w{i}") for i in range(2)]
    rt = ht.Runtime(devices=["cpu"], device_memory=18_000, host_memory="5MiB")
    first = rt.submit(forever)
    handles = [rt.submit(t) for t in waiting]
    assert [h.status for h in handles] == ["queued", "queued"]
    rt.close()
    for h in [first] + handles:
        assert h.status == "cancelled"
    with pytest.raises(RuntimeClosed, match="the runtime was closed before task 'w0' started"):
        handles[0].result()
    assert builds == []


def test_a_waiting_tasks_build_error_goes_to_its_handle():
    gate = threading.Event()

    def needs_weights():
        m = _mlp()
        if not _is_meta(m):
            raise OSError("weights.pt not found")
        return m

    first = ht.ModelTask(_mlp, _gated(OPTIMIZERS["sgd_momentum"], gate), _data(2), loss=_mse, name="first")
    later = ht.ModelTask(needs_weights, OPTIMIZERS["sgd_momentum"], _data(2), loss=_mse, name="later")
    with ht.Runtime(devices=["cpu"], device_memory=18_000, host_memory="5MiB") as rt:
        h0, h1 = rt.submit(first), rt.submit(later)  # `later` waits: its factory is only run on the meta device
        gate.set()
        h0.result()
        with pytest.raises(OSError, match="building the task's model failed: OSError: weights.pt not found"):
            h1.result()
        assert h1.status == "failed" and rt.host_memory()["admitted"] == {}


def test_measured_host_memory_admits_normal_tasks_at_once():
    task = ht.ModelTask(make_gpt2, OPTIMIZERS["adamw"], lm_batches(2), name="gpt2")
    with ht.Runtime(devices=["cpu"], device_memory="600KiB") as rt:
        host = rt.host_memory()
        handle = rt.submit(task)
        assert rt.host_memory()["waiting"] == {}
        handle.result()
    available, total = available_host_memory()
    assert host["measured"] and 0 < host["budget"] <= available + (1 << 30)
    assert host_reserve(total) == min(max(total // 10, 1 << 30), 8 << 30)


def test_host_memory_argument_is_checked():
    with pytest.raises(ValueError) as err:
        ht.Runtime(devices=["cpu"], host_memory="lots")
    assert str(err.value) == (
        "`host_memory` is None (measured), a positive int or a size string with a unit in B, KB, KiB, MB, MiB, GB, "
        "GiB, TB, TiB must hold, but got (host_memory='lots'). Fix: write e.g. host_memory='16GiB', or None to "
        "measure the available memory.")


def test_admission_rules():
    host = HostAdmission(budget=100)
    assert host.offer("big", 101, 100) == "reject"
    assert host.offer("a", 60, 100) == "admit"
    assert host.offer("b", 50, 100) == "queue"      # 40 free
    assert host.offer("c", 10, 100) == "queue"      # it would fit, but "b" came first: first come, first served
    assert host.next(100) is None
    host.release("a")
    assert host.next(100) == ("admit", "b") and host.next(100) == ("admit", "c")
    with pytest.raises(ValueError, match="task names are unique"):
        host.offer("b", 1, 100)
    # Measured: an admitted task is charged the larger of its footprint and what it holds now.
    assert host.free(100, {"b": 70}) == 100 - 70 - 10
    # A reservation grows once its activations are known, if they fit.
    assert host.resize("c", 40, 100) and not host.resize("c", 51, 100)
    # Capacity that shrank below the head of the queue, with nothing admitted: it can never start.
    host.release("b"), host.release("c")
    assert host.offer("d", 80, 100) == "admit" and host.offer("e", 90, 100) == "queue"
    host.release("d")
    assert host.next(50) == ("reject", "e") and host.waiting == {}
