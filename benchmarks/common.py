"""Shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this directory is on sys.path)."""

import datetime
import os
import platform

import torch


def machine() -> str:
    """One line naming the CPU, cores, torch build and threads, Python and the date."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    )
