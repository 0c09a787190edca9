"""Inference needs only the core dependencies: the `train` (matplotlib) and `vision` (Pillow) extras are optional,
and `python -m k3` is the console script."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

WITHOUT_EXTRAS = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PIL", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
import torch, k3
model = k3.K3ForCausalLM(k3.K3Config.from_preset("k3-tiny"))
out = k3.generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)
assert out.shape == (1, 7)
try:
    k3.K3Processor
except ModuleNotFoundError as e:
    assert "kimi-k3[vision]" in str(e), e
else:
    raise AssertionError("K3Processor imported without Pillow")
print("ok")
"""


def test_inference_without_the_optional_extras():
    result = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_kernel_sources_ship_with_the_package():
    """Every C++ kernel `k3.ops.compiled` builds, and every header they include, exists and is package data
    (compiled on the user's machine)."""
    from pathlib import Path

    from k3.ops import compiled

    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

    root = Path(__file__).resolve().parents[1]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    ops = root / "src" / "k3" / "ops"
    headers = {include for source in compiled.KERNELS.values()
               for include in re.findall(r'#include "(.+)"', (ops / source).read_text())}
    assert headers == {"kernel_math.h", "matvec.h", "mxfp4.h"}
    for source in [*compiled.KERNELS.values(), *headers]:
        path = ops / source
        package = ".".join(path.parent.relative_to(root / "src").parts)
        assert path.is_file() and any(path.match(glob) for glob in package_data.get(package, [])), source


def test_build_command_reports_every_kernel():
    """`python -m k3.ops.build` (run by `make` while installing) names each kernel and exits 0 either way."""
    from k3.ops import compiled

    result = subprocess.run([sys.executable, "-m", "k3.ops.build"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in compiled.KERNELS:
        assert f"k3: compiled {name} kernel " in result.stdout
