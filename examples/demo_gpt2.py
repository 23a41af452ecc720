"""Train four tiny GPT-2s (one learning rate each) at once, each cut into shards that fit a small device budget.

    make demo                                                     # or:
    .venv/bin/python examples/demo_gpt2.py --epochs 3 --budget 10MiB --devices 2
    # prints per-task losses and shard counts, then per-device busy time and measured peak vs budget, and
    # writes demo_trace.json (open in https://ui.perfetto.dev) and demo_timeline.png (with matplotlib)
"""
from __future__ import annotations

import argparse
import inspect
import json.decoder
import sys
import textwrap
import time
from collections.abc import Callable

import torch

import hydra_tune as ht
from hydra_tune.errors import format_bytes

SEQ, BATCH, VOCAB = 64, 8, 256
LRS = (1e-4, 3e-4, 1e-3, 3e-3)
Batch = dict[str, torch.Tensor]


def corpus() -> bytes:
    """Text that ships with Python itself: the source (code, comments, docstrings) of a few stdlib modules."""
    return "\n".join(inspect.getsource(m) for m in (textwrap, argparse, json.decoder)).encode("utf-8")


def split(data: bytes, n_train: int, n_eval: int) -> tuple[list[Batch], list[Batch]]:
    """Byte-level tokens (vocab 256) cut into SEQ-byte sequences, shuffled once, split into train and held-out."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    seqs = ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)
    need = (n_train + n_eval) * BATCH
    if need > len(seqs):
        raise SystemExit(f"the corpus has {len(seqs)} sequences of {SEQ} bytes, fewer than the {need} needed")
    seqs = seqs[torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0))[:need]]
    out = [{"input_ids": rows.clone(), "labels": rows.clone()} for rows in seqs.view(-1, BATCH, SEQ)]  # own storage
    return out[:n_train], out[n_train:]


def make_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def warmup(opt: torch.optim.Optimizer, steps: int = 10) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / steps))


def adamw(lr: float) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3, help="epochs per task (default 3)")
    p.add_argument("--budget", default="10MiB", help="memory per device: 10MiB, 2000000 or none (default 10MiB)")
    p.add_argument("--devices", type=int, default=2, help="number of CPU stand-in devices (default 2)")
    p.add_argument("--progress", type=float, default=10.0,
                   help="seconds between status lines (tasks, devices busy, steps/s); 0: none (default 10)")
    p.add_argument("--train-batches", type=int, default=24, help="training batches per epoch (default 24)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches (default 4)")
    p.add_argument("--trace", default="demo_trace.json", help="Chrome trace output ('' to skip)")
    p.add_argument("--timeline", default="demo_timeline.png", help="Gantt chart output ('' to skip)")
    args = p.parse_args(argv)
    args.budget = None if args.budget.lower() == "none" else int(args.budget) if args.budget.isdigit() else args.budget
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one core per CPU device, as the runtime's worker threads use them
    text = corpus()
    train, held_out = split(text, args.train_batches, args.eval_batches)
    tasks = [ht.ModelTask(make_gpt2, adamw(lr), train, eval_data=held_out, epochs=args.epochs, lr_scheduler=warmup,
                          grad_clip_norm=1.0, seed=i, name=f"gpt2-lr{lr:g}") for i, lr in enumerate(LRS)]
    print(f"corpus: {len(text):,} bytes of stdlib source; {len(train)} train + {len(held_out)} eval batches of "
          f"{BATCH}x{SEQ} bytes; {len(tasks)} tasks on {args.devices} CPU devices, budget {args.budget or 'none'} each")
    t0 = time.perf_counter()
    with ht.Runtime(devices=["cpu"] * args.devices, device_memory=args.budget,
                    progress=args.progress or None) as rt:
        try:
            handles = [rt.submit(t) for t in tasks]
        except ht.PlanError as exc:  # the budget is below what one stage needs: the message says how much
            print(f"error: {exc}", file=sys.stderr)
            return 2
        last = [h.result() for h in handles]
        stats = rt.stats()
        trace = rt.trace()
    wall = time.perf_counter() - t0

    print(f"\n{'task':<14}{'lr':>8}{'shards':>8}{'train loss':>12}{'eval loss':>11}{'samples/s':>11}")
    for lr, h, m in zip(LRS, handles, last):
        shards = len(stats["tasks"][h.name]["shards"])
        print(f"{h.name:<14}{lr:>8.0e}{shards:>8}{m['train_loss']:>12.4f}{m['eval_loss']:>11.4f}"
              f"{m['samples'] / m['seconds']:>11.1f}")
    plan = stats["tasks"][handles[0].name]["shards"]
    print(f"plan of {handles[0].name}: " + " | ".join("+".join(s) for s in plan))

    print(f"\n{'device':<8}{'units':>7}{'busy s':>9}{'busy %':>8}{'peak':>12}{'budget':>12}{'peak %':>8}")
    over = []
    for d in stats["devices"]:
        peak, budget = d["peak_bytes"], d["budget"]
        limit, share = (format_bytes(budget), f"{100 * peak / budget:.0f}%") if budget else ("none", "-")
        print(f"{d['name']:<8}{d['units']:>7}{d['busy_seconds']:>9.1f}{100 * d['busy_seconds'] / wall:>7.0f}%"
              f"{format_bytes(peak):>12}{limit:>12}{share:>8}")
        if budget is not None and peak > budget:
            over.append(d["name"])
    print(f"wall {wall:.1f} s; policy {stats['policy']}; prefetch copies hidden under compute: "
          + ", ".join(f"{share:.0%}" for share in trace.overlap()))
    if args.trace:
        trace.save(args.trace)
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.timeline:
        try:
            ht.plot_timeline(trace, args.timeline, title="demo: 4 GPT-2 tasks")
            print(f"timeline: {args.timeline}")
        except ImportError as exc:
            print(f"timeline skipped: {exc}")
    if over:
        print(f"FAIL: measured peak above the budget on {over}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
