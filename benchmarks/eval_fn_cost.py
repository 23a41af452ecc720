"""What ModelTask(eval_fn=fn) costs per evaluation point: fn timed inside hydra_tune, run_eval_fn as a whole (a
device-resident state copied to host memory, eval mode, RNG routing, fn) and the same fn called directly (one thread).

    python benchmarks/eval_fn_cost.py 256      # MLP 64-256-256-10 (85k parameters); 1024: 1.1M parameters
"""
import sys, time, statistics
import torch, torch.nn as nn, torch.nn.functional as F
import hydra_tune as ht
import hydra_tune.training.loop as L
whole = []
_orig = L.run_eval_fn
def _timed_run(state, reported):
    t0 = time.perf_counter(); r = _orig(state, reported); whole.append(time.perf_counter() - t0); return r
L.run_eval_fn = _timed_run
torch.manual_seed(0)
D = int(sys.argv[1]) if len(sys.argv) > 1 else 256
train = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(20)]
val = [(torch.randn(256, 64), torch.randint(0, 10, (256,))) for _ in range(8)]
def make(): return nn.Sequential(nn.Linear(64, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 10))
def acc(model):
    c = t = 0
    for x, y in val:
        c += (model(x).argmax(-1) == y).sum().item(); t += y.numel()
    return {"acc": c / t}
inside = []
def timed(model):
    t0 = time.perf_counter(); r = acc(model); inside.append(time.perf_counter() - t0); return r
def loss(o, b): return F.cross_entropy(o, b[1])
for mem, label in ((None, "state resident on the device"), (str(16 * D * D) , "sharded, state in host memory")):
    inside.clear(); whole.clear()
    walls = {}
    for fn in (None, timed):
        task = ht.ModelTask(make, lambda m: torch.optim.Adam(m.parameters()), train, loss=loss, epochs=1,
                            eval_every=1, eval_fn=fn)
        best = []
        for _ in range(3):
            with ht.Runtime(devices=["cpu"], device_memory=mem) as rt:
                t0 = time.perf_counter(); rt.submit(task).result(); best.append(time.perf_counter() - t0)
        walls[fn is None] = min(best)
    torch.set_num_threads(1); m = make().eval()
    direct = []
    with torch.no_grad():
        for _ in range(10):
            t0 = time.perf_counter(); acc(m); direct.append(time.perf_counter() - t0)
    n = len(inside) // 3
    print(f"{label}: params={sum(p.numel() for p in m.parameters())} evals={n} eval_fn inside={statistics.median(inside)*1e3:.2f} ms, run_eval_fn (copy+modes+fn) {statistics.median([w for w in whole if w > 1e-4])*1e3:.2f} ms "
          f"direct={statistics.median(direct)*1e3:.2f} ms; task wall without {walls[True]:.2f}s with {walls[False]:.2f}s "
          f"-> {(walls[False]-walls[True])/n*1e3:.1f} ms per evaluation point")
