"""KDA over packed documents (spec §3.8): every document starts from a zero state.

A packed batch marks documents with `document_ids` [B, T] (non-decreasing within a row; equal ids = one
document). Two layouts, both padded with identity steps (q = k = v = 0, g = 0, β = 0, exactly like the chunk
padding of §3.5):

* `kda_by_document` (any core, e.g. the `recurrent_kda` reference): the documents are gathered into a
  right-padded [D, M] batch, M the longest document, run through one call and scattered back;
* `chunk_kda_by_document` (the chunked core): each row keeps its documents in order, every document padded
  only to a multiple of the chunk size, and the state is reset at the chunks where a document starts — the
  padding is < one chunk per document instead of up to the longest document.
"""
# Shape suffixes: B batch, T time, D documents, M longest document, H heads, K key dim, V value dim,
# R re-laid row length, N chunks.

import torch

from k3.ops.kda.chunk import chunk_kda


def document_starts(document_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts_BT: token t of row b starts a document, flat start position of each document [D] (into B·T), its
    length [D]). A row always starts a new document."""
    B, T = document_ids_BT.shape
    starts_BT = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    flat_starts_D = starts_BT.flatten().nonzero().squeeze(-1)
    lengths_D = torch.diff(flat_starts_D, append=torch.tensor([B * T], device=flat_starts_D.device))
    return starts_BT, flat_starts_D, lengths_D


def document_index(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Flat positions (into B·T) of each document's tokens, right-padded with −1: [D, M]."""
    _, flat_starts, lengths_D = document_starts(document_ids_BT)
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


def chunk_aligned_layout(document_ids_BT: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token goes when every document of a row starts on a chunk boundary.

    Returns (new position of each token in its row [B, T], reset_chunks [B, N]: chunk n of row b starts a
    document). Rows are re-laid to the longest re-laid row, R = N · chunk_size.
    """
    B, T = document_ids_BT.shape
    starts_BT, flat_starts_D, lengths_D = document_starts(document_ids_BT)
    doc_BT = starts_BT.flatten().cumsum(0).view(B, T) - 1  # global document index of every token
    padded_D = -(-lengths_D // chunk_size) * chunk_size
    ends_D = padded_D.cumsum(0)
    row_D = flat_starts_D // T
    row_first_D = torch.searchsorted(row_D, row_D)  # index of the first document of the same row
    new_start_D = ends_D - padded_D - (ends_D[row_first_D] - padded_D[row_first_D])  # exclusive cumsum per row
    offset_BT = torch.arange(B * T, device=document_ids_BT.device).view(B, T) - flat_starts_D[doc_BT]
    new_pos_BT = new_start_D[doc_BT] + offset_BT
    row_length_B = torch.zeros(B, dtype=padded_D.dtype, device=padded_D.device).index_add(0, row_D, padded_D)
    reset_BN = torch.zeros(B, int(row_length_B.max()) // chunk_size, dtype=torch.bool, device=padded_D.device)
    reset_BN[row_D, new_start_D // chunk_size] = True
    return new_pos_BT, reset_BN


def chunk_kda_by_document(q, k, v, g, beta, document_ids_BT: torch.Tensor, chunk_size: int = 64,
                          scale=None) -> torch.Tensor:
    """`chunk_kda` on packed rows with a state reset at every document start; returns o [B,T,H,V]."""
    B, T = document_ids_BT.shape
    new_pos_BT, reset_BN = chunk_aligned_layout(document_ids_BT, chunk_size)
    R = reset_BN.shape[1] * chunk_size
    rows_BT = torch.arange(B, device=new_pos_BT.device)[:, None].expand(B, T)

    def relaid(x_BT_):
        x_BR_ = x_BT_.new_zeros(B, R, *x_BT_.shape[2:])
        x_BR_[rows_BT, new_pos_BT] = x_BT_
        return x_BR_

    o_BRHV, _ = chunk_kda(*(relaid(x) for x in (q, k, v, g, beta)), scale=scale, chunk_size=chunk_size,
                          reset_chunks=reset_BN)
    return o_BRHV[rows_BT, new_pos_BT]
