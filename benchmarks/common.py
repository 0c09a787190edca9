"""Shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this directory is on sys.path)."""

import datetime
import os
import platform
import time

import torch

from k3.runtime import keep_freed_memory

KEEPS_FREED_MEMORY = keep_freed_memory()  # what the `k3` command does at start: measure the product as users run it


def allocator() -> str:
    """The allocator settings in effect, for the header of a benchmark's output."""
    env = " ".join(f"{name}={value}" for name, value in os.environ.items() if name.startswith("MALLOC_"))
    setting = ("freed memory kept for reuse (k3.runtime.keep_freed_memory, as the k3 command does)"
               if KEEPS_FREED_MEMORY else "default settings")
    return f"glibc malloc, {setting}" + (f"; environment {env}" if env else "")


def machine() -> str:
    """One line naming the CPU, cores, torch build and threads, Python and the date."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    )


class CpuWait:
    """Share of wall time since creation in which some runnable task waited for a CPU (Linux PSI
    `/proc/pressure/cpu`). Our threads fit the cores, so a share well above 0 means other processes competed."""

    def __init__(self):
        self.start_us, self.start_s = self._total_us(), time.perf_counter()

    @staticmethod
    def _total_us():
        try:
            with open("/proc/pressure/cpu") as f:
                return int(f.readline().split("total=")[1])
        except (OSError, IndexError, ValueError):
            return None

    def __str__(self):
        now_us = self._total_us()
        if now_us is None or self.start_us is None:
            return "n/a"
        return f"{(now_us - self.start_us) / 1e6 / (time.perf_counter() - self.start_s):.0%}"


def print_table(columns, rows, align):
    """A markdown table; `align` has one letter per column, "r" for right-aligned numbers."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print(flush=True)
