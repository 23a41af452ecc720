"""Stages a user declares for any model: ``ModelTask(stages=...)`` or a ``hydra_stages()`` method on the model.

    task = ModelTask(make_model, opt, data, stages=lambda m: [m.encoder, ("middle", m.mixer), *m.blocks, m.head])
    class MyModel(nn.Module):
        def hydra_stages(self): return [self.encoder, self.mixer, *self.blocks, self.head]

The declared modules run in order, each on the previous one's output, and must compute exactly what
``model(...)`` computes (checked at submit on the first batch, check.py): the first receives the model's input as
the plain loop passes it (a dict batch as one dict argument, ``inputs`` of an ``(inputs, target)`` tuple, or the
tensor), the last returns the model's outputs (given to ``loss(outputs, batch)``, or carrying ``.loss``).
Together they must own every trainable parameter of the model, and nothing else: a parameter no stage holds would
silently never train. A module forward calls twice is listed twice (its parameters are then shared by the two
stages, their gradients summed as autograd does); a container without a forward (nn.ModuleList) is listed by
its items; a module working in place on its input (``inplace=True``) joins the stage before it. Modules of a
stage that are not the model's (a wrapper built in ``stages``) follow the model's train/eval mode.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from ..errors import rule_error
from .base import ModelStages, Stage, join_inplace

StageSpec = Callable[[nn.Module], Sequence[Any]]


def _model_input(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch  # a dict (the first stage takes it whole) or a tensor


def explicit_stages(model: nn.Module, spec: StageSpec | None) -> ModelStages:
    """The model's declared stages: ``spec(model)``, else ``model.hydra_stages()``; validated against the model."""
    declared = spec(model) if spec is not None else model.hydra_stages()  # type: ignore[operator]
    where = "`stages(model)`" if spec is not None else f"{type(model).__name__}.hydra_stages()"
    if isinstance(declared, nn.Module) or not isinstance(declared, Sequence) or not declared:
        raise TypeError(f"{where} returns a non-empty list of modules or (name, module) pairs, but got "
                        f"(type={type(declared).__name__}). Fix: return e.g. [model.encoder, model.head].")
    stages = []
    for i, item in enumerate(declared):
        name, module = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if not isinstance(module, nn.Module):
            raise TypeError(f"each stage from {where} is an nn.Module or a (name, module) pair, but got "
                            f"(stage={i}, type={type(module).__name__}). Fix: wrap plain functions in a module.")
        if type(module).forward is nn.Module.forward:  # a container (ModuleList, ModuleDict): nothing to run
            raise rule_error(f"each stage from {where} is a module with a forward", "list its items in the order "
                             "forward runs them, e.g. `[m.embed, *m.blocks, m.head]`", kind=TypeError, stage=i,
                             type=type(module).__name__)
        stages.append(Stage(str(name) if name is not None else f"{i}:{type(module).__name__}", module))
    _check_ownership(model, stages, where)
    return ModelStages(_following_mode(model, join_inplace(stages)), _model_input, "explicit")


class _FollowsModel(nn.Module):
    """A declared stage with modules of its own (``nn.Sequential(m.fc1, nn.Dropout(0.1))``: the Dropout is not the
    model's): before each call they take the model's train/eval mode, which ``model.train()``/``eval()`` gives
    only the model's own modules. The stage's computation is unchanged."""

    def __init__(self, stage: nn.Module, model: nn.Module, own: list[nn.Module]) -> None:
        super().__init__()
        self.stage = stage
        self.__dict__["model"] = model  # not a submodule: the model's parameters are not the wrapper's
        self.__dict__["own"] = own

    def forward(self, carry: Any) -> Any:
        for m in self.own:
            m.training = self.model.training
        return self.stage(carry)


def _following_mode(model: nn.Module, stages: Sequence[Stage]) -> tuple[Stage, ...]:
    mine = {id(m) for m in model.modules()}
    out = []
    for stage in stages:
        # a plain Sequential's own mode changes nothing (only what it holds does)
        own = [m for m in stage.module.modules()
               if id(m) not in mine and type(m).forward is not nn.Sequential.forward]
        out.append(Stage(stage.name, _FollowsModel(stage.module, model, own)) if own else stage)
    return tuple(out)


def _check_ownership(model: nn.Module, stages: list[Stage], where: str) -> None:
    owned = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    covered: set[int] = set()
    for stage in stages:
        for n, p in stage.module.named_parameters(remove_duplicate=False):
            if id(p) not in owned:
                raise ValueError(f"every stage parameter is one of the model's, but got (stage={stage.name!r}, "
                                 f"parameter={n!r}) from {where}. Fix: build stages from the model's own submodules "
                                 "(the runtime trains and returns the model's parameters only).")
            covered.add(id(p))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ValueError(f"the stages from {where} hold every trainable parameter of the model, but got "
                         f"(missing={missing[:5]}{' ...' if len(missing) > 5 else ''}). Fix: include the "
                         "submodules that own them in a stage (or set requires_grad=False if they are frozen).")
