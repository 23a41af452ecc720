"""The CUDA copier's stream rules, checked on CPU (issue 17, part 2): the keep path (``release`` = resize_(0),
``refill`` from the copy thread) and the offload copies run the CUDA copier's own code over a recording stand-in
for ``torch.cuda`` (streams, events, ``record_stream``), and a whole training in keep and offload mode through it
still matches the plain loop bit for bit.

Rules checked: a tensor made on the copy stream and used by the compute stream is recorded on the compute stream;
a released block is recorded on the stream that last used it before it goes back to the allocator; every copy
the compute stream reads is joined by an event it waits on, or the copy stream was waited for by the host first;
an activation's copy out holds its source (recorded on the copy stream) until its event completed, and its copy
back waits for that event.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import lm_batches, make_gpt2
from reference import max_param_diff, plain_train, run_in_mode, smallest_plan

import hydra_tune as ht
from hydra_tune.device.devices import CpuDevice
from hydra_tune.device.offload import RECOMPUTE_ENV, releases_graphs
from hydra_tune.device.offload import Offloader
from hydra_tune.device.streams import CudaCopier


class Event:
    def __init__(self, log: list) -> None:
        self.log, self.stream, self.done = log, None, False

    def record(self, stream: Stream) -> None:
        self.stream = stream.name
        self.log.append(("event", stream.name, self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
        self.log.append(("host-waits-event", self.stream, self))


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, ev: Event) -> None:
        self.log.append(("wait", self.name, ev))

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait-stream", self.name, other.name))

    def synchronize(self) -> None:
        self.log.append(("host-waits", self.name))


class RecordingStreams:
    """``CudaStreams`` on CPU: one compute stream, new side streams named copy, out, ...; everything logged."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = Stream("compute", self.log)
        self.active = self.compute
        self._names = iter(["copy", "out"])

    def new_stream(self) -> Stream:
        return Stream(next(self._names), self.log)

    def current(self) -> Stream:
        return self.active

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        outer, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = outer

    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> Event:
        return Event(self.log)

    def pinned(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)  # CPU: strides of a dense tensor kept, others contiguous (the rule)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False

    def record(self, t: torch.Tensor, stream: Stream) -> None:
        self.log.append(("record", t.untyped_storage()._cdata, stream.name))

    def recorded(self, t: torch.Tensor, stream: str) -> bool:
        return ("record", t.untyped_storage()._cdata, stream) in self.log

    def unjoined(self) -> list[Event]:
        """Copy-stream events the compute stream never waited on and the host did not wait past either."""
        out = []
        for i, entry in enumerate(self.log):
            if entry[0] == "event" and entry[1] == "copy":
                later = self.log[i + 1:]
                if ("wait", "compute", entry[2]) not in later and ("host-waits", "copy") not in later:
                    out.append(entry[2])
        return out


def _copier() -> tuple[CudaCopier, RecordingStreams]:
    rec = RecordingStreams()
    return CudaCopier(torch.device("cpu"), rec), rec


def test_refill_from_the_copy_thread_is_recorded_and_joined():
    copier, rec = _copier()
    host = torch.arange(12.0).reshape(3, 4)
    dev = copier.to_device(host, "state")
    assert rec.recorded(dev, "compute") and rec.unjoined() == []
    kept = dev.t()  # autograd's saved reference: a view of the released storage
    version = kept._version
    copier.release(dev)
    assert rec.recorded(dev, "compute") and dev.untyped_storage().nbytes() == 0
    with copier.deferred():  # the copy thread, ahead of the B unit
        copier.refill(dev, host)
    assert rec.log[-1][0] == "record" and rec.recorded(dev, "compute")
    waits = [e for e in rec.log if e[0] == "wait" and e[1] == "compute"]
    copier.wait_prefetched()  # the B unit starts: the compute stream waits for the refill
    assert [e for e in rec.log if e[0] == "wait" and e[1] == "compute"] != waits and rec.unjoined() == []
    assert torch.equal(kept, host.t()) and kept._version == version  # the saved view: values back, version kept


