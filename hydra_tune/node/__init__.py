"""One hydra_tune Runtime per node, shared by many processes (e.g. Optuna workers): a local server and its clients.

    rt = hydra_tune.node.connect(devices=["cpu", "cpu"], device_memory="64MiB")   # find or start the server
    config = hydra_tune.RuntimeConfig(devices=["cpu", "cpu"], device_memory="64MiB")
    rt = hydra_tune.node.connect(config=config)        # the same server: a config or its four keywords, not both
    handle = rt.submit(task); print(handle.result()["train_loss"]); model = handle.model()
    rt.close()                                         # the server cancels this client's unfinished tasks
    pool = hydra_tune.node.spread(["cpu", "cpu"])      # a server per device: small models' devices share no GIL
    print(open(hydra_tune.node.server_files(config=config)["log"]).read())       # what that server printed

The server (``python hydra_tune/node/boot.py``, run by its path so that a ``hydra_tune.py`` in the working
directory cannot shadow the package there) is one detached process per (OS user, RuntimeConfig, Python
interpreter, visible GPUs), gone ``$HYDRA_TUNE_NODE_LINGER`` s (10) after its last client left. Its files, in the
0700 directory /tmp/hydra_tune-<uid> ($HYDRA_TUNE_NODE_DIR): ``authkey`` (0600: the connection's HMAC handshake,
passed before anything is unpickled), ``<key>.sock``, ``<key>.lock`` (starting and stopping) and ``<key>.log``.

Modules: ``client`` (connect, NodeRuntime, RemoteHandle), ``files`` (where a server lives), ``wire`` (the messages
and how errors travel), and the server's: ``boot`` (its start: which hydra_tune it imports), ``server`` (its
lifetime), ``connections``, ``handlers``, ``forward``; ``spread`` (a pool of one-device servers). Tasks and models travel as ``hydra_tune/shipping.py``
writes them (each tensor storage once).
"""
from .client import NodeRuntime, RemoteHandle, connect
from .files import server_files
from .spread import NodePool, spread
from .wire import RemoteError, TaskNotPicklable

__all__ = ["connect", "spread", "server_files", "NodeRuntime", "NodePool", "RemoteHandle", "RemoteError",
           "TaskNotPicklable"]
