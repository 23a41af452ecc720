"""`import hydra_tune` stays light: no ray, optuna, transformers, pynvml or matplotlib until a feature needs them;
the layers keep their imports: policy/ is torch-free, only device/ touches ``torch.cuda``."""
import ast
import pathlib
import re
import subprocess
import sys

import pytest

HEAVY = ("ray", "optuna", "transformers", "pynvml", "matplotlib")

_FRESH = (
    "import sys, hydra_tune; hydra_tune.ModelTask; hydra_tune.Runtime; hydra_tune.train\n"
    f"print('IMPORT=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    "print('DYNAMO=' + str('torch._dynamo' in sys.modules))\n"
    "import torch, hydra_tune as ht\n"
    "t = ht.ModelTask(torch.nn.Sequential(torch.nn.Linear(2, 2)), lambda m: torch.optim.SGD(m.parameters(),"
    " lr=0.1), [(torch.ones(1, 2), torch.ones(1, 2))], loss=lambda o, b: o.sum())\n"
    "with ht.Runtime(devices=['cpu']) as rt: rt.submit(t).result()\n"
    f"print('RUNTIME=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    "import hydra_tune.integrations as i; print('INTEGRATIONS=' + i.__name__)\n")


@pytest.fixture(scope="module")
def fresh() -> dict:
    """What one fresh interpreter saw, step by step: the heavy modules loaded after `import hydra_tune`, then after
    a task ran on a CPU runtime, then the name `import hydra_tune.integrations` gives. Its working directory is
    "/": the installed package is imported, not this checkout's folder. One interpreter for the three tests: each
    step only adds imports, so each sees what a fresh interpreter doing only its step would (an interpreter and
    `import torch` cost seconds on 2 busy cores)."""
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, cwd="/")
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    return dict(seen, stderr=out.stderr[-3000:])   # a step that failed: its key is missing, its error here


def test_import_pulls_no_optional_dependency(fresh):
    assert "IMPORT" in fresh, fresh["stderr"]
    assert fresh["IMPORT"] == "", f"imported eagerly: {fresh['IMPORT']}"


def test_import_does_not_load_torch_dynamo(fresh):
    # torch imports torch._dynamo (over a second on a busy core) at its first optimizer: `import hydra_tune`
    # must not make one (a Ray driver or a node's client never trains)
    assert "DYNAMO" in fresh, fresh["stderr"]
    assert fresh["DYNAMO"] == "False"


def test_runtime_on_cpu_imports_no_optional_dependency(fresh):
    assert "RUNTIME" in fresh, fresh["stderr"]
    assert fresh["RUNTIME"] == ""


def test_integrations_subpackage_is_installed(fresh):
    assert fresh.get("INTEGRATIONS") == "hydra_tune.integrations", fresh["stderr"]


# ----------------------------------------------------------------------------------------------- layer rules

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICY_MODULES = ("hydra_tune.policy.partition", "hydra_tune.policy.schedule", "hydra_tune.policy.admission")
POLICY_MAY_IMPORT = ("hydra_tune.policy", "hydra_tune.errors", "hydra_tune.config")


def _module_file(name: str) -> pathlib.Path:
    path = ROOT.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(name: str, with_typing: bool = True) -> set[str]:
    """Absolute names of every module ``name``'s source imports, at any depth (inside functions too); without
    ``with_typing``, less the ``if TYPE_CHECKING:`` blocks (what only a type checker reads)."""
    tree = ast.parse(_module_file(name).read_text())
    if not with_typing:
        for block in ast.walk(tree):
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
                block.body = []
    package = name if _module_file(name).name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            out.add(mod)
            # `from . import schedule` names a submodule; `from .errors import rule_error` names an attribute.
            out |= {f"{mod}.{a.name}" for a in node.names if _module_file(f"{mod}.{a.name}").exists()}
    return out


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_policy_modules_import_only_the_standard_library_errors_and_config():
    seen, todo, bad = set(), list(POLICY_MODULES), []
    while todo:   # follow hydra_tune's own imports: what errors and config import counts too
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for mod in sorted(_imports(name)):
            if mod == "__future__" or mod.split(".")[0] in sys.stdlib_module_names:
                continue
            if _inside(mod, POLICY_MAY_IMPORT):
                todo.append(mod)
            else:
                bad.append(f"{name} imports {mod}")
    assert not bad, bad


def test_policy_modules_load_without_torch():
    # hydra_tune/__init__ imports torch: stand in an empty package for it, then load the policy modules for real.
    code = ("import importlib, importlib.util, sys, types\n"
            "spec = importlib.util.find_spec('hydra_tune')\n"
            "pkg = types.ModuleType('hydra_tune'); pkg.__path__ = list(spec.submodule_search_locations)\n"
            "sys.modules['hydra_tune'] = pkg\n"
            f"for m in {POLICY_MODULES!r}: importlib.import_module(m)\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the policy modules imported: {out.stdout.strip()}"


def test_only_device_modules_touch_torch_cuda():
    cuda = re.compile(r"\btorch\.cuda\b|\bfrom\s+torch\s+import\s+[^\n]*\bcuda\b")
    device = ROOT / "hydra_tune" / "device"
    files = [p for d in ("hydra_tune", "integrations") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20 and any(p.parent == device for p in files)
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in files if device not in p.parents
           for n, line in enumerate(p.read_text().splitlines(), 1) if cuda.search(line)]
    assert not bad, f"torch.cuda outside hydra_tune/device/: {bad}"


def test_the_package_import_graph_has_no_cycles():
    """No hydra_tune module imports, directly or through others, a module that imports it back: the layers import
    downwards only. Function-level imports count; type-checking-only imports do not."""
    files = sorted((ROOT / "hydra_tune").rglob("*.py"))
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in files}
    graph = {m: {i for i in _imports(m, with_typing=False) if i in modules and i != m} for m in modules}
    assert len(graph) > 40 and graph["hydra_tune.runtime.runtime"]
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for nxt in sorted(graph[m]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)