def test_offload_copy_out_holds_its_source_until_its_event_and_the_copy_back_waits_for_it():
    copier, rec = _copier()
    x = torch.randn(64, 32, requires_grad=True) * 1.0   # an activation (with history): copied out at its save
    src = x.t()
    hooks = Offloader(copier)
    packed = hooks.pack(src)
    ev = next(e[2] for e in rec.log if e[0] == "event" and e[1] == "out")
    assert ("wait-stream", "out", "compute") in rec.log and rec.recorded(src, "out")
    assert packed.span.source is not None, "the source was let go before its copy out completed"
    ev.done = True
    hooks.pack(torch.randn(300, requires_grad=True) * 1.0)  # any later pack lets landed sources go
    assert packed.span.source is None
    back = hooks.unpack(packed)
    assert ("wait", "compute", ev) in rec.log
    assert back.stride() == src.stride() and torch.equal(back, src.detach())
    hooks.settle()
    assert all(s.source is None for s in hooks._flying) and hooks._flying == []


def _gpt_task() -> ht.ModelTask:
    return ht.ModelTask(lambda: make_gpt2(n_layer=3), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        lm_batches(2), seed=5)


@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_training_through_the_cuda_copier_matches_plain_loop(mode):
    task = _gpt_task()
    ref, _ = plain_train(task)
    state = smallest_plan(task)  # the most shards
    assert len(state.execs) >= 3, state.plan
    device = CpuDevice("cpu:0", None)
    device.copier, rec = _copier()
    run_in_mode(state, mode, device)
    assert max_param_diff(ref, state.model) == 0.0
    assert rec.unjoined() == []
    released = [e for e in rec.log if e[0] == "record" and e[2] == "compute"]
    assert released, "nothing crossed from the copy stream to the compute stream"
    if mode == "offload":
        outs = sum(1 for e in rec.log if e[0] == "event" and e[1] == "out")
        waited = {id(e[2]) for e in rec.log if e[0] in ("wait", "host-waits-event") and e[2].stream == "out"}
        assert outs > 0 and len(waited) == outs  # every copy out was waited for (settle, or its copy back)


def test_cuda_releases_graphs_by_default_and_the_switch_forces_recompute(monkeypatch):
    monkeypatch.delenv(RECOMPUTE_ENV, raising=False)
    assert releases_graphs("cuda") and releases_graphs("cpu")
    monkeypatch.setenv(RECOMPUTE_ENV, "1")
    assert not releases_graphs("cuda") and releases_graphs("cpu")
    monkeypatch.setenv(RECOMPUTE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{RECOMPUTE_ENV} is 0 or 1 must hold"):
        releases_graphs("cuda")


def test_copies_out_keep_a_dense_layout():
    from hydra_tune.device.streams import _dense

    x = torch.randn(6, 4)
    assert _dense(x) and _dense(x.t()) and _dense(x.permute(1, 0)[None]) and not _dense(x[:, ::2])
    assert not _dense(x[:, :1].expand(6, 3)) and _dense(torch.randn(3, 1, 5)[:, :, :])
    copier, _ = _copier()
    back = copier.to_host(x.t())  # a carry copied out, as the next shard's copy in will see it
    assert back.stride() == x.t().stride() and torch.equal(back, x.t())


def test_spread_carries_keep_their_strides_through_the_cuda_copier():
    """A strided slice and a broadcast view come back with their sizes and strides (the span they read copied as
    one run, on the copy stream like any carry): tests/test_carry_layout.py shows why the layout matters."""
    copier, rec = _copier()
    x = torch.arange(32.0).reshape(4, 8)
    for view in (x[:, ::2], x[:, :1].expand(4, 8), x[1:, 2:5]):
        dev = copier.to_device(view)
        back = copier.to_host(dev)
        assert dev.stride() == back.stride() == view.stride()
        assert torch.equal(dev, view) and torch.equal(back, view) and dev.data_ptr() != view.data_ptr()
        assert rec.recorded(dev, "compute")
