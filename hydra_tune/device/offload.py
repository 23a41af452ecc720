"""Saved-tensor hooks that send a forward's activations to host memory and bring each back where it came from.

    hooks = Offloader(copier, keep=the shard's parameter copies, pause=lambda: paused_accounting(mode))
    with hooks:                      # torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack) inside
        out = forward(...)           # on exit: every copy out has landed and no source is held any more
    out.backward(g)                  # each saved tensor comes back on its own device, with its own layout

Rules (each one a way the CUDA autograd engine has crashed or could read wrong values):
* Only a tensor on the copier's device (or on ``meta``: a footprint's model), of plain strided layout, not a
  parameter/buffer (``keep``) and holding at
  least ``copier.offload_min_bytes`` bytes is moved. Everything else is returned as it was saved: CPU scalars that
  CUDA kernels read on the host (SDPA's ``philox_seed``/``philox_offset``), other devices' tensors, tiny tensors.
* What moves is the tensor's whole storage, once per storage: the tensor comes back as a view with its dtype,
  storage offset, sizes and strides (a transposed or sliced activation stays so; ``q``, ``k`` and ``v`` viewed
  from one ``qkv`` come back as views of one copy, as the forward left them).
* The copy out may run on a side stream: the source is held (and recorded on that stream) until its event has
  completed, and the copy back waits for that event before it reads the host buffer.
* ``keep`` names the shard's parameter and buffer copies by tensor, not by storage id alone: a buffer the forward
  reassigns frees its old copy, and the next activation's storage may take its id (it would stay on the device,
  saved as it is, against the plan).
* A tensor saved as it is goes in detached when it has a graph: a forward's output saved by its own node (ReLU's
  result) would hold that node through the hook's reference, a cycle the garbage collector cannot see, and the
  whole graph (parameter copies included) would outlive a forward whose backward never runs (an out-of-memory
  retry, a cancelled task, a dropped graph).
* A saved tensor changed in place before the backward reads it raises, as plain PyTorch's autograd does (hooks turn
  its version check off): the offloaded copy holds the old values, the tensor the new ones.
* A saved tensor with no autograd history (no ``grad_fn``, no ``requires_grad``: masks, indices, statistics) is
  copied out at the forward's end, not at its save: torch saves an op's arguments before the op runs, and an op that
  fills one of them saves it unfilled, with no version change to tell (``rrelu``'s ``noise``, its random slopes: a
  copy at its save held garbage). Activations with history are copied at once (no op writes those unseen).
"""
from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import rule_error


class _Span:
    """One storage's bytes in host memory: the copy's event, and its source until the event completed."""

    __slots__ = ("host", "event", "source", "device", "version", "users", "on_device")

    def __init__(self, host: torch.Tensor, event: Any, source: torch.Tensor | None, t: torch.Tensor) -> None:
        self.host = host
        self.event = event
        self.source = source  # held until the copy out completed: its bytes must not be reused before
        self.device = t.device
        self.version = t._version  # shared by every view of the storage: a later in-place write changes it
        self.users: list[weakref.ref[torch.Tensor]] = []  # packed tensors over this storage, while alive
        self.on_device: torch.Tensor | None = None  # the copy back, shared by every tensor over this storage


class _Packed:
    """A saved tensor whose storage is in host memory: where and how to rebuild it, and the tensor it was (weakly,
    with its version then: a change in place before the backward is refused)."""

    __slots__ = ("span", "dtype", "offset", "size", "stride", "source", "version")

    def __init__(self, span: _Span | None, t: torch.Tensor, source: weakref.ref[torch.Tensor]) -> None:
        self.span = span  # None until copied out (``Offloader._copy_pending``)
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.source = source
        self.version = t._version


