"""The storage an Optuna study of hydra_tune is made on: a URL opened with a heartbeat, an SQLite file set up once.

    with creating(url):                                    # one process at a time sets up a new SQLite file
        storage = study_storage(url, heartbeat_interval=10)   # None -> InMemoryStorage, a URL -> RDBStorage
        study = optuna.create_study(storage=storage, ...)

Rules: ``heartbeat_interval`` is an int >= 1 (seconds) or None (no heartbeat), checked before anything is opened;
a storage object is used as it is; an SQLite URL waits up to 60 s for another process's writer.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.storages import InMemoryStorage

from hydra_tune.errors import rule_error


@contextlib.contextmanager
def creating(storage: Any) -> Iterator[None]:
    """Processes that open a new SQLite file at once race in its schema set-up ("UNIQUE constraint failed:
    alembic_version"): one process of this user at a time sets up a given file."""
    path = storage[len("sqlite:///"):] if isinstance(storage, str) and storage.startswith("sqlite:///") else None
    if not path or path.startswith(":memory:"):
        yield
        return
    from hydra_tune.node.files import locked, private_dir

    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    with locked(os.path.join(private_dir(), f"sqlite-{digest}.lock")):
        yield


def study_storage(storage: Any, heartbeat_interval: int | None) -> Any:
    """The storage object the study is made on (so the study knows it without asking Optuna's privates): None
    becomes an InMemoryStorage, a URL string an RDBStorage (with Optuna's heartbeat unless ``heartbeat_interval``
    is None, so dead processes' trials can be failed); a storage object is kept."""
    if storage is None:
        return InMemoryStorage()
    if not isinstance(storage, str):
        return storage
    if heartbeat_interval is not None and (isinstance(heartbeat_interval, bool) or
                                           not isinstance(heartbeat_interval, int) or heartbeat_interval < 1):
        raise rule_error("`heartbeat_interval >= 1` (seconds, an int) or None", "pass e.g. 10, or None to open "
                         "the storage URL without a heartbeat", heartbeat_interval=heartbeat_interval)
    # SQLite: wait for a writer of another process instead of failing with "database is locked" at once.
    engine = {"connect_args": {"timeout": 60}} if storage.startswith("sqlite") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(storage, engine_kwargs=engine, heartbeat_interval=heartbeat_interval)
