"""Chunkwise-parallel Kimi Delta Attention (§3.5) with the numerically safe rules of §3.6.

Everything that does not depend on the state (decays, A, the triangular solve, W, U) is computed for all chunks
at once; only the state recursion (§3.5 steps 4 and 7) is a loop over chunks.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: U chunks of length C, u sub-chunks of length Z per chunk (C = u·Z), Y = Z(Z+1)/2 causal pairs of a
# sub-chunk, X = C·C.

import math

import torch
import torch.nn.functional as F

from k3.ops.kda.naive import prepare_inputs

SUB_CHUNK = 16  # secondary chunking (§3.6): the C×C intra-chunk matrices are built from Z×Z blocks


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
              reset_chunks=None):
    """KDA over whole chunks of `chunk_size` tokens (§3.5); same contract as `recurrent_kda`.

    q, k [B,T,H,K] (already L2-normalised), v [B,T,H,V], g [B,T,H,K] per-channel log-decay (≤ 0, any
    magnitude), beta [B,T,H] in (0, 1), initial_state [B,H,K,V] (key-major) or None for zeros.
    `reset_chunks` [B, U] bool (U = ⌈T / chunk_size⌉): the state entering chunk n is zero, i.e. a new sequence
    starts there (packed documents laid out on chunk boundaries, §3.8; see `varlen.chunk_kda_by_document`).
    Returns (o [B,T,H,V] in q.dtype, final state [B,H,K,V] in the compute dtype, or None).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
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

    q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1 = (
        _to_chunks(x, chunk_size) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH[..., None])
    )
    decay_BHUCK = g_BHUCK.cumsum(-2).exp()  # e^{b_r}, b_r = Σ_{i≤r} g_i the in-chunk cumulative log decay (≤ 0)
    Z = math.gcd(chunk_size, SUB_CHUNK)  # 16 for C = 32, 64, …; any divisor of C is exact
    factors = _score_factors(k_BHUCK, g_BHUCK, Z)
    M_BHUCC = _decayed_scores(q_BHUCK, factors)  # query–key, j ≤ r (step 5)
    A_BHUCC = beta_BHUC1 * _decayed_scores(k_BHUCK, factors).tril(-1)  # key–key, j < r, row r scaled by β_r (step 1)
    W_BHUCK, U_BHUCV = _wy_representation(A_BHUCC, beta_BHUC1 * decay_BHUCK * k_BHUCK, beta_BHUC1 * v_BHUCV)

    k_to_end_BHUCK = k_BHUCK * _sum_after(g_BHUCK).exp()  # K ⊙ e^{b_C − b}
    keep_BU = None if reset_chunks is None else ~reset_chunks.to(q_BHUCK.device)
    S_in_BHUKV, u_BHUCV, S_BHKV = _scan_chunks(S_BHKV, W_BHUCK, U_BHUCV, k_to_end_BHUCK, decay_BHUCK[..., -1:, :],
                                               keep_BU)
    o_BHUCV = (q_BHUCK * decay_BHUCK) @ S_in_BHUKV + M_BHUCC @ u_BHUCV  # O = (Q ⊙ e^b) S + M Ũ (step 6)
    o_BTHV = o_BHUCV.flatten(2, 3)[:, :, :T].transpose(1, 2)  # drop the padding
    return o_BTHV.to(out_dtype).contiguous(), (S_BHKV if output_final_state else None)


def _to_chunks(x_BTHX, chunk_size):
    """[B,T,H,X] -> [B,H,U,C,X], zero-padding the end: q = k = v = 0, g = 0, β = 0 are identity steps (§3.5)."""
    pad = -x_BTHX.shape[1] % chunk_size
    return F.pad(x_BTHX.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, chunk_size))


def _sum_after(g):
    """Σ_{i>r} g_i along axis −2 of a [..., C, K] tensor (exclusive reverse cumsum), e.g. b_C − b_r.

    Summing only the g in between keeps the fp32 digits that a difference of two long cumsums would lose.
    """
    return F.pad(g[..., 1:, :].flip(-2).cumsum(-2).flip(-2), (0, 0, 0, 1))


def _diagonal_pairs(C, Z, device):
    """Row and column indices r_uY, j_uY of the causal pairs j ≤ r inside each of the u diagonal Z×Z blocks."""
    r_Y, j_Y = torch.tril_indices(Z, Z, device=device)
    start_u1 = torch.arange(0, C, Z, device=device)[:, None]
    return start_u1 + r_Y, start_u1 + j_Y


