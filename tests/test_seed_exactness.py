"""``torch.manual_seed`` and torch's other seeding functions, called by a task's own code (its model, optimizer and
data factories, its forward), seed the task's stream as the plain loop's call seeds the global generator (CPU fp32:
max abs parameter difference 0.0); calls from any other thread, and a forked DataLoader worker's, are torch's own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, run_in_mode, trained
from torch.utils.data import DataLoader, TensorDataset

import hydra_tune as ht
from hydra_tune.device import seeding
from hydra_tune.device.rng import TaskRNG
from hydra_tune.training.state import TaskState

from torch import manual_seed as manual_seed_bound_after_import  # noqa: E402,I001  (bound to hydra_tune's wrapper)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.2),
                         nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.1), nn.Linear(32, 2))


def _batches(n: int = 6) -> list:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _mse(out: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(out, batch[1])


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _task(model, optimizer=_sgd, data=None, **kw) -> ht.ModelTask:
    return ht.ModelTask(model, optimizer, _batches() if data is None else data, loss=_mse, epochs=2, seed=5, **kw)


def _hydra(task: ht.ModelTask, device_memory: int | None = None) -> nn.Module:
    with ht.Runtime(devices=["cpu"], device_memory=device_memory) as rt:
        return trained(rt.submit(task))


def _diff(make_task, device_memory: int | None = None) -> float:
    plain, _ = plain_train(make_task())
    return max_param_diff(plain, _hydra(make_task(), device_memory))


# -- factories ------------------------------------------------------------------------------------------------
def _seeded_by(seed_call):
    def make() -> nn.Module:
        seed_call()
        return _mlp()
    return make


SEED_CALLS = {
    "torch.manual_seed": lambda: torch.manual_seed(123),
    "torch.random.manual_seed": lambda: torch.random.manual_seed(123),
    "from torch import manual_seed (after import hydra_tune)": lambda: manual_seed_bound_after_import(123),
    "negative seed": lambda: torch.manual_seed(-7),
    "set_rng_state(get_rng_state of a fresh generator)":
        lambda: torch.set_rng_state(torch.Generator().manual_seed(123).get_state()),
    "transformers.set_seed": lambda: __import__("transformers").set_seed(123),
    "cuda seeds (nothing on CPU)": lambda: (torch.cuda.manual_seed_all(99), torch.cuda.manual_seed(98),
                                            torch.cuda.seed(), torch.cuda.seed_all()),
}


@pytest.mark.parametrize("call", list(SEED_CALLS), ids=list(SEED_CALLS))
def test_model_factory_that_seeds_trains_as_the_plain_loop(call):
    if call.startswith("transformers"):
        pytest.importorskip("transformers")   # compat.sh's cell torch-low has none (no release imports on torch 2.4)
    # Before: the call reseeded torch's global generator, which the task does not read (max diff 0.49)
    assert _diff(lambda: _task(_seeded_by(SEED_CALLS[call]))) == 0.0


def test_the_factory_seed_reaches_the_dropout_of_every_shard_and_backward_mode():
    make = lambda: _task(_seeded_by(lambda: torch.manual_seed(123)), name="sharded")  # noqa: E731
    plain, _ = plain_train(make())
    assert _diff(make, device_memory=15_000) == 0.0   # cut into shards, one device
    for mode in ("recompute", "keep", "offload"):
        state = TaskState.build(make(), budget=15_000)
        assert len(state.execs) > 1
        run_in_mode(state, mode)
        assert max_param_diff(plain, state.model) == 0.0, mode


def test_rng_state_calls_and_fork_rng_in_a_factory():
    def make() -> nn.Module:
        state = torch.get_rng_state()
        first = nn.Linear(8, 8)
        torch.set_rng_state(state)              # the second layer starts as the first (the plain loop's global)
        second = nn.Linear(8, 8)
        with torch.random.fork_rng():           # draws inside do not move the stream
            torch.manual_seed(1)
            torch.rand(100)
        assert torch.initial_seed() == 5        # the task's seed, as after the plain loop's manual_seed(5)
        return nn.Sequential(first, nn.Dropout(0.2), second, nn.ReLU(), nn.Linear(8, 2))

    assert _diff(lambda: _task(make)) == 0.0


def test_optimizer_and_data_factories_that_seed():
    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        torch.manual_seed(77)
        return _sgd(m)

    def data() -> DataLoader:   # reseeds before each epoch's shuffling, as the plain loop's call does each epoch
        torch.manual_seed(3)
        x = torch.randn(12, 8)
        return DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=4, shuffle=True)

    assert _diff(lambda: _task(_mlp, optimizer=optimizer, data=data)) == 0.0


class _Reseeding(nn.Module):
    """A forward that seeds: every call draws the same dropout mask, in the plain loop as here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(31)
        return F.dropout(x, 0.5, self.training)


