"""Block Attention Residuals: the depth-mixing operator (§5.1, §5.3, §5.5).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops import decode
from k3.ops.norm import RMSNorm, normalized_key_mix
from k3.ops.precision import fp32, without_autocast


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """MIX(V; γ, w) = Σ_i softmax_i(key(V_i)·(γ⊙w)) · V_i with key(V) = V/sqrt(mean(V²)+ε) (§5.1).

    γ = `norm.weight` (a `*_res_norm` gain, [D]); w = `proj.weight[0]` (a `*_res_proj` pseudo-query, a bias-free
    `Linear(D, 1)`, zero-initialised so every mix starts as the mean of its sources). Keys are normalised,
    values are the raw sources, no temperature; one softmax over all sources; fp32 throughout, result cast to
    the sources' dtype. Each source is [B, T, D]; the mix is per token.
    """
    fused = decode.attn_res_mix(sources, norm.weight, proj.weight[0], norm.eps)  # one compiled call when decoding
    if fused is None:  # many rows: the compiled mix (and its backward) where it serves
        fused = normalized_key_mix(sources, norm.weight * proj.weight[0], norm.eps)
    if fused is not None:
        return fused
    V_SBTD = [fp32(V_BTD) for V_BTD in sources]  # a list: the sources are never stacked into one copy
    mix_BTD = sum(p_BT[..., None] * V_BTD for p_BT, V_BTD in zip(_weights(V_SBTD, norm, proj), V_SBTD))
    return mix_BTD.to(sources[0].dtype)


def attn_res_weights(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """The mixing weights p [S, B, T] of `attn_res_mix` over its sources (for inspection and plots)."""
    return _weights([fp32(V_BTD) for V_BTD in sources], norm, proj)


def _weights(V_SBTD: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """softmax over the fp32 sources of key(V)·q = (V·q) / sqrt(mean(V²)+ε), one source at a time: no normalised
    (or stacked) copy of the sources."""
    query_D = (norm.weight * proj.weight[0]).to(V_SBTD[0].dtype)  # γ ⊙ w
    with without_autocast(query_D.device):  # fp32 logits under a caller's bf16 autocast too (§0.4)
        logits_SBT = torch.stack([(V_BTD @ query_D) * torch.rsqrt(V_BTD.pow(2).mean(-1) + norm.eps)
                                  for V_BTD in V_SBTD])
    return torch.softmax(logits_SBT, dim=0)
