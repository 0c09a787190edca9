"""Normalisations (docs/architecture.md §0.2, §0.4, §0.5) and the normalised-key mix of Block AttnRes (§5.1).

RMSNorm keeps its statistics in fp32: normalise in fp32, round to the activation dtype, then multiply by the
gain. L2Norm puts ε inside the square root (it is not `F.normalize`).

Each has its formula in torch ops (the reference) and, for fp32 CPU tensors, one compiled pass over the rows each
way (`norm_kernel.cpp`: a forward that keeps 1/norm per row, a hand-derived backward); one-token calls take the
decode kernel's (`k3.ops.decode`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from k3.ops import compiled, decode
from k3.ops.precision import fp32, without_autocast


class _RowNormFunction(torch.autograd.Function):
    """x / sqrt(Σx²/n + ε) (⊙ weight) on the compiled kernel; saves x and 1/norm per row."""

    @staticmethod
    def forward(ctx, x, weight, eps, mean):
        x = x.contiguous()
        y, r = compiled.load("norm").rms_norm_forward(x, weight, eps, mean)
        ctx.save_for_backward(x, weight, r)
        ctx.mean = mean
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        dx, dw = compiled.load("norm").rms_norm_backward(x, weight, r, dy.contiguous(), ctx.mean)
        return dx, dw, None, None


def _compiled_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mean: bool) -> torch.Tensor | None:
    """The norm of x over its last axis (times `weight`) by a compiled kernel — the decode kernel's for one-token
    calls, else the norm kernel (with its backward where autograd needs one) — or None where none serves."""
    if x.numel() == 0:  # nothing to normalise (the kernels count rows by dividing by the width)
        return None
    fused = decode.rms_norm(x, weight, eps, mean)
    if fused is not None or not compiled.serves("norm", x, *(() if weight is None else (weight,))):
        return fused
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RowNormFunction.apply(x, weight, eps, mean)
    return compiled.load("norm").rms_norm_forward(x.contiguous(), weight, eps, mean)[0]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean_c(x_c²) + ε) in fp32 (no gain); compiled for fp32 CPU tensors."""
    fused = _compiled_norm(x, None, eps, mean=True)
    if fused is not None:
        return fused
    x = fp32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ_c x_c² + ε) in fp32 (§0.2; KDA q/k use ε = 1e-6); compiled for fp32 CPU tensors."""
    fused = _compiled_norm(x, None, eps, mean=False)
    if fused is not None:
        return fused
    x = fp32(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class _MixFunction(torch.autograd.Function):
    """`normalized_key_mix` on the compiled kernel; saves the softmax weights and 1/norm per row and source."""

    @staticmethod
    def forward(ctx, query_D, eps, *sources):
        sources = [V.contiguous() for V in sources]
        y, p, r = compiled.load("norm").mix_forward(sources, query_D.contiguous(), eps)
        ctx.save_for_backward(query_D, p, r, *sources)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        query_D, p, r, *sources = ctx.saved_tensors
        *dsources, dquery = compiled.load("norm").mix_backward(sources, query_D.contiguous(), p, r, dy.contiguous())
        return dquery, None, *dsources


def normalized_key_mix(sources: list[torch.Tensor], query_D: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Σ_s softmax_s(q·V_s / sqrt(mean(V_s²) + ε)) V_s of same-shaped fp32 CPU sources by the compiled kernel (with
    its backward where autograd needs one), or None where it does not serve (the caller's torch ops then do)."""
    if (len({tuple(V.shape) for V in sources}) != 1 or sources[0].numel() == 0
            or not compiled.serves("norm", *sources, query_D)):
        return None
    if torch.is_grad_enabled() and (query_D.requires_grad or any(V.requires_grad for V in sources)):
        return _MixFunction.apply(query_D, eps, *sources)
    return compiled.load("norm").mix_forward([V.contiguous() for V in sources], query_D.contiguous(), eps)[0]


def key_mix(sources: list[torch.Tensor], gain_D: torch.Tensor, query_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The Block AttnRes mix (§5.1) Σ_s softmax_s((V_s·(γ⊙w)) / sqrt(mean(V_s²) + ε)) V_s of [B, T, D] sources, fp32
    inside, in the sources' dtype: the decode kernel for a few rows, the compiled mix for many, else the torch ops
    (`key_mix_weights`, the reference)."""
    mixed = decode.attn_res_mix(sources, gain_D, query_D, eps)
    if mixed is not None:
        return mixed
    scaled_query_D = gain_D * query_D  # γ ⊙ w
    mixed = normalized_key_mix(sources, scaled_query_D, eps)
    if mixed is not None:
        return mixed
    V_SBTD = [fp32(V_BTD) for V_BTD in sources]  # a list: the sources are never stacked into one copy
    p_SBT = key_mix_weights(V_SBTD, scaled_query_D, eps)
    return sum(p_BT[..., None] * V_BTD for p_BT, V_BTD in zip(p_SBT, V_SBTD)).to(sources[0].dtype)


def key_mix_weights(V_SBTD: list[torch.Tensor], query_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The mixing weights p [S, B, T]: softmax over the fp32 sources of (V·q) / sqrt(mean(V²) + ε), one source at a
    time (no normalised or stacked copy of the sources)."""
    query_D = query_D.to(V_SBTD[0].dtype)
    with without_autocast(query_D.device):  # fp32 logits under a caller's bf16 autocast too (§0.4)
        logits_SBT = torch.stack([(V_BTD @ query_D) * torch.rsqrt(V_BTD.pow(2).mean(-1) + eps) for V_BTD in V_SBTD])
    return torch.softmax(logits_SBT, dim=0)


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
        fused = _compiled_norm(x, self.weight, eps, mean=True)
        if fused is not None:
            return fused
        return (self.weight * rms_normalize(x, eps).to(x.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
