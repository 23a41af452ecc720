"""PEFT's adapter switches in a prepared loop: reference outputs under ``disable_adapter()`` (a DPO-style
reference pass) between training steps stay exact against the plain loop (max abs difference 0.0, fp32 on CPU),
with the base held once or per trial, resident or on a tight budget; what would go silently wrong is refused:
``merge_adapter()`` (it writes the adapter into the base through ``.data``: the units ran the base without it) and
a first call inside ``disable_adapter()`` (the task is planned with nothing to train)."""
from __future__ import annotations

import pytest
import torch
from test_peft_lora import batches, lora_bert

import hydra_tune as ht

pytest.importorskip("peft", reason="PEFT support needs the `peft` extra (pip install hydra_tune[peft])")

DATA = batches(4, seed=3)


def _loop(body, rt=None) -> list[torch.Tensor]:
    """``body(model, opt, step)`` around each step of a plain PEFT loop; what it returns, the weights at the end."""
    torch.manual_seed(0)
    model = lora_bert()()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if rt is not None:
        model, opt = ht.prepare(model, opt, runtime=rt)
    seen = []
    for s, b in enumerate(DATA):
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(body(model, s))
    seen.append(torch.cat([v.detach().flatten() for v in model.state_dict().values()]))
    if rt is not None:
        model.release()
    return seen


def _reference(model, step) -> torch.Tensor:
    with torch.no_grad(), model.disable_adapter():
        return model(input_ids=DATA[0]["input_ids"]).logits.clone()


def _reference_with_grad(model, step) -> torch.Tensor:
    with model.disable_adapter():  # grad on, the output detached: a training forward whose backward never comes
        return model(input_ids=DATA[0]["input_ids"]).logits.detach().clone()


@pytest.mark.parametrize("budget", ["64MiB", "256KiB"], ids=["resident", "tight-budget"])
@pytest.mark.parametrize("share", [True, False], ids=["base-held-once", "base-per-trial"])
@pytest.mark.parametrize("reference", [_reference, _reference_with_grad], ids=["no_grad", "grad"])
def test_reference_outputs_with_the_adapter_disabled_between_steps_are_exact(budget, share, reference):
    # before: a resident task's unit under disable_adapter() raised KeyError (the adapter's weights, frozen for
    # the while, were neither the state's nor the frozen ones the unit copies in)
    want = _loop(reference)
    with ht.Runtime(config=ht.RuntimeConfig(devices=["cpu"], device_memory=budget, share_frozen=share)) as rt:
        got = _loop(reference, rt)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.fixture(scope="module")
def rt():
    with ht.Runtime(devices=["cpu"], device_memory="64MiB") as runtime:
        yield runtime


def test_a_merged_adapter_is_refused_at_the_next_call(rt):
    # before: the merged evaluation ran the base as the runtime held it, without the adapter (logits off by 1e-4)
    model = lora_bert()()
    model, opt = ht.prepare(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), runtime=rt)
    model(**DATA[0]).loss.backward()
    opt.step()
    model.merge_adapter()
    with pytest.raises(RuntimeError, match=r"adapters stay unmerged.*merged=\['base_model.*query.*merge_and_unload"):
        model(input_ids=DATA[0]["input_ids"])
    model.unmerge_adapter()
    model.release()


def test_a_first_call_inside_disable_adapter_is_refused_naming_it(rt):
    # before: "the model has at least one parameter to train", for a model whose optimizer steps 10 of them
    model = lora_bert()()
    model, _ = ht.prepare(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), runtime=rt)
    with torch.no_grad(), model.disable_adapter(), pytest.raises(RuntimeError, match="disable_adapter"):
        model(input_ids=DATA[0]["input_ids"])
    model(**DATA[0]).loss.backward()  # the first call outside it plans the task
    model.release()


@pytest.mark.parametrize("budget", ["64MiB", "256KiB"], ids=["resident", "tight-budget"])
@pytest.mark.parametrize("first", ["B", "A"], ids=["other-brought-the-base", "unfreezer-brought-the-base"])
def test_a_trial_unfreezing_part_of_a_shared_base_trains_exactly_beside_one_that_does_not(budget, first):
    # before: the unfreezing trial's step was refused (its LayerNorms were held once with the other trial's); and
    # when the unfreezing trial was the one whose weights the pool took, each of its steps moved the pooled
    # tensor's in-place counter (shared with its parameter), so B's next unit failed reading them as written
    def loop(rt=None, name=None):
        torch.manual_seed(0)
        model = lora_bert()()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if rt is None:
            torch.manual_seed(1)  # what each trial's own stream starts from (seed=1): the two share this thread
            return model, opt
        return ht.prepare(model, opt, runtime=rt, name=name, seed=1)

    def steps(model, opt, thaw, which):
        for s in which:
            if thaw and s == 2:
                norms = [p for n, p in model.named_parameters() if "LayerNorm" in n]
                for p in norms:
                    p.requires_grad_(True)
                opt.add_param_group({"params": norms, "lr": 1e-3})
            loss = model(**DATA[s]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    def weights(model):
        return {k: v.clone() for k, v in model.state_dict().items()}

    want = {}
    for thaw in (True, False):
        model, opt = loop()
        steps(model, opt, thaw, range(4))
        want[thaw] = weights(model)
    with ht.Runtime(devices=["cpu"], device_memory=budget) as rt:
        (a, a_opt), (b, b_opt) = loop(rt, name="A"), loop(rt, name="B")
        if first == "A":  # A's first call submits it: the pool takes A's weights, B's point at them
            steps(a, a_opt, True, range(1))
            steps(b, b_opt, False, range(2))
            steps(a, a_opt, True, range(1, 4))
        else:
            steps(b, b_opt, False, range(2))
            steps(a, a_opt, True, range(4))   # B holds the base meanwhile: A's LayerNorms are copied for it
        steps(b, b_opt, False, range(2, 4))
        pool = rt.stats()["shared_frozen"]
        got = {True: weights(a), False: weights(b)}
        a.release()
        b.release()
    assert pool["thawed_copy_bytes"] > 0
    for thaw in (True, False):
        assert all(torch.equal(want[thaw][k], got[thaw][k]) for k in want[thaw]), thaw
