"""What a prepared model cannot do faithfully: each refused at the call, naming it and the supported alternative.

    hooks = HookCheck(model)        # prepare(): a model with hooks is refused now
    hooks.check()                   # every forward: a hook registered since (on any submodule or parameter) raises
    slots = SlotCheck(model)        # prepare(): the modules, parameters and buffers in their places
    slots.check()                   # every forward: one swapped since (functional_call, parametrize) raises

Why each is refused rather than run:
- hooks on the model's modules or parameters: the units run the modules on a device worker thread, a forward
  hook runs again when a shard's backward recomputes its forward, and a parameter's tensor hook never fires (the
  units differentiate device copies, not the parameters): the hook's effect would silently differ from the plain
  loop's.
- ``torch.compile(model)`` / ``model.compile()``: the compiled code would trace the hand-off to the runtime, not
  the model; compile inside your model's own modules is not affected.
- ``optimizer.step(closure)``: the closure's forward and backward would run inside the step, which the runtime
  does not interleave with units of the same task.
- inputs that require grad, ``backward(create_graph=True)``, a backward of an output whose forward was followed
  by another forward: gradients flow only from the latest output into the parameters.
- weights changed in place between a forward and its backward (``optimizer.step()`` in between): the plain
  loop's backward raises for the saved tensors it changed; a recomputing unit would use the new weights.
- a forward inside ``torch.autocast`` of a model prepared without that ``precision``: autocast is per thread,
  and the units run on the runtime's threads (they would compute in fp32).
- dtype changes after prepare (``.half()`` of an fp32 model, ``.to(torch.bfloat16)``, ``.type(...)``),
  ``load_state_dict(assign=True)``: the runtime planned the model's tensors as they were; use ``precision=`` or
  cast before ``prepare``.
- a PEFT adapter merged into its base (``merge_adapter()``): it writes through ``.data``; the units would run the
  base as the runtime holds it, without the adapter (``MergeCheck``, at the next forward).
- a module, parameter or buffer swapped under the prepared model by other means (``torch.func.functional_call``,
  ``torch.nn.utils.parametrize``, ``model[4].weight = nn.Parameter(...)`` on a submodule): the units would run the
  planned ones and ignore the call's tensors; refused at the next forward (``SlotCheck``).
- modules, parameters or buffers assigned, registered or deleted on the prepared model (``model.head = nn.Linear(...)``,
  ``model.register_buffer(...)``, ``model[0] = ...``): the plan and the optimizer hold the ones it had; on the
  proxy they would never reach the forward.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn as nn

from ..errors import rule_error

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooks(model: nn.Module) -> list[str]:
    """Where hooks are registered on ``model``: "<module>.<kind>" and "<parameter>.grad hook" entries."""
    found = []
    for name, module in model.named_modules():
        for kind in _MODULE_HOOKS:
            if getattr(module, kind, None):
                found.append(f"{name or type(model).__name__}.{kind.strip('_')}")
    from torch.nn.modules import module as torch_module  # torch keeps the global module hooks there

    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(torch_module, kind, None):
            found.append(f"torch.nn.modules.module.register_module{kind.replace('_global', '')}")
    for name, p in model.named_parameters():
        # torch keeps a tensor's hooks in these attributes: there is no public reader
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
            found.append(f"{name}.grad hook")
    return found


def refuse_hooks(found: list[str], when: str) -> Exception:
    return rule_error(f"a prepared model has no hooks on its modules or parameters ({when})", "compute what the "
                      "hook computes in your loop from the model's output, or train the model with "
                      "hydra_tune.ModelTask; or remove the hook before hydra_tune.prepare", kind=RuntimeError,
                      hooks=found[:6])


_GRAD_HOOKS = operator.attrgetter("_backward_hooks")
_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


class HookCheck:
    """The model's hooks: none at prepare, none registered since (checked at every forward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        found = _hooks(model)
        if found:
            raise refuse_hooks(found, "at hydra_tune.prepare")
        # every forward looks at these (the model's modules are the planned ones): a module's hook dicts are
        # filled in place by register_*_hook; a parameter's are made at its first hook, so read each time
        self._dicts = [getattr(m, kind) for m in model.modules() for kind in _MODULE_HOOKS if hasattr(m, kind)]
        self._params = list(model.parameters())
        from torch.nn.modules import module as torch_module

        self._globals = [getattr(torch_module, k) for k in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                              "_global_backward_hooks", "_global_backward_pre_hooks")
                         if hasattr(torch_module, k)]

    def check(self) -> None:
        # (C-level reads of each parameter's two hook slots: a generator would be a Python frame per parameter)
        if not (any(self._dicts) or any(self._globals) or any(map(_GRAD_HOOKS, self._params))
                or any(map(_ACCUMULATE_HOOKS, self._params))):
            return
        found = _hooks(self.model)  # names them; also a hook on a module or parameter added after prepare
        if found:
            raise refuse_hooks(found, "registered after hydra_tune.prepare")


