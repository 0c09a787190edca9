"""KDA over packed documents (§3.8): every document starts from a zero state.

A packed batch marks documents with `document_ids` [B, T] (non-decreasing within a row; equal ids = one
document). Two layouts, both padded with identity steps (q = k = v = 0, g = 0, β = 0, exactly like the chunk
padding of §3.5):

* `kda_by_document` (any core, e.g. the `recurrent_kda` reference): the documents are gathered into a
  right-padded [b, r] batch, M the longest document, run through one call and scattered back;
* `chunk_kda_by_document` (the chunked core): each row keeps its documents in order, every document padded
  only to a multiple of the chunk size, and the state is reset at the chunks where a document starts — the
  padding is < one chunk per document instead of up to the longest document.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: b documents gathered as rows, r positions of a re-laid row, U chunks.

import torch

from k3.ops.kda.chunk import chunk_kda


def document_starts(document_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts_BT: token t of row b starts a document, flat start position of each document [D] (into B·T), its
    length [D]). A row always starts a new document."""
    B, T = document_ids_BT.shape
    starts_BT = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    flat_starts_b = starts_BT.flatten().nonzero().squeeze(-1)
    lengths_b = torch.diff(flat_starts_b, append=torch.tensor([B * T], device=flat_starts_b.device))
    return starts_BT, flat_starts_b, lengths_b


def document_index(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Flat positions (into B·T) of each document's tokens, right-padded with −1: [b, r]."""
    _, flat_starts, lengths_b = document_starts(document_ids_BT)
    offsets_r = torch.arange(int(lengths_b.max()), device=flat_starts.device)
    index_br = flat_starts[:, None] + offsets_r
    return index_br.masked_fill(offsets_r >= lengths_b[:, None], -1)


def kda_by_document(op, q, k, v, g, beta, document_ids_BT: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run a KDA core `op` (`chunk_kda` or `recurrent_kda`) separately on every document; returns o [B,T,H,V]."""
    B, T = document_ids_BT.shape
    index_br = document_index(document_ids_BT)
    valid_br = index_br >= 0
    gather = index_br.clamp_min(0)

    def to_documents(x_BT_):
        x_br_ = x_BT_.flatten(0, 1)[gather]
        return x_br_.masked_fill(~valid_br.view(*valid_br.shape, *[1] * (x_br_.dim() - 2)), 0)

    o_brHV, _ = op(*(to_documents(x) for x in (q, k, v, g, beta)), **kwargs)
    o_NHV = o_brHV.new_zeros(B * T, *o_brHV.shape[2:])
    o_NHV[index_br[valid_br]] = o_brHV[valid_br]
    return o_NHV.view(B, T, *o_brHV.shape[2:])


def chunk_aligned_layout(document_ids_BT: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token goes when every document of a row starts on a chunk boundary.

    Returns (new position of each token in its row [B, T], reset_chunks [B, U]: chunk n of row b starts a
    document). Rows are re-laid to the longest re-laid row, r = U · chunk_size.
    """
    B, T = document_ids_BT.shape
    starts_BT, flat_starts_b, lengths_b = document_starts(document_ids_BT)
    doc_BT = starts_BT.flatten().cumsum(0).view(B, T) - 1  # global document index of every token
    padded_b = -(-lengths_b // chunk_size) * chunk_size
    ends_b = padded_b.cumsum(0)
    row_b = flat_starts_b // T
    row_first_b = torch.searchsorted(row_b, row_b)  # index of the first document of the same row
    new_start_b = ends_b - padded_b - (ends_b[row_first_b] - padded_b[row_first_b])  # exclusive cumsum per row
    offset_BT = torch.arange(B * T, device=document_ids_BT.device).view(B, T) - flat_starts_b[doc_BT]
    new_pos_BT = new_start_b[doc_BT] + offset_BT
    row_length_B = torch.zeros(B, dtype=padded_b.dtype, device=padded_b.device).index_add(0, row_b, padded_b)
    reset_BU = torch.zeros(B, int(row_length_B.max()) // chunk_size, dtype=torch.bool, device=padded_b.device)
    reset_BU[row_b, new_start_b // chunk_size] = True
    return new_pos_BT, reset_BU


def chunk_kda_by_document(q, k, v, g, beta, document_ids_BT: torch.Tensor, chunk_size: int = 64, scale=None,
                          initial_state=None, output_final_state=False):
    """`chunk_kda` on packed rows with a state reset at every document start; returns o [B,T,H,V], or with
    `output_final_state` (o, the state after each row's last token [B,H,K,V]). With `initial_state` [B,H,K,V] each
    row's first document continues from it (a row that continues a document of an earlier call)."""
    B, T = document_ids_BT.shape
    new_pos_BT, reset_BU = chunk_aligned_layout(document_ids_BT, chunk_size)
    if initial_state is not None:
        reset_BU[:, 0] = False
    R = reset_BU.shape[1] * chunk_size
    flat_N = (torch.arange(B, device=new_pos_BT.device)[:, None] * R + new_pos_BT).flatten()  # N = B·T tokens

    # index_copy / index_select rather than indexing with the (row, position) pairs: their backward is a gather or
    # a scatter-add instead of an accumulating index_put (4× slower on CPU, measured)
    def relaid(x_BT_):
        x_N_ = x_BT_.flatten(0, 1)
        return x_N_.new_zeros(B * R, *x_N_.shape[1:]).index_copy(0, flat_N, x_N_).view(B, R, *x_N_.shape[1:])

    # the padding between documents and after a row's last one is identity steps: the final state is the last token's
    o_BrHV, S_BHKV = chunk_kda(*(relaid(x) for x in (q, k, v, g, beta)), scale=scale, chunk_size=chunk_size,
                               initial_state=initial_state, output_final_state=output_final_state,
                               reset_chunks=reset_BU)
    o_BTHV = o_BrHV.flatten(0, 1).index_select(0, flat_N).view(B, T, *o_BrHV.shape[2:])
    return (o_BTHV, S_BHKV) if output_final_state else o_BTHV
