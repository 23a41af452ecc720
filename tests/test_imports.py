"""`import hydra_tune` stays light: no ray, optuna, transformers, pynvml or matplotlib until a feature needs them."""
import subprocess
import sys

HEAVY = ("ray", "optuna", "transformers", "pynvml", "matplotlib")


def test_import_pulls_no_optional_dependency():
    code = ("import sys, hydra_tune; hydra_tune.ModelTask; hydra_tune.Runtime; hydra_tune.train; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported eagerly: {out.stdout.strip()}"


def test_runtime_on_cpu_imports_no_optional_dependency():
    code = ("import sys, torch, hydra_tune as ht\n"
            "t = ht.ModelTask(torch.nn.Sequential(torch.nn.Linear(2, 2)), lambda m: torch.optim.SGD(m.parameters(),"
            " lr=0.1), [(torch.ones(1, 2), torch.ones(1, 2))], loss=lambda o, b: o.sum())\n"
            "with ht.Runtime(devices=['cpu']) as rt: rt.submit(t).result()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_integrations_subpackage_is_installed():
    out = subprocess.run([sys.executable, "-c", "import hydra_tune.integrations as i; print(i.__name__)"],
                         capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "hydra_tune.integrations"
