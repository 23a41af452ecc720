"""Usage: .venv/bin/python benchmarks/gpt2_calls.py [--layers N] [--steps N] [--top N]

Python function calls per training step of a transformers GPT-2 (the tests' tiny config: width 32, 2 heads, dropout
0.1, AdamW) on one CPU device: the plain loop, the same task as a ``ModelTask``, and the plain loop after
``hydra_tune.prepare``. Counted in every thread (unit_breakdown.py's ``CallCounter``) over a run of ``--steps`` and
one of a fifth as many; their difference per step is the steady state, which the machine's load does not change.
Prints the three counts and the functions where the ModelTask (or, with ``--prepared``, the prepared loop) differs
most from the plain loop.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
from typing import Any

import torch
from unit_breakdown import ROOT, CallCounter, print_differences, steady_calls

sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import lm_batches, make_gpt2  # noqa: E402

import hydra_tune as ht  # noqa: E402


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """The user's loop (the same for a plain and a prepared model)."""
    for b in lm_batches(steps):
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()


def plain(layers: int, steps: int) -> None:
    torch.manual_seed(0)
    model = make_gpt2(n_layer=layers)
    train(model, adamw(model), steps)


def as_task(rt: ht.Runtime, layers: int, steps: int) -> None:
    rt.submit(ht.ModelTask(lambda: make_gpt2(n_layer=layers), adamw, lm_batches(steps), epochs=1, seed=0,
                           name=f"task-{steps}")).result()


def prepared(rt: ht.Runtime, layers: int, steps: int) -> None:
    torch.manual_seed(0)
    model = make_gpt2(n_layer=layers)
    model, opt = ht.prepare(model, adamw(model), seed=0, runtime=rt, name=f"prepared-{steps}")
    train(model, opt, steps)
    model.release()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--prepared", action="store_true", help="list the prepared loop's differences")
    args = p.parse_args()
    torch.set_num_threads(1)
    short, long = max(args.steps // 5, 1), args.steps
    if short == long:
        raise SystemExit("gpt2_calls: --steps must be at least 2")
    counter = CallCounter()
    plain(args.layers, 2)
    runs: dict[str, dict[int, collections.Counter[Any]]] = {
        "plain": {n: counter.count(lambda n=n: plain(args.layers, n)) for n in (short, long)}}
    threading.setprofile(counter)  # (the runtime's threads start after this)
    try:
        with ht.Runtime(devices=["cpu"]) as rt:
            as_task(rt, args.layers, 2)
            prepared(rt, args.layers, 2)
            runs["task"] = {n: counter.count(lambda n=n: as_task(rt, args.layers, n)) for n in (short, long)}
            runs["prepared"] = {n: counter.count(lambda n=n: prepared(rt, args.layers, n)) for n in (short, long)}
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    steady = {k: steady_calls(r, short, long, long - short) for k, r in runs.items()}
    totals = {k: round(sum(v.values())) for k, v in steady.items()}
    print(f"GPT-2 {args.layers} layers, Python calls per step (steady): plain loop {totals['plain']}, ModelTask "
          f"{totals['task']}, prepared {totals['prepared']}")
    print_differences(steady["prepared" if args.prepared else "task"], steady["plain"], args.top)
    print(json.dumps({"benchmark": "gpt2_calls", "layers": args.layers, "calls_per_step": totals}))


if __name__ == "__main__":
    main()
