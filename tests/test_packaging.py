"""Inference needs only the core dependencies: the `train` (tqdm, matplotlib) and `vision` (Pillow) extras are
optional, and `python -m k3` is the console script."""

from __future__ import annotations

import subprocess
import sys

WITHOUT_EXTRAS = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PIL", "matplotlib", "tqdm"):
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
