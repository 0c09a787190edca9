"""Chunkwise-parallel Kimi Delta Attention (§3.5) with the numerically safe rules of §3.6.

`chunk_kda` checks the arguments, casts to the compute dtype (§0.4), lays the sequence out in chunks and runs
`ChunkKDAFunction` (k3.ops.kda.function): a forward that keeps only the inputs and the per-chunk states, and a
hand-derived backward that recomputes inside each chunk. On CPU tensors with bounded gates the same algorithm runs
compiled (`k3.ops.kda.cpu`) where the kernel could be built.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: U chunks of length C.

import math

import torch
import torch.nn.functional as F

from k3.ops.kda import cpu
from k3.ops.kda.function import MAX_EXPONENT, SUB_CHUNK, ChunkKDAFunction
from k3.ops.kda.naive import prepare_inputs
from k3.ops.precision import without_autocast

BACKENDS = ("auto", "torch", "compiled")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
              reset_chunks=None, backend="auto"):
    """KDA over whole chunks of `chunk_size` tokens (§3.5); same contract as `recurrent_kda`.

    q, k [B,T,H,K] (already L2-normalised), v [B,T,H,V], g [B,T,H,K] per-channel log-decay (≤ 0, any
    magnitude), beta [B,T,H] in (0, 1), initial_state [B,H,K,V] (key-major) or None for zeros.
    `reset_chunks` [B, U] bool (U = ⌈T / chunk_size⌉): the state entering chunk n is zero, i.e. a new sequence
    starts there (packed documents laid out on chunk boundaries, §3.8; see `varlen.chunk_kda_by_document`).
    `backend`: "auto" runs the compiled CPU kernel where it applies (CPU tensors, gates bounded as K3's are, the
    kernel built), else the torch ops; "torch" always the torch ops; "compiled" demands the kernel (ValueError
    where it does not apply). Both compute the same algorithm.
    Returns (o [B,T,H,V] in q.dtype, final state [B,H,K,V] in the compute dtype, or None).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    n_chunks = -(-q.shape[1] // chunk_size)
    if reset_chunks is not None and (tuple(reset_chunks.shape) != (q.shape[0], n_chunks)
                                     or reset_chunks.dtype != torch.bool):
        raise ValueError(f"reset_chunks must be a bool tensor [batch, chunks] = {[q.shape[0], n_chunks]}, got "
                         f"{reset_chunks.dtype} {list(reset_chunks.shape)}")
    out_dtype = q.dtype
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV = prepare_inputs(q, k, v, g, beta, scale, initial_state)
    T = q_BTHK.shape[1]
    if T == 0:
        return torch.zeros_like(v_BTHV).to(out_dtype), (S_BHKV if output_final_state else None)

    if T < chunk_size:  # one chunk either way: pad it only to whole sub-chunks (a 21-token caption row: 32, not 64)
        step = math.gcd(chunk_size, SUB_CHUNK)
        chunk_size = -(-T // step) * step
    keep_BU = None if reset_chunks is None else (~reset_chunks).to(S_BHKV)
    sub_chunk = math.gcd(chunk_size, SUB_CHUNK)
    inputs = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    if _use_compiled(backend, g_BTHK, sub_chunk):  # the kernel reads the token-major layout itself
        pad = -T % chunk_size  # zero steps at the end (§3.5); packed rows come re-laid to whole chunks already
        padded = (x if pad == 0 else F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in inputs)
        o_BTHV, S_BHKV = cpu.CpuChunkKDAFunction.apply(*(x.contiguous() for x in padded), S_BHKV, keep_BU,
                                                       chunk_size, sub_chunk)
        o_BTHV = o_BTHV[:, :T]  # drop the padding
    else:
        with without_autocast(q_BTHK.device):  # the compute dtype under autocast too (its backward runs without)
            o_BHUCV, S_BHKV = ChunkKDAFunction.apply(*(_to_chunks(x, chunk_size) for x in inputs[:4]),
                                                     _to_chunks(beta_BTH[..., None], chunk_size), S_BHKV, keep_BU)
        o_BTHV = o_BHUCV.flatten(2, 3)[:, :, :T].transpose(1, 2)  # drop the padding
    return o_BTHV.to(out_dtype).contiguous(), (S_BHKV if output_final_state else None)


def _use_compiled(backend, g_BTHK, sub_chunk):
    """Whether this call runs the compiled kernel: CPU, gates bounded so that no sub-chunk decays by more than
    e^`MAX_EXPONENT` (its diagonal blocks use the reciprocal decays), and the kernel built."""
    if backend == "torch":
        return False
    applies = g_BTHK.device.type == "cpu" and bool(-(sub_chunk - 1) * g_BTHK.amin() <= MAX_EXPONENT)
    if backend == "compiled" and not (applies and cpu.available()):
        gates = f"gates above -{MAX_EXPONENT / (sub_chunk - 1):.3g} per token" if sub_chunk > 1 else "gates without NaN"
        raise ValueError(f"backend 'compiled' needs CPU tensors, {gates} and the built kernel"
                         + ("" if cpu.available() else " (it could not be built here: see the warning)"))
    return applies and cpu.available()


def _to_chunks(x_BTHX, chunk_size):
    """[B,T,H,X] -> contiguous [B,H,U,C,X], zero-padding the end: q = k = v = 0, g = 0, β = 0 are identity steps
    (§3.5). Contiguous even without padding: the batched matmuls would copy strided operands again and again."""
    pad = -x_BTHX.shape[1] % chunk_size
    return F.pad(x_BTHX.transpose(1, 2), (0, 0, 0, pad)).contiguous().unflatten(2, (-1, chunk_size))
