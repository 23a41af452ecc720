"""Exact checkpoints of a task, taken between optimizer steps, and the position to resume from.

    path = handle.checkpoint("ckpt/trial-3.pt")          # at the task's next step boundary; written atomically
    task = ModelTask(..., resume_from="ckpt/trial-3.pt")  # a new runtime (or process) continues bit-identically

A checkpoint holds the model, optimizer, LR scheduler and loss scaler states, the task's RNG streams, and where the
loop stands (epoch, batches done in it, steps, samples, the epoch's losses and skipped minibatches so far, and the
RNG states at the epoch's start: the task's and those of the data's own generators; at an epoch end, the
metrics it emitted). Resuming rebuilds the data
iterator from that epoch-start state and steps over the batches already trained on, so shuffling and any random
data transforms repeat exactly; then the RNG continues from the checkpoint. A checkpoint at the end of the last
epoch resumes to a task that emits that epoch's metrics once more and ends (a restored Tune trial's final
report); ``check_position`` refuses at submit a resume that would train nothing else or pass ``max_steps``.

It also holds the Python state that changed since the task was built (pystate.py; put back on resume): the
model's (a forward's call counter, annealed temperature, hook closure), the optimizer's attributes beyond torch's
own, the samplers' (train data: as at the epoch's start; eval data: as they stand); the eval data's own
generators' states as they stand (each evaluation continues their order); and each parameter group's base
learning rate (``resume_hparams="task"`` scales from it, also under ReduceLROnPlateau, which keeps none). State
that ``weights_only`` cannot read (a plain object, a function), or hooks registered or removed on the model while
it trains, refuse the checkpoint with an error naming them; the task goes on.

Files are written to a private (0600) temporary file in the target directory and renamed into place, so a kill
mid-write never leaves a torn checkpoint, and read with ``torch.load(weights_only=True)`` (tensors and plain data
only: a file holding any other pickled object is refused, not run). A writer killed mid-write (SIGKILL,
power loss) leaves its temporary file, ``.hydra-ckpt-<host>-<pid>-<random>``; the next save into that directory
removes those of writers on this host that are no longer running. Asking for one and serving it at a step boundary
is boundary.py's work.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..errors import rule_error
from .data import data_generators, is_factory, restore_generators, sampler_state
from .pystate import Change, ModuleState
from .write_errors import encoded_size, write_error

if TYPE_CHECKING:
    from .state import TaskState

FORMAT = 1
_TEMP = f".hydra-ckpt-{socket.gethostname()}-"   # + "<pid>-<random>": whose write it is


@dataclass
class Position:
    """Where a task's loop stands at a step boundary."""

    epoch: int                  # the epoch being trained (1-based)
    batch_in_epoch: int         # batches of it already trained on
    steps: int
    samples: int
    losses: list[float]         # this epoch's minibatch losses so far (the epoch's train_loss averages them)
    epoch_rng: torch.Tensor     # the task's CPU generator state when the epoch's data iterator was made
    rng: torch.Tensor           # the CPU generator state now
    accel_rng: torch.Tensor | None
    skipped: int = 0            # this epoch's minibatches dropped so far for a non-finite loss (skip_step)
    # the states of the train data's own generators (a DataLoader's `generator=g`, its sampler's) at the epoch's
    # start (training/data.py data_generators); None: not recorded
    data_rng: list[torch.Tensor] | None = None
    # what had changed in the Python state of the train data's samplers by the epoch's start, before its
    # set_epoch (data.py sampler_state): pystate Changes in the loop, storable entries in a checkpoint
    data_python: list[Any] | None = None
    # at an epoch end: the metrics that epoch emitted (a task resumed from its last epoch's end emits them again)
    metrics: dict[str, Any] | None = None
    # Python's and numpy's global generators (host_rng.states) for a task whose forward or loss draws from them
    # (TaskRNG.host_draws), else None: a resume sets them back, as a resumed Hugging Face Trainer does
    host_rng: dict[str, Any] | None = None

    def is_final(self, epochs: int | None) -> bool:
        """Whether this is the end of the last of ``epochs``: nothing is left to train (never, with no limit)."""
        return epochs is not None and self.epoch == epochs + 1 and self.batch_in_epoch == 0


