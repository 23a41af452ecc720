"""A task's data: what each epoch iterates, and the sample batch taken at submit without touching the user's data.

    loader = epoch_data(task.train_data, "train_data", task.name)   # the data, or what its factory returns now
    batch = sample_batch(task.train_data, task.seed, task.name)   # NO_BATCH when the data yields nothing
    data_length(loader)                                    # len(loader), or None

Rules:
* An epoch iterates the data as the plain loop does: ``for batch in data`` every epoch, or, for a zero-argument
  factory, ``for batch in factory()``: it is called once at the start of every epoch (train: before its first
  batch; eval: before each evaluation), in the task's RNG stream, and may return any iterable, a generator too.
* Each training epoch starts as the plain loop's ``sampler.set_epoch(epoch)`` idiom (``set_epoch``): the train
  DataLoader's samplers with a ``set_epoch`` (DistributedSampler) are given the epoch, 0 for the first.
* A resumed epoch starts from the state the train data had at that epoch's start, before ``set_epoch``: the
  states of its own generators (``data_generators``: the loader's, its samplers', its dataset's) and the Python
  state of its samplers (``sampler_state``), both in the checkpoint.
* A DataLoader given as the data is iterated as the task's own clone, made when the task is built: copies of its
  sampler, batch sampler and ``generator=`` (the dataset shared). Tasks sharing one loader each start from its
  state then, as the plain loop alone would, and the user's loader, its generator and sampler are not advanced.
* The sample batch (for the checks and the cost profile at submit) leaves the user's objects as the plain loop
  would find them: a DataLoader is sampled through a clone whose sampler and generators are copies (so
  ``generator=g``, a sampler's state and persistent workers stay untouched), its dataset a shallow copy or, with
  workers, read by one worker process; any other iterable through a shallow copy; the generators a dataset holds
  itself get their states back after it. Random draws of the sample come from a scratch stream seeded with the
  task's seed, never the task's own.
* A factory is called for the sample too (its random draws then come from the scratch stream): it must return a
  fresh iterable on every call. A one-shot result (a generator) is checked for that: two calls must give the same
  first batch, else the task is refused (slices of one shared iterator would lose the sample's batch).
* Python's ``random`` and numpy's global generator are shared by every thread of the process: data that draws
  from them in this process (a dataset with ``num_workers=0``, a sampler, a collate_fn) cannot be given the
  task's stream, so the sample batch refuses it (checked while no other task's sample is taken: one that blocks
  holds the others up for ``SAMPLE_WAIT_S`` at most). In DataLoader workers PyTorch seeds both from the task's
  stream.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten  # torch's own pytree walk: there is no public one

from ..device.dispatch import UnitMode
from ..errors import rule_error
from . import host_rng
from .build import build_part
from .pystate import ModuleState

NO_BATCH = object()
SAMPLE_WAIT_S = 10.0  # how long a sample waits for another task's to end before it goes on unchecked
_SAMPLE_LOCK = threading.Lock()


def is_factory(data: Any) -> bool:
    """A zero-argument data factory: callable, and not itself iterable."""
    return callable(data) and not hasattr(data, "__iter__")


def epoch_data(data: Any, what: str, task: str) -> Iterable[Any]:
    """What one epoch iterates: ``data``, or what its factory returns now (call it in the task's RNG mode)."""
    if not is_factory(data):
        return data
    made = build_part(data, f"{what} (the data factory)")
    if not isinstance(made, Iterable):
        raise rule_error(f"the `{what}` factory returns an iterable", "return a DataLoader, a list of batches or "
                         "a generator", kind=TypeError, task=task, returned=type(made).__name__)
    return made


def data_length(data: Any) -> int | None:
    """``len(data)``, or None for data without a length."""
    try:
        return int(len(data))
    except TypeError:
        return None


def data_generators(data: Any) -> list[torch.Generator]:
    """The torch.Generators ``data`` draws from besides the task's stream, each once, in a fixed order: a
    DataLoader's ``generator=``, those its sampler and batch sampler hold (and samplers nested in them, two levels
    down), and its dataset's own (datasets nested in it too: a Subset's); of any other iterable, its attributes.
    Checkpoints keep their states at each epoch's start, so a resumed epoch repeats its order and draws."""
    from torch.utils.data import DataLoader, Dataset, Sampler

    found: dict[int, torch.Generator] = {}

    def walk(holder: Any, depth: int) -> None:
        for value in list(getattr(holder, "__dict__", {}).values()):
            nested = value if isinstance(value, (list, tuple)) and len(value) <= 64 else [value]  # ConcatDataset's
            for item in nested:
                if isinstance(item, torch.Generator):
                    found.setdefault(id(item), item)
                elif depth and isinstance(item, (Sampler, Dataset)):
                    walk(item, depth - 1)

    walk(data, 0)
    if isinstance(data, DataLoader):
        for holder in (data.sampler, data.batch_sampler, getattr(data.batch_sampler, "sampler", None),
                       data.dataset):
            walk(holder, 2)
    del walk  # a recursive closure is a cycle (holding ``found``) until Python's collector runs
    return list(found.values())


@contextlib.contextmanager
def _generators_kept(data: Any) -> Iterator[None]:
    """``data``'s own generators (``data_generators``: a dataset's too, which a sample read in this process
    draws from) have their states back after the block."""
    states = [(g, g.get_state()) for g in data_generators(data)]
    try:
        yield
    finally:
        for generator, state in states:
            generator.set_state(state)


def restore_generators(data: Any, states: list[torch.Tensor] | None, task: str, what: str = "train data") -> None:
    """A resume: put the states its checkpoint recorded (``states``; None: none recorded) into ``data``'s own
    generators (train data: at the resumed epoch's start; eval data: at the build, as they stood)."""
    generators = _matching_generators(data, states, task, what)
    for generator, state in zip(generators, states or ()):
        generator.set_state(state)


def _matching_generators(data: Any, states: list[torch.Tensor] | None, task: str,
                         what: str = "train data") -> list[torch.Generator]:
    generators = data_generators(data)
    if (states is not None or generators) and len(states or ()) != len(generators):
        raise rule_error(f"the resumed task's {what} has as many generators of its own as the checkpointed "
                         "task's (their states are in the checkpoint)", "build the DataLoader (its generator= and "
                         "sampler) as the checkpointed task did, with a checkpoint written by this hydra_tune "
                         "version", task=task, checkpoint=None if states is None else len(states),
                         data=len(generators))
    return generators


def sampler_state(data: Any) -> ModuleState | None:
    """The Python state of ``data``'s samplers now (a DataLoader's sampler, batch sampler and the batch sampler's
    sampler), labelled by their role; None for other data. A checkpoint carries what changed in it by each epoch's
    start (a counter a sampler's ``__iter__`` steps, DistributedSampler's epoch)."""
    from torch.utils.data import DataLoader

    if not isinstance(data, DataLoader):
        return None
    named: dict[int, tuple[str, Any]] = {}
    for role, sampler in (("sampler", data.sampler), ("batch_sampler", data.batch_sampler),
                          ("batch_sampler.sampler", getattr(data.batch_sampler, "sampler", None))):
        if hasattr(sampler, "__dict__"):
            named.setdefault(id(sampler), (role, sampler))
    return ModuleState.of_objects(list(named.values()), opaque=[data.dataset])  # the dataset: not theirs


def set_epoch(data: Any, epoch: int) -> None:
    """As the plain loop's ``sampler.set_epoch(epoch)`` at each epoch's start (``epoch``: 0 for the first): the
    sampler, batch sampler and batch sampler's sampler of a DataLoader that have a ``set_epoch`` (DistributedSampler)
    are given it, each once. They are the task's own copies (``loader_clone``), or what its factory made."""
    from torch.utils.data import DataLoader

    if not isinstance(data, DataLoader):
        return
    done: set[int] = set()
    for sampler in (data.sampler, data.batch_sampler, getattr(data.batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and id(sampler) not in done:
            done.add(id(sampler))
            sampler.set_epoch(epoch)


def check_resume(task: Any, epoch: int, states: list[torch.Tensor] | None) -> None:
    """Refuse at submit what a resume at ``epoch`` cannot repeat: train data whose own generators do not match the
    checkpoint's ``states``; a DataLoader with persistent workers, which made its iterator (and drew its base seed)
    in the first epoch, and whose workers keep their random state, in no checkpoint."""
    from torch.utils.data import DataLoader

    if not is_factory(task.train_data):  # a factory's data is checked when the resumed epoch makes it
        _matching_generators(task.train_data, states, task.name)
    for what in ("train_data", "eval_data"):
        data = getattr(task, what)
        if epoch > 1 and isinstance(data, DataLoader) and data.persistent_workers and data.num_workers > 0:
            raise rule_error("a task resumed after its first epoch has no DataLoader with persistent workers (they "
                             "keep random state from earlier epochs that no checkpoint holds)", "train and resume "
                             "with persistent_workers=False: the workers then start each epoch from the task's "
                             "stream, which the checkpoint holds", task=task.name, data=what, epoch=epoch)


def sample_batch(data: Any, seed: int, task: str, what: str = "train_data") -> Any:
    """The first batch of a fresh epoch of ``data`` (``NO_BATCH`` if it yields none), taken without advancing the
    user's iterables, samplers or generators; random draws come from a scratch stream seeded with ``seed``."""
    with _one_sample_at_a_time() as alone, UnitMode(torch.Generator().manual_seed(seed)), \
            _no_global_draws(task, what, check=alone):
        if not is_factory(data):
            return _peek(data, seed)
        made = epoch_data(data, what, task)
        if not isinstance(made, Iterator):  # re-iterable (a DataLoader, a list): sampled as any data is
            return _peek(made, seed)
        first = next(made, NO_BATCH)
    with UnitMode(torch.Generator().manual_seed(seed)):
        again = next(iter(epoch_data(data, what, task)), NO_BATCH)
    if not _same(first, again):
        raise rule_error(f"the `{what}` factory returns a fresh iterable on every call (two calls give the same "
                         "first batch)", "build the stream inside the factory, e.g. `lambda: itertools.islice("
                         "iter(stream), n)` rather than slices of one shared iterator: hydra_tune calls it at "
                         "submit for a sample batch, and once per epoch", task=task, data=what,
                         returned=type(made).__name__)
    return first


def _peek(data: Any, seed: int) -> Any:
    from torch.utils.data import DataLoader

    with _generators_kept(data):  # a dataset's own generator is shared by the clone or copy
        if isinstance(data, DataLoader):
            data = _sample_clone(data, seed)
        elif not isinstance(data, (list, tuple)):
            with contextlib.suppress(Exception):  # not copyable: iterated itself
                data = copy.copy(data)
        return next(iter(data), NO_BATCH)


def task_data(data: Any) -> Any:
    """What a task iterates in place of ``data``: a DataLoader becomes the task's own (``loader_clone``), so tasks
    sharing one loader, or trained one after another, each start from its sampler's and generator's state at
    submit, and the user's loader is never advanced; a factory or any other data stays as it is."""
    from torch.utils.data import DataLoader

    return loader_clone(data) if isinstance(data, DataLoader) else data


def close_workers(data: Any) -> None:
    """Shut down the persistent workers of a task's own DataLoader copy (``task_data``) when the task ends: left to
    the garbage collector, they live on and their shutdown pauses some later allocation for seconds per worker."""
    from torch.utils.data import DataLoader

    it = getattr(data, "_iterator", None) if isinstance(data, DataLoader) else None
    if it is None:
        return
    vars(data)["_iterator"] = None
    shutdown = getattr(it, "_shutdown_workers", None)  # torch's own iterator method: there is no public one
    if shutdown is not None:
        shutdown()


def loader_clone(loader: Any) -> Any:
    """A shallow copy of ``loader`` with deep copies of its sampler, batch sampler and generator (sharing among
    them preserved; the dataset shared, not copied) and no live iterator: it iterates as ``loader`` would now."""
    dataset = loader.dataset
    try:
        samplers = copy.deepcopy((loader.sampler, loader.batch_sampler, loader.generator), {id(dataset): dataset})
    except Exception as exc:
        raise rule_error("the DataLoader's sampler, batch_sampler and generator can be copied (copy.deepcopy): "
                         "each task iterates its own", "make them deep-copyable (no locks or open files in a custom "
                         "sampler), or pass a list of batches", kind=TypeError, sampler=type(loader.sampler).__name__,
                         batch_sampler=type(loader.batch_sampler).__name__, error=f"{type(exc).__name__}: {exc}"
                         ) from None
    clone = copy.copy(loader)
    # Written to the clone's __dict__: DataLoader refuses to set sampler or dataset after its __init__.
    vars(clone).update(sampler=samplers[0], batch_sampler=samplers[1], generator=samplers[2], _iterator=None)
    return clone


def _sample_clone(loader: Any, seed: int) -> Any:
    """``loader_clone`` for one sample batch: at most one worker and no persistent one; without workers, a
    shallow copy of the dataset (``__getitem__`` changing its attributes does not reach the user's)."""
    clone = loader_clone(loader)
    workers = min(loader.num_workers, 1)
    if not workers:
        with contextlib.suppress(Exception):
            vars(clone)["dataset"] = copy.copy(loader.dataset)
    if clone.generator is None:  # its base seed drawn from a scratch generator, not from any stream
        vars(clone)["generator"] = torch.Generator().manual_seed(seed)
    vars(clone).update(num_workers=workers, persistent_workers=False)
    return clone


@contextlib.contextmanager
def _one_sample_at_a_time() -> Iterator[bool]:
    """Whether this sample is the only one being taken (so the global generators' check sees its own draws only);
    a sample that blocks holds the others up for ``SAMPLE_WAIT_S`` at most, then they go on unchecked."""
    alone = _SAMPLE_LOCK.acquire(timeout=SAMPLE_WAIT_S)
    try:
        yield alone
    finally:
        if alone:
            _SAMPLE_LOCK.release()


@contextlib.contextmanager
def _no_global_draws(task: str, what: str, check: bool) -> Iterator[None]:
    written = host_rng.writes()
    before = host_rng.states() if check else {}
    yield
    after = host_rng.states() if check else {}
    if host_rng.writes() != written:  # hydra_tune set them meanwhile (another task's build): no verdict
        return
    for name in before:
        if name in after and after[name] != before[name]:
            raise rule_error(f"`{what}` draws no random numbers from the global generator of `{name}` in this "
                             "process (it is shared by all threads: the task's own stream cannot be given to it)",
                             "draw with torch (torch.rand, torch.randperm: the task's stream), load with "
                             "DataLoader(num_workers>=1) (PyTorch seeds `random` and numpy in each worker from the "
                             "task's stream), or keep a generator of the dataset's own (random.Random(seed), "
                             "numpy.random.default_rng(seed))", task=task, data=what, module=name)


def _same(a: Any, b: Any) -> bool:
    """Two batches equal leaf by leaf (tensors by value); leaves that cannot be compared count as equal."""
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x, y)):
                return False
            continue
        try:
            if not bool(x == y):
                return False
        except Exception:  # an array's ambiguous truth value, a type without ==
            continue
    return True
