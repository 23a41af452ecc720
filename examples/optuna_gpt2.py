"""TPE + MedianPruner (Optuna) over learning rate, weight decay, warmup and dropout for a GPT-2 causal LM, on hydra_tune.

    python examples/optuna_gpt2.py                              # tiny GPT-2, CPU stand-in devices, < 5 min on 2 cores
    python examples/optuna_gpt2.py --storage sqlite:///gpt2.db  # run it in several terminals: one shared runtime
    python examples/optuna_gpt2.py --model gpt2-medium --devices auto --device-memory 20GiB --trials 32   # GPUs

The same setup as examples/tune_gpt2.py (its corpus, sizes and model are reused). The objective is an ordinary
Optuna objective: build the task from the trial, report every epoch's eval loss, prune when Optuna says so.
``hydra_tune.optuna_study`` runs the concurrent trials on one shared runtime; a pruned trial's task is cancelled
at once. Prints the trials, the best one and the devices' busy share; writes Optuna's optimization-history and
parameter-importance plots (HTML) when plotly is installed, and the runtime's trace.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_gpt2  # noqa: E402  (corpus and split)
import torch  # noqa: E402
import tune_gpt2  # noqa: E402  (GPT-2 sizes and model factory)

import hydra_tune as ht  # noqa: E402


def make_objective(args: argparse.Namespace):
    train, held_out = demo_gpt2.split(demo_gpt2.corpus(), args.train_batches, args.eval_batches)

    def objective(trial) -> float:
        import optuna

        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        wd = trial.suggest_categorical("weight_decay", [0.0, 0.01, 0.1])
        warmup = trial.suggest_categorical("warmup", [1, 5, 20])
        dropout = trial.suggest_float("dropout", 0.0, 0.2)
        task = ht.ModelTask(
            lambda: tune_gpt2.make_model(args.model, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout),
            lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd),
            train, eval_data=held_out, epochs=args.epochs, grad_clip_norm=1.0, seed=0,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup)))
        for m in ht.train(task):
            trial.report(m["eval_loss"], m["epoch"])
            if trial.should_prune():
                raise optuna.TrialPruned()
        return m["eval_loss"]
    return objective


def trial_line(total: int | None):
    """An Optuna callback: one line per finished trial (state, value, epochs, params, how many done, best so far)."""
    def report(study, trial) -> None:
        ended = sum(t.state.is_finished() for t in study.trials)
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        try:
            best = f"best {study.best_value:.4f} (trial {study.best_trial.number})"
        except ValueError:   # no completed trial yet
            best = "no completed trial yet"
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        print(f"[{ended}/{total or '?'}] trial {trial.number} {trial.state.name.lower()}: eval loss {value} after "
              f"{trial.last_step or 0} epochs ({params}); {best}", flush=True)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tune_gpt2.search_parser(__doc__, "max epochs per trial (default 6)")
    p.add_argument("--trials", type=int, default=16, help="trials (default 16)")
    p.add_argument("--n-jobs", type=int, default=None, help="trials at once (default: the study's concurrency)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: in memory)")
    p.add_argument("--study-name", default="optuna_gpt2", help="study name (with --storage: shared by processes)")
    p.add_argument("--out", default=".", help="folder for the plots and the trace (default: here)")
    p.add_argument("--quiet", action="store_true", help="no line per finished trial")
    p.add_argument("--progress", type=float, default=0.0,
                   help="seconds between the runtime's status lines (tasks, devices busy, steps/s); 0: none")
    return tune_gpt2.parse_search(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import optuna

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.progress:   # the study's runtime reads it (hydra_tune/runtime/progress.py)
        os.environ["HYDRA_TUNE_PROGRESS"] = str(args.progress)
    study = ht.optuna_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0),
                            pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
                            storage=args.storage, study_name=args.study_name, load_if_exists=True,
                            devices=args.devices, device_memory=args.device_memory)
    t0 = time.perf_counter()
    with study:
        study.optimize(make_objective(args), n_trials=args.trials, n_jobs=args.n_jobs,
                       callbacks=[] if args.quiet else [trial_line(args.trials)])
        wall = time.perf_counter() - t0
        stats = study.runtime_stats()
        trace = study.runtime.trace()
    State = optuna.trial.TrialState
    print(f"corpus: stdlib source, {args.train_batches} train + {args.eval_batches} eval batches of "
          f"{demo_gpt2.BATCH}x{demo_gpt2.SEQ} bytes; model {args.model}; devices {args.devices}; "
          f"{study.concurrency if args.n_jobs is None else args.n_jobs} trials at once")
    print(f"\n{'trial':>5}{'lr':>10}{'wd':>6}{'warmup':>8}{'dropout':>9}{'epochs':>8}{'eval loss':>11}  state")
    for t in sorted(study.trials, key=lambda t: (t.value is None, t.value or 0.0)):
        p = t.params
        last = t.intermediate_values.get(t.last_step) if t.last_step is not None else None
        print(f"{t.number:>5}{p['lr']:>10.2e}{p['weight_decay']:>6}{p['warmup']:>8}{p['dropout']:>9.3f}"
              f"{(t.last_step or 0):>8}{(t.value if t.value is not None else last or float('nan')):>11.4f}"
              f"  {t.state.name.lower()}")
    best = study.best_trial
    print(f"\nbest trial {best.number}: eval loss {best.value:.4f} with "
          + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items()))
    states = [t.state for t in study.trials]
    print(f"search wall {wall:.1f} s; {len(states)} trials: {states.count(State.COMPLETE)} completed, "
          f"{states.count(State.PRUNED)} pruned, {states.count(State.FAIL)} failed; "
          f"{study.cancelled_tasks} tasks cancelled at once by pruning")
    busy = ", ".join(f"{d['name']} {100 * d['busy_seconds'] / wall:.0f}%" for d in stats["devices"])
    print(f"devices busy: {busy} of the search wall time")
    os.makedirs(args.out, exist_ok=True)
    trace.save(os.path.join(args.out, "optuna_trace.json"))
    try:
        import plotly  # noqa: F401
    except ImportError:
        print("plots skipped: plotly is not installed (pip install plotly)")
        return 0
    for name, plot in (("optuna_history.html", optuna.visualization.plot_optimization_history),
                       ("optuna_importances.html", optuna.visualization.plot_param_importances)):
        plot(study).write_html(os.path.join(args.out, name))
        print(f"plot: {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
