"""The compiled CPU path of the chunkwise KDA core (`cpu_kernel.cpp`, §3.12): the algorithm of `ChunkKDAFunction`
(function.py) one (batch, head) and one chunk at a time, so its intermediates stay in the core's cache.

Built by `k3.ops.compiled` (on first use, or at install). It covers fp32 and float64 with K3's bounded gates (each
16-token sub-chunk decays by at most e^80, §3.6); `chunk_kda` runs the torch path for anything else and where the
kernel could not be built.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: U chunks of length C.

import torch
from torch.autograd.function import once_differentiable

from k3.ops import compiled


def available() -> bool:
    """Whether the compiled kernel is usable here (built on the first call, which warns once if it cannot be)."""
    return compiled.load("kda") is not None


class CpuChunkKDAFunction(torch.autograd.Function):
    """`ChunkKDAFunction`'s algorithm (chunks of `chunk_size`, β, initial state, keep) on the compiled kernel, in the
    token-major layout: q, k, g [B,T,H,K], v [B,T,H,V], β [B,T,H], T a multiple of `chunk_size` (the kernel copies
    each chunk's rows into contiguous blocks itself: no transposed copy of the sequence); o [B,T,H,V].

    Saves the inputs with e^g in place of g and the state entering every chunk; the kernel's backward recomputes
    the intra-chunk quantities chunk by chunk.
    """

    @staticmethod
    def forward(ctx, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV, keep_BU, chunk_size, sub_chunk):
        eg_BTHK = g_BTHK.exp()
        o_BTHV, S_BHKV, S_in_BHUKV = compiled.load("kda").forward(
            q_BTHK, k_BTHK, v_BTHV, eg_BTHK, beta_BTH, S_BHKV.contiguous(), keep_BU, chunk_size, sub_chunk)
        ctx.save_for_backward(q_BTHK, k_BTHK, v_BTHV, eg_BTHK, beta_BTH, S_in_BHUKV)
        ctx.keep_BU, ctx.chunk_size, ctx.sub_chunk = keep_BU, chunk_size, sub_chunk
        ctx.set_materialize_grads(False)
        return o_BTHV, S_BHKV

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BTHV, dS_end_BHKV):
        q_BTHK, k_BTHK, v_BTHV, eg_BTHK, beta_BTH, S_in_BHUKV = ctx.saved_tensors
        do_BTHV = torch.zeros_like(v_BTHV) if do_BTHV is None else do_BTHV.contiguous()
        dS_end_BHKV = (torch.zeros_like(S_in_BHUKV[:, :, 0]) if dS_end_BHKV is None
                       else dS_end_BHKV.contiguous())
        dq, dk, dv, dg, dbeta, dS = compiled.load("kda").backward(
            q_BTHK, k_BTHK, v_BTHV, eg_BTHK, beta_BTH, S_in_BHUKV, ctx.keep_BU, do_BTHV, dS_end_BHKV,
            ctx.chunk_size, ctx.sub_chunk)
        return dq, dk, dv, dg, dbeta, dS, None, None, None
