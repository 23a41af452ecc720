"""Offloaded activations come back where they came from (issue 17, part 1).

A CPU stand-in that tells devices apart: a copier whose "device" is ``meta`` (host memory is the CPU), so a tensor
that comes back on the wrong device, with other strides or another storage offset is seen at once; values are
covered by the exactness tests below (plain loop vs offloaded shards, max abs diff 0.0) and test_state_exactness.
"""
from __future__ import annotations

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, run_in_mode, smallest_plan

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.streams import HostCopier
from hydra_tune.training.residency import offloading


class MetaCopier(HostCopier):
    """A copier whose device is ``meta``: copies out land on the CPU (the host), copies in on ``meta``."""

    def __init__(self, min_bytes: int = 0) -> None:
        super().__init__(torch.device("meta"))
        self.offload_min_bytes = min_bytes

    def to_device(self, t: torch.Tensor, what: str = "activations") -> torch.Tensor:
        self._count(t, "h2d", what)
        return t.detach().to("meta")

    def to_host(self, t: torch.Tensor, wait: bool = True, what: str = "activations") -> torch.Tensor:
        self._count(t, "d2h", what)
        return torch.empty_like(t, device="cpu") if t.device.type == "meta" else t.detach().clone()

    def stash(self, src: torch.Tensor) -> tuple[torch.Tensor, None]:
        self._count(src, "d2h")
        return torch.empty(src.shape, dtype=torch.uint8), None  # meta has no values to copy


class Saves(torch.autograd.Function):
    """Saves the given tensors for backward and reports how they came back (device, layout, identity)."""

    seen: list[tuple[torch.device, tuple[int, ...], tuple[int, ...], int, int]] = []

    @staticmethod
    def forward(ctx, x, *saved):  # type: ignore[override]
        ctx.save_for_backward(*saved)
        return x * 1

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        Saves.seen = [(t.device, tuple(t.shape), t.stride(), t.storage_offset(), id(t)) for t in ctx.saved_tensors]
        return (g,) + (None,) * len(ctx.saved_tensors)


def _device(min_bytes: int = 0) -> CpuDevice:
    dev = CpuDevice("cpu:0", None)
    dev.copier = MetaCopier(min_bytes)
    return dev


def test_unpack_restores_device_layout_and_leaves_host_and_tiny_tensors_alone():
    dev = _device(min_bytes=64)
    base = torch.empty(32, 48, device="meta")
    qkv = torch.empty(4, 8, 96, device="meta")
    saved = [
        base.t(),                       # dense, not contiguous: strides (1, 48)
        base[3:, ::2],                  # gaps and an offset
        qkv[..., :32], qkv[..., 32:64],  # two views of one storage (SDPA's q and k): one copy
        torch.tensor(1234, dtype=torch.int64),  # a CPU scalar read on the host (SDPA's philox seed)
        torch.empty(4, device="meta"),  # 16 bytes: under the copier's threshold
    ]
    x = torch.empty(2, device="meta", requires_grad=True)
    with offloading(dev, {}, None):
        y = Saves.apply(x, *saved)
    moved = dev.copier.counts.snapshot()
    y.sum().backward()
    got = Saves.seen
    for t, (device, shape, stride, offset, _) in zip(saved, got):
        assert (device, shape, stride, offset) == (t.device, tuple(t.shape), t.stride(), t.storage_offset())
    assert got[4][4] == id(saved[4]), "a CPU tensor saved on a device's forward was copied"
    assert got[5][4] == id(saved[5]), "a tensor under offload_min_bytes was copied"
    storages = base.untyped_storage().nbytes() + qkv.untyped_storage().nbytes()
    assert moved["d2h"]["activations"] == storages, moved  # each storage once: q and k share one copy


def test_parameters_stay_referenced():
    dev = _device()
    w = torch.empty(16, 16, device="meta")
    x = torch.empty(2, device="meta", requires_grad=True)
    with offloading(dev, {1: w}, None):
        y = Saves.apply(x, w.t())
    y.sum().backward()
    assert Saves.seen[0][4] != 0 and Saves.seen[0][2] == (1, 16)


def _gpt_task() -> ht.ModelTask:
    return ht.ModelTask(lambda: make_gpt2(n_layer=3), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        lm_batches(2), seed=3)


def test_offloaded_gpt2_with_dropout_matches_plain_loop():
    task = _gpt_task()
    ref, _ = plain_train(task)
    state = smallest_plan(task)  # the most shards
    assert len(state.execs) >= 3, state.plan
    device = run_in_mode(state, "offload")
    assert device.account.current == 0
    assert max_param_diff(ref, state.model) == 0.0


