"""Planning a task whose whole state does not fit its device: shards small enough that each one's state entry
fits next to its units, so the entries move in for their units and the lazy per-shard step updates them there.

    plan_entries(state, budget, bandwidth, keep, scaler_ok=True)   # the runtime, once the task is built

Rules: only for a task whose optimizer takes the lazy per-shard step (step/allow.py ``check_lazy``), whose whole
state (parameters, gradients, optimizer state, temporaries: ``StateHome.state_bytes``) does not fit next to its
plan's peak within ``budget``, and (fp16) whose devices step its GradScaler exactly. A shard's entry is the state
of the parameters it owns (a tied parameter belongs to the first shard holding it); a unit reads the entries of
every parameter its shard holds, so each unit's largest read (``need``) must fit beside the peak. When no plan
does (``policy.partition.entry_plan``), the task keeps its plan: shards whose entries do not fit keep the host
path (state_cache.py says so in the task's ``why``). The new plan is no re-plan (``replans`` stays).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..policy.partition import Plan, entry_plan, resident_fits
from .resident import entry_sizes
from .shard import ShardExec
from .step import check_lazy

if TYPE_CHECKING:
    from .state import TaskState


def largest_read(state: TaskState, plan: Plan) -> int:
    """The largest sum of entry bytes one unit of ``plan`` reads (its shard's own entry and its tied owners')."""
    execs = [ShardExec(s.index, state.cut.stages[s.start:s.stop]) for s in plan.shards]
    owner: dict[int, int] = {}
    owned: list[list] = []
    for i, ex in enumerate(execs):
        owned.append([p for p in ex.params if owner.setdefault(id(p), i) == i])
    groups = {id(p): g for g in state.optimizer.param_groups for p in g["params"]}
    sizes = entry_sizes(owned, groups, state.home.optimizer_bytes, state.task.grad_accumulation)
    return max(sum(sizes[j] for j in {owner[id(p)] for p in ex.params} | {i}) for i, ex in enumerate(execs))


def plan_entries(state: TaskState, budget: int | None, bandwidth: float | None, keep: bool,
                 scaler_ok: bool = True) -> bool:
    """Re-cut ``state`` for per-shard entries when its whole state does not fit (module docstring); whether it
    was."""
    home = state.home
    if budget is None or not home.enabled or (state.scaler is not None and not scaler_ok):
        return False
    if resident_fits(state.plan.peak, home.state_bytes, budget):
        return False
    if not check_lazy(state.optimizer, state.scaler, state.model).lazy:
        return False
    plan = entry_plan(state.costs or [], budget, lambda p: largest_read(state, p), keep=keep, bandwidth=bandwidth)
    if plan is None or plan == state.plan:
        return False
    state.reshard(plan, replanned=False)
    home.planned = f"planned for per-shard entries: {len(plan.shards)} shards whose entries fit next to their units"
    return True
