"""Normalisations (docs/architecture.md §0.2, §0.4, §0.5).

RMSNorm keeps its statistics in fp32: normalise in fp32, round to the activation dtype, then multiply by the
gain. L2Norm puts ε inside the square root (it is not `F.normalize`).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops import decode
from k3.ops.precision import fp32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean_c(x_c²) + ε) in fp32 (no gain); one compiled call when decoding (`k3.ops.decode`)."""
    fused = decode.rms_norm(x, None, eps)
    if fused is not None:
        return fused
    x = fp32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ_c x_c² + ε) in fp32 (§0.2; KDA q/k use ε = 1e-6); one compiled call when decoding."""
    fused = decode.rms_norm(x, None, eps, mean=False)
    if fused is not None:
        return fused
    x = fp32(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm_{w,ε}(x) = w ⊙ x / sqrt(mean(x²) + ε); statistics in fp32, gain applied in the input dtype.

    `eps=None` follows `torch.nn.RMSNorm`: ε is the machine epsilon of the input dtype (2⁻⁷ for bf16, 1.19e-7
    for fp32) — the MoonViT-V2 norms of the released code (§9.4, §13 row 10)."""

    def __init__(self, dim: int, eps: float | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        fused = decode.rms_norm(x, self.weight, eps)  # one compiled call when decoding
        if fused is not None:
            return fused
        return (self.weight * rms_normalize(x, eps).to(x.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
