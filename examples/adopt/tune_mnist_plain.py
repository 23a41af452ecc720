"""Ray Tune's PyTorch pattern: a small ConvNet on sklearn's digits, learning rate and momentum searched, ASHA
stopping poor trials on accuracy, ``tune.report`` after every epoch.

    python examples/adopt/tune_mnist_plain.py      # the plain loop: one Tune trial per process
    python examples/adopt/tune_mnist_hydra.py      # the same loop, the trials sharing hydra_tune's runtime
    diff examples/adopt/tune_mnist_plain.py examples/adopt/tune_mnist_hydra.py   # the adoption: 3 lines

Our own version of the pattern of Ray Tune's ``mnist_pytorch.py`` (offline data: sklearn's bundled digits, 8x8
images, 10 classes); tests/test_prepare_examples.py runs it next to its hydra_tune twin.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import BasicVariantGenerator

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH, SEED = 64, 0
EPOCHS = 5


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3)
        self.fc = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv(x), 2))
        return F.log_softmax(self.fc(x.flatten(1)), dim=1)


def digits() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(y)
    return (torch.utils.data.TensorDataset(x[:1400], y[:1400]), torch.utils.data.TensorDataset(x[1400:], y[1400:]))


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: torch.utils.data.DataLoader) -> None:
    model.train()
    for data, target in loader:
        data, target = data.to(DEVICE), target.to(DEVICE)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()


def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for data, target in loader:
            pred = model(data.to(DEVICE)).argmax(dim=1)
            correct += (pred == target.to(DEVICE)).sum().item()
            total += target.size(0)
    return correct / total


def train_digits(config: dict) -> None:
    torch.manual_seed(SEED)
    train, valid = digits()
    train_loader = torch.utils.data.DataLoader(train, batch_size=BATCH, shuffle=True)
    valid_loader = torch.utils.data.DataLoader(valid, batch_size=BATCH)
    model = ConvNet().to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    for _ in range(config.get("epochs", EPOCHS)):
        train_epoch(model, optimizer, train_loader)
        tune.report({"mean_accuracy": evaluate(model, valid_loader)})


def main(num_samples: int = 8, epochs: int = EPOCHS, max_concurrent: int = 0) -> list[tuple]:
    space = {"lr": tune.loguniform(1e-3, 1e-1), "momentum": tune.uniform(0.1, 0.9), "epochs": epochs}
    search = BasicVariantGenerator(random_state=SEED, max_concurrent=max_concurrent)
    config = tune.TuneConfig(metric="mean_accuracy", mode="max", num_samples=num_samples, search_alg=search,
                             scheduler=ASHAScheduler(max_t=epochs, grace_period=1))
    tuner = tune.Tuner(train_digits, param_space=space, tune_config=config, run_config=tune.RunConfig(verbose=0))
    results = tuner.fit()
    best = results.get_best_result()
    print(f"trials: {len(results)}, best accuracy {best.metrics['mean_accuracy']:.4f}: {best.config}")
    return sorted((r.config["lr"], r.config["momentum"], list(r.metrics_dataframe["mean_accuracy"])) for r in results)


if __name__ == "__main__":
    main()
