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
    """`ChunkKDAFunction`'s contract (chunked q, k, v, g, β, initial state, keep) on the compiled kernel.

    Saves the inputs with e^g in place of g and the state entering every chunk; the kernel's backward recomputes
    the intra-chunk quantities chunk by chunk.
    """

    @staticmethod
    def forward(ctx, q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1, S_BHKV, keep_BU, sub_chunk):
        eg_BHUCK = g_BHUCK.exp()
        o_BHUCV, S_BHKV, S_in_BHUKV = compiled.load("kda").forward(
            q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1, S_BHKV.contiguous(), keep_BU, sub_chunk)
        ctx.save_for_backward(q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1, S_in_BHUKV)
        ctx.keep_BU, ctx.sub_chunk = keep_BU, sub_chunk
        ctx.set_materialize_grads(False)
        return o_BHUCV, S_BHKV

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BHUCV, dS_end_BHKV):
        q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1, S_in_BHUKV = ctx.saved_tensors
        do_BHUCV = torch.zeros_like(v_BHUCV) if do_BHUCV is None else do_BHUCV.contiguous()
        dS_end_BHKV = (torch.zeros_like(S_in_BHUKV[:, :, 0]) if dS_end_BHKV is None
                       else dS_end_BHKV.contiguous())
        dq, dk, dv, dg, dbeta, dS = compiled.load("kda").backward(
            q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1, S_in_BHUKV, ctx.keep_BU, do_BHUCV, dS_end_BHKV,
            ctx.sub_chunk)
        return dq, dk, dv, dg, dbeta, dS, None, None
