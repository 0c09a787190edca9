"""Exact causal softmax attention of any length (docs/architecture.md §4.7), the one entry MLA calls.

`attention` picks the path: the compiled CPU kernel (fp32/float64 CPU tensors, `cpu.py`), PyTorch's fused SDPA on
GPUs for a fresh unmasked sequence (its flash kernel is blocked too), and otherwise the torch blocked form
(`blocked.py`). All three keep O(T) memory; `naive.py` is the materialised reference the tests hold them to.
"""

import torch
import torch.nn.functional as F

from k3.ops import compiled
from k3.ops.attention.blocked import BlockedAttention
from k3.ops.attention.cpu import CpuBlockedAttention
from k3.ops.attention.naive import attention_mask, naive_attention

__all__ = ["attention", "attention_mask", "naive_attention"]


def attention(q_BHTK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSV: torch.Tensor, scale: float,
              key_valid_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """o [B,H,T,V] = softmax(scale · q kᵀ + mask) v for T new queries at positions S − T.. over S keys.

    k, v have G = H heads or one head shared by all (G = 1, the absorbed form); K ≠ V allowed. Query t sees key s
    when s ≤ S − T + t and, with `key_valid_BS` [B,S], key s is a real token or the query itself, or, with
    `document_ids_BS` [B,S] (packed rows: the document of every position, the queries' the last T), both belong to
    one document.
    """
    T, S, G = q_BHTK.shape[2], k_BGSK.shape[2], k_BGSK.shape[1]
    if compiled.serves("attention", q_BHTK, k_BGSK, v_BGSV, dtypes=(torch.float32, torch.float64)) and \
            q_BHTK.dtype == k_BGSK.dtype == v_BGSV.dtype:
        return CpuBlockedAttention.apply(q_BHTK, k_BGSK, v_BGSV, scale, key_valid_BS, document_ids_BS)
    if q_BHTK.is_cuda and key_valid_BS is None and document_ids_BS is None and S == T:
        H = q_BHTK.shape[1]
        k, v = (k_BGSK, v_BGSV) if G == H else (k_BGSK.expand(-1, H, -1, -1), v_BGSV.expand(-1, H, -1, -1))
        return F.scaled_dot_product_attention(q_BHTK, k, v, is_causal=True, scale=scale)
    return BlockedAttention.apply(q_BHTK, k_BGSK, v_BGSV, scale, key_valid_BS, document_ids_BS)