class AsBuilt:
    """What a task was built with, that its checkpoints are taken against.

        state.as_built = AsBuilt(model, optimizer, eval_data)   # TaskState: before any training or restore

    ``python``: the Python state then of the model, of the optimizer (attributes beyond torch's own: a custom
    optimizer's counter) and of the eval data's samplers; a checkpoint carries what changed since. ``base_lrs``:
    each parameter group's base learning rate (``initial_lr``, which torch's LR schedulers set, else ``lr``), which
    ``resume_hparams="task"`` scales from. A task resumed with the checkpoint's hyper-parameters takes its bases.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, eval_data: Any = None) -> None:
        self.python = {"model": ModuleState.of_model(model),
                       "optimizer": ModuleState.of_objects([("optimizer", optimizer)])}
        samplers = None if eval_data is None or is_factory(eval_data) else sampler_state(eval_data)
        if samplers is not None:
            self.python["eval_data"] = samplers
        self.base_lrs: list[float | None] = [g.get("initial_lr", g.get("lr")) for g in optimizer.param_groups]


def capture(state: TaskState, position: Position) -> dict[str, Any]:
    """Everything needed to continue ``state`` exactly from ``position``; a rule error when Python state that
    changed cannot be stored."""
    return {
        "format": FORMAT, "task": state.task.name,
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
        "scaler": None if state.scaler is None else state.scaler.state_dict(),
        "position": _position(state, position),
        "python": _python_entries(state), "base_lrs": list(state.as_built.base_lrs),
        "eval_rng": _eval_states(state),
    }


def restore(state: TaskState, data: dict[str, Any], keep_hparams: bool = False) -> Position:
    """Load ``data`` (from ``capture``) into a freshly built ``state``; returns the position to resume from.
    ``keep_hparams``: the fresh optimizer's hyper-parameters and base learning rates win (PBT's explore step);
    each group's learning rate becomes the checkpointed one times new base / checkpointed base."""
    if data.get("format") != FORMAT:
        raise ValueError(f"a checkpoint of format {FORMAT}, but got (format={data.get('format')!r}). Fix: resume "
                         "from a file written by TaskHandle.checkpoint of this hydra_tune version.")
    state.model.load_state_dict(data["model"])
    if _own_eval(state) is not None:  # the eval data's own generators continue where the checkpoint left them
        restore_generators(_own_eval(state), data.get("eval_rng"), state.task.name, "eval data")
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]
    fresh_bases = list(getattr(state.scheduler, "base_lrs", []) or [])
    state.optimizer.load_state_dict(data["optimizer"])
    saved_python = data.get("python") or {}
    for what, base in state.as_built.python.items():  # after load_state_dict, which sets no other attributes
        put_entries(base, saved_python.get(what, []), state.task.name, what)
    for name in ("scheduler", "scaler"):
        target, saved = getattr(state, name), data[name]
        if (target is None) != (saved is None):
            raise ValueError(f"the resumed task has a {name} exactly when the checkpointed one had, but got "
                             f"(task={target is not None}, checkpoint={saved is not None}). Fix: build the task "
                             "with the same lr_scheduler and precision as the checkpointed one.")
        if target is not None:
            target.load_state_dict(saved)
    if keep_hparams:
        _keep_hparams(state, fresh, fresh_bases, data.get("base_lrs"))
    elif data.get("base_lrs") is not None:  # its hyper-parameters are the checkpoint's: so are its bases
        state.as_built.base_lrs = list(data["base_lrs"])
    return Position(**data["position"])


def check_position(task: Any, position: Position) -> None:
    """Refuse at submit a resume that would silently train nothing, or steps past ``max_steps``: the task has the
    checkpoint's epoch left, or the checkpoint is the end of its last epoch and holds the metrics emitted there
    (the resumed task emits them again and ends); it has steps left, unless the checkpoint is at its last step."""
    where = {"task": task.name, "checkpoint_epoch": position.epoch,
             "checkpoint_batches_done": position.batch_in_epoch, "checkpoint_steps": position.steps,
             "epochs": task.epochs, "max_steps": task.max_steps}
    final = position.is_final(task.epochs)
    if task.epochs is not None and position.epoch > task.epochs and not (final and position.metrics is not None):
        done = position.epoch - 1 if position.batch_in_epoch == 0 else position.epoch
        raise rule_error("a resumed task has training left at its checkpoint, or the checkpoint is the end of its "
                         "last epoch and holds that epoch's metrics", f"resume with epochs >= {done + 1} to train "
                         f"on (the checkpoint has {done} epoch(s) done), or load the checkpoint's model itself "
                         "(torch.load(path)['model'] is its state_dict)", **where)
    if task.max_steps is None:
        return
    at_last_step = position.steps == task.max_steps and (position.batch_in_epoch > 0 or final)
    if position.steps > task.max_steps or (position.steps == task.max_steps and not at_last_step):
        raise rule_error("a resumed task has steps left (checkpoint steps < max_steps), unless the checkpoint was "
                         "taken at its last step", f"resume with max_steps > {position.steps} (or None)", **where)


