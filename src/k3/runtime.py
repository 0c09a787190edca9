"""Process-wide settings that make k3 fast without environment variables (docs/benchmarks.md, "KDA core").

`keep_freed_memory()`: by default glibc hands every large freed block (≥ 128 KiB, adaptively up to 32 MiB) back
to the operating system and trims the heap top, so a training step, which frees and re-allocates the same
temporaries every chunk and layer, faults its memory back in again and again; on small VMs that system time
halved the KDA chunk path. Switching mmap allocation and trimming off makes glibc reuse freed memory — the
effect of `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge>` — at the price of a resident size that stays at its
peak. The command line calls it; a library user may. A no-op where the C library has no `mallopt` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h> parameter numbers
NEVER_TRIM = 2**31 - 1  # bytes (mallopt takes an int)


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; True where it took effect."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
