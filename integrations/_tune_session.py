"""Ray's function session inside the runtime actor: each trial thread's ``tune.report`` reaches its own proxy.

    router = ThreadRoutedSession()
    route_sessions(router)                        # Ray's function API now reads the calling thread's session
    s = ForwardSession(trial_id, info, checkpoint)
    router.use(s)                                 # in the trial's thread: tune.report(...) puts ("report", ...)
    kind, metrics, ckpt = s.events.get()          # in the actor's next_event; s.ack.release() once Tune took it

How ``tune.report``/``tune.get_context`` keep working inside ``train_fn``: Ray's function API reads the
process-wide ``ray.train._internal.session._session``. In the runtime actor that variable is replaced by a
per-thread router (``route_sessions``, which checks the installed Ray still reads it), so each trial thread sees
its own forwarding session.
Rules: imported only in the runtime actor (which imports hydra_tune and torch anyway), never by the proxy that
Tune's trial actors unpickle (_tune_proxy.py); a report blocks until the proxy acknowledged it, as Tune's own
does; once the trial is cancelled ``report`` raises ``TrialStopped``.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import ray


class TrialStopped(BaseException):
    """Raised in ``train_fn`` (at ``tune.report``) once Tune stopped the trial; a BaseException, so an
    ``except Exception`` in user code does not swallow it."""


class ForwardSession:
    """What ``train_fn`` sees as Ray's session inside the runtime actor: reports go to the trial's proxy."""
    world_rank = local_rank = node_rank = 0
    world_size = local_world_size = 1
    metadata = None
    synchronous_result_reporting = False

    def __init__(self, trial_id: str, info: dict[str, Any], checkpoint: Any) -> None:
        self.trial_id = trial_id
        self.trial_name = info["trial_name"]
        self.trial_dir = info["trial_dir"]
        self.experiment_name = info["experiment_name"]
        self.trial_resources = info["trial_resources"]
        self.storage = info.get("storage")
        self.run_id = info.get("run_id")
        self.loaded_checkpoint = checkpoint
        self.events: queue.Queue = queue.Queue()    # runtime thread -> proxy
        self.ack = threading.Semaphore(0)           # proxy -> runtime thread: Tune took the report
        self.cancelled: str | None = None
        self.token = f"{time.time_ns()}-{id(self)}"   # this incarnation of the trial (restarts reuse trial_id)
        self.thread: threading.Thread | None = None
        self.handles: list[Any] = []                # the hydra_tune tasks this trial's train_fn submitted
        self.lock = threading.Lock()

    def track(self, handle: Any) -> Any:
        """Record a task this trial submitted; one submitted after the trial was cancelled is cancelled now."""
        with self.lock:
            self.handles = [h for h in self.handles if not h.done()] + [handle]
            late = self.cancelled is not None
        if late:
            handle.cancel()
        return handle

    def cancel_tasks(self) -> None:
        """Cancel this trial's running tasks now (their state is freed)."""
        with self.lock:
            handles = list(self.handles)
        for h in handles:
            if not h.done():
                h.cancel()

    def forget_tasks(self) -> None:
        """Drop the handles (and the trained models they hold) once the trial's thread has ended."""
        with self.lock:
            self.handles = []

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if self.cancelled:
            raise TrialStopped(self.cancelled)
        self.events.put(("report", dict(metrics), checkpoint))
        while not self.ack.acquire(timeout=0.1):   # block, as Tune does, until the proxy reported it
            if self.cancelled:
                raise TrialStopped(self.cancelled)
        if self.cancelled:
            raise TrialStopped(self.cancelled)


class ThreadRoutedSession:
    """Installed as Ray's process-wide session in the runtime actor; each attribute access goes to the calling
    thread's ``ForwardSession`` (falsy in threads without one)."""

    def __init__(self) -> None:
        object.__setattr__(self, "_local", threading.local())

    def use(self, session: ForwardSession | None) -> None:
        """The calling thread's session from now on (None: none)."""
        self._local.session = session

    def _current(self) -> ForwardSession | None:
        return getattr(self._local, "session", None)

    def __bool__(self) -> bool:
        return self._current() is not None

    def __getattr__(self, name: str) -> Any:
        s = self._current()
        if s is None:
            raise AttributeError(name)
        return getattr(s, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._current(), name, value)


def route_sessions(router: Any) -> None:
    """Make ``router`` the session Ray's function API (``tune.report``, ``tune.get_checkpoint``,
    ``tune.get_context``) reads in this process, and check that it does; RuntimeError naming Ray's version if not.

    Third-party private, the one place hydra_tune touches Ray internals: Ray 2.41 to 2.60 keep the session in the
    module variable ``ray.train._internal.session._session``, read by ``get_session()``, and offer no per-thread
    hook. The check makes a Ray that moved it fail here, with its version, instead of in a trial's first report
    ("`report` is meant to only be called inside a function that is executed by a Tuner")."""
    try:
        from ray.train._internal import session as module
    except ImportError as exc:
        raise RuntimeError(_moved(f"ray.train._internal.session does not import ({exc})")) from exc
    if not hasattr(module, "_session") or not callable(getattr(module, "get_session", None)):
        raise RuntimeError(_moved("ray.train._internal.session has no `_session` or `get_session`"))
    module._session = router
    if module.get_session() is not router:
        raise RuntimeError(_moved("ray.train._internal.session.get_session() does not read `_session`"))


def _moved(what: str) -> str:
    return (f"Ray keeps Tune's function session in ray.train._internal.session._session must hold, but got ({what}, "
            f"ray={ray.__version__}). Fix: install a supported Ray, pip install 'ray[tune]>=2.41,<2.61'.")
