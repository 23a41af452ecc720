"""One task's training state and loop: building it from a ModelTask, profiling and planning it, the chain of
segments (the plain loop as units), shard execution, host buffers, checkpoints, host footprints and re-planning
after a device out-of-memory."""