class _AsIs:
    """A saved tensor left where it is (a parameter, a tiny or host tensor), detached (no cycle through its graph),
    with its version when saved."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor, checked: bool) -> None:
        self.tensor = t.detach() if t.grad_fn is not None else t  # (detach shares the version counter)
        # None: not checked (parameter copies are refilled in place by the runtime itself)
        self.version = t._version if checked else None


def _changed_in_place(t: torch.Tensor, version: int) -> Exception:
    return rule_error(
        "a tensor saved for the backward is not changed in place before the backward reads it (plain PyTorch's "
        "autograd raises here too)", "use the out-of-place form of the operation (y = y + 1, not y.add_(1)), or "
        "clone the tensor before changing it", kind=RuntimeError, shape=tuple(t.shape), saved_at_version=version,
        now=t._version)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``t``'s whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _movable(t: torch.Tensor, device: torch.device, min_bytes: int) -> bool:
    # meta: a footprint's model built on the meta device stands for the device's tensors (no bytes to copy)
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and (t.device == device or t.device.type == "meta")
            and not t.is_conj() and not t.is_neg() and t.untyped_storage().nbytes() >= max(min_bytes, 1))


class Offloader:
    """Pack/unpack hooks for one offloading forward; enter it around the forward (see the module's rules)."""

    def __init__(self, copier: Any, keep: Iterable[torch.Tensor] = (),
                 pause: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.copier = copier
        self.device = torch.device(copier.device)
        # storage id -> the copy over it, weakly: an id counts only while its own tensor still lives over it
        self._keep = {t.untyped_storage()._cdata: weakref.ref(t) for t in keep}
        self.pause = pause
        self._spans: dict[int, _Span] = {}  # storage id -> its host copy, while a tensor over it is alive
        self._flying: list[_Span] = []  # spans whose source is still held
        self._held: set[int] = set()  # storages the graph still references as they are (not moved)
        self._pending: list[tuple[torch.Tensor, _Packed]] = []  # saved, to copy out at the end (module rules)

    def references(self, t: torch.Tensor) -> bool:
        """Whether the graph saved a tensor over ``t``'s storage as it is (not moved): its bytes must stay."""
        return t.untyped_storage()._cdata in self._held

    def _keeps(self, key: int) -> bool:
        ref = self._keep.get(key)
        own = ref() if ref is not None else None
        return own is not None and own.untyped_storage()._cdata == key

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage()._cdata
        kept = self._keeps(key)
        if kept or not _movable(t, self.device, self.copier.offload_min_bytes):
            self._held.add(key)
            return _AsIs(t, checked=not kept)
        packed = _Packed(None, t, weakref.ref(t))
        if t.grad_fn is None and not t.requires_grad:  # maybe an argument its op has yet to fill (module rules)
            self._pending.append((t, packed))
        else:
            packed.span = self._span(t)
        return packed

    def _copy_pending(self) -> None:
        pending, self._pending = self._pending, []
        for t, packed in pending:
            packed.span = self._span(t)

    def _span(self, t: torch.Tensor) -> _Span:
        """The host copy of ``t``'s storage: made now, or the one made earlier while unwritten since."""
        key = t.untyped_storage()._cdata
        self._land(wait=False)
        span = self._spans.get(key)
        if span is None or span.version != t._version or not any(
                u() is not None and u().untyped_storage()._cdata == key for u in span.users):
            # new, written since, or every tensor over that storage is gone (its id may name another storage now)
            with self.pause():
                src = _bytes_of(t)
                host, event = self.copier.stash(src)
            span = _Span(host, event, src if event is not None else None, t)
            self._spans[key] = span
            if event is not None:
                self._flying.append(span)
        span.users.append(weakref.ref(t))
        return span

    def unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, _AsIs):
            if x.version is not None and x.tensor._version != x.version:
                raise _changed_in_place(x.tensor, x.version)
            return x.tensor
        source = x.source()
        if source is not None and source._version != x.version:
            raise _changed_in_place(source, x.version)
        if x.span is None:  # (a backward within the forward that saved it: its ops have run)
            self._copy_pending()
        span = x.span
        if span.on_device is None:
            span.on_device = self.copier.unstash(span.host, span.event, span.device)
        return torch.empty(0, dtype=x.dtype, device=span.device).set_(
            span.on_device.untyped_storage(), x.offset, x.size, x.stride)

    def _land(self, wait: bool) -> None:
        """Drop the sources of copies out that completed (all of them, waiting, with ``wait``)."""
        still = []
        for span in self._flying:
            if wait or self.copier.landed(span.event):
                if wait:
                    self.copier.wait_event(span.event)
                span.source = None
            else:
                still.append(span)
        self._flying = still

    def settle(self) -> None:
        """Copy out what waits, wait until every copy out has landed; hold no source and no storage id any more."""
        self._copy_pending()
        self._land(wait=True)
        self._spans.clear()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.settle()

    def __enter__(self) -> Offloader:
        self._cm = self.hooks()
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


RECOMPUTE_ENV = "HYDRA_TUNE_CUDA_RECOMPUTE"


def releases_graphs(device_type: str) -> bool:
    """Whether plans on a device of ``device_type`` may keep or offload a forward's graph for its backward.

        releases_graphs("cuda")   # True, unless HYDRA_TUNE_CUDA_RECOMPUTE=1: every CUDA backward recomputes

    CPU: always. CUDA: yes by default. Offloaded activations come back on the device they came from with their
    layout and after their copy out (device/offload.py: the first CUDA run crashed when CPU-resident SDPA seeds
    were moved to the GPU), and every tensor that crosses streams is recorded on the stream that uses it
    (device/streams.py; both checked on CPU with a recording stand-in). ``HYDRA_TUNE_CUDA_RECOMPUTE=1`` forces
    recompute on CUDA should a GPU still find a problem there (``0`` or unset: keep and offload allowed)."""
    if device_type != "cuda":
        return True
    value = os.environ.get(RECOMPUTE_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise rule_error(f"{RECOMPUTE_ENV} is 0 or 1", f"set {RECOMPUTE_ENV}=1 to make every CUDA plan "
                         "recompute its backward, or unset it", **{RECOMPUTE_ENV: value})
    return value != "1"
