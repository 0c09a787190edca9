"""Rotary position embedding for the K2-style MLA baseline (docs/architecture.md §14.2).

K3's MLA has no positional encoding; K2's rotates the rope part of the query and of the shared key. Channel pairs
(c, c + R/2) of an R-wide vector turn by the angle p·θ^(−2c/R) at position p, so the score of a query at p and a
key at s depends on p − s only. Computed in fp32, returned in the input dtype.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md. Here: R rope channels.

from __future__ import annotations

import torch

from k3.ops.precision import fp32


def rope_angles(positions_T: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, R/2] in float64 of the angles p·θ^(−2c/R) for the positions p and the pairs c < R/2."""
    if dim % 2:
        raise ValueError(f"rotary embedding needs an even width, got qk_rope_head_dim={dim}")
    inv_freq_C = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions_T.device) / dim)
    angles_TC = positions_T.to(torch.float64)[:, None] * inv_freq_C
    return angles_TC.cos(), angles_TC.sin()


def apply_rope(x_BTR: torch.Tensor, cos_TC: torch.Tensor, sin_TC: torch.Tensor) -> torch.Tensor:
    """Rotate the channel pairs (x_c, x_{c+R/2}) of x [B, T, ..., R]; cos/sin [T, R/2] broadcast over the axes
    between T and R (heads)."""
    x = fp32(x_BTR)
    extra = x.dim() - 3  # axes between T and R
    cos = cos_TC.to(x.dtype).view(cos_TC.shape[0], *([1] * extra), -1)
    sin = sin_TC.to(x.dtype).view(sin_TC.shape[0], *([1] * extra), -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTR.dtype)
