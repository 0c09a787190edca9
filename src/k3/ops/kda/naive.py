"""Reference Kimi Delta Attention: the plain token-by-token recurrence (§3.4).

Also holds the argument checks and the dtype rule shared by both KDA ops: everything is computed in fp32
(§0.4), or in float64 when the inputs are float64 (used by tests for tight comparisons).
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

import torch

from k3.ops.precision import without_autocast


def _check_shape(name, x, expected, layout):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {layout} = {tuple(expected)}")


def check_inputs(q, k, v, g, beta, initial_state):
    """Raise ValueError naming the first argument whose shape does not fit q [B,T,H,K] and v [B,T,H,V]."""
    if q.dim() != 4 or not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor of shape [B,T,H,K], got {q.dtype} {tuple(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v has shape {tuple(v.shape)}, expected [B,T,H,V] with B,T,H = {(B, T, H)} matching q")
    V = v.shape[-1]
    _check_shape("k", k, (B, T, H, K), "[B,T,H,K] matching q")
    _check_shape("g", g, (B, T, H, K), "[B,T,H,K] matching q")
    _check_shape("beta", beta, (B, T, H), "[B,T,H]")
    if initial_state is not None:
        _check_shape("initial_state", initial_state, (B, H, K, V), "[B,H,K,V]")


def prepare_inputs(q, k, v, g, beta, scale, initial_state):
    """Check shapes and cast to the compute dtype (§0.4).

    Returns (scale·q, k, v, g, beta, S_BHKV); scale=None means K**-0.5, initial_state=None means zeros.
    """
    check_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    if initial_state is None:
        initial_state = q.new_zeros(B, H, K, V, dtype=dtype)
    q, k, v, g, beta, S_BHKV = (x.to(dtype) for x in (q, k, v, g, beta, initial_state))
    return q * scale, k, v, g, beta, S_BHKV


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """KDA one token at a time, exactly in the order of §3.4 (the reference for `chunk_kda`).

    q, k [B,T,H,K] (already L2-normalised), v [B,T,H,V], g [B,T,H,K] per-channel log-decay (≤ 0),
    beta [B,T,H] in (0, 1), initial_state [B,H,K,V] (key-major) or None for zeros.
    Returns (o [B,T,H,V] in q.dtype, final state [B,H,K,V] in the compute dtype, or None).
    """
    out_dtype = q.dtype
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV = prepare_inputs(q, k, v, g, beta, scale, initial_state)
    # unbind, not indexing [:, t]: the backward of each index op would allocate a full [B,T,...] gradient
    steps = zip(*(x.unbind(1) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)))
    outputs = []
    with without_autocast(q_BTHK.device):
        for q_BHK, k_BHK, v_BHV, g_BHK, beta_BH in steps:
            S_BHKV = g_BHK[..., None].exp() * S_BHKV  # 1. decay the key rows: S ← Diag(e^g) S
            u_BHV = beta_BH[..., None] * (v_BHV - torch.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV))  # 2. u = β(v − Sᵀk)
            S_BHKV = S_BHKV + k_BHK[..., :, None] * u_BHV[..., None, :]  # 3. S ← S + k uᵀ
            outputs.append(torch.einsum("bhk,bhkv->bhv", q_BHK, S_BHKV))  # 4. o = Sᵀ q, read after the write
    o_BTHV = torch.stack(outputs, 1) if outputs else torch.zeros_like(v_BTHV)  # T = 0: empty output
    return o_BTHV.to(out_dtype), (S_BHKV if output_final_state else None)
