"""One hydra_tune Runtime per node, shared by many processes (e.g. Optuna workers): a local server and its clients.

    rt = hydra_tune.node.connect(devices=["cpu", "cpu"], device_memory="64MiB")   # find or start the server
    handle = rt.submit(task); print(handle.result()["train_loss"]); model = handle.model()
    rt.close()                                     # the server cancels this client's unfinished tasks

The server (``python -m hydra_tune.node.server``) is one detached process per (OS user, devices, device_memory,
policy), gone ``$HYDRA_TUNE_NODE_LINGER`` s (10) after its last client left. Its files, in the 0700 directory
/tmp/hydra_tune-<uid> ($HYDRA_TUNE_NODE_DIR): ``authkey`` (0600: the connection's HMAC handshake, passed before
anything is unpickled), ``<key>.sock``, ``<key>.lock`` (starting and stopping) and ``<key>.log``. Protocol: the
client sends ``(op, request_id, *args)``; the server replies ``("reply", request_id, ok, value_or_error)`` and
streams ``("metrics"|"status"|"end", task_id, ...)``; task ids are the client's, so events may precede a reply.
"""
from .client import NodeRuntime, RemoteError, RemoteHandle, TaskNotPicklable, connect
from .files import server_files

__all__ = ["connect", "server_files", "NodeRuntime", "RemoteHandle", "RemoteError", "TaskNotPicklable"]
