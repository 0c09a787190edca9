"""KDA over packed documents (spec §3.8): every document starts from a zero state.

A packed batch marks documents with `document_ids` [B, T] (non-decreasing within a row; equal ids = one
document). The documents are gathered into a right-padded [D, Tmax] batch — the padding is made of identity
steps (q = k = v = 0, g = 0, β = 0), exactly like the chunk padding of §3.5 — run through one KDA call, and
scattered back.
"""
# Shape suffixes: B batch, T time, D documents, M longest document, H heads, K key dim, V value dim.

import torch


def document_index(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Flat positions (into B·T) of each document's tokens, right-padded with −1: [D, M]."""
    B, T = document_ids_BT.shape
    starts_BT = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    flat_starts = starts_BT.flatten().nonzero().squeeze(-1)
    lengths_D = torch.diff(flat_starts, append=torch.tensor([B * T], device=flat_starts.device))
    offsets_M = torch.arange(int(lengths_D.max()), device=flat_starts.device)
    index_DM = flat_starts[:, None] + offsets_M
    return index_DM.masked_fill(offsets_M >= lengths_D[:, None], -1)


def kda_by_document(op, q, k, v, g, beta, document_ids_BT: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run a KDA core `op` (`chunk_kda` or `recurrent_kda`) separately on every document; returns o [B,T,H,V]."""
    B, T = document_ids_BT.shape
    index_DM = document_index(document_ids_BT)
    valid_DM = index_DM >= 0
    gather = index_DM.clamp_min(0)

    def to_documents(x_BT_):
        x_DM_ = x_BT_.flatten(0, 1)[gather]
        return x_DM_.masked_fill(~valid_DM.view(*valid_DM.shape, *[1] * (x_DM_.dim() - 2)), 0)

    o_DMHV, _ = op(*(to_documents(x) for x in (q, k, v, g, beta)), **kwargs)
    o_NHV = o_DMHV.new_zeros(B * T, *o_DMHV.shape[2:])
    o_NHV[index_DM[valid_DM]] = o_DMHV[valid_DM]
    return o_NHV.view(B, T, *o_DMHV.shape[2:])
