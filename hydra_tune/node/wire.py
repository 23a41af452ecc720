"""What travels between a node client and its server, and how an error crosses from one to the other.

    ("submit", request_id, task_id, shipping.dump(task), host_rng.states())  # client -> server: (op, id, *args)
    ("reply", request_id, True, value)                         # server -> client: one per request but "forget"
    ("reply", request_id, False, pack_error(exc))              # ... and the client raises unpack_error(packed)
    ("metrics" | "status" | "end", task_id, ...)               # server -> client: streamed per task

Rules: every message is one pickled tuple in one ``send_bytes`` frame, sent only after the connection's HMAC
handshake. Task ids are the client's own, so a task's events may arrive before the reply to its submit. An error
travels as ``pack_error``'s (pickled error or None, type name, message, traceback text): the client gets the error
itself back when it pickles both ways and its class imports there, else a ``RemoteError`` with the rest.
"""
from __future__ import annotations

import pickle
import traceback
from typing import Any

from ..errors import HydraError

__all__ = ["RemoteError", "TaskNotPicklable", "pack_error", "unpack_error", "renamed"]

PackedError = tuple[bytes | None, str, str, str]


class TaskNotPicklable(HydraError, TypeError):
    """A ModelTask could not be shipped to the node server (cloudpickle failed here, or loading failed there)."""


class RemoteError(HydraError):
    """An error raised in the node server whose own type could not come back: its type name, message, traceback."""

    def __init__(self, type_name: str, message: str, traceback_text: str) -> None:
        super().__init__(f"{type_name}: {message}\n--- raised in the hydra_tune node server ---\n{traceback_text}")
        self.type_name, self.message, self.traceback_text = type_name, message, traceback_text

    def __reduce__(self) -> Any:
        return RemoteError, (self.type_name, self.message, self.traceback_text)


def pack_error(exc: BaseException, where: str | None = None) -> PackedError:
    """(pickled error or None, type name, message, traceback text): the error, or what is left of it. With
    ``where``, the pickled error carries a note "raised in <where>" and its traceback text."""
    import cloudpickle  # the server's side only: a client unpacks with pickle

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if where is not None:
        exc.__notes__ = [*getattr(exc, "__notes__", []), f"raised in {where}:\n{tb}"]
    try:
        blob: bytes | None = cloudpickle.dumps(exc)  # a class the client's task brought by value goes back so
        pickle.loads(blob)  # some errors pickle but do not unpickle (a required argument not in .args)
    except Exception:  # noqa: BLE001
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb


def unpack_error(packed: PackedError) -> BaseException:
    """The error ``pack_error`` packed: itself if its class imports here, else a ``RemoteError``."""
    blob, type_name, message, tb = packed
    if blob is not None:
        try:
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001  (its class does not import here)
            pass
    return RemoteError(type_name, message, tb)


def renamed(exc: BaseException, old: str, new: str) -> BaseException:
    """``exc`` with the server's task name in its message replaced by the client's own."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and old in exc.args[0]:
        exc.args = (exc.args[0].replace(old, new),)
    return exc