def test_a_forward_that_seeds_in_every_backward_mode():
    def make_model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), _Reseeding(), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.2),
                             nn.Linear(32, 2))

    make = lambda: _task(make_model, name="reseeding-forward")  # noqa: E731
    plain, _ = plain_train(make())
    for mode in ("recompute", "keep", "offload"):
        state = TaskState.build(make(), budget=15_000)
        assert len(state.execs) > 1
        run_in_mode(state, mode)
        assert max_param_diff(plain, state.model) == 0.0, mode


def test_submit_and_training_leave_the_global_generator_alone():
    before = torch.get_rng_state()
    _hydra(_task(_seeded_by(lambda: torch.manual_seed(123))))   # built, profiled, footprint, trained
    assert torch.equal(torch.get_rng_state(), before)


def test_torch_seed_in_a_factory_seeds_the_task_nondeterministically():
    seeds: list[int] = []

    def make() -> nn.Module:
        seeds.append(torch.seed())
        return _mlp()

    before = torch.get_rng_state()
    got = _hydra(_task(make))
    assert torch.equal(torch.get_rng_state(), before)
    seed = seeds[-1]   # the build's call (the footprint estimate calls the factory first, on a scratch stream)
    plain, _ = plain_train(_task(_seeded_by(lambda: torch.manual_seed(seed))))
    assert max_param_diff(plain, got) == 0.0


# -- other threads ----------------------------------------------------------------------------------------------
def test_another_threads_manual_seed_during_a_build_is_its_own():
    seeded, other_done = threading.Event(), threading.Event()
    drawn: list[torch.Tensor] = []

    def make() -> nn.Module:
        torch.manual_seed(123)
        seeded.set()
        assert other_done.wait(30)   # the other thread seeds and draws between this seed and the init
        return _mlp()

    def other() -> None:
        assert seeded.wait(60)
        torch.manual_seed(7)
        drawn.append(torch.rand(5))
        other_done.set()

    plain, _ = plain_train(_task(_seeded_by(lambda: torch.manual_seed(123))))
    t = threading.Thread(target=other, daemon=True)
    t.start()
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = rt.submit(_task(make))
        t.join(60)
        got = trained(handle)
    assert max_param_diff(plain, got) == 0.0
    assert torch.equal(drawn[0], torch.rand(5, generator=torch.Generator().manual_seed(7)))


def test_outside_a_task_the_functions_are_torchs_own():
    assert seeding.current() is None
    g = torch.manual_seed(42)
    assert g is torch.default_generator and torch.initial_seed() == 42
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(42)))
    torch.cuda.manual_seed_all(1)   # CPU-only or not: as torch does it, no error
    torch.cuda.manual_seed(1)


