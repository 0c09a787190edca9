"""Exact causal softmax attention in O(T) memory, in torch (docs/architecture.md §4.7): query blocks against key
blocks with a running maximum and sum (online softmax), forward and backward, never a [T, S] score matrix.

The torch path of `k3.ops.attention.attention` (GPUs with masks, no compiled kernel, bf16) and the algorithm of the
compiled CPU kernel (`cpu_kernel.cpp`). Statistics and accumulators are fp32 whatever the input dtype.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md. Here G key/value heads (G = H,
or 1: one latent head read by every head), S = start + T keys, n / m the rows of a query / key block.
"""

import torch
from torch.autograd.function import once_differentiable

from k3.ops.precision import fp32

Q_BLOCK = 512  # queries per block
K_BLOCK = 1024  # keys per block


def block_mask(t0: int, t1: int, s0: int, s1: int, start: int, key_valid_BS: torch.Tensor | None,
               document_ids_BS: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Which keys [s0, s1) queries [t0, t1) see, [B|1, 1, n, m] (the rule of `naive.attention_mask`); None where all
    of them see all of them."""
    if key_valid_BS is None and document_ids_BS is None and s1 - 1 <= start + t0:
        return None
    p_n1 = torch.arange(start + t0, start + t1, device=device)[:, None]
    s_m = torch.arange(s0, s1, device=device)
    mask_nm = s_m <= p_n1
    if document_ids_BS is not None:
        same_Bnm = document_ids_BS[:, start + t0: start + t1, None] == document_ids_BS[:, None, s0:s1]
        return (mask_nm & same_Bnm)[:, None]
    if key_valid_BS is None:
        return mask_nm[None, None]
    return ((mask_nm & key_valid_BS[:, None, s0:s1]) | (s_m == p_n1))[:, None]


def _blocks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _heads_sum(x_BHmX: torch.Tensor, G: int) -> torch.Tensor:
    """A key/value gradient summed over the heads that share its head (G = 1), else as it is."""
    return x_BHmX.sum(1, keepdim=True) if G == 1 and x_BHmX.shape[1] != 1 else x_BHmX


class BlockedAttention(torch.autograd.Function):
    """o = softmax(scale · q kᵀ + causal/padding/document mask) v; saves q, k, v, o and the row log-sum-exp, and the
    backward recomputes each block's probabilities from them (FlashAttention-2's scheme)."""

    @staticmethod
    def forward(ctx, q_BHTK, k_BGSK, v_BGSV, scale, key_valid_BS, document_ids_BS):
        B, H, T, _ = q_BHTK.shape
        S = k_BGSK.shape[2]
        start = S - T
        stats = dict(dtype=torch.promote_types(q_BHTK.dtype, torch.float32), device=q_BHTK.device)
        o_BHTV = q_BHTK.new_empty(B, H, T, v_BGSV.shape[-1])
        lse_BHT = torch.empty(B, H, T, **stats)
        for t0, t1 in _blocks(T, Q_BLOCK):
            q_BHnK = fp32(q_BHTK[:, :, t0:t1])
            m_BHn = torch.full((B, H, t1 - t0), float("-inf"), **stats)
            l_BHn = torch.zeros_like(m_BHn)
            acc_BHnV = torch.zeros(B, H, t1 - t0, v_BGSV.shape[-1], **stats)
            for s0, s1 in _blocks(start + t1, K_BLOCK):
                x_BHnm = (q_BHnK @ fp32(k_BGSK[:, :, s0:s1]).transpose(-1, -2)) * scale
                mask = block_mask(t0, t1, s0, s1, start, key_valid_BS, document_ids_BS, q_BHTK.device)
                if mask is not None:
                    x_BHnm = x_BHnm.masked_fill(~mask, float("-inf"))
                m_new_BHn = torch.maximum(m_BHn, x_BHnm.amax(-1))
                shift_BHn = m_new_BHn.masked_fill(m_new_BHn == float("-inf"), 0.0)  # rows with nothing seen yet
                p_BHnm = torch.exp(x_BHnm - shift_BHn[..., None])
                rescale_BHn = torch.exp(m_BHn - shift_BHn)
                l_BHn = l_BHn * rescale_BHn + p_BHnm.sum(-1)
                acc_BHnV = acc_BHnV * rescale_BHn[..., None] + p_BHnm @ fp32(v_BGSV[:, :, s0:s1])
                m_BHn = m_new_BHn
            o_BHTV[:, :, t0:t1] = acc_BHnV / l_BHn[..., None]  # every query sees itself: l > 0
            lse_BHT[:, :, t0:t1] = m_BHn + torch.log(l_BHn)
        ctx.save_for_backward(q_BHTK, k_BGSK, v_BGSV, o_BHTV, lse_BHT, key_valid_BS, document_ids_BS)
        ctx.scale = scale
        return o_BHTV

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BHTV):
        q_BHTK, k_BGSK, v_BGSV, o_BHTV, lse_BHT, key_valid_BS, document_ids_BS = ctx.saved_tensors
        scale, G = ctx.scale, k_BGSK.shape[1]
        T, S = q_BHTK.shape[2], k_BGSK.shape[2]
        start = S - T
        delta_BHT = (fp32(do_BHTV) * fp32(o_BHTV)).sum(-1)
        dq_BHTK, dk_BGSK, dv_BGSV = fp32(torch.zeros_like(q_BHTK)), fp32(torch.zeros_like(k_BGSK)), \
            fp32(torch.zeros_like(v_BGSV))
        for t0, t1 in _blocks(T, Q_BLOCK):
            q_BHnK, do_BHnV = fp32(q_BHTK[:, :, t0:t1]), fp32(do_BHTV[:, :, t0:t1])
            for s0, s1 in _blocks(start + t1, K_BLOCK):
                k_BGmK, v_BGmV = fp32(k_BGSK[:, :, s0:s1]), fp32(v_BGSV[:, :, s0:s1])
                x_BHnm = (q_BHnK @ k_BGmK.transpose(-1, -2)) * scale
                mask = block_mask(t0, t1, s0, s1, start, key_valid_BS, document_ids_BS, q_BHTK.device)
                if mask is not None:
                    x_BHnm = x_BHnm.masked_fill(~mask, float("-inf"))
                p_BHnm = torch.exp(x_BHnm - lse_BHT[:, :, t0:t1, None])
                ds_BHnm = p_BHnm * (do_BHnV @ v_BGmV.transpose(-1, -2) - delta_BHT[:, :, t0:t1, None])
                dv_BGSV[:, :, s0:s1] += _heads_sum(p_BHnm.transpose(-1, -2) @ do_BHnV, G)
                dk_BGSK[:, :, s0:s1] += _heads_sum(ds_BHnm.transpose(-1, -2) @ q_BHnK, G) * scale
                dq_BHTK[:, :, t0:t1] += (ds_BHnm @ k_BGmK) * scale
        return (dq_BHTK.to(q_BHTK.dtype), dk_BGSK.to(k_BGSK.dtype), dv_BGSV.to(v_BGSV.dtype), None, None, None)
