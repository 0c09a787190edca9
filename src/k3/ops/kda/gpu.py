"""The GPU fast path of the KDA core: flash-linear-attention's Triton kernels (docs/architecture.md §3.11).

When the activations are on a CUDA device and the optional flash-linear-attention kernels import (package
`fla-core`, `pip install 'kimi-k3[cuda]'`), `k3.ops.kda.delta_rule` with impl "auto" (the default) runs
fla's `chunk_kda` for multi-token calls and its `fused_recurrent_kda` for one-token decode steps; everywhere
else it runs this package's torch ops (`chunk_kda`, `recurrent_kda`), which stay the reference.
Impl "fla" demands the kernels (one-line error without them); "chunk" and "recurrent" force the torch
ops on any device.

fla's kernels take the same tensors as ours — q, k [B,T,H,K] L2-normalised, v [B,T,H,V], g [B,T,H,K] the
per-channel log-decay, β [B,T,H], the state [N,H,K,V] key-major in fp32, scale K^-1/2 by default — and packed
documents as `cu_seqlens` over one flattened row: `cu_seqlens` below turns `document_ids` into it.
tests/ops/test_cuda.py compares every fla call with the torch reference on a GPU.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from k3.ops.kda.varlen import document_starts

@functools.cache
def fla_kernels() -> SimpleNamespace | None:
    """fla's KDA kernels (`chunk`, `fused_recurrent`), or None when flash-linear-attention (or Triton) is not
    installed. Imported once."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return None
    return SimpleNamespace(chunk=chunk_kda, fused_recurrent=fused_recurrent_kda)


def use_fla(impl: str, device: torch.device) -> bool:
    """Whether a KDA call on `device` runs fla's kernels under `impl`; ValueError for "fla" where they cannot run."""
    if impl == "fla":
        if device.type != "cuda" or fla_kernels() is None:
            missing = ("a CUDA device" if device.type != "cuda"
                       else "flash-linear-attention (pip install 'kimi-k3[cuda]')")
            raise ValueError(f"KDA impl 'fla' runs flash-linear-attention's Triton kernels, which need {missing}; "
                             "use impl 'auto' to fall back to the torch ops")
        return True
    return impl == "auto" and device.type == "cuda" and fla_kernels() is not None


def cu_seqlens(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """The documents of packed rows as fla's `cu_seqlens` [N + 1] (int64) over the rows flattened into one
    sequence of B·T tokens: the start of every document (every row starts one) and B·T."""
    _, flat_starts_N, _ = document_starts(document_ids_BT)
    end = torch.tensor([document_ids_BT.numel()], device=flat_starts_N.device)
    return torch.cat([flat_starts_N, end])


def fla_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, document_ids=None):
    """KDA through fla's kernels, with the contract of `chunk_kda` / `recurrent_kda`: (o [B,T,H,V] in v's dtype,
    final state [B,H,K,V] fp32 or None). One token without documents: `fused_recurrent_kda`; otherwise
    `chunk_kda`, packed rows (`document_ids` [B,T]) as one flattened sequence with `cu_seqlens` (no state in
    or out: every document starts from zero). q and k are cast to v's dtype; g, β and the state stay fp32."""
    kernels = fla_kernels()
    B, T, H, K = q.shape
    q, k = q.to(v.dtype), k.to(v.dtype)
    g, beta = g.float(), beta.float()
    if initial_state is not None:
        initial_state = initial_state.float()
    if document_ids is not None:
        flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta)]
        o_1NHV, _ = kernels.chunk(*flat, cu_seqlens=cu_seqlens(document_ids))
        return o_1NHV.view(B, T, H, -1).to(v.dtype), None
    run = kernels.fused_recurrent if T == 1 else kernels.chunk
    o_BTHV, state = run(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)
    return o_BTHV.to(v.dtype), state
