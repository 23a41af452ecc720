"""torch releases whose ``manual_seed`` has no ``_manual_seed_impl`` (2.4 to at least 2.8): a ``manual_seed`` bound
before hydra_tune was imported is still routed to the task's stream (device/seeding.py gives such a torch the same
split), so the task trains exactly as the plain loop. On the installed torch the old function is recreated here;
benchmarks/compat.sh's cell torch-low runs the real one (tests/test_seed_exactness.py).
"""
from __future__ import annotations

from test_seed_exactness import BOUND_BEFORE_IMPORT, _run

# torch 2.4's torch.random.manual_seed (its body, cut to the CPU and CUDA parts): it seeds the default generator
# itself, with no module-level helper a wrapper could reach
OLD_TORCH = '''
import torch, torch.random as R
exec("""
def manual_seed(seed):
    seed = int(seed)
    import torch.cuda
    if not torch.cuda._is_in_bad_fork():
        torch.cuda.manual_seed_all(seed)
    return default_generator.manual_seed(seed)
""", R.__dict__)
R.__dict__.pop("_manual_seed_impl", None)   # absent on the old torch itself
torch.manual_seed = R.manual_seed
'''


def test_manual_seed_bound_before_import_on_a_torch_without_manual_seed_impl():
    assert _run(OLD_TORCH + BOUND_BEFORE_IMPORT) == "0.0"   # manual_seed: torch's own (old-style) function


def test_old_style_manual_seed_outside_a_task_seeds_torch():
    assert _run(OLD_TORCH + """
from torch import manual_seed
import torch, hydra_tune
manual_seed(5)
a = torch.rand(3)
print(torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(5))), torch.initial_seed())
""") == "True 5"
