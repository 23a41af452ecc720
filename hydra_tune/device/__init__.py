"""Device code, the only place that branches on the device type or touches ``torch.cuda``: CPU and CUDA devices
with their byte accounting and budgets (devices.py), host<->device copies (streams.py: CUDA streams and pinned
memory, CPU stand-ins), the per-unit dispatch modes that account bytes and route a task's random numbers
(dispatch.py), a task's own random streams (rng.py), torch's seeding functions routed to them while the task's
code runs (seeding.py), and torch's intra-op threads for CPU devices (threads.py)."""
