"""Where the node runtime server lives: its private directory, authkey, socket, lock and log.

    files = server_files(devices=["cpu", "cpu"], device_memory="64MiB")     # or server_files(config=config)
    with locked(files["lock"]): ...                     # one starter (or stopper) of that server at a time
    print(files["socket"], log_tail(files["log"]))

Rules: one server per (OS user, RuntimeConfig, interpreter, visible GPUs, hydra_tune's code), named by a hash of those:
a process whose hydra_tune differs from a lingering server's (upgraded, reinstalled, edited) starts its own rather
than being served by the old code (``code_identity``). Its files live
in this user's 0700 directory (``$HYDRA_TUNE_NODE_DIR``, else /tmp/hydra_tune-<uid>); an existing directory or
authkey that is not private to this user is refused, never used. The authkey is written whole or not at all and
outlives servers; the socket and log go with their server.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import site
import stat
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..config import RuntimeConfig
from ..errors import HydraError, rule_error

_SOCKET_MAX = 107       # bytes in an AF_UNIX path (sun_path is 108 with its NUL)
LOG_BYTES = 1 << 20     # the server's log rotates at this size ($HYDRA_TUNE_NODE_LOG_BYTES): 2 lines per client
_rotation: dict[str, Any] = {"path": None, "limit": LOG_BYTES, "lock": threading.Lock()}


def server_files(devices: int | str | Sequence[str] = "auto", device_memory: int | str | None = None, *,
                 policy: str = "lrtf", host_memory: int | str | None = None,
                 config: RuntimeConfig | None = None, slot: str | None = None) -> dict[str, Any]:
    """The server's files for these settings; creates the private base directory and its authkey if missing.
    ``slot``: one of several servers of the same settings (``node.spread``'s "1/2": the second of two).

        files = node.server_files(devices=["cpu", "cpu"], device_memory="64MiB")
        print(open(files["log"]).read())                  # what the server printed
        files["config"], files["socket"], files["lock"], files["authkey"], files["base"]
    """
    config = RuntimeConfig.of(config, devices=devices, device_memory=device_memory, policy=policy,
                              host_memory=host_memory).as_dict()
    # The interpreter and the visible GPUs are part of the identity: a server is only shared by processes that
    # would have built the same Runtime (same venv, same torch, same devices).
    identity = dict(config, python=sys.executable, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    code=code_identity())
    if slot is not None:  # (absent otherwise: the servers of earlier versions keep their names)
        identity["slot"] = slot
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    base = private_dir()
    files = {name: os.path.join(base, f"{key}.{ext}") for name, ext in (("socket", "sock"), ("lock", "lock"),
                                                                       ("log", "log"))}
    if len(os.fsencode(files["socket"])) > _SOCKET_MAX:
        raise rule_error(f"the node server's socket path is at most {_SOCKET_MAX} bytes (the AF_UNIX limit)",
                         "set HYDRA_TUNE_NODE_DIR to a short directory such as /tmp/ht", kind=HydraError,
                         socket=files["socket"], length=len(os.fsencode(files["socket"])))
    files.update(base=base, key=key, config=config, authkey=os.path.join(base, "authkey"))
    _make_authkey(files["authkey"])
    return files


_CODE: list[str] = []  # this package's code_identity, once computed


def code_identity(package: str | None = None) -> str:
    """A digest of the hydra_tune package in ``package`` (this one by default): its version and each source file's
    path, size and modification time. Part of a server's name, so that a server started by other code (before an
    upgrade, a reinstall or an edit) never serves this process. This package's is computed once per process.

        code_identity()   # '3f0c9a...' (16 hex digits)
    """
    if package is None and _CODE:
        return _CODE[0]
    root = package or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    if package is None:
        from .. import __version__
        digest.update(__version__.encode())
    for folder, dirs, names in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):  # (a file removed meanwhile: its absence is the identity)
                st = os.stat(path)
                digest.update(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    code = digest.hexdigest()[:16]
    if package is None:
        _CODE.append(code)
    return code


def private_dir() -> str:
    """This user's private directory for node servers and locks (made 0700 if missing, checked if present)."""
    base = os.path.abspath(os.environ.get("HYDRA_TUNE_NODE_DIR") or f"/tmp/hydra_tune-{os.getuid()}")
    _make_private_dir(base)
    return base


