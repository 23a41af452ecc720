"""The node's runtime: per-device workers that run every admitted task's segments, a host thread per task for its
host work between them, the host-memory gate, the handles callers hold, and the trace of what ran where."""