def _keep_hparams(state: TaskState, fresh: list[dict[str, Any]], fresh_bases: list[float],
                  saved_bases: list[float | None] | None) -> None:
    """The fresh optimizer's hyper-parameters win; each group's learning rate is the checkpointed one times new
    base / checkpointed base: the scheduler's ``base_lrs``, else the bases the checkpoint recorded (a
    ReduceLROnPlateau keeps none: its reductions are in the checkpointed rate)."""
    groups = state.optimizer.param_groups
    if len(fresh) != len(groups):
        raise ValueError(f"the resumed optimizer has as many parameter groups as the checkpointed one, but got "
                         f"(task={len(fresh)}, checkpoint={len(groups)}). Fix: build the same optimizer layout.")
    sched = state.scheduler
    old_bases = list(getattr(sched, "base_lrs", []) or []) or list(saved_bases or [])
    for i, (group, new) in enumerate(zip(groups, fresh)):
        old_base = old_bases[i] if i < len(old_bases) else group.get("initial_lr", group.get("lr"))
        new_base = fresh_bases[i] if i < len(fresh_bases) else new.get("initial_lr", new.get("lr"))
        lr = group.get("lr")
        group.update({k: v for k, v in new.items() if k != "lr"})
        if lr is not None and new_base is not None and old_base:
            group["lr"] = lr * (new_base / old_base)
    if sched is not None and fresh_bases:
        sched.base_lrs = fresh_bases
    if sched is not None and hasattr(sched, "_last_lr"):  # get_last_lr()'s value (torch has no setter)
        sched._last_lr = [g["lr"] for g in groups]


def _own_eval(state: TaskState) -> Any:
    """The task's eval data when it is iterated itself (not made by a factory each evaluation), else None."""
    data = state.eval_iterable
    return None if data is None or is_factory(data) else data


def _eval_states(state: TaskState) -> list[torch.Tensor] | None:
    """The states of the eval data's own generators now (between evaluations): None for no or a factory's data."""
    data = _own_eval(state)
    return None if data is None else [g.get_state() for g in data_generators(data)]


# Types torch.load(weights_only=True) reads (exact types: a numpy float or an IntEnum is pickled otherwise)
_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device,
                     torch.Size, torch.Tensor, nn.Parameter})
_NESTS = frozenset({tuple, list, set, dict, collections.OrderedDict})
_STORABLE = ("None, bool, int, float, complex, str, bytes, tensors, torch.dtype/device/Size and tuples, lists, "
             "dicts and sets of them")


def _unstorable(value: Any, seen: set[int] | None = None) -> str | None:
    """The type name of the first part of ``value`` that ``weights_only`` cannot read, or None."""
    kind = type(value)
    if kind in _LEAVES:
        return None
    if kind not in _NESTS:
        return kind.__name__
    seen = set() if seen is None else seen
    if id(value) in seen:  # a container holding itself: pickled once
        return None
    seen.add(id(value))
    parts = itertools.chain.from_iterable(value.items()) if isinstance(value, dict) else value
    return next((bad for part in parts if (bad := _unstorable(part, seen)) is not None), None)


def _position(state: TaskState, position: Position) -> dict[str, Any]:
    """``position`` as plain data: its train samplers' Python state as storable entries."""
    changes = position.data_python
    out = asdict(replace(position, data_python=None))
    out["data_python"] = None if changes is None else storable(changes, state.task.name, "train_data")
    return out


def _python_entries(state: TaskState) -> dict[str, list[dict[str, Any]]]:
    """What changed since the task was built in the Python state of its model (its forwards), optimizer and eval
    data's samplers, as storable entries; a rule error names what cannot be stored, or hooks registered or removed
    meanwhile."""
    python, task = state.as_built.python, state.task.name
    for module, hooks, built, now in python["model"].hooks_changed():
        raise rule_error("no hook is registered or removed on the model while it trains (a checkpoint carries the "
                         "state hooks keep, not the hooks)", "register the hooks when the model is built (in its "
                         "factory or __init__), not in forward or from outside while the task runs",
                         kind=TypeError, task=task, module=module, hooks=hooks, built=built, now=now)
    return {what: storable(base.changes(), task, what) for what, base in python.items()}


