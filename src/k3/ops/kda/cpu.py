"""The compiled CPU path of the chunkwise KDA core (`cpu_kernel.cpp`): the algorithm of `ChunkKDAFunction`
(function.py) one (batch, head) and one chunk at a time, so its intermediates stay in the core's cache.

The kernel is C++ compiled with PyTorch's extension builder (a C++ compiler, and ninja from the `ninja` package) on
first use, or ahead of time by `python -m k3.ops.kda.build` (`make` runs it while installing; ≈ 40 s), and cached per
user and CPU capability. Where it cannot be built, `available()` warns once with the reason and `chunk_kda` keeps
the torch path.
It covers fp32 and float64 with K3's bounded gates (each 16-token sub-chunk decays by at most e^80, §3.6);
anything else runs the torch path.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: U chunks of length C.

import functools
import os
import shutil
import sysconfig
import warnings

import torch
from torch.autograd.function import once_differentiable

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernel.cpp")
_VECTOR_FLAGS = {  # by the capability PyTorch itself detected on this CPU (its own kernels use the same)
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma"],
}


@functools.cache
def build():
    """(the compiled module, None) or (None, why it is unavailable)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, [])]
    if shutil.which("ninja") is None:  # the builder runs `ninja` from PATH; the `ninja` package puts it beside python
        os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"k3_kda_cpu_{capability.lower()}", sources=[SOURCE], extra_cflags=flags,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the torch path serves every call
        return None, f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    return module, None


def available() -> bool:
    """Whether the compiled kernel is usable here (built on the first call, which warns once if it cannot be)."""
    module, why = build()
    if module is None:
        warnings.warn(f"the compiled KDA kernel is unavailable ({why}); chunk_kda uses the torch ops", stacklevel=2)
    return module is not None


class CpuChunkKDAFunction(torch.autograd.Function):
    """`ChunkKDAFunction`'s contract (chunked q, k, v, g, β, initial state, keep) on the compiled kernel.

    Saves the inputs with e^g in place of g and the state entering every chunk; the kernel's backward recomputes
    the intra-chunk quantities chunk by chunk.
    """

    @staticmethod
    def forward(ctx, q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1, S_BHKV, keep_BU, sub_chunk):
        eg_BHUCK = g_BHUCK.exp()
        o_BHUCV, S_BHKV, S_in_BHUKV = build()[0].forward(q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1,
                                                          S_BHKV.contiguous(), keep_BU, sub_chunk)
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
        dq, dk, dv, dg, dbeta, dS = build()[0].backward(q_BHUCK, k_BHUCK, v_BHUCV, eg_BHUCK, beta_BHUC1, S_in_BHUKV,
                                                         ctx.keep_BU, do_BHUCV, dS_end_BHKV, ctx.sub_chunk)
        return dq, dk, dv, dg, dbeta, dS, None, None

