"""Usage: .venv/bin/python benchmarks/p1_overhead.py [--quick] [--json out.json] [--trace trace.json]

P1, the runtime's overhead: one GPT-2 task trained unsharded (device_memory=None) on one CPU device through
hydra_tune, against the same training in a plain PyTorch loop in this thread (both on one intra-op thread).
Runs alternate hydra, plain, plain, hydra, ... after one untimed warm-up of each; medians are reported.
Headline: hydra / plain steady-state samples/s (after epoch 1); total samples/s (whole run incl. model build and
hydra's planning) alongside. Prints a table, the headline, then one JSON line with every raw number.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

from _common import (SIDE_HEADERS, Spec, alternate, emit, gpt2_factory, hydra_run, median, plain_run, print_table,
                     setup, side_rows, token_batches)

GOAL = 0.97


def main() -> int:
    t_start = time.perf_counter()
    args = setup(__doc__)
    size = args.size
    spec = Spec("p1", gpt2_factory(size), 1e-3, 0, token_batches(size, seed=0), size.epochs)
    print(f"P1 overhead: {size.label()}, AdamW, dropout 0.1, 1 CPU device, 1 thread; {args.repeats} runs per side")

    warm = replace(spec, batches=spec.batches[:2], epochs=2)
    hydra_run([warm], 1, None)
    plain_run([warm])
    runs = alternate({"hydra (1 dev, unsharded)": lambda: hydra_run([spec], 1, None),
                      "plain PyTorch loop": lambda: plain_run([spec])}, args.repeats)
    if args.trace:
        hydra_run([spec], 1, None, trace=args.trace)

    hydra, plain = runs.values()
    print()
    print_table(SIDE_HEADERS, side_rows(runs))
    ratio = median(hydra, "steady_sps") / median(plain, "steady_sps")
    total_ratio = median(hydra, "total_sps") / median(plain, "total_sps")
    loss_diff = max(abs(a - b) for h, p in zip(hydra, plain) for a, b in zip(h["final_loss"], p["final_loss"]))
    print(f"hydra submit (build + plan) {median(hydra, 'submit_s'):.2f} s of {median(hydra, 'wall_s'):.2f} s wall; "
          f"shards {hydra[0]['shards'][0]}; final-epoch loss |hydra - plain| max {loss_diff:.2e}")
    print(f"P1 hydra/plain total throughput (incl. build+plan) = {total_ratio:.3f}x")
    print(f"P1 hydra/plain throughput = {ratio:.3f}x (steady state, median of {args.repeats}; goal >= {GOAL}x)")
    emit({"benchmark": "p1_overhead", "ratio": ratio, "total_ratio": total_ratio, "goal": GOAL,
          "final_loss_max_diff": loss_diff, "runs": runs}, args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