_SAMPLER_FIX = ("keep a sampler's state as numbers, strings or tensors (or containers of them), or derive its "
                "order from set_epoch(epoch), which hydra_tune calls at each training epoch's start")
_FIX = {
    "model": "keep such state as numbers, strings or tensors (or containers of them): e.g. the object's numbers as "
             "attributes of the module, a tensor as a buffer; or set it when the model is built (factory or "
             "__init__) so that training does not change it: a checkpoint carries the attributes changed since the "
             "task was built",
    "optimizer": "keep the optimizer's own state in its `state` (per parameter, in its state_dict) or as numbers, "
                 "strings or tensors",
    "train_data": _SAMPLER_FIX, "eval_data": _SAMPLER_FIX,
}
_CHANGED_BY = {"model": "a forward", "optimizer": "an optimizer", "train_data": "a sampler", "eval_data": "a sampler"}


def storable(changes: list[Change], task: str, what: str) -> list[dict[str, Any]]:
    """``changes`` (pystate) of ``what`` ("model": its modules; "optimizer"; "train_data", "eval_data": their
    samplers) as entries ``weights_only`` reads (a deque as its items and maxlen); a rule error names the first
    that cannot be stored."""
    entries = []
    for change in changes:
        value, entry = change.value, {"module": change.module, "holder": change.holder, "key": change.key,
                                      "how": change.how}
        if isinstance(value, collections.deque):
            value, entry["deque_maxlen"] = list(value), value.maxlen
        elif isinstance(value, torch.Generator):  # a module's own generator: its state (a byte tensor)
            value, entry["generator"] = value.get_state(), str(value.device)
        bad = _unstorable(value)
        if bad is not None:
            kind = type(change.value).__name__
            where = ({"module": change.module} if what == "model" else {} if what == "optimizer"
                     else {"data": what, "sampler": change.module})
            raise rule_error(
                f"the Python state {_CHANGED_BY[what]} changes can be stored in a checkpoint (read with "
                f"torch.load(weights_only=True): {_STORABLE})", _FIX[what], kind=TypeError,
                task=task, **where, attribute=change.attribute, type=kind if kind == bad else f"{kind} holding {bad}")
        entries.append({**entry, "value": value})
    return entries


def put_entries(base: ModuleState, entries: list[dict[str, Any]], task: str, what: str) -> None:
    """Put a checkpoint's Python state ``entries`` (``storable``'s) into the objects ``base`` was taken of: the
    freshly built model, optimizer and eval samplers, the train data's samplers at the resumed epoch's start."""
    for e in entries:
        value = collections.deque(e["value"], e["deque_maxlen"]) if "deque_maxlen" in e else e["value"]
        if "generator" in e:
            value = torch.Generator(device=e["generator"])
            value.set_state(e["value"])
        change = Change(e["module"], e["holder"], e["key"], e["how"], value)
        if not base.put(change):
            raise rule_error(f"the resumed task's {what.replace('_', ' ')} has every place of Python state the "
                             "checkpointed one changed", f"build the {what.replace('_', ' ')} as the checkpointed "
                             "task did", task=task, place=change.module, attribute=change.attribute)


def save(data: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write ``data`` to ``path`` atomically (private temp file in the same directory, fsync, rename, fsync of the
    directory); first remove the temp files dead writers on this host left there. A full file system or an
    unwritable directory raises ``CheckpointNotWritten`` naming the path (and the bytes needed); the file already
    at ``path`` is left whole."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        _remove_stale(directory)
        fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP}{os.getpid()}-", dir=directory)  # mode 0600
    except OSError as exc:  # an unwritable directory: say so plainly (write_errors.py)
        clear = write_error(exc, path, lambda: encoded_size(data))
        if clear is not None:
            raise clear from exc
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)  # first: the space it took is free again, the previous checkpoint was never touched
        clear = write_error(exc, path, lambda: encoded_size(data))
        if clear is not None:
            raise clear from exc
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power loss (not every filesystem can)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def _remove_stale(directory: str) -> None:
    """Unlink this user's temp files in ``directory`` whose writer (a process on this host) no longer runs."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            pid = entry.name[len(_TEMP):].split("-")[0] if entry.name.startswith(_TEMP) else ""
            if pid.isdigit() and not _running(int(pid)):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                        os.unlink(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint; tensors and plain data only (no arbitrary objects are unpickled)."""
    return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
