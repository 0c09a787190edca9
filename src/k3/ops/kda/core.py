"""The KDA core as one entry (docs/architecture.md §3.4–§3.8, §3.11): which implementation runs a call is chosen
here, not in the layer.

    impl "auto"       fla's Triton kernels on a CUDA device where they are installed (`k3.ops.kda.gpu`), else "chunk"
         "chunk"      the chunkwise algorithm (`chunk_kda`, compiled on the CPU) for every multi-token call, the
                      recurrent form for a single token
         "recurrent"  the token-by-token reference (`recurrent_kda`) for every call
         "fla"        fla's kernels, or a one-line error where they cannot run

Packed rows (`document_ids`) restart the state at every document; the row's first document continues from
`initial_state` where one is given (a context-parallel shard).
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

from __future__ import annotations

import torch

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.gpu import fla_kda, use_fla
from k3.ops.kda.naive import recurrent_kda
from k3.ops.kda.varlen import chunk_kda_by_document, kda_by_document

IMPLS = ("auto", "chunk", "recurrent", "fla")


def delta_rule(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTHK: torch.Tensor,
               beta_BTH: torch.Tensor, initial_state_BHKV: torch.Tensor | None = None, output_final_state: bool = False,
               document_ids_BT: torch.Tensor | None = None, impl: str = "auto",
               chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o_t = S_tᵀ q_t with S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ, from `initial_state`
    (None: zeros). Returns (o [B,T,H,V], the final state [B,H,K,V] where asked, else None)."""
    if impl not in IMPLS:
        raise ValueError(f"KDA impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    state = dict(initial_state=initial_state_BHKV, output_final_state=output_final_state)
    if use_fla(impl, q_BTHK.device):
        return fla_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state, document_ids=document_ids_BT)
    recurrent = impl == "recurrent"
    if document_ids_BT is not None and recurrent:  # the reference: every document a row of its own, from zero
        if initial_state_BHKV is not None:
            raise ValueError("packed rows continuing a state (context parallelism) need KDA impl 'chunk'")
        return kda_by_document(recurrent_kda, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, document_ids_BT), None
    if document_ids_BT is not None:
        out = chunk_kda_by_document(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, document_ids_BT,
                                    chunk_size=chunk_size, **state)
        return out if output_final_state else (out, None)
    if recurrent or q_BTHK.shape[1] == 1:
        return recurrent_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state)
    return chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state, chunk_size=chunk_size)