class _Slots:
    """What a list of slot dicts (a module's ``_modules``, ``_parameters`` or ``_buffers``) hold now, compared by
    identity in C-level loops (a GPT-2 forward would otherwise pay tens of microseconds for the check)."""

    def __init__(self, owners: list[tuple[str, dict]]) -> None:
        self.owners = owners
        self.all = [slots for _, slots in owners]
        self.sizes = [len(slots) for slots in self.all]
        self.count = sum(self.sizes)   # a slot added anywhere (one removed or replaced shows in the identity check)
        entries = [(slots, k, v, f"{prefix}.{k}" if prefix else k)
                   for prefix, slots in owners for k, v in slots.items()]
        self.dicts = [e[0] for e in entries]
        self.keys = [e[1] for e in entries]
        self.values = [e[2] for e in entries]
        self.names = [e[3] for e in entries]

    def same(self) -> bool:
        return not any(map(operator.is_not, map(dict.get, self.dicts, self.keys), self.values)) and \
            sum(map(len, self.all)) == self.count

    def changed(self) -> list[str]:
        out = [name for slots, k, v, name in zip(self.dicts, self.keys, self.values, self.names)
               if slots.get(k) is not v]
        return out + [f"{prefix or '<model>'} (slots added)" for (prefix, slots), n in zip(self.owners, self.sizes)
                      if len(slots) > n]


class SlotCheck:
    """The model's modules, parameters and buffers are the ones it was prepared with (checked at every forward).

    What changes a slot without passing through the prepared model: ``torch.func.functional_call`` (it puts the
    given tensors in the slots for the call), ``torch.nn.utils.parametrize`` or ``weight_norm`` on a submodule, an
    assignment on a submodule the user holds (``model[4].weight = nn.Parameter(...)``, ``net.fc = ...``). The units
    run the tensors the runtime planned and holds: without the check the call's own tensors would be silently
    ignored. A forward may reassign its buffers (``self.calls = self.calls + 1`` runs as in the plain loop), so
    the buffers are noted again after each call (``note_buffers``).
    """

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.named_modules())
        self._fixed = _Slots([(prefix, m.__dict__[kind]) for prefix, m in modules for kind in ("_modules",
                                                                                                "_parameters")])
        self._buffer_owners = [(prefix, m.__dict__["_buffers"]) for prefix, m in modules]
        self._buffers = _Slots(self._buffer_owners)

    def note_buffers(self) -> None:
        """The buffers as they stand now (after a forward that may have reassigned some)."""
        if not self._buffers.same():
            self._buffers = _Slots(self._buffer_owners)

    def check(self) -> None:
        if self._fixed.same() and self._buffers.same():
            return
        raise rule_error("a prepared model keeps the modules, parameters and buffers it was prepared with in their "
                         "places (the runtime runs the ones it planned and holds)", "change a weight's values in "
                         "place (with torch.no_grad(): model.fc.weight.copy_(w)); for torch.func.functional_call, "
                         "a parametrization or other swapped weights, use a plain copy of the model "
                         "(copy.deepcopy(model)); build the model as it should train before hydra_tune.prepare",
                         kind=RuntimeError, changed=(self._fixed.changed() + self._buffers.changed())[:6])


class MergeCheck:
    """No PEFT adapter is merged into its base when the prepared model is called (checked at every forward).

    ``merge_adapter()`` adds the adapter into the base weight through ``.data``, which no version counter sees: the
    units would run the base as the runtime holds it (its device copy, or the copy held once for several trials)
    without the adapter, and ``unmerge_adapter()`` leaves the rounding of the round trip in the host weight only.
    """

    def __init__(self, model: nn.Module) -> None:
        # peft's tuner layers keep the names of the adapters merged into their base in ``merged_adapters``
        self._layers = [(name, m) for name, m in model.named_modules()
                        if isinstance(getattr(m, "merged_adapters", None), list)]

    def check(self) -> None:
        if self._layers and any(m.merged_adapters for _, m in self._layers):
            raise rule_error("a prepared model's PEFT adapters stay unmerged while it trains (merge_adapter writes "
                             "them into the base weights through .data, which the runtime cannot see)",
                             "evaluate a merged copy instead: merged = copy.deepcopy(model).merge_and_unload(); "
                             "call unmerge_adapter() before the next call of the model", kind=RuntimeError,
                             merged=[name for name, m in self._layers if m.merged_adapters][:6])


def refuse_register(what: str) -> Exception:
    return rule_error("a prepared model takes no hooks", "compute from the model's output in your loop instead "
                      f"of `model.{what}(...)`, or train the model with hydra_tune.ModelTask", kind=RuntimeError,
                      call=f"model.{what}")


def refuse_replace(call: str) -> Exception:
    return rule_error("a prepared model keeps the modules, parameters and buffers it was prepared with (the runtime "
                      "planned them and the optimizer steps them)", "build the model as it should train before "
                      "hydra_tune.prepare; change a weight's values in place instead (with torch.no_grad(): "
                      "model.fc.weight.copy_(w)), and keep other objects outside the model", kind=RuntimeError,
                      call=call)


