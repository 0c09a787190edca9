"""Block Attention Residuals: the depth-mixing operator (§5.1, §5.3, §5.5).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.norm import RMSNorm, key_mix, key_mix_weights
from k3.ops.precision import fp32


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """MIX(V; γ, w) = Σ_i softmax_i(key(V_i)·(γ⊙w)) · V_i with key(V) = V/sqrt(mean(V²)+ε) (§5.1).

    γ = `norm.weight` (a `*_res_norm` gain, [D]); w = `proj.weight[0]` (a `*_res_proj` pseudo-query, a bias-free
    `Linear(D, 1)`, zero-initialised so every mix starts as the mean of its sources). Keys are normalised,
    values are the raw sources, no temperature; one softmax over all sources; fp32 throughout, result cast to
    the sources' dtype. Each source is [B, T, D]; the mix is per token.
    """
    return key_mix(sources, norm.weight, proj.weight[0], norm.eps)


def attn_res_weights(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """The mixing weights p [S, B, T] of `attn_res_mix` over its sources (for inspection and plots)."""
    return key_mix_weights([fp32(V_BTD) for V_BTD in sources], norm.weight * proj.weight[0], norm.eps)