def _score_factors(k_BHUCK, g_BHUCK, Z):
    """Factors of the intra-chunk matrices Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]} (j ≤ r) for x = Q and K (§3.6).

    Secondary chunking in Z×Z blocks. Off-diagonal blocks (j in an earlier sub-chunk than r) factor through
    the anchor a = first row of r's sub-chunk, j < a ≤ r: e^{b_r − b_j} = e^{b_r − b_a} · e^{b_a − b_j}, both
    exponents ≤ 0, so the blocks become matmuls. Diagonal blocks use the exact pairwise e^{b_r − b_j}
    (§13 #16), formed for the causal pairs only. No excluded pair reaches exp with a positive exponent
    (it is −inf or never formed), so values and gradients stay finite for unbounded gates. Exponents are sums
    of the g in between, not differences of the chunk cumsum b, which lose fp32 digits.

    Returns the row factors rows_BHUuZK = e^{b_r − b_a}, the off-diagonal keys k_cols_BHUuCK = k_j e^{b_a − b_j}
    (0 unless j < a) and the diagonal-block keys k_pairs_BHUuYK = k_j e^{b_r − b_j} (pairs of `_diagonal_pairs`).
    """
    C = g_BHUCK.shape[-2]
    g_BHUuZK = g_BHUCK.unflatten(-2, (-1, Z))
    rows_BHUuZK = F.pad(g_BHUuZK[..., 1:, :], (0, 0, 1, 0)).cumsum(-2).exp()  # b_r − b_a = Σ_{a<i≤r} g_i

    j_C, a_u1 = torch.arange(C, device=g_BHUCK.device), torch.arange(0, C, Z, device=g_BHUCK.device)[:, None]
    g_to_anchor_BHUuCK = g_BHUCK[..., None, :, :].masked_fill((j_C > a_u1)[:, :, None], 0)
    b_anchor_minus_b_BHUuCK = _sum_after(g_to_anchor_BHUuCK)  # b_a − b_j = Σ_{j<i≤a} g_i
    cols_BHUuCK = b_anchor_minus_b_BHUuCK.masked_fill((j_C >= a_u1)[:, :, None], -math.inf).exp()

    r_uY, j_uY = _diagonal_pairs(C, Z, g_BHUCK.device)
    b_local_BHUCK = g_BHUuZK.cumsum(-2).flatten(-3, -2)  # cumsum restarting at every sub-chunk
    pairs_BHUuYK = (b_local_BHUCK[..., r_uY, :] - b_local_BHUCK[..., j_uY, :]).exp()  # e^{b_r − b_j}
    return rows_BHUuZK, k_BHUCK[..., None, :, :] * cols_BHUuCK, k_BHUCK[..., j_uY, :] * pairs_BHUuYK


def _decayed_scores(x_BHUCK, factors):
    """Lower-triangular [B,H,U,C,C] scores out[r, j] = Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]} for j ≤ r, else 0."""
    rows_BHUuZK, k_cols_BHUuCK, k_pairs_BHUuYK = factors
    C, Z = x_BHUCK.shape[-2], rows_BHUuZK.shape[-2]
    # earlier sub-chunks: (x ⊙ e^{b_r − b_a}) (k ⊙ e^{b_a − b_j})ᵀ, zero from the anchor column on
    scores_BHUuZC = (x_BHUCK.unflatten(-2, (-1, Z)) * rows_BHUuZK) @ k_cols_BHUuCK.transpose(-1, -2)
    # diagonal blocks, pair by pair, added at row r, column j (still zero there)
    r_uY, j_uY = _diagonal_pairs(C, Z, x_BHUCK.device)
    pairs_BHUuY = (x_BHUCK[..., r_uY, :] * k_pairs_BHUuYK).sum(-1)
    scores_BHUX = scores_BHUuZC.flatten(-3).index_add(-1, (r_uY * C + j_uY).flatten(), pairs_BHUuY.flatten(-2))
    return scores_BHUX.unflatten(-1, (C, C))


def _wy_representation(A_BHUCC, beta_k_decayed_BHUCK, beta_v_BHUCV):
    """W = T·Diag(β)·(e^b ⊙ K) and U = T·Diag(β)·V with T = (I + A)⁻¹ (§3.5 steps 2–3).

    A unit-lower-triangular solve, i.e. forward substitution (never a Neumann/repeated-squaring inverse, §3.6).
    """
    C, K = beta_k_decayed_BHUCK.shape[-2:]
    eye_CC = torch.eye(C, dtype=A_BHUCC.dtype, device=A_BHUCC.device)
    rhs_BHUCX = torch.cat([beta_k_decayed_BHUCK, beta_v_BHUCV], -1)
    WU_BHUCX = torch.linalg.solve_triangular(eye_CC + A_BHUCC, rhs_BHUCX, upper=False, unitriangular=True)
    return WU_BHUCX.split([K, WU_BHUCX.shape[-1] - K], -1)


def _scan_chunks(S_BHKV, W_BHUCK, U_BHUCV, k_to_end_BHUCK, decay_end_BHU1K, keep_BU=None):
    """The sequential part (§3.5 steps 4 and 7), one chunk at a time; `keep_BU` false zeroes the state
    entering that chunk (a new sequence starts there).

    Returns the state entering every chunk [B,H,U,K,V], the pseudo-values Ũ [B,H,U,C,V] and the final state.
    """
    states, pseudo_values = [], []
    for n, (W_BHCK, U_BHCV, k_to_end_BHCK, decay_end_BH1K) in enumerate(zip(
        W_BHUCK.unbind(2), U_BHUCV.unbind(2), k_to_end_BHUCK.unbind(2), decay_end_BHU1K.unbind(2)
    )):
        if keep_BU is not None:
            S_BHKV = S_BHKV * keep_BU[:, n, None, None, None].to(S_BHKV.dtype)
        u_BHCV = U_BHCV - W_BHCK @ S_BHKV  # Ũ = U − W S
        states.append(S_BHKV)
        pseudo_values.append(u_BHCV)
        # S ← Diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ Ũ
        S_BHKV = decay_end_BH1K.transpose(-1, -2) * S_BHKV + k_to_end_BHCK.transpose(-1, -2) @ u_BHCV
    return torch.stack(states, 2), torch.stack(pseudo_values, 2), S_BHKV
