"""Keep the memory a step frees for the next step: glibc's malloc thresholds set where it would settle.

glibc serves a large allocation with its own ``mmap`` (fresh pages, one page fault each on first touch, unmapped
again on ``free``) while it is above ``M_MMAP_THRESHOLD``, and gives the top of its heap back to the system once
more than ``M_TRIM_THRESHOLD`` of it is free. Both start low (128 KiB) and rise as large blocks are freed (the
threshold follows the largest block freed so far, up to 32 MiB; the trim threshold is twice it), so a fresh
process pays page faults on every step's activations until the thresholds have followed its largest tensors --
measured here on the goodput benchmark's model: 2,000-5,000 faults (~5-10 ms) in each of the first 3-4 steps
after a warm-up step, none afterwards. :func:`keep_freed_memory` sets the two thresholds to those upper values
from the start: tensors below 32 MiB come from the heap and what a step frees stays there for the next one.

Used by every training worker: the trainer's (``train/loop.py``) and a replica's under ``--fault-tolerance
torchft``, whose first steps after it healed are waited for by its peers. glibc only (elsewhere nothing changes).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's largest dynamic mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``)."""


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD` and its trim threshold to twice it (module
    docstring); whether it was set (False where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")  # find_library may find none: glibc's soname
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD))


__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]
