"""How tasks, models and Tune trainables cross to another process: cloudpickle's object graph in torch's
serialization format, each tensor storage written once.

    blob = dump(task)            # a node client's ModelTask; the server's trained model or snapshot
    task = load(blob)            # the other side
    fn_bytes = dump(train_fn, ray.cloudpickle)   # a Tune trainable (integrations/ray_tune.py), loaded in the
                                                 # runtime actor for each trial

Why: plain pickling writes a tensor's whole storage with every tensor that views it. A task whose minibatches
are slices of one dataset tensor (``[x[i:i + 64] for i in ...]``, the usual way to batch an in-memory set) carried
the whole dataset once per minibatch: the 8x8 digits task of ``benchmarks/small_trials.py`` was 13.8 MB on the
wire for 0.46 MB of data, and its submit spent ~30 ms pickling and unpickling it. ``torch.save`` with
cloudpickle's pickler writes each storage once (factories and lambdas still go by value where cloudpickle sends
them so), and tensors that shared a storage in the sender share one in the receiver, as they do in the sender's
own process (an in-process Runtime sees the user's tensors as they are).

Rules: both sides are the same hydra_tune (a node server imports its client's, node/boot.py; a Ray runtime actor
the driver's); a blob that is not in torch's format (a plain cloudpickle blob: no zip header) still loads. Loading
runs code from the blob, as any unpickling does: only what came over a node connection after its HMAC handshake
(node/connections.py) or as an argument of a Ray actor call (Ray's transport).
"""
from __future__ import annotations

import io
import pickle
from typing import Any

_ZIP = b"PK\x03\x04"  # torch.save's format is a zip archive


def dump(obj: Any, pickle_module: Any = None) -> bytes:
    """``obj`` as bytes: cloudpickle's graph, each storage once (raises what pickling raises). ``pickle_module``:
    the cloudpickle to use (Ray's own for a Tune trainable: the modules it registered to go by value), by default
    the ``cloudpickle`` package."""
    import torch

    if pickle_module is None:
        import cloudpickle as pickle_module
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=pickle_module, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def load(blob: bytes) -> Any:
    """The object ``dump`` wrote (or a plain cloudpickle blob's)."""
    if not blob.startswith(_ZIP):
        return pickle.loads(blob)
    import torch

    # weights_only=False: the blob holds functions and classes by value; it came over an authenticated connection
    return torch.load(io.BytesIO(blob), weights_only=False)
