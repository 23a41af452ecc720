"""Why a checkpoint could not be written, said plainly: a full file system (with the bytes it needed) or a path
this process may not write.

    try:
        write(data, tmp)
    except BaseException as exc:
        clear = write_error(exc, path, lambda: encoded_size(data))
        if clear is not None:
            raise clear from exc
        raise

Rules: only an OSError in the failure's chain (torch.save reports a full disk as a RuntimeError whose context is
the OSError) with a full-disk errno (ENOSPC, EDQUOT, EFBIG) or a denied one (EACCES, EPERM, EROFS) is translated;
the result is a ``CheckpointNotWritten`` (an OSError with that errno, so code that handles OSError still does).
The bytes needed are counted by encoding the checkpoint again into a sink that keeps nothing.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import HydraError, format_bytes, rule_error

__all__ = ["CheckpointNotWritten", "write_error", "encoded_size"]

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointNotWritten(HydraError, OSError):
    """A checkpoint could not be written (full file system, unwritable path); the previous file at its path, if
    any, is left whole, and the task goes on. ``errno`` is the OS error's (kept through pickling: a node server's
    error reaches its client whole)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (str(self), self.errno)


def _rebuild(message: str, code: int | None) -> CheckpointNotWritten:
    err = CheckpointNotWritten(message)
    err.errno = code
    return err


class _Counter:
    """A write-only sink that counts bytes (torch.save needs write and flush)."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: Any) -> int:
        self.n += len(b)
        return len(b)

    def flush(self) -> None:
        pass


def encoded_size(data: dict[str, Any]) -> int:
    """Bytes ``torch.save(data)`` writes."""
    sink = _Counter()
    torch.save(data, sink)
    return sink.n


def _os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def write_error(exc: BaseException, path: str, size: Callable[[], int]) -> CheckpointNotWritten | None:
    """The clear error for ``exc``, raised writing the checkpoint ``path``; None when it is no disk or permission
    error (the caller re-raises ``exc``). ``size()`` gives the checkpoint's bytes (called only for a full disk)."""
    cause = _os_error(exc)
    if cause is None or cause.errno not in _FULL | _DENIED:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    said = f"[Errno {cause.errno}] {cause.strerror}"
    if cause.errno in _FULL:
        needed = size()
        try:
            st = os.statvfs(directory)
            free: object = format_bytes(st.f_bavail * st.f_frsize)
        except OSError:
            free = "unknown"
        err = rule_error("the checkpoint's file system has room for it", "free space there, or checkpoint to a "
                         "file system with room (the previous checkpoint at this path, if any, is left whole; the "
                         "task goes on)", kind=CheckpointNotWritten, path=path, bytes_needed=needed,
                         needed=format_bytes(needed), free_now=free, error=said)
    else:
        err = rule_error("the checkpoint's directory is writable by this process", "make it writable, or "
                         "checkpoint to a writable path (the previous checkpoint at this path, if any, is left "
                         "whole; the task goes on)", kind=CheckpointNotWritten, path=path, directory=directory,
                         error=said)
    err.errno = cause.errno  # strerror and filename stay unset: str() is the message above
    return err
