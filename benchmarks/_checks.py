"""The end the check-style benchmarks share (soak, node churn, the Optuna chaos study): the verdict, the JSON line.

    return finish(result, failures(result), args.json)      # the exit status: 1 when a check failed

Torch-free: the node-churn and Optuna chaos drivers import it without loading torch.
"""
from __future__ import annotations

import json
from typing import Any


def finish(result: dict[str, Any], bad: list[str], path: str | None, echo: bool = False) -> int:
    """Print whether every check passed (else the failures), write ``result`` as one JSON line to ``path`` if
    given (and print it with ``echo``); the process's exit status."""
    print("checks:", "all passed" if not bad else "FAILED: " + "; ".join(bad))
    line = json.dumps(result, default=str)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    if echo:
        print(line)
    return 1 if bad else 0
