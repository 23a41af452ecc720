"""Exact checkpoints of a task, taken between optimizer steps, and the position to resume from.

    path = handle.checkpoint("ckpt/trial-3.pt")          # at the task's next step boundary; written atomically
    task = ModelTask(..., resume_from="ckpt/trial-3.pt")  # a new runtime (or process) continues bit-identically

A checkpoint holds the model, optimizer, LR scheduler and loss scaler states, the task's RNG streams, and where the
loop stands (epoch, batches done in it, steps, samples, the epoch's losses and skipped minibatches so far, the RNG
states at the epoch's start: the task's and those of the data's own generators; at an epoch end, the metrics it
emitted). Resuming rebuilds the data iterator from that epoch-start state and steps over the batches already
trained on, so shuffling and any random data transforms repeat exactly; then the RNG continues from the checkpoint.
A checkpoint at the end of the last epoch resumes to a task that emits that epoch's metrics once more and ends (a
restored Tune trial's final report); ``check_position`` refuses at submit a resume that would train nothing else
or pass ``max_steps``. Files are written to a private (0600) temporary file in the target directory and renamed
into place, so a kill mid-write never leaves a torn checkpoint, and read with ``torch.load(weights_only=True)``
(tensors and plain data only: a file holding any other pickled object is refused, not run). A writer killed
mid-write (SIGKILL, power loss) leaves its temporary file, ``.hydra-ckpt-<host>-<pid>-<random>``; the next save
into that directory removes those of writers on this host that are no longer running. Asking for one and serving
it at a step boundary is boundary.py's work.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import rule_error

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
    # at an epoch end: the metrics that epoch emitted (a task resumed from its last epoch's end emits them again)
    metrics: dict[str, Any] | None = None

    def is_final(self, epochs: int) -> bool:
        """Whether this is the end of the last of ``epochs``: nothing is left to train."""
        return self.epoch == epochs + 1 and self.batch_in_epoch == 0


def capture(state: TaskState, position: Position) -> dict[str, Any]:
    """Everything needed to continue ``state`` exactly from ``position``."""
    return {
        "format": FORMAT, "task": state.task.name,
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
        "scaler": None if state.scaler is None else state.scaler.state_dict(),
        "position": asdict(position),
    }


def restore(state: TaskState, data: dict[str, Any], keep_hparams: bool = False) -> Position:
    """Load ``data`` (from ``capture``) into a freshly built ``state``; returns the position to resume from.
    ``keep_hparams``: the fresh optimizer's hyper-parameters and base learning rates win (PBT's explore step);
    each group's learning rate becomes the checkpointed one times new base / checkpointed base."""
    if data.get("format") != FORMAT:
        raise ValueError(f"a checkpoint of format {FORMAT}, but got (format={data.get('format')!r}). Fix: resume "
                         "from a file written by TaskHandle.checkpoint of this hydra_tune version.")
    state.model.load_state_dict(data["model"])
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]
    fresh_bases = list(getattr(state.scheduler, "base_lrs", []) or [])
    state.optimizer.load_state_dict(data["optimizer"])
    for name in ("scheduler", "scaler"):
        target, saved = getattr(state, name), data[name]
        if (target is None) != (saved is None):
            raise ValueError(f"the resumed task has a {name} exactly when the checkpointed one had, but got "
                             f"(task={target is not None}, checkpoint={saved is not None}). Fix: build the task "
                             "with the same lr_scheduler and precision as the checkpointed one.")
        if target is not None:
            target.load_state_dict(saved)
    if keep_hparams:
        _keep_hparams(state, fresh, fresh_bases)
    return Position(**data["position"])


def check_position(task: Any, position: Position) -> None:
    """Refuse at submit a resume that would silently train nothing, or steps past ``max_steps``: the task has the
    checkpoint's epoch left, or the checkpoint is the end of its last epoch and holds the metrics emitted there
    (the resumed task emits them again and ends); it has steps left, unless the checkpoint is at its last step."""
    where = {"task": task.name, "checkpoint_epoch": position.epoch,
             "checkpoint_batches_done": position.batch_in_epoch, "checkpoint_steps": position.steps,
             "epochs": task.epochs, "max_steps": task.max_steps}
    final = position.is_final(task.epochs)
    if position.epoch > task.epochs and not (final and position.metrics is not None):
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


def _keep_hparams(state: TaskState, fresh: list[dict[str, Any]], fresh_bases: list[float]) -> None:
    groups = state.optimizer.param_groups
    if len(fresh) != len(groups):
        raise ValueError(f"the resumed optimizer has as many parameter groups as the checkpointed one, but got "
                         f"(task={len(fresh)}, checkpoint={len(groups)}). Fix: build the same optimizer layout.")
    sched = state.scheduler
    old_bases = list(getattr(sched, "base_lrs", []) or [])
    for i, (group, new) in enumerate(zip(groups, fresh)):
        old_base = old_bases[i] if i < len(old_bases) else group.get("initial_lr", group.get("lr"))
        new_base = fresh_bases[i] if i < len(fresh_bases) else new.get("initial_lr", new.get("lr"))
        lr = group.get("lr")
        group.update({k: v for k, v in new.items() if k != "lr"})
        if lr is not None and new_base is not None and old_base:
            group["lr"] = lr * (new_base / old_base)
    if sched is not None and fresh_bases:
        sched.base_lrs = fresh_bases
        if hasattr(sched, "_last_lr"):  # torch's LRScheduler keeps get_last_lr()'s value there (no setter)
            sched._last_lr = [g["lr"] for g in groups]


def save(data: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write ``data`` to ``path`` atomically (private temp file in the same directory, fsync, rename, fsync of the
    directory); first remove the temp files dead writers on this host left there."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale(directory)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP}{os.getpid()}-", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
