"""Process memory as the soak measures it: RSS, the bytes malloc has handed out, and glibc's knobs.

    fix_malloc_thresholds()          # before the work: RSS then follows live memory (benchmarks/soak.py docstring)
    trim(); print(rss(), malloc_in_use(), deep_size(runtime.scheduler.task_stats()))
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys
import types
from typing import Any


def fix_malloc_thresholds() -> bool:
    """glibc: fix the mmap and trim thresholds at 128 KiB (mallopt), so RSS follows live memory; False elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-1, 128 << 10) and libc.mallopt(-3, 128 << 10))  # M_TRIM_, M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def trim() -> None:
    """Collect garbage and give free heap pages back to the OS (glibc's malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back, all arenas (glibc's mallinfo2; 0 where there is none)."""
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    f.restype = _Mallinfo2
    m = f()
    return int(m.uordblks + m.hblkhd)


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def deep_size(root: Any) -> int:
    """Bytes of the Python objects reachable from ``root`` (``sys.getsizeof`` each, once; classes, modules and
    functions not followed): an estimate of what a record keeps alive."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total
