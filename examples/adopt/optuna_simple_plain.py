"""Optuna's PyTorch pattern: an MLP on sklearn's digits, its layers, dropout, optimizer and
learning rate searched by TPE, accuracy reported every epoch, poor trials pruned by the MedianPruner.

    python examples/adopt/optuna_simple_plain.py      # the plain loop: trials in threads of one process
    python examples/adopt/optuna_simple_hydra.py      # the same loop, the trials sharing hydra_tune's runtime
    diff examples/adopt/optuna_simple_plain.py examples/adopt/optuna_simple_hydra.py   # the adoption: 3 lines

Our own version of the pattern of Optuna's ``pytorch_simple.py`` (offline data: sklearn's bundled digits, 8x8
images, 10 classes); tests/test_prepare_examples.py runs it next to its hydra_tune twin.
"""
from __future__ import annotations

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH, CLASSES, SEED = 64, 10, 0
EPOCHS = 3


def digits() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    return (torch.utils.data.TensorDataset(x[:1400], y[:1400]), torch.utils.data.TensorDataset(x[1400:], y[1400:]))


def define_model(trial: optuna.Trial) -> nn.Module:
    layers, width = [], 64
    for i in range(trial.suggest_int("n_layers", 1, 3)):
        out = trial.suggest_int(f"n_units_l{i}", 8, 128)
        layers += [nn.Linear(width, out), nn.ReLU(), nn.Dropout(trial.suggest_float(f"dropout_l{i}", 0.1, 0.5))]
        width = out
    return nn.Sequential(*layers, nn.Linear(width, CLASSES), nn.LogSoftmax(dim=1))


def objective(trial: optuna.Trial) -> float:
    torch.manual_seed(SEED + trial.number)
    model = define_model(trial).to(DEVICE)
    name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=trial.suggest_float("lr", 1e-4, 1e-1, log=True))
    train, valid = digits()
    train_loader = torch.utils.data.DataLoader(train, batch_size=BATCH, shuffle=True)
    valid_loader = torch.utils.data.DataLoader(valid, batch_size=BATCH)
    for epoch in range(EPOCHS):
        model.train()
        for data, target in train_loader:
            data, target = data.to(DEVICE), target.to(DEVICE)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for data, target in valid_loader:
                pred = model(data.to(DEVICE)).argmax(dim=1)
                correct += (pred == target.to(DEVICE)).sum().item()
        accuracy = correct / len(valid)
        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return accuracy


def main(n_trials: int = 20, n_jobs: int = 2) -> list[tuple]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=SEED), pruner=optuna.pruners.MedianPruner())
    study.optimize(objective, n_trials=n_trials, n_jobs=n_jobs)
    trials = sorted(study.trials, key=lambda t: t.number)
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    print(f"trials: {len(trials)}, pruned: {len(pruned)}, best accuracy {study.best_value:.4f}: {study.best_params}")
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in trials]


if __name__ == "__main__":
    main()