def _make_private_dir(base: str) -> None:
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    _check_private(base, stat.S_ISDIR, "directory", f"`chmod 700 {base}` if it is yours, or set "
                   "HYDRA_TUNE_NODE_DIR to a directory of your own")


def _check_private(path: str, is_kind: Any, kind: str, fix: str) -> None:
    st = os.lstat(path)  # lstat: a symlink planted by someone else is refused, not followed
    if not is_kind(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise rule_error(f"the node server's {kind} is a {kind} owned by you (uid {os.getuid()}) with no "
                         "group/other permissions", fix, kind=HydraError, path=path,
                         mode=oct(stat.S_IMODE(st.st_mode)), owner=st.st_uid)


def _make_authkey(path: str) -> None:
    if not os.path.exists(path):  # written whole under a temporary name, then linked: readers never see half a key
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_bytes(32))
        os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process won the race: its key is the key
            os.link(tmp, path)
        os.unlink(tmp)
    _check_private(path, stat.S_ISREG, "authkey file", f"remove {path} (a new one is made; running servers must "
                   "then be stopped)")


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Hold the exclusive ``flock`` on ``path`` (created 0600) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment (with ``extra`` over it), plus hydra_tune's root on PYTHONPATH where this process found it
    through sys.path (a checkout), so the server imports this same package. Not a site dir: its .pth files would
    then be skipped."""
    env, root = {**os.environ, **(extra or {})}, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root in {os.path.abspath(p or ".") for p in sys.path} and root not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


def log_tail(path: str, n: int = 3000) -> str:
    """The last ``n`` characters of the server's log (what a server that failed to start printed)."""
    with open(path, errors="replace") as f:  # a start-up log is short
        return f.read()[-n:]


def server_log(msg: str) -> None:
    """One line in the server's log (its stdout), stamped with the time and the server's pid; then the log rotates
    if it reached its bound (``rotate_log_at``)."""
    with _rotation["lock"]:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [hydra_tune node server {os.getpid()}] {msg}", flush=True)
        _rotate_if_full()


def rotate_log_at(path: str, limit: int) -> None:
    """From now on, once the log at ``path`` (this process's stdout and stderr) holds ``limit`` bytes, the next
    ``server_log`` moves it to ``path + ".1"`` (replacing the one before) and starts a new one at ``path``: a server
    that runs for weeks, a line per client arriving and leaving, keeps at most about 2 x ``limit`` of log."""
    with _rotation["lock"]:
        _rotation.update(path=path, limit=limit)


def _rotate_if_full() -> None:
    path = _rotation["path"]
    if path is None:
        return
    try:
        if os.fstat(sys.stdout.fileno()).st_size < _rotation["limit"]:
            return
        sys.stderr.flush()
        _swap_logs(path)
    except (OSError, ValueError):
        pass   # a log that cannot rotate (moved, no stdout) keeps growing: the server never stops for its log


def _swap_logs(path: str) -> None:
    """The full log becomes ``path + ".1"`` and a new empty one takes ``path``, each by an atomic rename, so a reader
    always finds a log at ``path`` (a rename of the log away first left a moment with none); where hard links are
    refused, the log is renamed away and the new one made after it."""
    fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.link(path, path + ".old")
        except OSError:   # no hard link here (or a stale one in the way): the log is renamed away first
            os.replace(path, path + ".1")
        else:
            os.replace(path + ".old", path + ".1")   # ".1" is the full log; ``path`` still names it too
        os.replace(path + ".new", path)               # ``path`` names the new log
        for target in (sys.stdout.fileno(), sys.stderr.fileno()):   # tracebacks and warnings follow the log
            os.dup2(fd, target)
    finally:
        os.close(fd)
