"""Plan a model without building its weights: stages measured on the meta device (shapes only, no data).

    plan = hydra_tune.plan_model(lambda: LlamaForCausalLM(config_6b), {"input_ids": ids, "labels": ids},
                                 device_memory="40GiB")
    [sh.names for sh in plan.shards], plan.peak            # in seconds, without allocating the 6B weights

The factory runs under ``torch.device("meta")``, so parameters, activations and gradients are shapes with no
memory behind them; the runtime's accounting counts their bytes exactly as it counts real CPU storages. Unit
times cannot be measured this way, so the plan keeps and offloads nothing (those choices need measured forward
times): it is the partition a ``Runtime`` would start from, for sizing budgets and devices.

Real tokenizer batches work for every family hydra_tune cuts (GPT-2, BERT, LLaMA-family, OPT): their stages read
the attention mask's values (whether anything is padded decides which mask transformers builds), so the mask
stays a real tensor while the rest goes to the meta device (``ModelStages.meta_batch``, ``stages.base.build_mask``).
A model run whole whose forward reads values (``.item()``, ``if tensor.all()``) is refused with a TypeError that
says so.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config import parse_bytes
from ..errors import rule_error
from ..policy.partition import Plan, partition
from ..stages import extract_stages
from .build import AUTOCAST_DTYPES
from .profile import measure_costs


def plan_model(model: Callable[[], nn.Module], sample_batch: Any, device_memory: int | str | None, *,
               loss: Callable[[Any, Any], Any] | None = None, precision: str = "fp32",
               stages: Callable[[nn.Module], Any] | None = None) -> Plan:
    """The shard plan of ``model()`` for batches shaped like ``sample_batch`` under ``device_memory`` (the
    planner's budget per device), built and measured on the meta device."""
    if not callable(model) or isinstance(model, nn.Module):
        raise TypeError(f"`model` is a zero-argument factory (it is built on the meta device), but got "
                        f"(model={type(model).__name__}). Fix: pass e.g. `lambda: MyModel(config)`.")
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"`precision` in {tuple(AUTOCAST_DTYPES)}, but got (precision={precision!r}). "
                         "Fix: pick one.")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the `model` factory returns an nn.Module, but got (type={type(built).__name__}).")
    on_meta = [n for n, t in list(built.named_parameters()) + list(built.named_buffers()) if t.device.type != "meta"]
    if on_meta:
        raise ValueError(f"every parameter and buffer is built on the meta device, but got (not_meta={on_meta[:3]})."
                         " Fix: create tensors without an explicit device= in the model's constructor.")
    cut = extract_stages(built, stages)
    try:
        costs = measure_costs(cut, cut.meta_batch(sample_batch), loss, 0, AUTOCAST_DTYPES[precision])
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
        raise rule_error("the model's forward and loss run on shapes alone (plan_model measures them on the meta "
                         "device, where no tensor has values)", "plan a model whose stages hydra_tune cuts (GPT-2, "
                         "BERT, LLaMA-family and OPT read their attention masks' values themselves), leave out "
                         "the batch entry whose values the forward reads, or measure a real build with "
                         "Runtime.footprint(task) or Runtime.submit", kind=TypeError, model=type(built).__name__,
                         stages=cut.family, error=f"{type(exc).__name__}: {exc}") from exc
    return partition(costs, parse_bytes(device_memory), keep=False)
