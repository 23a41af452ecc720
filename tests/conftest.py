"""Shared fixtures: tiny real models (transformers GPT-2 with random init) and their data."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # each CPU device uses one core, as the runtime's workers do


def gpt2_config(**overrides):
    from transformers import GPT2Config

    kw = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
              resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    kw.update(overrides)
    return GPT2Config(**kw)


def make_gpt2(**overrides):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(gpt2_config(**overrides))


def lm_batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 128, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def process_alive(pid: int) -> bool:
    """The process runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(autouse=True)
def _quiet_transformers():
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()
