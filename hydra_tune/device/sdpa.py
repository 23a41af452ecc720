"""CPU attention with dropout drawn from a task's generator, in the aten calls torch's own math attention makes.

    out = routed_sdpa(args, kwargs, generator)    # F.scaled_dot_product_attention's arguments; None: not this case

Why: on a CPU device, ``F.scaled_dot_product_attention`` with dropout draws from torch's global generator inside
one C++ call, so the light router (dispatch.RandomRouter) runs the whole call under the dispatch mode that gives
the draw the task's generator: each of its ~25 aten ops then goes through Python, and a GPT-2 step on a CPU device
made 2.3x the plain loop's Python calls, most of them there (benchmarks/gpt2_calls.py). With dropout, torch's CPU
attention is the math path (its fused CPU kernel takes no dropout): scale ``q`` and ``k`` by the square root of the
softmax scale, ``q @ k^T``, add the mask (a boolean one, or ``is_causal``'s, made ``0``/``-inf`` first), the safe
softmax, torch's CPU dropout (``dropout.py``'s four calls) and ``@ v``. Making the same calls with the task's
generator draws the same numbers, computes the same values and records the same graph for autograd.

Rule (nothing silently wrong): a kind of call (mask none, boolean or float; causal; scale given; dtype) is taken
only once this process has checked, for that kind, that the short form makes the aten calls torch's own attention
makes, in the same order, and that both give bit-identical outputs and input gradients and leave the generator in
the same state (``matches_torch``); a kind that differs keeps the dispatch mode's path. Only plain strided CPU
tensors of one floating dtype, ``0 < dropout_p < 1``, no ``enable_gqa``, with torch's math attention enabled.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from . import dropout

SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_verdicts: dict[tuple[Any, ...], bool] = {}  # kind of call -> whether the short form matches torch's there
_lock = threading.Lock()


def routed_sdpa(args: tuple, kwargs: dict, generator: torch.Generator) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` drawing its dropout from ``generator``, or None when
    the call is not a case the short form takes (the caller routes it the general way)."""
    if len(args) > len(_NAMES) or any(k not in _NAMES for k in kwargs):
        return None
    call = {**dict(zip(_NAMES, args)), **kwargs}
    q, k, v, mask = call.get("query"), call.get("key"), call.get("value"), call.get("attn_mask")
    p, causal, scale = call.get("dropout_p", 0.0), call.get("is_causal", False), call.get("scale")
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if (any(type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout is not torch.strided
            for t in tensors) or call.get("enable_gqa", False) or type(p) not in (float, int) or not 0 < p < 1
            or type(causal) is not bool or (causal and mask is not None) or not (scale is None or type(scale) is float)
            or not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype or q.dim() < 2
            or (mask is not None and mask.dtype not in (torch.bool, q.dtype))
            or not torch.backends.cuda.math_sdp_enabled()):  # (the switch torch's CPU attention obeys too)
        return None
    kind = ("none" if mask is None else "bool" if mask.dtype == torch.bool else "float", causal, scale is None,
            q.dtype)
    if not matches_torch(kind):
        return None
    return _sdpa(q, k, v, mask, float(p), causal, scale, generator)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float, causal: bool,
          scale: float | None, generator: torch.Generator) -> torch.Tensor:
    if mask is not None and mask.dtype == torch.bool:  # (torch converts a boolean mask before the math path)
        mask = _additive(mask, q.dtype)
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    query = torch.ops.aten.mul.Scalar(q, factor)
    if causal:
        mask = _additive(torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(), q.dtype)
    attn = torch.matmul(query, torch.ops.aten.mul.Scalar(k.transpose(-2, -1), factor))
    if mask is not None:
        attn = attn.add(mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    return torch.matmul(dropout.dropped(attn, p, generator), v)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the one torch adds: 0 where it attends, -inf elsewhere."""
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(-math.inf, dtype=dtype))


def matches_torch(kind: tuple[Any, ...]) -> bool:
    """Whether the short form equals torch's attention for this kind of call (checked once per kind, in a thread of
    its own: its first call may come from inside a unit, whose modes are thread-local; dropout.py says why)."""
    verdict = _verdicts.get(kind)
    if verdict is None:
        with _lock:
            verdict = _verdicts.get(kind)
            if verdict is None:
                verdict = _verdicts[kind] = dropout.in_fresh_thread(lambda: _check(*kind), "hydra-sdpa-check")
    return verdict


def _check(mask_kind: str, causal: bool, no_scale: bool, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(20261204)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = None if mask_kind == "none" else torch.rand(7, 7, generator=g) > 0.3 if mask_kind == "bool" else \
        torch.randn(2, 1, 7, 7, generator=g).to(dtype)
    scale = None if no_scale else 0.3
    theirs, ours = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    with dropout.Recorded(theirs) as torch_calls:  # torch's own attention, its random op given the generator
        expected = SDPA(q, k, v, attn_mask=mask, dropout_p=0.2, is_causal=causal, scale=scale)
    with dropout.Recorded(ours) as our_calls:
        got = _sdpa(q, k, v, mask, 0.2, causal, scale, ours)
    grads_expected = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    grads_got = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    # the same aten calls in the same order (so any shapes and strides compute alike), and the same numbers here
    return (_calls(torch_calls.ops) == _calls(our_calls.ops) and torch.equal(expected, got)
            and all(torch.equal(a, b) for a, b in zip(grads_expected, grads_got))
            and torch.equal(theirs.get_state(), ours.get_state()))


def _calls(ops: list[str]) -> list[str]:
    """Aten calls as compared: autograd's detaches left out, and a Python number's division (a wrapped scalar
    tensor: ``div_.Tensor``) the same as ATen's ``div_.Scalar``."""
    return [op.replace("div_.Tensor", "div_.Scalar") for op in ops if op != "aten.detach.default"]
