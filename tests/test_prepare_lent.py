"""A prepared call's segment run in the loop's own thread on the device its task was kept on (runtime/lend.py):
the plain loop's values (max abs diff 0.0), with the loop's thread inside no_grad (evaluation), autograd's
backward and a trial stream (streams.py); a ModelTask on the same device still gets its turns."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from test_prepare_exactness import X, Y, _diff, _mlp, mlp_loop

import hydra_tune as ht
from hydra_tune.prepare.streams import trial_stream

def test_lent_segments_run_in_the_loops_thread_bit_identical_in_a_trial_stream():
    plain = mlp_loop(epochs=3)
    with ht.Runtime(devices=["cpu"]) as rt:
        with trial_stream(concurrent=True):  # its dispatch mode is set aside for the units (device/lent.py)
            weights, history, model = mlp_loop(lambda m, o: ht.prepare(m, o, runtime=rt, name="lent"), epochs=3)
        record = rt.stats()["tasks"]["lent"]
        model.release()
    assert _diff(plain[0], weights) == 0.0 and plain[1] == history
    assert record["lent_segments"] > 0  # forwards, evaluation forwards and backwards ran in the loop's thread

def test_a_model_task_beside_a_lent_prepared_loop_runs_and_both_stay_exact():
    torch.manual_seed(3)
    other = _mlp(0.0)
    init = {k: v.clone() for k, v in other.state_dict().items()}
    alone = _mlp(0.0)
    alone.load_state_dict(init)
    batches = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 64, 8)]

    def task(model):
        return ht.ModelTask(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches,
                            loss=lambda out, b: F.cross_entropy(out, b[1]), epochs=2, seed=1, name="beside")
    with ht.Runtime(devices=["cpu"]) as rt:
        rt.submit(task(alone)).result()
    plain = mlp_loop(epochs=6)
    with ht.Runtime(devices=["cpu"]) as rt:
        handle = None

        def prepared(m, o):
            nonlocal handle
            model, opt = ht.prepare(m, o, runtime=rt, name="loop")
            handle = rt.submit(task(other))  # submitted as the loop starts: it runs between the loop's calls
            return model, opt
        weights, history, model = mlp_loop(prepared, epochs=6)
        handle.result()
        lent = rt.stats()["tasks"]["loop"]["lent_segments"]
        model.release()
    assert _diff(plain[0], weights) == 0.0 and plain[1] == history
    assert _diff({k: v for k, v in alone.state_dict().items()}, other.state_dict()) == 0.0
    assert lent > 0
