"""Patch merger (`sd2_tpool`) and projector (`patchmergerv2`, module `mm_projector`): docs/architecture.md §9.7, §9.8.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3.config import K3VisionConfig
from k3.ops.norm import RMSNorm
from k3.vision.moonvit import fan_in_trunc_normal_


def merge_patches(x_ND: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Per item: mean over the t frames, then 2×2 space-to-depth → [M, 4D] (§9.7).

    Merged token (Y, X) concatenates patches (2Y, 2X), (2Y, 2X+1), (2Y+1, 2X), (2Y+1, 2X+1) in that order;
    merged tokens are row-major in (Y, X) and items follow each other.
    """
    D = x_ND.shape[-1]
    merged = []
    for x_XD, (t, h, w) in zip(x_ND.split([t * h * w for t, h, w in grids]), grids):
        x_th2w2D = x_XD.view(t, h // 2, 2, w // 2, 2, D)
        merged.append(x_th2w2D.permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape(-1, 4 * D))
    return torch.cat(merged)


class PatchMergerProjector(nn.Module):
    """y = RMSNorm_{post_norm, 1e-5}(W₂ · GELU_erf(W₁ · v)), no pre-norm, no biases (§9.8)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        merged, C = config.merged_hidden_size, config.text_hidden_size
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), nn.GELU(),  # exact erf GELU
                                  nn.Linear(merged, C, bias=False))
        self.post_norm = RMSNorm(C, config.projector_ln_eps)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Truncated normal with std √(2/fan_in) for both linears, gain 1 (§9.11 [U])."""
        for fc in (self.proj[0], self.proj[2]):
            fan_in_trunc_normal_(fc.weight)
        nn.init.ones_(self.post_norm.weight)

    def forward(self, merged_M4D: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged_M4D.to(self.proj[0].weight.dtype)))
