"""Process-wide settings that make k3 fast without environment variables.

`keep_freed_memory()`: by default glibc hands every large freed block (≥ 128 KiB, adaptively up to 32 MiB) back
to the operating system and trims the heap top, so a training step, which frees and re-allocates the same
temporaries every chunk and layer, faults its memory back in again and again; on small VMs that system time
halved the KDA chunk path. Switching mmap allocation and trimming off makes glibc reuse freed memory — the
effect of `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge>` — at the price of a resident size that stays at its
peak. The command line calls it; a library user may. A no-op where the C library has no `mallopt` (not glibc).

`huge_page_weights(model)`: a decode step reads every weight once per token, hundreds of MB spread over 4 KiB pages,
so the CPU walks the page tables for each page it touches (a TLB holds a few thousand entries). Linux hands out
2 MiB pages to memory that asks for them (transparent huge pages in "madvise" mode, the usual default): the
weights are moved into one anonymous mapping advised so before its first touch — one TLB entry where 512 were
needed. `k3 generate` calls it after loading; a library user may. It returns False and changes nothing where the
kernel has transparent huge pages off ("never") or gives them to all memory anyway ("always").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch
from torch import nn

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h> parameter numbers
NEVER_TRIM = 2**31 - 1  # bytes (mallopt takes an int)


def _libc_function(name: str):
    """The C library's function `name`, or None where the library or the function is missing (not glibc)."""
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library), name, None) if library else None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; True where it took effect."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the operating system now (glibc `malloc_trim`), whatever
    `keep_freed_memory` set: for a one-off release as large as the model, which would otherwise stay resident."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
RELEASE_EVERY = 64 << 20  # bytes of moved weights between two releases of their old storage
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"; "never" where it cannot be read)."""
    try:
        with open(THP_MODE) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def huge_page_weights(module: nn.Module) -> bool:
    """Move the module's CPU parameters and buffers (plain tensors; the same objects, new storage: `tensor.data`) into
    one anonymous mapping advised for transparent huge pages, each tensor contiguous and 64-byte aligned. True where
    it did; False where huge pages are off or already everyone's, `mmap` cannot advise, or there is under one huge
    page of weights. Values are unchanged; the old storage is freed as each tensor moves and handed back to the
    operating system every `RELEASE_EVERY` bytes (`release_freed_memory`): the resident size peaks at one copy of
    the weights plus that much, not two copies."""
    if _thp_mode() != "madvise" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    tensors = list({id(t): t for t in (*module.parameters(), *module.buffers())
                    if type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.numel()}.values())
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    total = sum(sizes)
    if total < HUGE_PAGE:
        return False
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, private (shared memory has its
    # own huge-page switch, usually off), fresh: no page touched before the advice
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive while any view of it lives
    start = -flat.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, len(mapping) - start)
    offset, freed = start, 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            view = flat[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
            offset, freed = offset + size, freed + size
            if freed >= RELEASE_EVERY:  # the old storage, which glibc keeps under keep_freed_memory
                release_freed_memory()
                freed = 0
    release_freed_memory()
    return True


def peak_rss_gib() -> float:
    """This process's peak resident memory in GiB (Linux VmHWM: this program's own, unlike ru_maxrss, which can
    carry the peak of the process that started it); 0.0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return 0.0
