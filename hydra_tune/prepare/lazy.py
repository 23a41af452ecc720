"""The lazy per-shard step of a prepared model: the runtime's (training/lazy.py), with the user's loop zeroing its
gradients and reading its weights while updates are pending.

    lazy = PreparedLazySteps(optimizer, list(model.parameters()), verdict, guard)   # driver.py, per task
    state.home.set_lazy(lazy)
    lazy.hold_grads()       # access.py: optimizer.zero_grad() (set_to_none) while updates are pending

Why a subclass: a ModelTask's loop is ours and never zeroes gradients itself, so its pending update sets them to
None when applied. A prepared loop zeroes them (or not) itself, reads ``p.grad`` and the weights between steps: the
pending step keeps the gradients as the loop left them (``PendingStep.keep_grads``), the loop's ``zero_grad``
holds the ones the updates still need (``hold_grads``: ``.grad`` reads None at once, as in the plain loop), and
every pending parameter is marked for the guard (guard.py) from ``begin`` until its update is applied. A task
whose optimizer holds a parameter of another class than ``nn.Parameter`` cannot be marked: its steps are applied
at once (whole, each shard where its entry is), counted as unsplit steps.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..training.lazy import LazySteps, Where
from ..training.step import LazyVerdict
from .guard import PendingGuard


class PreparedLazySteps(LazySteps):
    """LazySteps for a prepared model (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], verdict: LazyVerdict,
                 guard: PendingGuard) -> None:
        # no scaler and no clipping of ours: the user's loop clips and scales before its optimizer.step()
        super().__init__(optimizer, None, None, params, verdict)
        self.guard = guard

    def reshard(self, shards: Sequence[Sequence[torch.Tensor]], where: Where) -> None:
        super().reshard(shards, where)  # pending updates applied first (our flush)
        if self._pending is not None:
            self._pending.keep_grads()

    def begin(self, where: Where) -> str | None:
        why = super().begin(where)
        pending = self._pending
        if why is not None or pending is None:
            return why
        if not self.guard.markable(p for g in self.optimizer.param_groups for p in g["params"]):
            why = "the optimizer holds a parameter that is not an nn.Parameter: reads of it cannot be checked"
            self.whole_steps += 1
            self.why_whole = why
            self.flush(where)
            return why
        self.guard.stepped_here()
        for shard in pending.pending_shards():
            self.guard.mark(shard, pending.stepped(shard))
        return None

    def apply(self, shard: int, where: Where) -> bool:
        if not self.pending(shard):
            return False
        with self._plain(self.needs(shard)):
            return super().apply(shard, where)

    def flush(self, where: Where) -> None:
        with self._plain(self.guard.marked()):
            super().flush(where)

    @contextlib.contextmanager
    def _plain(self, shards: Sequence[int]) -> Iterator[None]:
        """Their parameters plain ``nn.Parameter``s while their updates are applied (torch picks an optimizer's
        foreach or fused kernels only for plain ones, as in the plain loop); afterwards what is still pending is
        marked (after an error) and nothing else."""
        taken = self.guard.unmark(shards)
        try:
            yield
        finally:
            pending = self._pending
            left = set(pending.pending_shards()) if pending is not None else set()
            self.guard.unmark([s for s in self.guard.marked() if s not in left])
            for shard, params in taken.items():
                if shard in left:
                    self.guard.mark(shard, params)

    def hold_grads(self) -> None:
        """``optimizer.zero_grad()`` (set_to_none) while updates are pending (PendingStep.hold_grads)."""
        if self._pending is not None:
            self._pending.hold_grads()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "lazy_pending_reads": self.guard.reads}
