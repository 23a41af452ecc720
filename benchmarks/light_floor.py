"""Usage: .venv/bin/python benchmarks/light_floor.py [--trials 10] [--epochs 3] [--repeats 3] [--json out.json]

How fast could a small trial run on a runtime at all (issue 15)? small_trials.py's digits-MLP trials three ways, one
and two at a time in one process: the plain loop (small_trials' ``plain_trial``), hydra_tune (an in-process Runtime
of one or two CPU devices), and the *floor*: the plain loop plus what the runtime must do per minibatch to keep its
promise for a resident one-shard task, and nothing else:

- the task's own random stream: dropout drawn from a generator of the trial's, in torch's own four calls
  (``device/dropout.py``'s short form, what hydra's units use), the model built from that stream;
- the quiet-unit guard: torch's global generator read before and after every unit and compared (``device/quiet.py``);
- the batch's device copy (a CPU device's copy is a clone) and the loss read to the host after every unit;
- the RNG snapshots a retry and a checkpoint need: one when a minibatch starts, one at every step boundary.

The floor's trials draw exactly hydra's numbers, so their accuracies must equal hydra's (checked and printed: the
floor does the work hydra does). Read: ``hydra - floor`` per unit is what the runtime's machinery costs beyond its
obligations (segments, board, worker, trace, state home, boundaries); ``plain / floor`` with two threads is the most
an in-process runtime of two CPU devices can reach against plain loops two at a time. Each number is the fastest of
``--repeats`` runs, every side once a round (other load inflates a run, never deflates it).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import write_line
from small_trials import digits, hydra_search, plain_search, trial_task

import hydra_tune as ht
from hydra_tune.device.dispatch import UnitMode
from hydra_tune.device.dropout import matches_torch, routed_dropout
from hydra_tune.device.rng import TaskRNG
from hydra_tune.device.seeding import seeding_to

def _global_state() -> bytes:
    return torch.default_generator.get_state().numpy().tobytes()


def _build(task: ht.ModelTask) -> tuple[nn.Module, torch.Generator]:
    """The trial's model, built from its own stream as a task's is (the init's draws routed to it: torch's global
    generator, which the other thread's guard reads, stays still), and that stream's generator."""
    rng = TaskRNG(task.seed)
    with UnitMode(rng.cpu), seeding_to(rng):
        model = task.model()
    return model, rng.cpu


def _forward(model: nn.Sequential, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    for module in model:
        if isinstance(module, nn.Dropout) and module.training:
            routed = routed_dropout((x, module.p, True, False), {}, gen)
            x = routed if routed is not None else module(x)
        else:
            x = module(x)
    return x


def _guarded(unit: Callable[[], float]) -> float:
    before = _global_state()
    value = unit()
    if _global_state() != before:
        raise RuntimeError("light_floor: a unit drew from torch's global generator")
    return value


def floor_trial(task: ht.ModelTask, after_unit: Callable[[], None] | None = None) -> float:
    """The plain loop with the runtime's per-minibatch obligations (module docstring); the last accuracy.
    ``after_unit()`` runs after every step and eval batch, as in small_trials' ``plain_trial``."""
    model, gen = _build(task)
    assert isinstance(model, nn.Sequential), "light_floor runs small_trials' Sequential MLP"
    opt = task.optimizer(model)
    acc = 0.0
    for _ in range(task.epochs):
        model.train()
        for x, y in task.train_data:
            gen.get_state()  # the minibatch's retry point

            def train_unit() -> float:
                loss = F.cross_entropy(_forward(model, x.clone(), gen), y.clone())
                loss.backward()
                return loss.item()
            _guarded(train_unit)
            opt.step()
            opt.zero_grad()
            gen.get_state()  # the step boundary's checkpoint position
            if after_unit is not None:
                after_unit()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in task.eval_data:
                def eval_unit() -> float:
                    nonlocal correct
                    xd, yd = x.clone(), y.clone()
                    out = _forward(model, xd, gen)
                    correct += int((out.argmax(-1) == yd).sum().item())
                    return F.cross_entropy(out, yd).item()
                _guarded(eval_unit)
                total += y.numel()
                if after_unit is not None:
                    after_unit()
        acc = correct / total
    return acc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not matches_torch():
        raise SystemExit("light_floor: this torch's CPU dropout is not the short form hydra's units use")
    train, val = digits()
    units = args.trials * args.epochs * (len(train) + len(val))

    def tasks() -> list[ht.ModelTask]:
        return [trial_task(i, train, val, args.epochs) for i in range(args.trials)]
    sides: dict[str, Callable[[int], tuple[float, list[float]]]] = {
        "plain": lambda n: plain_search(tasks(), n), "floor": lambda n: plain_search(tasks(), n, trial=floor_trial),
        "hydra": lambda n: hydra_search(tasks(), n)}
    for side in sides.values():  # warm-up: imports, first calls, the allocator
        side(1)
    walls: dict[tuple[str, int], list[float]] = {(s, n): [] for s in sides for n in (1, 2)}
    accs: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):  # every setting once a round, the order rotated: the drift reaches each alike
        keys = list(walls)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            wall, accs[key] = sides[key[0]](key[1])
            walls[key].append(wall)
    best = {key: min(w) for key, w in walls.items()}
    same = accs[("floor", 1)] == accs[("hydra", 1)] == accs[("floor", 2)] == accs[("hydra", 2)]
    print(f"{args.trials} trials x {args.epochs} epochs of small_trials.py's MLP ({units} units), fastest of "
          f"{args.repeats}, seconds (us per unit):")
    for n in (1, 2):
        row = ", ".join(f"{s} {best[(s, n)]:.3f} s ({best[(s, n)] / units * 1e6:.0f} us)" for s in sides)
        print(f"  {n} at a time: {row}")
        print(f"    plain/floor {best[('plain', n)] / best[('floor', n)]:.3f}x, plain/hydra "
              f"{best[('plain', n)] / best[('hydra', n)]:.3f}x")
    machinery = (best[("hydra", 1)] - best[("floor", 1)]) / units * 1e6
    obligations = (best[("floor", 1)] - best[("plain", 1)]) / units * 1e6
    print(f"  alone, per unit: the floor's obligations {obligations:.0f} us, hydra's machinery beyond them "
          f"{machinery:.0f} us")
    print(f"  floor's accuracies equal hydra's (the same draws, the same work): {same}")
    write_line({"benchmark": "light_floor", "trials": args.trials, "epochs": args.epochs, "units": units,
                "best_s": {f"{s}_{n}": v for (s, n), v in best.items()},
                "walls": {f"{s}_{n}": v for (s, n), v in walls.items()},
                "obligations_us": obligations, "machinery_us": machinery, "accuracies_equal": same}, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
