"""Pure decisions over plain data, no torch: the partitioner (stage costs -> shards), the schedule (which task a
device runs next) and host-memory admission. Each has exact-output tests; the simulator replays them."""
