"""The discrete-event simulator (simulator.py: schedules of clusters you do not have, replaying the runtime's own
policies; pool.py: its ready pools) and the timeline plot of a real or simulated trace (plot.py).

    from hydra_tune.sim import simulate, synthetic_tasks
    res = simulate(synthetic_tasks(64), devices=8, record=True)      # record=True: res.trace holds the run
    hydra_tune.plot_timeline(res.trace, "sim.png")                   # imports matplotlib when called
"""
from .simulator import SimResult, SimTask, SimUnit, lower_bound, simulate, synthetic_tasks, tasks_from_trace

__all__ = ["simulate", "SimTask", "SimUnit", "SimResult", "lower_bound", "synthetic_tasks", "tasks_from_trace"]
