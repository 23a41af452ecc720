"""Stages a user declares for any model: ``ModelTask(stages=...)`` or a ``hydra_stages()`` method on the model.

    task = ModelTask(make_model, opt, data, stages=lambda m: [m.encoder, ("middle", m.blocks), m.head])
    class MyModel(nn.Module):
        def hydra_stages(self): return [self.encoder, self.blocks, self.head]

The declared modules run in order, each on the previous one's output, and must compute what ``model(...)``
computes: the first receives the model's input as the plain loop passes it (a dict batch as one dict argument,
``inputs`` of an ``(inputs, target)`` tuple, or the tensor), the last returns the model's outputs (given to
``loss(outputs, batch)``, or carrying ``.loss``). Together they must own every trainable parameter of the model,
and nothing else: a parameter no stage holds would silently never train.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from .base import ModelStages, Stage

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
        stages.append(Stage(str(name) if name is not None else f"{i}:{type(module).__name__}", module))
    _check_ownership(model, stages, where)
    return ModelStages(tuple(stages), _model_input, "explicit")


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