def refuse_shared_load(keys: list[str]) -> Exception:
    return rule_error("a prepared model's weights held once with other trials (frozen, equal) are loaded with their "
                      "own values only (other values would change every trial's)", "load such weights before "
                      "hydra_tune.prepare, or run with hydra_tune.RuntimeConfig(share_frozen=False)",
                      kind=RuntimeError, call="model.load_state_dict", changed=keys[:5], count=len(keys))


def refuse_compile() -> Exception:
    return rule_error("a prepared model is not compiled (the runtime runs its shards)", "drop torch.compile(model) "
                      "/ model.compile(); compile inside your modules if you need it, or train without prepare",
                      kind=RuntimeError, call="torch.compile(prepared model)")


def refuse_closure() -> Exception:
    return rule_error("a prepared optimizer steps without a closure", "compute the loss and call "
                      "loss.backward() before optimizer.step() (optimizers that need a closure, like LBFGS, are "
                      "not supported by hydra_tune.prepare)", kind=RuntimeError, call="optimizer.step(closure)")


def refuse_dtype(call: str) -> Exception:
    return rule_error("a prepared model keeps the dtype it was prepared with", "cast the model before "
                      "hydra_tune.prepare, or pass prepare(..., precision='bf16') for mixed precision",
                      kind=RuntimeError, call=call)


def check_inputs(leaves: list[Any]) -> None:
    """Inputs that require grad would need their gradients from the units: refused."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        raise rule_error("a prepared model's inputs do not require grad (gradients flow into the parameters "
                         "only)", "detach the inputs (x.detach()), or train the model without prepare",
                         kind=RuntimeError, call="model(x) with x.requires_grad")


def check_backward(number: int, pending: int, latest: int) -> None:
    """``number``: the forward whose output this backward comes from; ``pending``: the training forward awaiting
    its backward (0: none); ``latest``: the number of the latest training forward (named in the error: ``pending``
    reads 0 once a later forward's backward ran, e.g. in ``(loss(model(a)) + loss(model(b))).backward()``)."""
    if torch.is_grad_enabled():
        raise rule_error("a prepared model's backward builds no graph of its own", "call loss.backward() "
                         "without create_graph=True (higher-order gradients are not supported by prepare)",
                         kind=RuntimeError, call="backward(create_graph=True)")
    if number != pending:
        raise rule_error("a prepared model's backward comes from the latest training forward's output, once",
                         "call loss.backward() once after each forward (for gradient accumulation: forward, "
                         "backward, forward, backward, ... then optimizer.step()); a loss over several forwards of "
                         "one prepared model (model(a) and model(b) before one backward) is not supported",
                         kind=RuntimeError, call="backward", forward=number, latest=latest,
                         awaiting_backward=pending or None)


def check_unchanged(changed: list[str]) -> None:
    """Weights changed in place between a forward and its backward: the plain loop's backward raises (its saved
    tensors changed); the units would recompute from the new weights."""
    if changed:
        raise rule_error("a prepared model's weights are unchanged between a forward and its backward",
                         "call optimizer.step() and other in-place changes of the weights after loss.backward()",
                         kind=RuntimeError, changed=changed[:6])


def _autocast_on() -> dict[str, torch.dtype]:
    """This thread's enabled autocast regions: device type -> dtype."""
    on = {}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                on[device] = torch.get_autocast_dtype(device)
        except (TypeError, AttributeError):  # torch before 2.4: the per-device functions
            enabled = torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()
            if enabled:
                on[device] = torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype()
    return on


def check_autocast(precision: str, dtype: torch.dtype | None) -> None:
    """The units run on device threads, outside the caller's thread-local autocast region: a forward inside one
    must have been prepared with the same ``precision`` (the units then autocast alike)."""
    on = _autocast_on()
    if on and any(d != dtype for d in on.values()):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
        want = sorted({names.get(d, str(d)) for d in on.values()})
        raise rule_error("a prepared model called inside torch.autocast was prepared with that precision (its "
                         "units run on the runtime's threads, outside your autocast block)", "pass "
                         f"hydra_tune.prepare(..., precision={want[0]!r}) and keep the autocast block for your loss",
                         kind=RuntimeError, autocast={k: str(v) for k, v in on.items()}, precision=precision)


def output_error(got: str) -> Exception:
    return rule_error("a prepared model returns its tensors as tensors, or in tuples, lists, dicts, named tuples, "
                      "dataclasses or transformers' ModelOutput (the runtime joins each to your graph and brings it "
                      "to the inputs' device; tensors inside other objects would get no gradients)", "return them in "
                      "one of those, or register the class with torch.utils._pytree", kind=TypeError, output=got)


def check_output(leaves: list[Any]) -> None:
    """Refuse an output holding tensors in an object the runtime cannot see into (``output_error``)."""
    opaque = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor) and hasattr(x, "__dict__")
              and any(isinstance(v, torch.Tensor) for v in vars(x).values())]
    if opaque:
        raise output_error(f"tensors inside {opaque[:4]}")
