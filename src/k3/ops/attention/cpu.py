"""The compiled CPU path of blocked attention (`cpu_kernel.cpp`, docs/architecture.md §4.7): `BlockedAttention`'s
algorithm with each block's masking, running maximum, exponentials and sums fused in one pass (fp32 and float64).

Built by `k3.ops.compiled` (on first use, or at install); `k3.ops.attention.attention` uses the torch path where it
could not be built.
"""

import torch
from torch.autograd.function import once_differentiable

from k3.ops import compiled


def _optional(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype).contiguous()


class CpuBlockedAttention(torch.autograd.Function):
    """`BlockedAttention` on the compiled kernel: q [B,H,T,K], k [B,G,S,K], v [B,G,S,V] → o [B,H,T,V]."""

    @staticmethod
    def forward(ctx, q_BHTK, k_BGSK, v_BGSV, scale, key_valid_BS, document_ids_BS):
        q_BHTK, k_BGSK, v_BGSV = q_BHTK.contiguous(), k_BGSK.contiguous(), v_BGSV.contiguous()
        valid_BS, docs_BT = _optional(key_valid_BS, torch.bool), _optional(document_ids_BS, torch.int64)
        o_BHTV, lse_BHT = compiled.load("attention").forward(q_BHTK, k_BGSK, v_BGSV, scale, valid_BS, docs_BT)
        ctx.save_for_backward(q_BHTK, k_BGSK, v_BGSV, o_BHTV, lse_BHT, valid_BS, docs_BT)
        ctx.scale = scale
        return o_BHTV

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BHTV):
        q_BHTK, k_BGSK, v_BGSV, o_BHTV, lse_BHT, valid_BS, docs_BT = ctx.saved_tensors
        do_BHTV = do_BHTV.contiguous()
        delta_BHT = (do_BHTV * o_BHTV).sum(-1)
        dq, dk, dv = compiled.load("attention").backward(q_BHTK, k_BGSK, v_BGSV, do_BHTV, lse_BHT, delta_BHT,
                                                          ctx.scale, valid_BS, docs_BT)
        return dq, dk, dv, None, None, None
