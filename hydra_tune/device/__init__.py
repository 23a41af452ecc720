"""Device code, the only place that branches on the device type: CPU and CUDA devices with their byte accounting
and budgets, host<->device copies (CUDA streams and pinned memory, CPU stand-ins), and the per-unit dispatch
modes that account bytes and route a task's random numbers."""
