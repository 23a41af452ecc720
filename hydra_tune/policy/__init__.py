"""Pure decisions over plain data: the partitioner (partition.py: stage costs -> shards), the schedule
(schedule.py: which task a device runs next) and host-memory admission (admission.py).

Rule: these modules import only the standard library, ``hydra_tune.errors``, ``hydra_tune.config`` and each other
(no torch, no device state; tests/test_imports.py checks it), so each is tested with exact expected outputs and
the simulator (hydra_tune/sim/) replays the very same functions."""
