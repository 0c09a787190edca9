"""k3: the Kimi K3 model architecture in PyTorch (spec: shared/spec/K3_SPEC.md)."""

from k3.config import K3Config

__all__ = ["K3Config"]
__version__ = "0.1.0"
