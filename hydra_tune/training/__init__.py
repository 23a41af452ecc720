"""One task's training: building it from a ModelTask (build.py, state.py), measuring and planning it (profile.py,
plan_model.py, footprint.py), its loop as a chain of segments of units (loop.py, segments.py), running a shard's
units on a device (shard.py, loss.py, residency.py, store.py), checkpoints (checkpoint.py) and re-planning after
a device out-of-memory (replan.py)."""
