"""Host memory of LoRA trials sharing one base (issue 18, second round): admission charges a trial what it holds
once its frozen weights are pooled, and CPU devices read the pooled base in place instead of copying it per unit
(training/shared_frozen.py, training/footprint.py)."""
from __future__ import annotations

import threading
import time

import pytest
from reference import max_param_diff, plain_train, trained
from test_peft_lora import BUDGET, Gated, adamw, batches, distinct_bytes, lora_bert, task, two_equal_frozen_linears

import hydra_tune as ht
from hydra_tune.training.footprint import allowance

pytest.importorskip("peft", reason="PEFT support needs the `peft` extra (pip install hydra_tune[peft])")


def test_admission_charges_lora_trials_their_own_part_not_the_frozen_base_again():
    """The overhead allowance holds one optimizer step's temporaries of the largest *trainable* parameter: a
    frozen embedding larger than every adapter is no part of it (it was charged once per trial before)."""
    go = threading.Event()
    tasks = [task(f"r{r}", r=r, data=Gated(batches(2), go), seed=r, epochs=1) for r in (2, 4, 8)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=BUDGET, host_memory="1GB") as rt:
        handles = [rt.submit(t) for t in tasks]
        admitted = rt.host_memory()
        go.set()
        models = [trained(h) for h in handles]
        stats = rt.stats()
    base = distinct_bytes(lora_bert()())
    own = []
    for t, m in zip(tasks, models):
        trainable = [p.numel() * p.element_size() for p in m.parameters() if p.requires_grad]
        largest_frozen = max(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
        assert largest_frozen > max(trainable)  # else this test could not tell the two apart
        fp = stats["tasks"][t.name]["host_footprint"]
        assert fp["overhead"] == allowance(m) + max(trainable), (t.name, fp)
        assert fp["grads"] == sum(trainable)
        # its parameters, buffers and unpooled frozen ones; gradients; AdamW's state (measured); one minibatch's
        # activations; the allowance for its Python objects and one step's temporaries
        own.append(fp["params"] + fp["grads"] + fp["optimizer"] + fp["activations"] + allowance(m)
                   + max(trainable))
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name
    # the base once (to the pool), each trial what it holds: nothing of the base a second time
    pooled = admitted["admitted"]["(shared frozen weights)"]
    assert base <= pooled < 2 * base
    assert admitted["admitted_bytes"] <= pooled + sum(own), (admitted, base, own)


def test_a_cpu_device_that_cannot_keep_a_copy_reads_the_pooled_base_in_place():
    """Before: a CPU device whose budget share could not keep a pooled tensor's copy made a new one for every
    unit of every trial (host memory and time); now it reads the pooled host tensor itself, bit-exact."""
    # both trials run before either ends: a trial that ended before the other's submit returned (a loaded machine)
    # let its device copies go with it, by design, and the second trial then copied the base once more
    go = threading.Event()
    tasks = [task(f"t{r}", r=r, data=Gated(batches(3), go), epochs=2) for r in (2, 4)]
    base = distinct_bytes(lora_bert()())
    with ht.Runtime(devices=["cpu"], device_memory=BUDGET) as rt:
        handles = [rt.submit(t) for t in tasks]
        go.set()
        models = [trained(h) for h in handles]
        pool = rt.stats()["shared_frozen"]
    copied, aliased = pool["copied_bytes"].get("cpu:0", 0), pool.get("aliased_bytes", {}).get("cpu:0", 0)
    assert copied <= base, pool  # each pooled tensor copied at most once (those its budget share keeps)
    assert aliased > 0, pool
    for t, m in zip(tasks, models):
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name


def test_an_ended_trials_model_its_user_let_go_is_freed_at_once():
    """Before: the runtime's task objects (the loop, its retry closure, the task's state; a shard and its light
    path; a recursive helper's closure) were reference cycles holding an ended trial's model, freed only by
    Python's collector (the pool ran it at trials' ends, ~0.26 s with the GIL held). Now none is left: the model
    goes with its handle, by reference counting, with the collector off."""
    import gc
    import weakref

    go = threading.Event()
    first, second = task("first", epochs=1), task("second", data=Gated(batches(2), go), epochs=1)
    was = gc.isenabled()
    gc.collect()
    gc.disable()  # only reference counting frees anything here
    try:
        with ht.Runtime(devices=["cpu"], device_memory=None) as rt:
            h_first, h_second = rt.submit(first), rt.submit(second)
            model = trained(h_first)
            gone = weakref.ref(model.base_model.model.bert.embeddings.word_embeddings.weight)
            del model, h_first
            deadline = time.monotonic() + 5.0   # the device thread that ended it may still be on its way out
            while gone() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gone() is None
            go.set()
            trained(h_second)
    finally:
        if was:
            gc.enable()


def test_two_cpu_devices_share_one_copy_of_the_pooled_base():
    """CPU devices share one address space: the second takes the first one's kept copy (before: each made and
    kept its own, two copies of the base in host memory beside the pool's)."""
    go = threading.Event()
    tasks = [task(f"t{r}", r=r, data=Gated(batches(3), go), seed=r, epochs=1) for r in (2, 4)]
    base = distinct_bytes(lora_bert()())
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=None) as rt:
        handles = [rt.submit(t) for t in tasks]
        go.set()
        models = [trained(h) for h in handles]
        pool = rt.stats()["shared_frozen"]
    used = set(pool["copied_bytes"]) | set(pool.get("reused_bytes", {}))
    assert used == {"cpu:0", "cpu:1"}, pool   # both devices ran units over the pooled base
    assert sum(pool["copied_bytes"].values()) <= base, pool   # made once, for both
    for t, m in zip(tasks, models):
        assert max_param_diff(plain_train(t)[0], m) == 0.0, t.name


