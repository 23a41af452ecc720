"""Integrations with HPO tools (installed as ``hydra_tune.integrations``); each imports its tool lazily."""
