"""ASHA search (Ray Tune) over learning rate, weight decay and warmup for a GPT-2 causal LM, on hydra_tune.

    python examples/tune_gpt2.py                               # tiny GPT-2, CPU stand-in devices, < 5 min on 2 cores
    python examples/tune_gpt2.py --model gpt2-medium --devices auto --device-memory 20GiB --samples 16   # on GPUs

Corpus (offline): the source of a few Python stdlib modules (textwrap, argparse, json.decoder), byte-level tokens,
exactly as examples/demo_gpt2.py (its corpus/split helpers are reused). Every trial is an ordinary Tune function;
``HydraExecutor`` runs all of them on one shared hydra_tune runtime per node, and ASHA's stops cancel tasks at once.
Prints a results table, the best config, the devices' busy share, and writes the runtime's trace and timeline.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_gpt2  # noqa: E402  (corpus, split, sizes: shared with the single-runtime demo)
import torch  # noqa: E402

import hydra_tune as ht  # noqa: E402

SIZES = {"tiny": dict(n_layer=4, n_embd=64, n_head=4), "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
         "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16), "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20)}


def make_model(size: str, **config: Any) -> torch.nn.Module:
    """A randomly initialised GPT-2 of ``size``; ``config`` overrides GPT2Config fields (e.g. dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(vocab_size=demo_gpt2.VOCAB, n_positions=demo_gpt2.SEQ, bos_token_id=0,
                                      eos_token_id=0, **SIZES[size], **config))


def train_fn(config: dict[str, Any]) -> None:
    """An ordinary Tune function: build the task from the config, report every epoch's metrics."""
    from ray import tune

    torch.set_num_threads(1)
    train, held_out = demo_gpt2.split(demo_gpt2.corpus(), config["train_batches"], config["eval_batches"])
    task = ht.ModelTask(
        lambda: make_model(config["model"]),
        lambda m: torch.optim.AdamW(m.parameters(), lr=config["lr"], weight_decay=config["weight_decay"]),
        train, eval_data=held_out, epochs=config["epochs"], grad_clip_norm=1.0, seed=0,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / config["warmup"])))
    for metrics in ht.train(task):
        tune.report(metrics)


