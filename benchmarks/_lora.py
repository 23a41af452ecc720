"""The bases benchmarks/lora_memory.py fine-tunes, and the plain warm-up step its warmed baseline is read after.

    base = make_base("bert-base", minilm_path, vocab_size=30522)   # random init, seed BASE_SEED, no download
    warm_up(batch, vocab_size=30522)   # one plain PEFT step of a tiny BERT, let go: library pages touched

Both bases are ``BertForSequenceClassification`` (2 labels) fed by the MiniLM tokenizer: "minilm" the shipped
pretrained all-MiniLM-L6-v2 (``from_pretrained``, its ``model.safetensors``), "bert-base" ``BertConfig()``'s
defaults (12 layers x 768, ~110M parameters, ~418 MiB fp32) with ``vocab_size`` set to the tokenizer's.
"""
from __future__ import annotations

from typing import Any

BASE_SEED = 0   # every trial's bert-base is drawn from this seed: equal bytes, so the pool shares them
BASES = ("minilm", "bert-base")


def make_base(base: str, path: str, vocab_size: int) -> Any:
    """A trial's base model, built inside its factory. bert-base is initialised after ``torch.manual_seed(
    BASE_SEED)``: in a hydra_tune task that seeds the task's own stream (device/seeding.py), in a plain loop the
    global one; the caller reseeds with the trial's seed afterwards, so adapters and dropout draw per trial."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    if base == "minilm":
        return BertForSequenceClassification.from_pretrained(path, num_labels=2)
    if base != "bert-base":
        raise ValueError(f"unknown base {base!r}: one of {BASES}")
    torch.manual_seed(BASE_SEED)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab_size, num_labels=2))


def lora(model: Any, r: int) -> Any:
    """The search space's LoRA over ``model`` (both bases alike): rank ``r``, alpha 2r, query/value, dropout 0.1,
    the classifier trained in full."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["query", "value"],
                                            lora_dropout=0.1, modules_to_save=["classifier"]))


def warm_up(batch: dict, vocab_size: int) -> None:
    """One plain PEFT training step (forward, backward, AdamW) of a tiny BERT on ``batch``, in this thread, then
    let go: the library code pages a training step first touches (torch's and transformers' file-backed pages)
    become resident, so a baseline read after it leaves them out. Not hydra_tune's runtime: its own fixed costs
    stay in the reading."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=2)
    model = lora(BertForSequenceClassification(cfg), 2)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