def test_an_argument_its_op_fills_after_saving_it_comes_back_filled():
    # torch saves rrelu's `noise` before the op writes its random slopes into it, with no version change: copied
    # out at its save, it came back as garbage (a sharded RReLU model trained to NaN, or silently 4.6e30 off)
    x = torch.randn(64, 32, requires_grad=True)
    torch.manual_seed(1)
    want, = torch.autograd.grad(torch.nn.functional.rrelu(x, training=True).sum(), x)
    with offloading(_host_device(), {}, None):
        torch.manual_seed(1)
        out = torch.nn.functional.rrelu(x, training=True)
    got, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(want, got)


def test_offloaded_rrelu_model_matches_plain_loop(monkeypatch):
    from hydra_tune.policy import partition

    monkeypatch.setattr(partition, "choose_offload", lambda shards, keep, bandwidth: tuple(
        i < len(shards) - 1 for i in range(len(shards))))   # every shard but the last offloads

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.RReLU(), torch.nn.Linear(64, 64),
                                   torch.nn.RReLU(), torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(4)]
    task = ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, seed=3, epochs=2,
                        loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]), nonfinite_loss="ignore")
    ref, _ = plain_train(task)
    with ht.Runtime(devices=["cpu"], device_memory="130KiB") as rt:
        handle = rt.submit(task)
        handle.result()
        offloaded = rt.stats()["tasks"][task.name]["offloaded"]
    assert offloaded
    assert max_param_diff(ref, handle.model()) == 0.0


def test_footprint_on_meta_offloads_as_the_real_profile_does():
    # The admission footprint profiles the model built on the meta device: its offloading forward must move the
    # same activations as the real one (meta stands for the device), so both predict the same offload peaks.
    from hydra_tune.stages import extract_stages
    from hydra_tune.training.profile import measure_costs

    batch = lm_batches(1)[0]
    real_cut = extract_stages(make_gpt2(n_layer=2, n_embd=40))
    with torch.device("meta"):
        meta_cut = extract_stages(make_gpt2(n_layer=2, n_embd=40))
    real = measure_costs(real_cut, batch)
    meta = measure_costs(meta_cut, meta_cut.meta_batch(batch))
    assert [(c.off_fwd_peak, c.off_bwd_peak) for c in meta] == [(c.off_fwd_peak, c.off_bwd_peak) for c in real]


# -- what the hooks hold: nothing past an abandoned forward, no stale parameter ids, versions checked ------------
def _host_device(min_bytes: int = 0) -> CpuDevice:
    dev = CpuDevice("cpu:0", None)
    dev.copier.offload_min_bytes = min_bytes
    return dev


def test_an_abandoned_forward_with_outputs_saved_as_they_are_is_freed():
    # Nothing is moved (threshold above every tensor): ReLU's and tanh's results are saved as they are. Returned
    # undetached, each would hold its own node through the hook's reference: a cycle the collector cannot see.
    import gc
    import weakref

    dev = _host_device(min_bytes=1 << 30)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with offloading(dev, {1: w}, None):
        hidden = torch.relu(x @ w.t())
        out = torch.tanh(hidden * 2)
    inside = weakref.ref(hidden)
    del hidden, out  # the backward never runs (an out-of-memory retry, a cancelled task)
    gc.collect()
    assert inside() is None, "the abandoned forward's graph outlived its output"


def test_a_storage_id_no_copy_lives_over_any_more_is_not_kept_in_place():
    # ``keep`` names copies by tensor: a storage id counts while its own copy still lives over it. A forward that
    # reassigns a buffer frees the old copy, and the next activation's storage may take its id (the allocator's
    # reuse, which a test cannot force); a copy moved to other bytes stands for that here, deterministically.
    dev = _host_device()
    buffer = torch.zeros(16)
    hooks = offloading(dev, {1: buffer}, None)
    act = torch.empty(0).set_(buffer.untyped_storage())  # an activation over the storage id the buffer had
    buffer.set_(torch.zeros(16).untyped_storage())        # the buffer's copy is elsewhere now
    act.copy_(torch.randn(16))
    with hooks:
        packed = hooks.pack(act)
    assert not hooks.references(act), "an activation was saved in place as if it were the buffer"
    assert dev.copier.counts.snapshot()["d2h"]["activations"] == act.untyped_storage().nbytes()
    assert torch.equal(hooks.unpack(packed), act)


@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["moved", "in-place"])
def test_a_saved_tensor_changed_in_place_before_the_backward_raises_as_plain_autograd_does(min_bytes):
    x = torch.randn(6, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = x.exp()
        y.add_(1)
        y.sum().backward()
    with offloading(_host_device(min_bytes), {}, None):
        y = x.exp()  # exp saves its result
    y.add_(1)
    with pytest.raises(RuntimeError, match=r"not changed in place before the backward reads it.*now=1"):
        y.sum().backward()
