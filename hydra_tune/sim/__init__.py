"""The discrete-event simulator (schedules of clusters you do not have, replaying the runtime's own policies) and
the timeline plot of a real or simulated trace.

    res = hydra_tune.simulate(synthetic_tasks(64), devices=8); plot_timeline(res.trace, "sim.png")
"""
from .simulator import SimResult, SimTask, SimUnit, lower_bound, simulate, synthetic_tasks, tasks_from_trace

__all__ = ["simulate", "SimTask", "SimUnit", "SimResult", "lower_bound", "synthetic_tasks", "tasks_from_trace"]
