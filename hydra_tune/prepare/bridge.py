"""The autograd bridge: a prepared model's output joins the user's graph, its backward runs the model's B units.

    outs = Bridge.apply(backward_fn, token, float_leaves)    # outputs that require grad, on the host
    loss = criterion(outs[0], y); loss.backward()            # -> backward_fn(grads): B(K-1)..B0 on the runtime

Why a ``torch.autograd.Function``: the model's forward ran as units on the runtime's devices, outside the user's
graph; the user's loss is computed on the returned tensors in the user's thread. autograd hands the Function's
backward exactly the output gradients the plain loop's backward would carry into the model, so the B units compute
the same parameter gradients (training/shard.py). ``token`` is a scalar leaf that requires grad: it makes the
outputs require grad whatever the inputs are; its gradient is None. Outputs the loss does not use get None (not
zeros): the B unit then skips them, as autograd would.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Bridge(torch.autograd.Function):
    """Identity in the forward; the backward hands the output gradients to ``backward_fn`` (see module doc)."""

    @staticmethod
    def forward(ctx: Any, backward_fn: Callable[[list[torch.Tensor | None]], None], token: torch.Tensor,
                leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        ctx.backward_fn = backward_fn
        ctx.set_materialize_grads(False)
        # new tensors over the carries' storage, not the carries (not inputs either: autograd would make views of
        # returned inputs, and the loop's in-place ops on them, ``logits /= T``, would be refused); ``detach``
        # keeps their version counter, so a unit whose graph saved one still sees the loop's in-place writes
        return tuple(t.detach() for t in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.backward_fn(list(grads))
        return None, None, None


def token() -> torch.Tensor:
    """A fresh leaf that requires grad: the bridge's outputs require grad through it."""
    return torch.zeros((), requires_grad=True)
