"""What crosses a shard boundary: the next shard's input leaves, and which of them collect a gradient.

    leaves = CarryLeaves(tensor_leaves(carry)); leaves.collect(needs)   # ShardExec.grad_inputs, a later shard
    ... backward ...; leaves.grads                                       # each input's gradient, as autograd made it
    needs = output_needs(out)                                            # a shard's output: what the next needs

Why: the plain loop has no boundary there. Its next op receives the gradient as autograd made it (a leaf's
``.grad`` is a copy in the leaf's own strides, and some kernels' summation order follows the layout they are
handed: tests/test_carry_layout.py), and a tensor computed from frozen weights alone requires no gradient (its
shard makes none for it, and kernels that choose by ``requires_grad``, the attention fast paths, choose the same:
tests/test_fast_path.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .trees import tensor_leaves


class CarryLeaves(list):
    """A later shard's input carry tensors (``tensor_leaves`` order), the floating ones autograd leaves; ``grads``:
    each one's gradient as the backward hands it to the leaf (None: none reached it). Why not ``.grad``: autograd
    copies a leaf's gradient into the leaf's own strides, and the plain loop hands the op before it the gradient in
    the layout it was made in; some kernels' summation order follows that layout (tests/test_carry_layout.py)."""

    __slots__ = ("grads",)

    def __init__(self, tensors: list[Any]) -> None:
        super().__init__(tensors)
        self.grads: list[torch.Tensor | None] = [None] * len(tensors)

    def collect(self, needs: tuple[bool, ...] | None) -> None:
        """Make the floating tensors the plain loop computed a gradient for (``needs``, from ``output_needs``;
        None: every one) leaves that collect it into ``grads``."""
        for i, t in enumerate(self):
            if (isinstance(t, torch.Tensor) and t.is_floating_point()
                    and (needs is None or i >= len(needs) or needs[i])):
                t.requires_grad_(True)
                t.register_hook(functools.partial(_took, self.grads, i))  # (not a method: no cycle through the
                # leaf's hooks, which would keep its device bytes until Python's collector ran)
                t.register_post_accumulate_grad_hook(_drop_grad)  # (its copy in the leaf's strides: unused)


def _took(grads: list[torch.Tensor | None], i: int, grad: torch.Tensor) -> None:
    """Carry leaf ``i``'s tensor hook: its gradient, summed over the backward's calls (one, normally). Kept as a new
    tensor over its storage: the gradient itself keeps one reference, so ``.grad`` takes it over without a copy
    where the layouts agree (and ``_drop_grad`` lets go of the copy where they do not)."""
    held = grads[i]
    grads[i] = grad.detach() if held is None else held + grad


def _drop_grad(leaf: torch.Tensor) -> None:
    leaf.grad = None


def output_needs(out: Any) -> tuple[bool, ...]:
    """Which of a shard's output tensors (``tensor_leaves`` order) require a gradient: the next shard's input
    leaves that collect one (``grad_inputs``)."""
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in tensor_leaves(out))
