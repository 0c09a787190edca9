"""`k3.runtime.keep_freed_memory`: glibc keeps freed memory for reuse (the command line calls it at start)."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from k3 import runtime


def test_refuses_nothing_and_reports_whether_it_took_effect():
    """On glibc it succeeds; where the C library has no mallopt it is a no-op that says so."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert runtime.keep_freed_memory() is hasattr(libc, "mallopt")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_a_large_freed_block_stays_resident():
    """After it, a freed 64 MiB tensor is not returned to the OS (glibc's default would unmap it at once)."""
    code = """
import torch
from k3.runtime import keep_freed_memory
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
keep = {flag}
if keep:
    assert keep_freed_memory()
before = rss()
x = torch.ones(16 * 2**20)  # 64 MiB, touched
del x
print((rss() - before) / 2**20)
"""
    grown = {flag: float(subprocess.run([sys.executable, "-c", code.format(flag=flag)], check=True,
                                        capture_output=True, text=True).stdout) for flag in (True, False)}
    assert grown[True] > 60 and grown[False] < 8
