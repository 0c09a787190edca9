"""`k3.ops.compiled`: where the kernels are built, and a killed build's lock file."""

import os
import subprocess
import sys
import time

import pytest
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


def test_every_kernel_the_readme_promises_is_built():
    """`make test` must fail, not skip ~170 tests, where the C++ compiler is broken (K3_KERNELS=optional opts out)."""
    from k3.ops.build import kernels_optional

    if kernels_optional():
        pytest.skip("K3_KERNELS=optional: the torch ops may serve in place of the compiled kernels")
    missing = {name: compiled.summary(why) for name in compiled.KERNELS
               for module, why in [compiled.build(name)] if module is None}
    assert not missing, missing


def test_the_build_fails_loudly_without_a_compiler(tmp_path):
    """`python -m k3.ops.build` with a compiler that fails: exit 1, each kernel named with the builder's report, and
    how to opt out; with --allow-missing: exit 0, one line per kernel."""
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("K3_KERNELS", None)
    loud = subprocess.run([sys.executable, "-m", "k3.ops.build"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert loud.returncode == 1 and "Traceback" not in loud.stderr
    assert all(f"compiled {name} kernel FAILED to build" in loud.stderr for name in compiled.KERNELS)
    assert "/bin/false" in loud.stderr and "--allow-missing" in loud.stderr
    allowed = subprocess.run([sys.executable, "-m", "k3.ops.build", "--allow-missing"], capture_output=True,
                             text=True, env=env, timeout=300)
    assert allowed.returncode == 0 and allowed.stdout.count("the torch ops serve") == len(compiled.KERNELS)
