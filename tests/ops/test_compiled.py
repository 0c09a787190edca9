"""`k3.ops.compiled`: where the kernels are built, and a killed build's lock file."""

import os
import time

import torch

from k3.ops import compiled


def test_build_directory_per_kernel_capability_python_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = compiled._build_directory("kda", "AVX2")
    assert os.path.isdir(path) and os.path.dirname(path) == str(tmp_path)
    name = os.path.basename(path)
    assert name.startswith("k3_kda_avx2_py") and torch.__version__.replace("+", "_") in name


def test_a_stale_lock_is_removed_and_a_live_one_kept(monkeypatch, tmp_path):
    """PyTorch's builder waits for as long as a lock file exists: one older than any build (left by a killed
    build) is removed; a recent one (another process building now) stays."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(compiled._build_directory("matvec", "AVX2"), "lock")
    open(lock, "w").close()
    compiled._build_directory("matvec", "AVX2")
    assert os.path.exists(lock)
    old = time.time() - compiled.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    compiled._build_directory("matvec", "AVX2")
    assert not os.path.exists(lock)
