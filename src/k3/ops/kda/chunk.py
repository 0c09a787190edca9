"""Chunkwise-parallel Kimi Delta Attention (spec §3.5) with the numerically safe rules of spec §3.6.

Everything that does not depend on the state (decays, A, the triangular solve, W, U) is computed for all chunks
at once; only the state recursion (§3.5 steps 4 and 7) is a loop over chunks.
"""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim, N chunks, C chunk length,
# P sub-chunks per chunk, L sub-chunk length (C = P·L), Y = L(L+1)/2 causal pairs of a sub-chunk, X = C·C.

import math

import torch
import torch.nn.functional as F

from k3.ops.kda.naive import prepare_inputs

SUB_CHUNK = 16  # secondary chunking (spec §3.6): the C×C intra-chunk matrices are built from L×L blocks


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
              reset_chunks=None):
    """KDA over whole chunks of `chunk_size` tokens (spec §3.5); same contract as `recurrent_kda`.

    q, k [B,T,H,K] (already L2-normalised), v [B,T,H,V], g [B,T,H,K] per-channel log-decay (≤ 0, any
    magnitude), beta [B,T,H] in (0, 1), initial_state [B,H,K,V] (key-major) or None for zeros.
    `reset_chunks` [B, N] bool (N = ⌈T / chunk_size⌉): the state entering chunk n is zero, i.e. a new sequence
    starts there (packed documents laid out on chunk boundaries, spec §3.8; see `varlen.chunk_kda_by_document`).
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

    q_BHNCK, k_BHNCK, v_BHNCV, g_BHNCK, beta_BHNC1 = (
        _to_chunks(x, chunk_size) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH[..., None])
    )
    decay_BHNCK = g_BHNCK.cumsum(-2).exp()  # e^{b_r}, b_r = Σ_{i≤r} g_i the in-chunk cumulative log decay (≤ 0)
    L = math.gcd(chunk_size, SUB_CHUNK)  # 16 for C = 32, 64, …; any divisor of C is exact
    factors = _score_factors(k_BHNCK, g_BHNCK, L)
    M_BHNCC = _decayed_scores(q_BHNCK, factors)  # query–key, j ≤ r (step 5)
    A_BHNCC = beta_BHNC1 * _decayed_scores(k_BHNCK, factors).tril(-1)  # key–key, j < r, row r scaled by β_r (step 1)
    W_BHNCK, U_BHNCV = _wy_representation(A_BHNCC, beta_BHNC1 * decay_BHNCK * k_BHNCK, beta_BHNC1 * v_BHNCV)

    k_to_end_BHNCK = k_BHNCK * _sum_after(g_BHNCK).exp()  # K ⊙ e^{b_C − b}
    keep_BN = None if reset_chunks is None else ~reset_chunks.to(q_BHNCK.device)
    S_in_BHNKV, u_BHNCV, S_BHKV = _scan_chunks(S_BHKV, W_BHNCK, U_BHNCV, k_to_end_BHNCK, decay_BHNCK[..., -1:, :],
                                               keep_BN)
    o_BHNCV = (q_BHNCK * decay_BHNCK) @ S_in_BHNKV + M_BHNCC @ u_BHNCV  # O = (Q ⊙ e^b) S + M Ũ (step 6)
    o_BTHV = o_BHNCV.flatten(2, 3)[:, :, :T].transpose(1, 2)  # drop the padding
    return o_BTHV.to(out_dtype).contiguous(), (S_BHKV if output_final_state else None)


def _to_chunks(x_BTHD, chunk_size):
    """[B,T,H,D] -> [B,H,N,C,D], zero-padding the end: q = k = v = 0, g = 0, β = 0 are identity steps (§3.5)."""
    pad = -x_BTHD.shape[1] % chunk_size
    return F.pad(x_BTHD.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, chunk_size))


def _sum_after(g):
    """Σ_{i>r} g_i along axis −2 of a [..., C, K] tensor (exclusive reverse cumsum), e.g. b_C − b_r.

    Summing only the g in between keeps the fp32 digits that a difference of two long cumsums would lose.
    """
    return F.pad(g[..., 1:, :].flip(-2).cumsum(-2).flip(-2), (0, 0, 0, 1))


def _diagonal_pairs(C, L, device):
    """Row and column indices r_PY, j_PY of the causal pairs j ≤ r inside each of the P diagonal L×L blocks."""
    r_Y, j_Y = torch.tril_indices(L, L, device=device)
    start_P1 = torch.arange(0, C, L, device=device)[:, None]
    return start_P1 + r_Y, start_P1 + j_Y


def _score_factors(k_BHNCK, g_BHNCK, L):
    """Factors of the intra-chunk matrices Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]} (j ≤ r) for x = Q and K (§3.6).

    Secondary chunking in L×L blocks. Off-diagonal blocks (j in an earlier sub-chunk than r) factor through
    the anchor a = first row of r's sub-chunk, j < a ≤ r: e^{b_r − b_j} = e^{b_r − b_a} · e^{b_a − b_j}, both
    exponents ≤ 0, so the blocks become matmuls. Diagonal blocks use the exact pairwise e^{b_r − b_j}
    (spec §13 #16), formed for the causal pairs only. No excluded pair reaches exp with a positive exponent
    (it is −inf or never formed), so values and gradients stay finite for unbounded gates. Exponents are sums
    of the g in between, not differences of the chunk cumsum b, which lose fp32 digits.

    Returns the row factors rows_BHNPLK = e^{b_r − b_a}, the off-diagonal keys k_cols_BHNPCK = k_j e^{b_a − b_j}
    (0 unless j < a) and the diagonal-block keys k_pairs_BHNPYK = k_j e^{b_r − b_j} (pairs of `_diagonal_pairs`).
    """
    C = g_BHNCK.shape[-2]
    g_BHNPLK = g_BHNCK.unflatten(-2, (-1, L))
    rows_BHNPLK = F.pad(g_BHNPLK[..., 1:, :], (0, 0, 1, 0)).cumsum(-2).exp()  # b_r − b_a = Σ_{a<i≤r} g_i

    j_C, a_P1 = torch.arange(C, device=g_BHNCK.device), torch.arange(0, C, L, device=g_BHNCK.device)[:, None]
    g_to_anchor_BHNPCK = g_BHNCK[..., None, :, :].masked_fill((j_C > a_P1)[:, :, None], 0)
    b_anchor_minus_b_BHNPCK = _sum_after(g_to_anchor_BHNPCK)  # b_a − b_j = Σ_{j<i≤a} g_i
    cols_BHNPCK = b_anchor_minus_b_BHNPCK.masked_fill((j_C >= a_P1)[:, :, None], -math.inf).exp()

    r_PY, j_PY = _diagonal_pairs(C, L, g_BHNCK.device)
    b_local_BHNCK = g_BHNPLK.cumsum(-2).flatten(-3, -2)  # cumsum restarting at every sub-chunk
    pairs_BHNPYK = (b_local_BHNCK[..., r_PY, :] - b_local_BHNCK[..., j_PY, :]).exp()  # e^{b_r − b_j}
    return rows_BHNPLK, k_BHNCK[..., None, :, :] * cols_BHNPCK, k_BHNCK[..., j_PY, :] * pairs_BHNPYK


def _decayed_scores(x_BHNCK, factors):
    """Lower-triangular [B,H,N,C,C] scores out[r, j] = Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]} for j ≤ r, else 0."""
    rows_BHNPLK, k_cols_BHNPCK, k_pairs_BHNPYK = factors
    C, L = x_BHNCK.shape[-2], rows_BHNPLK.shape[-2]
    # earlier sub-chunks: (x ⊙ e^{b_r − b_a}) (k ⊙ e^{b_a − b_j})ᵀ, zero from the anchor column on
    scores_BHNPLC = (x_BHNCK.unflatten(-2, (-1, L)) * rows_BHNPLK) @ k_cols_BHNPCK.transpose(-1, -2)
    # diagonal blocks, pair by pair, added at row r, column j (still zero there)
    r_PY, j_PY = _diagonal_pairs(C, L, x_BHNCK.device)
    pairs_BHNPY = (x_BHNCK[..., r_PY, :] * k_pairs_BHNPYK).sum(-1)
    scores_BHNX = scores_BHNPLC.flatten(-3).index_add(-1, (r_PY * C + j_PY).flatten(), pairs_BHNPY.flatten(-2))
    return scores_BHNX.unflatten(-1, (C, C))


def _wy_representation(A_BHNCC, beta_k_decayed_BHNCK, beta_v_BHNCV):
    """W = T·Diag(β)·(e^b ⊙ K) and U = T·Diag(β)·V with T = (I + A)⁻¹ (spec §3.5 steps 2–3).

    A unit-lower-triangular solve, i.e. forward substitution (never a Neumann/repeated-squaring inverse, §3.6).
    """
    C, K = beta_k_decayed_BHNCK.shape[-2:]
    eye_CC = torch.eye(C, dtype=A_BHNCC.dtype, device=A_BHNCC.device)
    rhs_BHNCD = torch.cat([beta_k_decayed_BHNCK, beta_v_BHNCV], -1)
    WU_BHNCD = torch.linalg.solve_triangular(eye_CC + A_BHNCC, rhs_BHNCD, upper=False, unitriangular=True)
    return WU_BHNCD.split([K, WU_BHNCD.shape[-1] - K], -1)


def _scan_chunks(S_BHKV, W_BHNCK, U_BHNCV, k_to_end_BHNCK, decay_end_BHN1K, keep_BN=None):
    """The sequential part (spec §3.5 steps 4 and 7), one chunk at a time; `keep_BN` false zeroes the state
    entering that chunk (a new sequence starts there).

    Returns the state entering every chunk [B,H,N,K,V], the pseudo-values Ũ [B,H,N,C,V] and the final state.
    """
    states, pseudo_values = [], []
    for n, (W_BHCK, U_BHCV, k_to_end_BHCK, decay_end_BH1K) in enumerate(zip(
        W_BHNCK.unbind(2), U_BHNCV.unbind(2), k_to_end_BHNCK.unbind(2), decay_end_BHN1K.unbind(2)
    )):
        if keep_BN is not None:
            S_BHKV = S_BHKV * keep_BN[:, n, None, None, None].to(S_BHKV.dtype)
        u_BHCV = U_BHCV - W_BHCK @ S_BHKV  # Ũ = U − W S
        states.append(S_BHKV)
        pseudo_values.append(u_BHCV)
        # S ← Diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ Ũ
        S_BHKV = decay_end_BH1K.transpose(-1, -2) * S_BHKV + k_to_end_BHCK.transpose(-1, -2) @ u_BHCV
    return torch.stack(states, 2), torch.stack(pseudo_values, 2), S_BHKV
