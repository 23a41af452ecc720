"""What every stage extractor builds: ``Stage`` (a named module), ``ModelStages`` (the stages in order, how a batch
becomes the first stage's carry, the family that cut them and the batch keys whose values they read), the batch
convention, a token model's batches and its attention masks; ``join_inplace`` for cuts of user-listed modules.

    cut = ModelStages((Stage("embed", embed), Stage("head", head)), prepare=token_batches("a GPT-2", keys),
                      family="gpt2", value_keys=("attention_mask",))
    cut.meta_batch(batch)          # for shapes-only planning: tensors on the meta device, the attention mask kept
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass(frozen=True)
class Stage:
    name: str
    module: nn.Module


@dataclass(frozen=True)
class ModelStages:
    """``value_keys``: keys of a dict batch whose values (not only shapes) decide what the stages build, such as
    the attention mask (transformers builds no mask at all for an unpadded batch under SDPA)."""

    stages: tuple[Stage, ...]
    prepare: Callable[[Any], Any]
    family: str
    value_keys: tuple[str, ...] = ()

    def meta_batch(self, batch: Any) -> Any:
        """``batch`` for a shapes-only run (hydra_tune.plan_model, the host footprint): every tensor moved to the
        meta device, except the ``value_keys`` of a dict batch, which stay as they are (small index tensors the
        stages read with ``build_mask``)."""
        import torch
        from torch.utils._pytree import tree_map  # torch's own pytree walk: there is no public one

        def meta(tree: Any) -> Any:
            return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)

        if not isinstance(batch, dict):
            return meta(batch)
        return {k: v if k in self.value_keys else meta(v) for k, v in batch.items()}


class NotCuttable(Exception):
    """A family's model whose stages would not repeat its forward (OPT's ``layerdrop``): it runs as one stage."""


def call_with_batch(model: nn.Module, batch: Any) -> Any:
    """The batch convention: dict -> model(**batch); (inputs, target) -> model(inputs); tensor -> model(t)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


class WholeModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> Any:
        return call_with_batch(self.model, batch)


def token_batches(what: str, keys: tuple[str, ...], unsupported: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """The ``prepare`` of a token model (``what``: e.g. "a BERT"): a dict with ``input_ids`` and only ``keys``, a
    tuple ``(input_ids, ...)`` or a tensor of input ids; keys in ``unsupported`` name the training-path limit."""
    import torch

    def prepare(batch: Any) -> dict[str, Any]:
        if isinstance(batch, torch.Tensor):
            return {"input_ids": batch}
        if isinstance(batch, (tuple, list)):
            return {"input_ids": batch[0]}
        if isinstance(batch, dict):
            special = sorted(set(batch) & set(unsupported))
            if special:
                raise ValueError(
                    f"{what} batch cut into stages takes no {special}, but got (keys={sorted(batch)}). Fix: drop "
                    f"{special} (the stages run the training path: input_ids, no cache), or train the model "
                    "unsharded (a budget that fits the whole model).")
            unknown = sorted(set(batch) - set(keys))
            if unknown or "input_ids" not in batch:
                raise TypeError(
                    f"{what} batch dict has `input_ids` and only keys in {list(keys)}, but got (keys="
                    f"{sorted(batch)}). Fix: drop {unknown or 'nothing'} from the batch and include input_ids.")
            return dict(batch)
        raise TypeError(f"{what} batch is a dict, a tuple (input_ids, ...) or a tensor of input ids, but got "
                        f"(batch={type(batch).__name__}). Fix: yield e.g. {{'input_ids': ids, 'labels': ids}}.")

    return prepare


def outputs_checked(prepare: Callable[[Any], Any], what: str, config: Any) -> Callable[[Any], Any]:
    """``prepare`` refusing, at every batch, a transformers config that asks the forward for more than the logits
    and the loss: the stages' head returns those two only, so ``output.hidden_states`` / ``.attentions`` would be
    None where the plain model returns them (a loss term that checks for them would be left out silently)."""
    def checked(batch: Any) -> Any:
        asked = [k for k in ("output_hidden_states", "output_attentions") if getattr(config, k, False) is True]
        if asked:
            raise ValueError(
                f"{what} model cut into stages returns the logits and the loss only, but got "
                f"({', '.join(f'config.{k}=True' for k in asked)}). Fix: set "
                f"{' and '.join(f'model.config.{k} = False' for k in asked)} and compute what you need from the "
                "logits, or declare stages of your own (stages=...) whose last returns what the loss reads.")
        return prepare(batch)
    return checked


class _Chain(nn.Sequential):
    """Stages joined into one by ``join_inplace``: the same modules, run in the same order."""


def join_inplace(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """``stages`` with each module that works in place on its input (``inplace=True``: ReLU, Dropout, ...) joined
    to the stage before it: a stage's input is a leaf that collects its gradient, and torch forbids changing such
    a leaf in place. The same modules run in the same order, so the stages still compute the model's forward.

        [s.name for s in join_inplace(cut)]  ->  ['0:Linear+1:ReLU', '2:Linear']   # ReLU(inplace=True)
    """
    out: list[Stage] = []
    for stage in stages:
        if out and getattr(stage.module, "inplace", False) is True:
            prev = out[-1]
            modules = list(prev.module) if isinstance(prev.module, _Chain) else [prev.module]
            out[-1] = Stage(f"{prev.name}+{stage.name}", _Chain(*modules, stage.module))
        else:
            out.append(stage)
    return tuple(out)


def build_mask(builder: Callable[..., Any], inputs_embeds: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """``builder(inputs_embeds=..., attention_mask=..., **kwargs)`` (transformers' create_causal_mask and the
    like), also when the embeddings are on the meta device (shapes-only planning).

        mask = build_mask(create_causal_mask, inputs_embeds, batch.get("attention_mask"), config=cfg, cache=None)

    The builders read the mask's values (under SDPA an unpadded batch gets no mask at all), which meta tensors do
    not have. With meta embeddings the mask is built on the CPU from the batch's real attention mask
    (``ModelStages.meta_batch`` keeps it) and an embedding stand-in with no storage, then given the meta device
    with its layout (so the bytes counted are those of the real run; the CPU build takes the mask's bytes once,
    briefly). A meta attention mask has no values: it is planned as padded, the larger case. ``position_ids``
    only matter to the builders without an attention mask, so meta ones are left out here."""
    import torch

    from .compat import renamed

    kwargs = renamed(builder, kwargs)   # keyword names of the installed transformers (stages/compat.py)
    meta = inputs_embeds.device.type == "meta"
    if not meta or attention_mask is None:
        return builder(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)
    if attention_mask.device.type == "meta":
        attention_mask = torch.zeros(attention_mask.shape, dtype=torch.long)
    if isinstance(kwargs.get("position_ids"), torch.Tensor) and kwargs["position_ids"].device.type == "meta":
        kwargs["position_ids"] = None
    stand_in = torch.empty(tuple(inputs_embeds.shape[:-1]) + (0,), dtype=inputs_embeds.dtype)
    mask = builder(inputs_embeds=stand_in, attention_mask=attention_mask, **kwargs)
    if not isinstance(mask, torch.Tensor):
        return mask
    layout = (mask.untyped_storage().nbytes() // mask.element_size(), mask.dtype, mask.shape, mask.stride(),
              mask.storage_offset())
    del mask  # freed before its meta twin exists, as in the real run only one mask is held
    numel, dtype, shape, stride, offset = layout
    return torch.empty(numel, dtype=dtype, device="meta").as_strided(shape, stride, offset)


def identity(batch: Any) -> Any:
    return batch
