"""KDA's short convolution + SiLU of many tokens on the compiled CPU kernel (`cpu_kernel.cpp`, docs/architecture.md
§3.2 step 2, §3.12): one pass over the positions each way instead of W shifted products and their autograd nodes.
`short_conv` is the entry the layer calls: the formula in torch ops, and the choice of the fastest path for each call.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md. Here S = T + W − 1.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k3.ops import compiled
from k3.ops.precision import fp32


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


def short_conv(x_BTP: torch.Tensor, weight_P1W: torch.Tensor, context_BWP: torch.Tensor | None = None,
               document_ids_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU in fp32, cast back (§3.2 step 2, §3.7); tap W−1 is the current token.

    `context` holds the W−1 inputs before x (zeros for a fresh sequence). With `document_ids`, a tap never
    reads an input of another document (packed rows, §3.8). Returns (output [B,T,P], the last W−1
    inputs [B,W−1,P] = the context of the next call).

    y_t = Σ_j w_j · x_{t−(W−1)+j}, computed the fastest way measured on CPU: one
    token (decoding) as a product with its window, training (gradients or documents) by the compiled kernel
    (`compiled_short_conv`; where it does not serve, as W shifted products), a no-grad multi-token call (prefill) by
    `conv1d`.
    """
    W = weight_P1W.shape[-1]
    if context_BWP is None:
        context_BWP = x_BTP.new_zeros(x_BTP.shape[0], W - 1, x_BTP.shape[2])
    full_BTP = torch.cat([context_BWP.to(x_BTP.dtype), x_BTP], dim=1)
    x_BTP_fp32 = fp32(full_BTP)
    w_PW = weight_P1W[:, 0].to(x_BTP_fp32.dtype)
    T = x_BTP.shape[1]
    if T == 1 and document_ids_BT is None:
        y_BTP = (x_BTP_fp32 * w_PW.t()).sum(1, keepdim=True)
    elif document_ids_BT is not None or torch.is_grad_enabled():
        fused_BTP = compiled_short_conv(x_BTP_fp32, w_PW, document_ids_BT)  # SiLU included, one pass each way
        if fused_BTP is not None:
            return fused_BTP.to(x_BTP.dtype), full_BTP[:, full_BTP.shape[1] - (W - 1):]
        # the (zero) context belongs to no document
        doc_BT = None if document_ids_BT is None else F.pad(document_ids_BT, (W - 1, 0), value=-1)
        y_BTP = sum(w_PW[:, j] * x_BTP_fp32[:, j: j + T] * (1 if doc_BT is None else
                                                            (doc_BT[:, j: j + T] == document_ids_BT)[..., None])
                    for j in range(W))
    else:
        y_BTP = F.conv1d(x_BTP_fp32.transpose(1, 2), w_PW[:, None], groups=w_PW.shape[0]).transpose(1, 2)
    return F.silu(y_BTP).to(x_BTP.dtype), full_BTP[:, full_BTP.shape[1] - (W - 1):]