def search_parser(doc: str, epochs_help: str) -> argparse.ArgumentParser:
    """The options every GPT-2 search example shares (model size, data, devices); parse with ``parse_search``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", choices=sorted(SIZES), default="tiny", help="GPT-2 size (default tiny)")
    p.add_argument("--epochs", type=int, default=6, help=epochs_help)
    p.add_argument("--train-batches", type=int, default=16, help="training batches per epoch (default 16)")
    p.add_argument("--eval-batches", type=int, default=2, help="held-out batches (default 2)")
    p.add_argument("--devices", default="cpu,cpu", help="'auto', a count, or names such as cpu,cpu (default)")
    p.add_argument("--device-memory", default=None, help="budget per device, e.g. 10MiB (default: none)")
    return p


def parse_search(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    d = args.devices
    args.devices = d if d == "auto" else int(d) if d.isdigit() else d.split(",")
    return args


def trial_lines(max_t: int) -> Any:
    """A Tune callback printing one line per trial result and per trial end, with the trials' states so far."""
    from ray import tune

    class TrialLines(tune.Callback):
        def _states(self, trials: list, ended: Any = None) -> str:
            counts: dict[str, int] = {}
            for t in trials:   # Tune calls on_trial_complete before it marks the trial terminated
                status = "terminated" if t is ended else t.status.lower()
                counts[status] = counts.get(status, 0) + 1
            return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))

        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            print(f"{time.strftime('%H:%M:%S')} trial {trial.trial_id} epoch {result.get('training_iteration')}/"
                  f"{max_t}: eval loss {result.get('eval_loss', float('nan')):.4f} (train "
                  f"{result.get('train_loss', float('nan')):.4f}) | {self._states(trials)}", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            done = trial.last_result.get("training_iteration", 0)
            how = "finished" if done >= max_t else f"stopped by ASHA after {done} epochs"
            print(f"{time.strftime('%H:%M:%S')} trial {trial.trial_id} {how} | {self._states(trials, trial)}", flush=True)

    return TrialLines()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = search_parser(__doc__, "max epochs per trial = ASHA's max_t (default 6)")
    p.add_argument("--samples", type=int, default=12, help="trials sampled (default 12)")
    p.add_argument("--concurrent", type=int, default=4, help="max_concurrent_trials (default 4)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs for the local Ray (default 2)")
    p.add_argument("--progress", choices=("lines", "tune", "none"), default="lines",
                   help="while it runs: one line per trial result (default), Tune's own status tables, or nothing")
    p.add_argument("--trace", default="tune_trace.json", help="Chrome trace output ('' to skip)")
    p.add_argument("--timeline", default="tune_timeline.png", help="Gantt chart output ('' to skip)")
    return parse_search(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import cloudpickle, tune
    from ray.tune.schedulers import ASHAScheduler

    cloudpickle.register_pickle_by_value(demo_gpt2)   # the runtime actors need not find examples/ on their path
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ex = ht.HydraExecutor(devices=args.devices, device_memory=args.device_memory)
    space = {"lr": tune.loguniform(1e-4, 1e-2), "weight_decay": tune.choice([0.0, 0.01, 0.1]),
             "warmup": tune.choice([1, 5, 20]), "model": args.model, "epochs": args.epochs,
             "train_batches": args.train_batches, "eval_batches": args.eval_batches}
    tuner = tune.Tuner(
        ex.wrap(train_fn), param_space=space,
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min", num_samples=args.samples,   # seeded sampling;
                                    search_alg=tune.search.BasicVariantGenerator(        # max_concurrent here is
                                        random_state=0, max_concurrent=args.concurrent),  # max_concurrent_trials
                                    scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="tune_gpt2_"),
                                  callbacks=[ex] + ([trial_lines(args.epochs)] if args.progress == "lines" else []),
                                  verbose=1 if args.progress == "tune" else 0))
    t0 = time.perf_counter()
    results = tuner.fit()
    wall = time.perf_counter() - t0
    print(f"corpus: stdlib source, {args.train_batches} train + {args.eval_batches} eval batches of "
          f"{demo_gpt2.BATCH}x{demo_gpt2.SEQ} bytes; model {args.model}; devices {args.devices} per node")
    print(f"\n{'trial':<14}{'lr':>9}{'wd':>6}{'warmup':>8}{'epochs':>8}{'train loss':>12}{'eval loss':>11}  status")
    rows = sorted(results, key=lambda r: r.metrics.get("eval_loss", float("inf")))
    for r in rows:
        c, m = r.config, r.metrics
        status = "error" if r.error else "done" if m.get("training_iteration") == args.epochs else "stopped"
        print(f"{m.get('trial_id', '?'):<14}{c['lr']:>9.2e}{c['weight_decay']:>6}{c['warmup']:>8}"
              f"{m.get('training_iteration', 0):>8}{m.get('train_loss', float('nan')):>12.4f}"
              f"{m.get('eval_loss', float('nan')):>11.4f}  {status}")
    best = results.get_best_result()
    print(f"\nbest config: lr={best.config['lr']:.2e} weight_decay={best.config['weight_decay']} "
          f"warmup={best.config['warmup']} (eval loss {best.metrics['eval_loss']:.4f})")
    epochs = sum(r.metrics.get("training_iteration", 0) for r in results)
    print(f"search wall {wall:.1f} s; {len(results)} trials, {epochs} epochs trained, "
          f"{sum(1 for r in rows if r.metrics.get('training_iteration', 0) < args.epochs)} stopped early by ASHA")
    for nid, st in ex.final_stats.items():
        cancelled = sum(t["state"] == "cancelled" for t in st["tasks"].values())
        busy = ", ".join(f"{d['name']} {100 * d['busy_seconds'] / wall:.0f}%" for d in st["devices"])
        print(f"node {nid[:8]}: {len(st['tasks'])} tasks ({cancelled} cancelled); devices busy: {busy}")
    for nid, trace in ex.final_traces.items():
        if args.trace:
            trace.save(args.trace)
            print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
        if args.timeline:
            try:
                ht.plot_timeline(trace, args.timeline, title=f"ASHA over {len(results)} GPT-2 trials")
                print(f"timeline: {args.timeline}")
            except ImportError as exc:
                print(f"timeline skipped: {exc}")
        break   # one node here; a cluster run saves the first node's timeline
    ray.shutdown()
    return 1 if results.num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
