"""Draws made inside a torch function the light router does not know as random: ``nn.MultiheadAttention``'s
attention dropout is drawn inside ``F.multi_head_attention_forward``, and the dropout between the layers of an
``nn.LSTM``/``GRU``/``RNN`` inside ``torch.lstm`` & co. A function mode (the light router, dispatch.RandomRouter)
is handed such a call whole and runs it as it is: the draws inside reach no function mode and drew from torch's
global generator.
A measured unit now notes the outermost call of each draw (``draws.OutermostCall``); one the router would not
see keeps its task on the full mode (``UnitMode``), so these models train bit-identical to the plain loop (CPU fp32),
as ModelTasks and in prepared loops."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_param_diff, plain_train, sgd_loop

import hydra_tune as ht
from hydra_tune.device import dispatch, draws

X = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(2))


class Attention(nn.Module):
    """A sequence of 4 tokens of 8 features from each 16-feature input, through ``layer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(x.shape[0], 4, 4).repeat(1, 1, 2)
        if isinstance(self.layer, nn.MultiheadAttention):
            h = self.layer(h, h, h, need_weights=False)[0]
        else:
            h = self.layer(h)
        return h.flatten(1)


def _trained(task: ht.ModelTask, devices: list[str], budget: str) -> nn.Module:
    """``task`` trained on a fresh runtime of ``devices`` with ``budget`` each: its model."""
    with ht.Runtime(devices=devices, device_memory=budget) as rt:
        handle = rt.submit(task)
        handle.result()
        return handle.model()


def _model(kind: str) -> nn.Module:
    layer = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True) if kind == "mha" else \
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
    return nn.Sequential(nn.Linear(16, 16), Attention(layer), nn.Linear(32, 4))


class Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 16, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.view(x.shape[0], 4, 4))[0][:, -1])


def _task_of(make, name: str) -> ht.ModelTask:
    """A task training ``make()`` on the six batches of X, Y, two epochs, SGD."""
    return ht.ModelTask(make, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)], loss=lambda o, b: F.cross_entropy(o, b[1]),
                        epochs=2, seed=0, name=name)


def _task(kind: str) -> ht.ModelTask:
    make = (lambda: Recurrent(kind)) if kind in ("LSTM", "GRU", "RNN") else (lambda: _model(kind))
    return _task_of(make, f"composite-{kind}")


@pytest.mark.parametrize("kind", ["mha", "encoder-layer"])
@pytest.mark.parametrize("budget", ["64MiB", "120KiB"], ids=["resident", "sharded"])
def test_attention_dropout_inside_multi_head_attention_trains_exactly(kind, budget):
    # before: max abs difference 0.005 (MultiheadAttention) and 0.039 (TransformerEncoderLayer)
    want, _ = plain_train(_task(kind))
    got = _trained(_task(kind), ["cpu", "cpu"], budget)
    assert max_param_diff(want, got) == 0.0


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_dropout_between_recurrent_layers_trains_exactly(kind):
    # before: max abs difference 0.0014 (LSTM), 0.0060 (GRU), 0.018 (RNN)
    want, _ = plain_train(_task(kind))
    got = _trained(_task(kind), ["cpu"], "64MiB")
    assert max_param_diff(want, got) == 0.0


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.FractionalMaxPool2d(2, output_size=(2, 2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(x.view(-1, 1, 4, 4)))).flatten(1))


def test_fractional_max_pooling_draws_its_samples_from_the_tasks_stream():
    # its random samples are drawn inside F.fractional_max_pool2d, a function the router does not know (a guard:
    # whichever way the runtime routes it, the samples must come from the task's stream)
    want, _ = plain_train(_task_of(Pooled, "pooled"))
    got = _trained(_task_of(Pooled, "pooled"), ["cpu"], "64MiB")
    assert max_param_diff(want, got) == 0.0


def test_a_prepared_loop_with_multi_head_attention_dropout_trains_exactly():
    def run(rt=None):
        model = sgd_loop(lambda: _model("mha"), X, Y, rt)
        return {k: v.clone() for k, v in model.state_dict().items()}

    want = run()
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as rt:
        got = run(rt)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_measured_draw_names_whether_the_router_would_see_it():
    def seeded(fn) -> set[str]:
        with dispatch.UnitMode(torch.Generator().manual_seed(0)) as mode, draws.OutermostCall() as mode.outermost:
            fn()
        return mode.seeded

    x = torch.randn(2, 4, 8)
    # a composite function the router does not know draws inside (its random samples): the task keeps UnitMode
    pool = nn.FractionalMaxPool2d(2, output_size=(2, 4))
    assert draws.UNSEEN in seeded(lambda: pool(x.unsqueeze(0)))
    # those it knows when they draw: run under UnitMode by the router itself (exact, the rest of the unit light)
    mha = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
    assert seeded(lambda: mha(x, x, x, need_weights=False)) <= draws.ROUTED
    lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.3)
    assert seeded(lambda: lstm(x)) <= draws.ROUTED
    assert seeded(lambda: F.dropout(x, 0.3)) <= draws.ROUTED  # what the router takes itself
    assert seeded(lambda: torch.ops.aten.bernoulli_(torch.empty(3), 0.5)) <= draws.ROUTED  # (by its name too)
    assert seeded(lambda: torch.randn_like(x)) <= draws.ROUTED


def test_attention_with_no_dropout_is_not_a_draw():
    # CPU attention's fused kernel is tagged as seeded whatever its dropout_p: with 0 it counted as a draw, kept
    # its task off the light router and lent torch's global generator under its lock at every call (LLaMA's
    # attention_dropout defaults to 0)
    q = torch.randn(2, 2, 4, 8)

    def drawn(p: float) -> tuple[set[str], int]:
        with dispatch.UnitMode(torch.Generator().manual_seed(0)) as mode:
            F.scaled_dot_product_attention(q, q, q, dropout_p=p)
        return mode.seeded, mode.draws

    assert drawn(0.0) == (set(), 0)
    seeded, draws = drawn(0.3)
    assert draws > 0 and seeded


class Attending(nn.Module):
    """Attention without dropout between layers with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.drop, self.head = nn.Linear(16, 48), nn.Dropout(0.2), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.drop(self.qkv(x)).view(x.shape[0], 2, 3, 8).unbind(2)
        return self.head(F.scaled_dot_product_attention(q, k, v).flatten(1))


def test_a_model_with_attention_without_dropout_trains_exactly():
    want, _ = plain_train(_task_of(Attending, "attending"))
    got = _trained(_task_of(Attending, "attending"), ["cpu", "cpu"], "64MiB")
    assert max_param_diff(want, got) == 0.0


def test_equal_attention_tasks_on_two_devices_train_exactly():
    # a runtime's CPU devices share what they counted (device/measured.py): while one counts the class's first segment
    # the other runs it routed and guarded; every task still ends as its plain loop
    tasks = [ht.ModelTask(lambda: _model("mha"), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                          [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 48, 8)],
                          loss=lambda o, b: F.cross_entropy(o, b[1]), epochs=2, seed=s, name=f"mha-{s}")
             for s in range(4)]
    with ht.Runtime(devices=["cpu", "cpu"], device_memory="64MiB") as rt:
        handles = [rt.submit(t) for t in tasks]
        for h in handles:
            h.result()
        got = [h.model() for h in handles]
    for task, model in zip(tasks, got):
        assert max_param_diff(plain_train(task)[0], model) == 0.0, task.name
