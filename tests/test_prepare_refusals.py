"""hydra_tune.prepare refuses what it cannot run faithfully, at the call, naming it and the alternative."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hydra_tune as ht


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def rt():
    with ht.Runtime(devices=["cpu"], device_memory="2KiB") as runtime:   # the MLP in 2+ shards
        yield runtime


def _prepared(rt, model=None):
    model = model if model is not None else _mlp()
    return ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt)


X, Y = torch.randn(3, 4), torch.tensor([0, 1, 0])


def test_a_forward_hook_registered_after_prepare_on_an_inner_module_is_refused(rt):
    # without the refusal the hook would run twice per minibatch (the F unit and its backward's recompute)
    model, _ = _prepared(rt)
    calls = []
    model.module[2].register_forward_hook(lambda m, i, o: calls.append(1))
    with pytest.raises(RuntimeError, match=r"no hooks.*registered after hydra_tune.prepare.*2\.forward_hooks"):
        model(X)
    assert calls == []


def test_a_parameter_grad_hook_at_prepare_is_refused(rt):
    # a tensor hook on a parameter never fires: the units differentiate device copies
    model = _mlp()
    model[0].weight.register_hook(lambda g: g * 0)
    with pytest.raises(RuntimeError, match=r"no hooks.*at hydra_tune.prepare.*0\.weight\.grad hook"):
        _prepared(rt, model)


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_parameter_hook_registered_after_prepare_is_refused_at_the_next_forward(rt, register):
    model, opt = _prepared(rt)
    F.cross_entropy(model(X), Y).backward()
    opt.step()
    getattr(model.module[4].bias, register)(lambda t: None)
    with pytest.raises(RuntimeError, match=r"registered after hydra_tune.prepare.*4\.bias\.grad hook"):
        model(X)


def test_hooks_on_the_prepared_model_itself_are_refused(rt):
    model, _ = _prepared(rt)
    with pytest.raises(RuntimeError, match=r"takes no hooks.*model\.register_forward_hook"):
        model.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(RuntimeError, match=r"register_full_backward_hook"):
        model.register_full_backward_hook(lambda m, gi, go: None)


def test_torch_compile_of_the_prepared_model_is_refused(rt):
    model, _ = _prepared(rt)
    with pytest.raises(RuntimeError, match=r"not compiled.*torch.compile\(prepared model\)"):
        torch.compile(model)(X)
    with pytest.raises(RuntimeError, match=r"not compiled"):
        model.compile()


def test_an_optimizer_step_with_a_closure_is_refused(rt):
    model, opt = _prepared(rt)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        return loss
    with pytest.raises(RuntimeError, match=r"steps without a closure.*optimizer\.step\(closure\)"):
        opt.step(closure)


def test_a_second_backward_through_the_same_output_is_refused(rt):
    model, _ = _prepared(rt)
    loss = F.cross_entropy(model(X), Y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"latest training forward's output, once"):
        loss.backward()


def test_a_backward_of_an_output_whose_forward_was_followed_by_another_is_refused(rt):
    model, _ = _prepared(rt)
    first = F.cross_entropy(model(X), Y)
    second = F.cross_entropy(model(X * 2), Y)
    with pytest.raises(RuntimeError, match=r"latest training forward's output.*forward=1, latest=2.*several forwards"):
        (first + second).backward()


def test_create_graph_and_inputs_that_require_grad_are_refused(rt):
    model, _ = _prepared(rt)
    with pytest.raises(RuntimeError, match=r"create_graph=True"):
        F.cross_entropy(model(X), Y).backward(create_graph=True)
    with pytest.raises(RuntimeError, match=r"inputs do not require grad"):
        model(X.clone().requires_grad_(True))


def test_dtype_changes_and_assigning_load_are_refused_device_moves_accepted(rt):
    model, _ = _prepared(rt)
    assert model.to("cpu") is model and model.cpu() is model
    for call in (model.half, model.double, lambda: model.to(torch.float64)):
        with pytest.raises(RuntimeError, match=r"keeps the dtype it was prepared with"):
            call()
    with pytest.raises(RuntimeError, match=r"assign=True"):
        model.load_state_dict(model.state_dict(), assign=True)
    assert next(model.parameters()).dtype == torch.float32


def test_bad_calls_and_bad_prepare_arguments_are_refused(rt):
    model, opt = _prepared(rt)
    with pytest.raises(TypeError, match=r"model\(x\) or model\(\*\*batch\).*positional=2"):
        model(X, X)
    with pytest.raises(TypeError, match=r"not prepared yet"):
        ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"Optimizer not prepared yet"):
        ht.prepare(_mlp(), opt)
    other = _mlp()
    with pytest.raises(ValueError, match=r"only the model's parameters.*foreign_parameters=6"):
        ht.prepare(_mlp(), torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_released_model_is_refused(rt):
    model, _ = _prepared(rt)
    model(X)
    model.release()
    with pytest.raises(RuntimeError, match=r"used before it is released"):
        model(X)


def test_weights_changed_between_forward_and_backward_are_refused(rt):
    # the plain loop's backward raises for the saved weights it changed; a recomputing unit would use the new ones
    model, opt = _prepared(rt)
    F.cross_entropy(model(X), Y).backward()
    loss = F.cross_entropy(model(X), Y)
    opt.step()
    with pytest.raises(RuntimeError, match=r"weights are unchanged between a forward and its backward.*0\.weight"):
        loss.backward()


def test_a_prepared_model_called_from_a_second_thread_meanwhile_is_refused(rt):
    import threading

    model, _ = _prepared(rt)
    model(X)   # submitted and built
    runner = model._hydra_runner
    errors = []
    entered, leave = threading.Event(), threading.Event()
    original = runner.driver.open_forward

    def slow(train):   # holds the first call inside its units while the second thread calls
        entered.set()
        leave.wait(5)
        return original(train)
    runner.driver.open_forward = slow
    first = threading.Thread(target=lambda: model(X))
    first.start()
    entered.wait(5)
    try:
        with torch.no_grad():
            model(X)
    except RuntimeError as exc:
        errors.append(str(exc))
    leave.set()
    first.join(10)
    assert errors and "one thread at a time" in errors[0]


def test_a_runtime_in_another_process_is_refused():
    import pickle

    class NodeLike:   # a node client sends the task to the node's server process: it pickles it
        def submit(self, task):
            return pickle.dumps(task)

    m = _mlp()
    model, _ = ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), runtime=NodeLike())
    with pytest.raises(RuntimeError, match=r"runtime in its own process.*share='process'"):
        model(X)


def test_a_forward_inside_autocast_of_a_model_prepared_without_that_precision_is_refused(rt):
    # autocast is per thread: the units (on the runtime's threads) would compute in fp32 while the plain loop's
    # forward runs in bf16
    model, _ = _prepared(rt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"inside torch.autocast.*precision='bf16'"):
            model(X)


def test_a_global_module_hook_is_refused(rt):
    # torch.nn.modules.module.register_module_forward_hook applies to every module, the units' runs included
    model, _ = _prepared(rt)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.raises(RuntimeError, match=r"no hooks.*register_module_forward_hooks"):
            model(X)
    finally:
        handle.remove()
    model(X)   # removed: accepted again


def test_a_call_after_the_task_failed_says_so_instead_of_repeating_the_old_error(rt):
    # before, every later call re-raised the first error (here a dtype mismatch) as if a float input failed too
    model, opt = _prepared(rt)
    F.cross_entropy(model(X), Y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="same dtype"):  # the model's own error, raised by the call that met it
        model(X.double())
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"whose task failed is not called again.*failed_with='RuntimeError: "
                                               r"mat1 and mat2 must have the same dtype") as err:
            model(X)
        assert "same dtype" in str(err.value.__cause__)


def test_a_model_holding_a_torchscript_module_is_refused_at_prepare():
    # before: KeyError '_modules' (a traced submodule) or a TypeError about OrderedModuleDict (a scripted model)
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(16, 16)
            self.head = torch.jit.trace(nn.Linear(16, 4), torch.randn(2, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    model = Wrapped()
    with pytest.raises(TypeError, match=r"holds no TorchScript module.*scripted=\['head'\]"):
        ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
