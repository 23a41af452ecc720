"""Which frozen tensors the pool of shared weights may take, and how equal ones are found (shared_frozen.py).

    qualifies(p)                        # a frozen host Parameter filling its whole storage
    probe_key(t)                        # (dtype, shape, strides, digest of ~12 KiB sampled): where to look
    same_bytes(a, b)                    # every byte compared: the only test that merges two tensors
    content_key(t)                      # a full BLAKE2b hash (benchmarks compare its cost with probe + compare)

Rules:
* What may be shared: parameters (``nn.Parameter``) with ``requires_grad=False`` when the task is built, in host
  memory, that occupy their whole storage (a view into a larger storage stays the task's own). Never buffers
  (BatchNorm running statistics and the like change during training), never a trainable parameter.
* Equality: two tensors are merged only when their dtype, shape and strides are equal and their bytes are equal,
  compared byte for byte: bases that differ in one value, in one bit (-0.0 vs 0.0, NaN payloads), are never
  merged. The probe only finds candidates (equal tensors have equal probes), so the first task of a base reads
  almost nothing and each later one compares every frozen byte once with the pool's copy (memory speed).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn as nn

_SAMPLES, _SAMPLE, _ENDS = 64, 64, 4096   # a probe reads 64 chunks of 64 bytes plus the first and last 4 KiB


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def qualifies(p: nn.Parameter) -> bool:
    """Whether the pool may take ``p``: frozen, in host memory, a plain Parameter filling its whole storage."""
    return (not p.requires_grad and p.device.type == "cpu" and type(p) is nn.Parameter and p.numel() > 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size() and p.storage_offset() == 0)


def content_key(t: torch.Tensor) -> tuple[Any, ...]:
    """(dtype, shape, strides, BLAKE2b digest of the elements' bytes): equal keys mean bit-equal tensors (what a
    full hash would cost: benchmarks/lora_memory.py compares it with the pool's probe and compare)."""
    digest = hashlib.blake2b(_bytes(t).numpy().data if t.numel() else b"", digest_size=32)
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()), digest.hexdigest())


def probe_key(t: torch.Tensor) -> tuple[Any, ...]:
    """(dtype, shape, strides, digest of a sample of the bytes): where to look for an equal tensor (equal
    tensors have equal probes; candidates are then compared byte for byte)."""
    b = _bytes(t)
    n = b.numel()
    if n > 2 * _ENDS + _SAMPLES * _SAMPLE:
        starts = torch.linspace(_ENDS, n - _ENDS - _SAMPLE, _SAMPLES).long().tolist()
        b = torch.cat([b[:_ENDS], b[-_ENDS:]] + [b[i:i + _SAMPLE] for i in starts])
    digest = hashlib.blake2b(b.numpy().tobytes(), digest_size=16).hexdigest()
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()), digest)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (equal dtype, shape and strides) hold the same bytes: -0.0 and 0.0 differ, equal
    NaN payloads are equal."""
    x, y = _bytes(a), _bytes(b)
    for wide, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):  # ~10x faster than bytewise
        if x.numel() % size == 0:
            return torch.equal(x.view(wide), y.view(wide))  # integer views: bits compared, not values
    return torch.equal(x, y)
