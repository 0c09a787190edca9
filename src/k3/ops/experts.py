"""The routed experts' products over rows sorted by expert, whatever form their weights take (§6.4, §6.7, §11.5).

A layer's stacked expert weights are either a dense `[E, out, in]` tensor (trained, or decoded on load) or an
`MXFP4Weight` kept as the release stores it; `expert_linear` sends each to its own kernels (`grouped_mm`,
`mxfp4.expert_linear`), so the MoE layer calls one function for both.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: A rows sorted by expert, E experts, L latent width, F expert width, O output width, I input width.

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k3.ops import mxfp4
from k3.ops.grouped_mm import grouped_mm

ExpertWeight = torch.Tensor | mxfp4.MXFP4Weight
"""E stacked [out, in] matrices: dense, or packed MXFP4."""


def expert_weight(experts: int, out_features: int, in_features: int, packed: bool) -> ExpertWeight:
    """Uninitialised stacked expert weights [E, out, in]: a trainable parameter, or MXFP4 buffers (`packed`)."""
    if packed:
        return mxfp4.MXFP4Weight(experts, out_features, in_features)
    return nn.Parameter(torch.empty(experts, out_features, in_features))


def reset_expert_weight(weight_EOI: ExpertWeight, std: float) -> None:
    """Draw every expert's weights from N(0, std²) (encoded one expert at a time where they are packed)."""
    if isinstance(weight_EOI, mxfp4.MXFP4Weight):
        weight_EOI.reset_parameters(std)
    else:
        nn.init.normal_(weight_EOI, std=std)


def expert_linear(x_AI: torch.Tensor, weight_EOI: ExpertWeight, counts_E: torch.Tensor) -> torch.Tensor:
    """x[rows of e] W_eᵀ for rows sorted by expert, `counts_E[e]` of them for expert e; [A, out]."""
    if isinstance(weight_EOI, mxfp4.MXFP4Weight):
        return mxfp4.expert_linear(x_AI, weight_EOI, counts_E)
    return grouped_mm(x_AI, weight_EOI.transpose(-1, -2), counts_E)


def expert_ffn(z_AL: torch.Tensor, counts_E: torch.Tensor, w1_EFL: ExpertWeight, w3_EFL: ExpertWeight,
               w2_ELF: ExpertWeight, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """E_e(z) = W2_e · act(W1_e z, W3_e z) for rows sorted by expert; [A, L]."""
    h_AF = activation(expert_linear(z_AL, w1_EFL, counts_E), expert_linear(z_AL, w3_EFL, counts_E))
    return expert_linear(h_AF, w2_ELF, counts_E)


def dense_expert(weight_EOI: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [out, in] matrix in `dtype` (decoded where it is packed)."""
    if isinstance(weight_EOI, mxfp4.MXFP4Weight):
        return mxfp4.decode_mxfp4(weight_EOI.weight_packed[e], weight_EOI.weight_scale[e], dtype)
    return weight_EOI[e].to(dtype)