# -- the GPU stream (CPU generators stand in for a GPU's) -----------------------------------------------------
def test_a_seed_outside_gpu_units_is_pending_for_the_next_one():
    rng = TaskRNG(5)
    with seeding.seeding_to(rng):
        torch.manual_seed(-1)                       # torch remaps it to 2**64 - 1: kept exactly
        snap = rng.snapshot()
    stand_in = torch.Generator()
    rng.fork().start_accel(stand_in)
    assert stand_in.initial_seed() == torch.Generator().manual_seed(-1).initial_seed() == 2**64 - 1
    rng.restore(snap)
    with seeding.seeding_to(rng):
        torch.cuda.manual_seed_all(9)
    rng.start_accel(stand_in)
    assert stand_in.initial_seed() == 9
    assert rng.cpu.initial_seed() == 2**64 - 1      # a GPU seed leaves the CPU stream alone, as in torch
    fresh = torch.Generator()
    TaskRNG(5).start_accel(fresh)
    assert fresh.initial_seed() == 5                 # untouched: seeded with the task's seed


def test_inside_a_gpu_unit_only_that_units_generator_is_seeded():
    cpu, unit_gen, other_gen = torch.Generator(), torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    with seeding.seeding_to(seeding.OnDevice(cpu, unit_gen)):
        torch.manual_seed(123)
        torch.cuda.manual_seed_all(124)
    assert (cpu.initial_seed(), unit_gen.initial_seed(), other_gen.initial_seed()) == (123, 124, 2)


# -- processes ----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_seeds_torchs_generator():
    r, w = os.pipe()
    with seeding.seeding_to(seeding.Scratch(torch.Generator())):
        pid = os.fork()
        if pid == 0:  # a DataLoader worker: PyTorch's torch.manual_seed(base_seed + id) is the process's own
            ok = seeding.current() is None
            torch.manual_seed(8)
            ok = ok and torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(8)))
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# A factory calling a `manual_seed` bound before hydra_tune was imported; prints the max parameter diff vs plain.
BOUND_BEFORE_IMPORT = """
from torch import manual_seed          # bound to torch's own function
import torch, hydra_tune as ht
from reference import max_param_diff, plain_train, trained
from test_seed_exactness import _mlp, _task

def make():
    manual_seed(123)
    return _mlp()

with ht.Runtime(devices=["cpu"]) as rt:
    got = trained(rt.submit(_task(make)))
print(max_param_diff(plain_train(_task(make))[0], got))
"""


def test_manual_seed_bound_before_hydra_tune_is_imported():
    assert _run(BOUND_BEFORE_IMPORT) == "0.0"


def test_install_is_once_and_uninstall_gives_torch_its_functions_back():
    assert _run("""
        import torch
        originals = (torch.manual_seed, torch.random.get_rng_state, torch.cuda.manual_seed_all)
        from hydra_tune.device import seeding
        wrapped = (torch.manual_seed, torch.random.get_rng_state, torch.cuda.manual_seed_all)
        assert all(w is not o and w.__wrapped__ is o for w, o in zip(wrapped, originals))
        seeding.install()
        assert (torch.manual_seed, torch.random.get_rng_state, torch.cuda.manual_seed_all) == wrapped
        later = lambda s: wrapped[0](s)    # another library wraps after us: it stays, and reaches ours
        torch.manual_seed = later
        seeding.uninstall()
        assert torch.manual_seed is later and torch.random.get_rng_state is originals[1]
        assert torch.cuda.manual_seed_all is originals[2]
        print("ok")
    """) == "ok"


# -- the optimizer step ---------------------------------------------------------------------------------------------
class _NoisySGD(torch.optim.SGD):
    """Gradient noise: the step draws random numbers (from torch's global generator in the plain loop)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        return super().step(closure)


def test_an_optimizer_step_that_draws_uses_the_tasks_stream():
    def make() -> ht.ModelTask:
        return _task(_mlp, optimizer=lambda m: _NoisySGD(m.parameters(), lr=0.1), grad_accumulation=2)

    before = torch.get_rng_state()
    got = _hydra(make())
    assert torch.equal(torch.get_rng_state(), before)        # before: the noise came from the global generator
    assert max_param_diff(plain_train(make())[0], got) == 0.0   # before: 0.011
