"""A task's lazy per-shard optimizer step inside the runtime: the PendingStep (step/pending.py) its StateHome owns.

    lazy = LazySteps(optimizer, scaler, max_norm, list(model.parameters()), check_lazy(optimizer, scaler, model))
    lazy.reshard([ex.params for ex in execs])   # StateHome.reshard: pending updates applied, a new PendingStep
    why = lazy.begin()                          # the step boundary (home.lock held), BEFORE scheduler.step()
    lazy.apply(i, where)                        # before shard i's first use in the next step (home.lock held)
    lazy.flush(where)                           # before eval, checkpoints, model(), a re-plan, the task's end

Rules: used only when ``verdict.lazy`` (check_lazy's allowlist). Shard indices are the plan's; one more shard
holds the parameters no stage holds (their update is applied at ``begin``: they are never on a device). ``needs(i)``
lists the shards owning shard i's parameters (a tied parameter belongs to the first shard listing it): before
shard i is used, all of them are applied. ``where(j)`` names the device holding shard j's entry (None: host
memory): the update runs there (``Device.step_scope``). Every call happens with the task's StateHome lock held,
so one thread at a time owns the PendingStep and no move of the state overlaps an update. Counted: shard updates
on a device / on the host, and optimizer steps (a step counts on the device when every shard's update of it ran
on a device).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..device.devices import Device
from .step import LazyVerdict, PendingStep

Where = Callable[[int], "Device | None"]


class LazySteps:
    """One task's pending per-shard updates (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None,
                 params: Sequence[torch.Tensor], verdict: LazyVerdict) -> None:
        self.optimizer, self.scaler, self.max_norm = optimizer, scaler, max_norm
        self.params = list(params)
        self.verdict = verdict
        self._pending: PendingStep | None = None
        self._needs: list[list[int]] = []
        self._extra = 0               # index of the shard of parameters no stage holds
        self._extra_empty = True
        self._on_host = False         # a shard of the step in flight was updated in host memory
        self.shard_steps_on_device = 0
        self.shard_steps_on_host = 0
        self.steps_on_device = 0
        self.steps_on_host = 0
        self.whole_steps = 0          # steps begin() could not split (applied whole at once)
        self.why_whole: str | None = None

    def reshard(self, shards: Sequence[Sequence[torch.Tensor]], where: Where) -> None:
        """The task's shards from now on (each ``ShardExec.params``); pending updates are applied first."""
        self.flush(where)
        owner: dict[int, int] = {}
        for i, shard in enumerate(shards):
            for p in shard:
                owner.setdefault(id(p), i)
        self._needs = [sorted({owner[id(p)] for p in shard}) for shard in shards]
        in_opt = [p for g in self.optimizer.param_groups for p in g["params"]]
        extra = list({id(p): p for p in [*self.params, *in_opt] if id(p) not in owner}.values())
        self._extra, self._extra_empty = len(shards), not extra
        if not self.verdict.lazy:  # the whole step: nothing pending, ever
            return
        self._pending = PendingStep(self.optimizer, [*[list(s) for s in shards], extra], self.params,
                                    scaler=self.scaler, max_norm=self.max_norm)

    def needs(self, shard: int) -> list[int]:
        """The shards whose entries shard ``shard``'s units read (its own and those owning its tied params)."""
        return self._needs[shard] if shard < len(self._needs) else [shard]

    def pending(self, shard: int) -> bool:
        """Whether a shard shard ``shard`` reads has an update not applied yet."""
        p = self._pending
        return p is not None and bool(set(p.pending_shards()) & set(self.needs(shard)))

    def pending_any(self) -> bool:
        """Whether any shard's update of the last begun step is not applied yet."""
        p = self._pending
        return p is not None and bool(p.pending_shards())

    def begin(self, where: Where) -> str | None:
        """Step t is due: snapshot, norms, found-inf, ``scaler.update()``; None, or why it was applied whole now
        (then every shard's update is done)."""
        if self._pending is None:
            raise RuntimeError("LazySteps.begin before reshard")
        self.flush(where)  # nothing should be left from the previous step (every shard ran meanwhile)
        self._on_host = False
        why = self._pending.begin()
        if why is not None:
            self.whole_steps += 1
            self.why_whole = why
            self.flush(where)
            return why
        self._apply_one(self._extra, None)  # parameters no stage holds: in host memory
        return None

    def apply(self, shard: int, where: Where) -> bool:
        """Apply the pending updates shard ``shard`` reads, each where its entry is; whether any was."""
        p = self._pending
        if p is None or not self.pending(shard):
            return False
        for j in self.needs(shard):
            self._apply_one(j, where(j))
        return True

    def flush(self, where: Where) -> None:
        """Apply every pending update (each where its entry is)."""
        p = self._pending
        if p is None:
            return
        for j in p.pending_shards():
            self._apply_one(j, where(j) if j != self._extra else None)

    def _apply_one(self, shard: int, device: Device | None) -> None:
        p = self._pending
        if p is None or shard not in p.pending_shards():
            return
        with device.step_scope() if device is not None else contextlib.nullcontext():
            p.apply(shard)
        if shard != self._extra or not self._extra_empty:
            if device is not None:
                self.shard_steps_on_device += 1
            else:
                self.shard_steps_on_host += 1
                self._on_host = True
        if not p.pending_shards():  # the step is complete
            if self._on_host:
                self.steps_on_host += 1
            else:
                self.steps_on_device += 1

    def stats(self) -> dict[str, Any]:
        return {"shard_steps_on_device": self.shard_steps_on_device,
                "shard_steps_on_host": self.shard_steps_on_host, "lazy_steps_on_device": self.steps_on_device,
                "lazy_steps_on_host": self.steps_on_host, "unsplit_steps": self.whole_steps}
