"""The bad-input catalogue: each mistake fails early (at ModelTask(...), Runtime(...) or submit) with exactly the
message README's Troubleshooting lists: "<rule> must hold, but got (values). Fix: <fix>."."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht
from hydra_tune.errors import PlanError, format_bytes
from hydra_tune.policy.partition import shard_of
from hydra_tune.stages import extract_stages
from hydra_tune.training.profile import measure_costs

X = [(torch.randn(2, 4), torch.randn(2, 2)) for _ in range(3)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def mse(out, batch):
    return F.mse_loss(out, batch[1])


def task(**kw) -> ht.ModelTask:
    args = dict(model=mlp, optimizer=sgd, train_data=X, loss=mse, name="t")
    args.update(kw)
    return ht.ModelTask(args.pop("model"), args.pop("optimizer"), args.pop("train_data"), **args)


# -- factories that are wrong in the ways people get them wrong ----------------------------------------------
OUTSIDE = mlp()  # a model made outside the optimizer factory


def optimizer_without_model():
    return torch.optim.SGD(OUTSIDE.parameters(), lr=0.1)


def optimizer_of_outside_model(m):
    return torch.optim.SGD(OUTSIDE.parameters(), lr=0.1)


def returns_param_list(m):
    return list(m.parameters())


def frozen_first_layer_only(m):
    m[0].requires_grad_(False)
    return torch.optim.SGD(m[0].parameters(), lr=0.1)


def frozen_mlp():
    return mlp().requires_grad_(False)


class NeedsConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.Linear(config, config)


class ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x.mul_(0.5))


class StageAddsToItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.second(self.first(x).add_(1.0))

    def hydra_stages(self):
        return [self.first, _AddOne(self.second)]


class _AddOne(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.add_(1.0))


def scheduler_without_optimizer():
    return None


def loss_with_one_argument(out):
    return out.sum()


FIX_OPT = "pass e.g. `lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)` so the optimizer is built over \
the runtime's copy of the model"
FIX_BATCH = ("make the Dataset or collate_fn return tensors, e.g. {'input_ids': ids, 'labels': ids} (-> "
             "model(**batch)) or (inputs, target) (-> model(inputs)); tokenize text there, and turn a BatchEncoding "
             "or other Mapping into a dict with dict(batch)")
RULE_BATCH = "each batch is a dict, a non-empty (inputs, target, ...) tuple or list, or a tensor must hold"
FIX_INT = {"epochs": "train for at least one epoch (use max_steps to stop earlier)",
           "max_steps": "pass None for no limit, or a positive number of optimizer steps",
           "grad_accumulation": "pass 1 for a step every batch, k for every k batches"}
MEM_RULE = ("`device_memory` is a positive int or a size string with a unit in B, KB, KiB, MB, MiB, GB, GiB, TB, "
            "TiB must hold")
NO_CUDA = ("a CUDA device is available (torch.cuda.device_count() > 0) must hold, but got (device={!r}, "
           "device_count=0, torch_cuda={!r}). Fix: use CPU stand-ins here, e.g. devices=['cpu', 'cpu'] with a "
           "device_memory budget, or run where a GPU is visible (a CUDA build of torch, CUDA_VISIBLE_DEVICES not "
           "empty).")

# (case, what, exception type, full message): raised by ModelTask(...)
AT_TASK = [
    ("optimizer-instance",
     lambda: task(optimizer=torch.optim.SGD(OUTSIDE.parameters(), lr=0.1)), TypeError,
     "`optimizer` is a factory `callable(model) -> torch.optim.Optimizer` must hold, but got (optimizer='SGD'). "
     f"Fix: {FIX_OPT}."),
    ("optimizer-factory-without-model-argument",
     lambda: task(optimizer=optimizer_without_model), TypeError,
     "`optimizer` is callable(model) -> torch.optim.Optimizer must hold, but got (optimizer="
     "'optimizer_without_model', signature='()'). Fix: take the runtime's copy of the model as the one argument, "
     "e.g. `lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)`."),
    ("optimizer-not-callable",
     lambda: task(optimizer="adamw"), TypeError,
     "`optimizer` is callable(model) -> torch.optim.Optimizer must hold, but got (optimizer='str'). Fix: pass e.g. "
     "`lambda model: torch.optim.SGD(model.parameters(), lr=0.1)`."),
    ("model-not-callable",
     lambda: task(model=42), TypeError,
     "`model` is an nn.Module or a zero-argument callable returning one must hold, but got (model='int'). Fix: "
     "pass the module, or a factory such as `lambda: MyModel(config)`."),
    ("model-class-needing-arguments",
     lambda: task(model=NeedsConfig), TypeError,
     "`model` is an nn.Module or a zero-argument callable returning one must hold, but got (model='NeedsConfig', "
     "signature='(config)'). Fix: pass the module, or a factory such as `lambda: MyModel(config)`."),
    ("loss-with-one-argument",
     lambda: task(loss=loss_with_one_argument), TypeError,
     "`loss` is None or callable with 2 arguments must hold, but got (loss='loss_with_one_argument', signature="
     "'(out)'). Fix: pass `callable(outputs, batch) -> scalar tensor`, or None to use `outputs.loss`."),
    ("scheduler-without-optimizer-argument",
     lambda: task(lr_scheduler=scheduler_without_optimizer), TypeError,
     "`lr_scheduler` is None or callable with 1 argument must hold, but got (lr_scheduler="
     "'scheduler_without_optimizer', signature='()'). Fix: pass e.g. `lambda opt: "
     "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)`."),
    ("one-shot-generator-data",
     lambda: task(train_data=(b for b in X)), TypeError,
     "`train_data` can be iterated once per epoch (not a one-shot iterator or generator) must hold, but got "
     "(train_data='generator'). Fix: pass a list or DataLoader, or a factory such as `lambda: my_generator()`."),
    ("zero-epochs",
     lambda: task(epochs=0), ValueError,
     f"`epochs >= 1` (an int) must hold, but got (epochs=0). Fix: {FIX_INT['epochs']}."),
    ("negative-epochs",
     lambda: task(epochs=-3), ValueError,
     f"`epochs >= 1` (an int) must hold, but got (epochs=-3). Fix: {FIX_INT['epochs']}."),
    ("zero-max-steps",
     lambda: task(max_steps=0), ValueError,
     f"`max_steps >= 1` (an int) must hold, but got (max_steps=0). Fix: {FIX_INT['max_steps']}."),
    ("zero-grad-accumulation",
     lambda: task(grad_accumulation=0), ValueError,
     f"`grad_accumulation >= 1` (an int) must hold, but got (grad_accumulation=0). Fix: "
     f"{FIX_INT['grad_accumulation']}."),
    ("unknown-nonfinite-policy",
     lambda: task(nonfinite_loss="skip"), ValueError,
     "`nonfinite_loss` in (None, 'fail', 'skip_step', 'ignore') must hold, but got (nonfinite_loss='skip'). Fix: "
     "keep None (the default: 'fail', or under fp16 'ignore' so the GradScaler skips the step) or pick one of "
     "those."),
]

# raised by runtime.submit(task): what the factories built, the first batch and the loss on it
AT_SUBMIT = [
    ("lazy-module",
     dict(model=lambda: nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))), ValueError,
     "the model's parameters and buffers are initialized (no LazyModule left uninitialized) must hold, but got "
     "(task='t', uninitialized=['0.weight', '0.bias']). Fix: initialize them in the factory with one forward on a "
     "sample input (`m = Net(); m(sample_x); return m`), or use the non-lazy module (nn.Linear(in, out))."),
    ("torchscript-module",  # before: AttributeError 'OrderedDictWrapper' object has no attribute 'get' (its unit)
     dict(model=lambda: torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))), TypeError,
     "the model holds no TorchScript module (torch.jit.script / torch.jit.trace): the runtime runs each stage over "
     "device copies of its parameters, bound into the Python modules must hold, but got (task='t', "
     "scripted=['(the model)', '0', '1', '2']). Fix: pass the Python module (script or trace it once trained)."),
    ("forward-changes-its-batch",  # before: trained on the batch as it was every epoch, the plain loop on halves
     dict(model=ScalesItsInput), ValueError,
     "the model's forward changes no tensor of its input batch in place (a unit runs it on the batch's device copy, "
     "so the batch would not change as it does in the plain loop, where a batch reused by a later epoch arrives "
     "changed) must hold, but got (stage='ScalesItsInput'). Fix: change a copy (`x = x * 0.5` instead of "
     "`x.mul_(0.5)`, or `x = x.clone()` first)."),
    ("stage-changes-its-input",  # before: torch's "a leaf Variable that requires grad is being used in an in-place"
     dict(model=StageAddsToItsInput), ValueError,
     "a stage after the first changes no tensor of its input in place (each stage's input is where the gradient for "
     "the stage before it collects) must hold, but got (stage='1:_AddOne'). Fix: make that change out of place (`x "
     "= x + 1` instead of `x.add_(1)`), or declare stages so that the module doing it is in the stage before (a "
     "module with `inplace=True` joins it by itself)."),
    ("forward-changes-a-parameter",  # before: the renormalized rows were lost (0.07-3.4 off, by budget)
     dict(model=lambda: nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 2)),
          train_data=[(torch.tensor([[1, 2], [3, 4]]), torch.randn(2, 2))] * 2), ValueError,
     "the model's forward changes no parameter in place (units run it on device copies of the parameters, and the "
     "optimizer steps the task's own) must hold, but got (parameters=['0:Embedding.weight']). Fix: leave the "
     "parameters to the optimizer: for nn.Embedding, pass max_norm=None (it renormalizes the rows it looks up in "
     "its forward)."),
    ("optimizer-factory-returns-list",
     dict(optimizer=returns_param_list), TypeError,
     "`optimizer(model)` returns a torch.optim.Optimizer must hold, but got (task='t', returned='list'). Fix: "
     "return the optimizer itself, e.g. `lambda m: torch.optim.AdamW(m.parameters())`."),
    ("optimizer-over-another-model",
     dict(optimizer=optimizer_of_outside_model), ValueError,
     "the optimizer's parameters are all parameters of the model it is given must hold, but got (task='t', "
     "foreign=4, optimizer_params=4, first_foreign_shape=(8, 4)). Fix: build it from the factory's argument, "
     "`lambda model: torch.optim.AdamW(model.parameters())`, not from a model made outside the factory."),
    ("optimizer-over-frozen-only",
     dict(optimizer=frozen_first_layer_only), ValueError,
     "the optimizer updates at least one trainable parameter of the model must hold, but got (task='t', "
     "optimizer_params=2, trainable=2). Fix: pass the parameters to train, e.g. `model.parameters()`."),
    ("model-without-parameters",
     dict(model=nn.ReLU), ValueError,
     "the model has at least one parameter to train (requires_grad=True) must hold, but got (task='t', "
     "model='ReLU', parameters=0, trainable=0). Fix: pass a model with parameters, and unfreeze the ones to train "
     "with `requires_grad_(True)`."),
    ("model-all-frozen",
     dict(model=frozen_mlp), ValueError,
     "the model has at least one parameter to train (requires_grad=True) must hold, but got (task='t', "
     "model='Sequential', parameters=4, trainable=0). Fix: pass a model with parameters, and unfreeze the ones to "
     "train with `requires_grad_(True)`."),
    ("model-factory-returns-class",
     dict(model=lambda: nn.Linear), TypeError,
     "the `model` factory returns an nn.Module must hold, but got (task='t', returned='type'). Fix: return the "
     "model instance, e.g. `lambda: MyModel(config)` (not the class or a tuple)."),
    ("empty-data",
     dict(train_data=[]), ValueError,
     "`train_data` yields at least one batch must hold, but got (task='t', batches=0). Fix: check the dataset's "
     "length and the DataLoader's batch_size and drop_last."),
    ("empty-eval-data",  # (was reported as eval_loss 0.0: a perfect score from no evaluation)
     dict(eval_data=[]), ValueError,
     "`eval_data` yields at least one batch (its mean loss and metrics are over its batches) must hold, but got "
     "(task='t', epoch=None, batches=0). Fix: check the eval dataset's length and the DataLoader's batch_size and "
     "drop_last, or pass eval_data=None to train without evaluation."),
    ("text-batch",
     dict(train_data=["the quick brown fox"]), TypeError,
     f"{RULE_BATCH}, but got (task='t', data='train_data', batch_in_epoch=1, type='str'). Fix: {FIX_BATCH}."),
    ("int-batch",
     dict(train_data=[7, 8]), TypeError,
     f"{RULE_BATCH}, but got (task='t', data='train_data', batch_in_epoch=1, type='int'). Fix: {FIX_BATCH}."),
    ("loss-not-scalar",
     dict(loss=lambda out, b: (out - b[1]) ** 2), ValueError,
     "the loss is a floating-point scalar (numel == 1) tensor must hold, but got (source=\"the task's `loss`\", "
     "shape=(2, 2), dtype=torch.float32). Fix: reduce it to one number, e.g. `.mean()`, and keep it floating "
     "point."),
    ("loss-not-tensor",
     dict(loss=lambda out, b: F.mse_loss(out, b[1]).item()), TypeError,
     "the loss is a tensor must hold, but got (source=\"the task's `loss`\", type='float'). Fix: return the loss "
     "tensor itself (not `.item()` or a number), or give the model labels so `outputs.loss` is set."),
    ("loss-detached",  # before: torch's "element 0 of tensors does not require grad and does not have a grad_fn"
     dict(loss=lambda out, b: F.mse_loss(out, b[1]).detach()), ValueError,
     "a training loss is computed from the model's outputs (it requires grad) must hold, but got (source=\"the "
     "task's `loss`\", requires_grad=False). Fix: return the loss tensor itself, not `.detach()`ed or rebuilt "
     "with torch.tensor(...) from numbers."),
    ("no-loss-and-no-outputs-loss",
     dict(loss=None), ValueError,
     "`loss` is given or the model's outputs carry `.loss` must hold, but got (outputs='Tensor', loss=None). Fix: "
     "pass ModelTask(loss=lambda outputs, batch: ...) or include labels in the batch."),
]

# raised by Runtime(...)
AT_RUNTIME = [
    ("unknown-device",
     dict(devices=["tpu:0"]), "each device name is 'cpu' or 'cuda:<index>' must hold, but got (device='tpu:0'). "
                              "Fix: write e.g. ['cuda:0', 'cuda:1'] or ['cpu', 'cpu']."),
    ("mixed-device-kinds",
     dict(devices=["cpu", "cuda:0"]), "all `devices` are of one kind must hold, but got (devices=['cpu', "
                                      "'cuda:0']). Fix: use only CUDA devices or only CPU devices."),
    ("duplicate-gpu",
     dict(devices=["cuda:0", "cuda"]), "each CUDA device is listed once must hold, but got (devices=['cuda:0', "
                                       "'cuda']). Fix: remove the duplicate (one worker per GPU; 'cuda' is "
                                       "'cuda:0'); only CPU stand-ins such as ['cpu', 'cpu'] may repeat."),
    ("zero-devices",
     dict(devices=0), "`devices >= 1` must hold, but got (devices=0). Fix: pass the number of devices to use, "
                      "'auto', or a list of names."),
    ("memory-abc",
     dict(devices=["cpu"], device_memory="abc"), f"{MEM_RULE}, but got (device_memory='abc'). Fix: write e.g. "
                                                 "512MiB or 8GB."),
    ("memory-unknown-unit",
     dict(devices=["cpu"], device_memory="64 MBs"), f"{MEM_RULE}, but got (device_memory='64 MBs'). Fix: write "
                                                    "e.g. 512MiB or 8GB."),
    ("memory-negative",
     dict(devices=["cpu"], device_memory=-5), "`device_memory > 0` must hold, but got (device_memory=-5). Fix: "
                                              "pass a positive byte count or a string like '512MiB'."),
    ("unknown-policy",
     dict(devices=["cpu"], policy="fastest"), "`policy` in ['fifo', 'lrtf', 'round_robin'] must hold, but got "
                                              "(policy='fastest'). Fix: pick one of those names."),
]


@pytest.fixture(scope="module")
def runtime():
    with ht.Runtime(devices=["cpu"]) as rt:
        yield rt


def _cases(table: list[tuple]) -> dict:
    return dict(argvalues=[case[1:] for case in table], ids=[case[0] for case in table])


@pytest.mark.parametrize("make, kind, message", **_cases(AT_TASK))
def test_task_arguments(make, kind, message):
    with pytest.raises(kind) as err:
        make()
    assert str(err.value) == message


@pytest.mark.parametrize("kw, kind, message", **_cases(AT_SUBMIT))
def test_submit_checks_what_the_factories_built(runtime, kw, kind, message):
    with pytest.raises(kind) as err:
        runtime.submit(task(**kw))
    assert str(err.value) == message
    assert "t" not in runtime.stats()["tasks"]  # nothing was admitted


@pytest.mark.parametrize("kw, message", **_cases(AT_RUNTIME))
def test_runtime_arguments(kw, message):
    with pytest.raises(ValueError) as err:
        ht.Runtime(**kw)
    assert str(err.value) == message


@pytest.mark.parametrize("name", ["cuda", "cuda:7"])
def test_cuda_without_a_gpu_says_so(name):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError) as err:
        ht.Runtime(devices=[name])
    assert str(err.value) == NO_CUDA.format(name, torch.version.cuda)


def test_two_cpu_stand_ins_are_allowed():
    with ht.Runtime(devices=["cpu", "cpu:0"], device_memory="64 MB") as rt:
        assert [(d["name"], d["budget"]) for d in rt.stats()["devices"]] == [("cpu:0", 64_000_000),
                                                                             ("cpu:1", 64_000_000)]


def test_a_later_unsupported_batch_fails_its_task_naming_the_batch(runtime):
    h = runtime.submit(task(train_data=[X[0], X[1], "oops"], name="late"))
    with pytest.raises(TypeError) as err:
        h.result(timeout=60)
    assert str(err.value) == (f"{RULE_BATCH}, but got (task='late', data='train_data', batch_in_epoch=3, "
                              f"type='str'). Fix: {FIX_BATCH}.")


def test_an_evaluation_that_finds_no_batch_fails_its_task_instead_of_reporting_zero(runtime):
    # an eval factory whose second pass is empty (a filtered split, an exhausted stream): the plain loop's mean
    # over no batch divides by zero; reporting eval_loss 0.0 would rank the trial best
    passes = iter([X[:2], []])
    h = runtime.submit(task(eval_data=lambda: next(passes), epochs=3, name="dry"))
    with pytest.raises(ValueError) as err:
        h.result(timeout=60)
    assert "`eval_data` yields at least one batch" in str(err.value) and "task='dry', epoch=2" in str(err.value)


def test_budget_too_small_for_a_stage_names_it_and_by_how_much():
    wide = lambda: nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))  # noqa
    t = task(model=wide)
    budget = 20_000
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        with pytest.raises(PlanError) as err:
            rt.submit(t)
    # The numbers come from the planner's measured inputs: stage #2 (64x64) is the largest; its parameters are
    # 64*64*4 + 64*4 bytes, held twice while the next shard is prefetched.
    costs = measure_costs(extract_stages(wide()), X[0], mse)
    alone = shard_of(costs, 2, 3)
    assert alone.state_bytes == (64 * 64 + 64) * 4
    need = alone.peak + alone.state_bytes
    assert str(err.value) == (
        f"`unit peak <= device_memory` must hold for every stage, but stage '2:Linear' (#2) alone needs "
        f"{format_bytes(need)}: parameters+buffers {format_bytes(alone.state_bytes)}, activations and gradients "
        f"{format_bytes(alone.peak - alone.state_bytes)}, prefetch buffer {format_bytes(alone.state_bytes)}; got "
        f"(peak={need}, device_memory={budget}), over by {format_bytes(need - budget)}. Fix: raise device_memory "
        f"to at least {need} bytes, use smaller batches or sequences, or split that stage into smaller ones.")
