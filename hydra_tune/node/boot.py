"""The node server's first lines: check which hydra_tune this interpreter imports, then start the server.

    python /path/to/hydra_tune/node/boot.py '{"package": "/path/to/hydra_tune", ...server settings...}'
    # how connect() starts a server (client.py); the settings are server.py's plus the client's package folder

Why not ``python -m hydra_tune.node.server``: ``-m`` puts the working directory first on ``sys.path``, and the
server keeps the user's working directory (for the relative paths of their factories), so a ``hydra_tune.py`` or
a ``hydra_tune/`` folder there would be imported as the package: a user's script run inside the server. Run by its
path, this file has its own folder first on ``sys.path``, and takes it off: the working directory is not on the
path (as with ``python -P``), and the user's modules become importable once a client says hello (handlers.py).
Before anything of hydra_tune is imported it checks that ``import hydra_tune`` finds the client's package; else it
prints the error after ``ERROR_PREFIX`` and exits with ``SHADOWED_EXIT``, which ``connect`` raises as ImportError
(``shadowing_error``). A ``hydra_tune`` earlier on ``PYTHONPATH`` is what remains to be caught that way.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":
    del sys.path[0]   # this file's folder (hydra_tune/node): its modules are no top-level modules

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

SHADOWED_EXIT = 3
ERROR_PREFIX = "hydra_tune node server cannot start: "


def script() -> str:
    """This file's path: what ``python`` runs to start a server."""
    return os.path.abspath(__file__)


def package_dir() -> str:
    """The folder of this hydra_tune package (what the server must import)."""
    return os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_package(expected: str) -> str | None:
    """None if ``import hydra_tune`` here loads the package in ``expected``; else the error, naming what it
    would load and the fix. Imports nothing of hydra_tune."""
    try:
        spec = importlib.util.find_spec("hydra_tune")
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    package = spec is not None and spec.submodule_search_locations is not None and origin is not None and \
        os.path.basename(origin) == "__init__.py"
    found = os.path.realpath(os.path.dirname(origin)) if package and origin else None
    if found == os.path.realpath(expected):
        return None
    shadow = origin if not package else os.path.dirname(origin or "")
    fix = (f"rename or move {shadow} (a script or folder named hydra_tune earlier on the server's path, "
           f"PYTHONPATH={os.environ.get('PYTHONPATH')!r}, shadows the package) and remove its __pycache__ entry"
           if origin else "install hydra_tune into this interpreter, or start from its checkout")
    return (f"`import hydra_tune` in the node server loads the client's package must hold, but got "
            f"(loads={origin!r}, client_package={expected!r}, python={sys.executable!r}). Fix: {fix}.")


def shadowing_error(log_text: str) -> ImportError | None:
    """The ImportError a server that exited with ``SHADOWED_EXIT`` printed into its log, or None."""
    for line in reversed(log_text.splitlines()):
        if line.startswith(ERROR_PREFIX):
            return ImportError(line[len(ERROR_PREFIX):])
    return None


def main(argv: list[str]) -> None:
    problem = check_package(json.loads(argv[0])["package"])
    if problem is not None:
        print(ERROR_PREFIX + problem, flush=True)
        sys.exit(SHADOWED_EXIT)
    from hydra_tune.node.server import main as serve

    serve(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
