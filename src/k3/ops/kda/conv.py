"""KDA's short convolution + SiLU of many tokens on the compiled CPU kernel (`cpu_kernel.cpp`, docs/architecture.md
§3.2 step 2, §3.12): one pass over the positions each way instead of W shifted products and their autograd nodes.
`k3.model.kda.short_conv` holds the formula in torch ops and calls `compiled_short_conv` first.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md. Here S = T + W − 1.

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from k3.ops import compiled


class ShortConvFunction(torch.autograd.Function):
    """silu(Σ_j w_j ⊙ x_{t+j}) over x [B, S, P] (context, then the new inputs) with taps w [W, P]; saves x and w."""

    @staticmethod
    def forward(ctx, x_BSP, w_WP, document_ids_BT):
        ctx.save_for_backward(x_BSP, w_WP)
        ctx.document_ids_BT = document_ids_BT
        return compiled.load("kda").short_conv_forward(x_BSP, w_WP, document_ids_BT)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_BTP):
        x_BSP, w_WP = ctx.saved_tensors
        dx_BSP, dw_WP = compiled.load("kda").short_conv_backward(x_BSP, w_WP, ctx.document_ids_BT,
                                                                 dy_BTP.contiguous())
        return dx_BSP, dw_WP, None


def compiled_short_conv(full_BSP: torch.Tensor, weight_PW: torch.Tensor,
                        document_ids_BT: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 output [B, T, P] of the short convolution + SiLU of `full_BSP` (the W−1 context inputs, then the new
    ones) with the taps `weight_PW` — a tap never reads another document's input where `document_ids_BT` is given —
    or None where the compiled kernel does not serve (other dtypes, a DTensor, no kernel)."""
    if full_BSP.shape[1] < weight_PW.shape[1] or not compiled.serves("kda", full_BSP, weight_PW):  # no new token
        return None
    w_WP = weight_PW.t().contiguous()  # autograd carries the gradient back to the [P, W] view
    documents = None if document_ids_BT is None else document_ids_BT.to(torch.long).contiguous()
    x_BSP = full_BSP.contiguous()
    if torch.is_grad_enabled() and (x_BSP.requires_grad or w_WP.requires_grad):
        return ShortConvFunction.apply(x_BSP, w_WP, documents)
    return compiled.load("kda").short_conv_forward(x_BSP, w_WP, documents)
