"""The device budget under which the runtime runs a task in k shards, planned as the runtime plans it.

    finder = ShardBudget(task, "cuda:0")    # builds the task once (its profile is then cached for the runtime)
    found = finder.find(2)   # found["budget"]: device_memory for Runtime(...); ["entries"]: their bytes

The runtime plans a submitted task in two steps (runtime.py ``_start``): the units plan for the device's plan
budget (``TaskState.build``: ``policy.partition.partition``), then, when the task's whole state does not fit
beside that plan's peak, the re-cut for per-shard entries (``training.entry_plan.plan_entries``), which has more,
smaller shards. A budget chosen from the units plan alone is therefore not the one whose task runs in k shards.
``find`` walks budgets down from the one that holds the whole task resident and returns the largest whose final
plan has k shards and every unit's entries fit beside the peak (``policy.partition.resident_fits`` over
``entry_plan.largest_read``): the spilled case that moves entries, not the host path.
"""
from __future__ import annotations

from typing import Any

import hydra_tune as ht
from hydra_tune.errors import PlanError
from hydra_tune.policy.partition import partition, resident_fits
from hydra_tune.training.entry_plan import largest_read, plan_entries
from hydra_tune.training.state import TaskState

STEPS = 200  # budgets tried, evenly spaced from the whole-resident one down


class ShardBudget:
    """One task built once, re-planned for each candidate budget with the runtime's own planner functions."""

    def __init__(self, task: ht.ModelTask, device: str) -> None:
        with ht.Runtime(devices=[device]) as rt:  # the device's overhead and copy rate, as every runtime has them
            dev = rt.devices[0]
            self.overhead, self.rate, self.keep = dev.overhead, dev.copy_bandwidth, dev.releases_graphs
            self.scaler_ok = dev.steps_loss_scaler
            optimizer_bytes = rt.footprint(task).optimizer  # what the runtime charges and predicts entries with
        self.state = TaskState.build(task, None, self.rate, self.keep)
        self.state.home.set_optimizer_bytes(optimizer_bytes)

    def plan(self, plan_budget: int) -> dict[str, Any]:
        """The plan the runtime makes for ``plan_budget`` (raises PlanError when none fits): ``shards``, ``moves``
        (the whole state does not fit beside the plan's peak, yet every unit's entries do: entries move in for
        their units), ``entries`` (their predicted bytes) and ``planned`` (how: ``residency["planned"]``)."""
        st = self.state
        st.reshard(partition(st.costs or [], plan_budget, bandwidth=self.rate, keep=self.keep), replanned=False)
        plan_entries(st, plan_budget, self.rate, self.keep, scaler_ok=self.scaler_ok)
        moves = (not resident_fits(st.plan.peak, st.home.state_bytes, plan_budget)
                 and resident_fits(st.plan.peak, largest_read(st, st.plan), plan_budget))
        return {"shards": len(st.plan.shards), "moves": moves, "entries": st.home.entry_list(),
                "planned": st.home.planned or "the units plan"}

    def find(self, shards: int) -> dict[str, Any]:
        """The largest device budget (``budget``, for ``device_memory``) whose plan has ``shards`` shards with
        entries that move in (``plan``'s keys besides). When no budget gives exactly that many (a tied GPT-2's
        head reads the embedding's entry, so the last unit of 2 shards reads the whole state: never a spill in
        2), the nearest larger count, with a note."""
        st = self.state
        top = partition(st.costs or [], None, bandwidth=self.rate, keep=self.keep).peak + st.home.state_bytes
        found: dict[int, dict[str, Any]] = {}  # shards -> the plan at the largest budget
        for step in range(STEPS, 0, -1):
            plan_budget = top * step // STEPS
            try:
                plan = self.plan(plan_budget)
            except PlanError:
                break
            if plan["moves"] and plan["shards"] >= shards:
                found.setdefault(plan["shards"], {**plan, "budget": plan_budget + self.overhead})
        if not found:
            raise PlanError(f"no budget plans {st.task.name!r} in {shards} or more shards whose entries move")
        if min(found) != shards:
            print(f"note: no budget gives exactly {shards} shards whose entries move; using {min(found)}")
        return found[min(found)]
