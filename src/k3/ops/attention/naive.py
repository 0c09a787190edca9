"""Causal softmax attention with every score materialised: the reference the blocked forms are tested against
(docs/architecture.md §4.7), and the mask rule they share.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md. Here G key/value heads (G = H,
or 1 for the absorbed form) and S = start + T keys.
"""

import torch

from k3.ops.precision import fp32


def attention_mask(T: int, start: int, key_valid_BS: torch.Tensor | None, device: torch.device,
                   document_ids_BS: torch.Tensor | None = None) -> torch.Tensor | None:
    """Boolean [B|1, 1, T, start+T] mask: new token t sees positions ≤ start+t that are real tokens of its own
    document (packed rows, §3.8; `document_ids_BS` [B, start+T]: every position's document).

    A padding query also sees itself, so no softmax row is empty (its output is discarded anyway). Returns None
    for a fresh, unpadded, unpacked sequence (plain causal attention).
    """
    if start == 0 and key_valid_BS is None and document_ids_BS is None:
        return None
    q_T1 = torch.arange(start, start + T, device=device)[:, None]
    k_S = torch.arange(start + T, device=device)
    mask_TS = k_S <= q_T1
    if document_ids_BS is not None:
        return (mask_TS & (document_ids_BS[:, start:, None] == document_ids_BS[:, None, :]))[:, None]
    if key_valid_BS is None:
        return mask_TS[None, None]
    return ((mask_TS & key_valid_BS[:, None, :]) | (k_S == q_T1))[:, None]


def naive_attention(q_BHTK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSV: torch.Tensor, scale: float,
                    key_valid_BS: torch.Tensor | None = None,
                    document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """o [B,H,T,V] = softmax(scale · q kᵀ + mask) v over all [T, S] scores at once (softmax in fp32)."""
    T, S = q_BHTK.shape[2], k_BGSK.shape[2]
    mask = attention_mask(T, S - T, key_valid_BS, q_BHTK.device, document_ids_BS)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q_BHTK.device).tril(S - T)
    scores_BHTS = (q_BHTK @ k_BGSK.transpose(-1, -2)) * scale
    p_BHTS = torch.softmax(fp32(scores_BHTS).masked_fill(~mask, float("-inf")), dim=-1)
    return p_BHTS.to(v_BGSV.dtype) @ v_BGSV