def test_a_unit_writing_into_a_pooled_tensor_a_cpu_device_reads_in_place_fails_visibly():
    """A CPU device with no room to keep a copy reads the pooled host tensor itself: a write into it in place
    (a forward that changes a frozen weight) is refused at the next hand-out and fails every holder, never
    silently trains the others on changed weights."""
    import types

    import torch

    pool, a, b, shares = two_equal_frozen_linears()
    cpu = types.SimpleNamespace(name="cpu:0", torch_device=torch.device("cpu"), budget=0, copier=None)
    seen = pool.device_copy(a.weight, cpu)
    assert seen.data_ptr() == a.weight.data_ptr() == b.weight.data_ptr()  # no copy made
    assert pool.stats()["aliased_bytes"] == {"cpu:0": a.weight.numel() * 4}
    seen.mul_(2.0)   # a unit's forward writes into it
    with pytest.raises(ValueError, match="changes no frozen parameter"):
        pool.device_copy(a.weight, cpu)
    failures = []
    for name in ("a", "b"):
        with pytest.raises(ValueError, match="changes no frozen parameter") as err:
            shares[name].check()
        failures.append(str(err.value))
    assert all("weight" in f for f in failures), failures


def test_a_device_asked_at_once_by_its_two_threads_copies_a_pooled_tensor_once():
    """A device's compute thread and copy thread (prefetching the next unit) may ask for the same pooled tensor
    at the same moment: before, both found no copy and both made one (the base copied twice onto the device,
    ``copied_bytes`` 2x the base in the benchmark); now the second waits for the first's copy."""
    import torch

    from hydra_tune.device.devices import CpuDevice
    from hydra_tune.training.shared_frozen import SharedFrozen

    weight = torch.nn.Parameter(torch.randn(2048, 2048), requires_grad=False)   # 16 MiB: a copy takes a while
    model = torch.nn.Module()
    model.weight = weight
    for attempt in range(4):
        pool, device = SharedFrozen(), CpuDevice(f"cpu:{attempt}", None)
        pool.share("a", model)
        start, got = threading.Barrier(2), []

        def ask():
            start.wait()
            got.append(pool.device_copy(weight, device))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = pool.stats()
        assert got[0] is got[1], attempt
        assert stats["copied_bytes"] == {device.name: weight.numel() * 4}, (attempt, stats)
        assert stats["recopied_bytes"] == {}, stats
        pool.release("a", model)


def _python_bytes_per_task(make, n: int = 3) -> tuple[int, int, dict]:
    """(Python bytes each of ``n`` running tasks holds, measured with tracemalloc while they wait at their second
    batch; the same over their whole run, builds and ends included; one task's footprint). Tensor storages are
    not traced: the footprint counts them exactly, the allowance is for everything else."""
    import gc
    import time
    import tracemalloc

    go = threading.Event()
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=None) as rt:
        trained(rt.submit(make("warm", batches(2))))  # one-time costs: caches, threads, the pool's first base
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            handles = [rt.submit(make(f"t{i}", Gated(batches(3), go))) for i in range(n)]
            while any(rt.stats()["tasks"][h.name].get("steps", 0) < 1 for h in handles):
                time.sleep(0.01)  # each ran its first minibatch and its optimizer step
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            footprint = rt.stats()["tasks"]["t0"]["host_footprint"]
            go.set()
            for h in handles:
                trained(h)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    return held // n, peak // n, footprint


@pytest.mark.parametrize("kind", ["lora", "mlp"])
def test_the_allowance_covers_what_a_task_allocates_beyond_its_tensors(kind):
    """The footprint's allowance (training/footprint.py: a fixed part plus a part per module and tensor) bounds
    the Python objects a running task holds (measured), so admission stays safe with an allowance smaller than
    the 4 MiB it was for every task (LoRA trials: their own bytes are small, their module objects are not)."""
    import torch

    def make(name, data):
        if kind == "lora":
            return task(name, data=data, epochs=1)
        layers = [torch.nn.Linear(16, 16) for _ in range(6)] + [torch.nn.Linear(16, 4)]
        layers[0].requires_grad_(False)  # a frozen first layer: the structural allowance applies
        batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
        data = Gated(batches, data.go) if isinstance(data, Gated) else batches
        return ht.ModelTask(torch.nn.Sequential(*layers), adamw, data, epochs=1, name=name,
                            loss=lambda out, b: torch.nn.functional.mse_loss(out, b[1]))

    held, peak, footprint = _python_bytes_per_task(make)
    assert held <= footprint["overhead"], (held, footprint)
    assert peak <= footprint["overhead"], (peak, footprint)
