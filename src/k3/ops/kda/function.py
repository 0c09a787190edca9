"""The chunkwise KDA core as one autograd Function (§3.5, with the numerics rules of §3.6).

Forward: the intra-chunk quantities (decays, A, the triangular solve, W, U, M) for all chunks at once, the state
scan over chunks (§3.5 steps 4 and 7), the outputs (step 6). It keeps only the inputs and the state entering every
chunk, [B,H,U,K,V] (memory linear in T).

Backward, derived by hand: the intra-chunk quantities are recomputed from the saved inputs, Ũ = U − W·S for all
chunks at once from the saved states, then one reverse scan carries dS from chunk to chunk; every other gradient is
batched over the chunks. Gradients reach the gate through b, the in-chunk cumulative log decay: everything depends on
g only through b (differences b_r − b_j, b_C − b_r, b_r), so ∂/∂g_i = Σ_{r ≥ i} ∂/∂b_r, a reverse cumsum.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: U chunks of length C, u sub-chunks of length Z per chunk (C = u·Z), Y = Z(Z+1)/2 causal pairs of a
# sub-chunk, X = 2Z (the rows of q and k of one sub-chunk, stacked).

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

SUB_CHUNK = 16  # secondary chunking (§3.6): the C×C intra-chunk matrices are built from Z×Z blocks
MAX_EXPONENT = 80.0  # e^80 ≈ 5.5e34: fp32 keeps it, and a product with its reciprocal, far from overflow (≈ e^88.7)


class ScoreFactors(NamedTuple):
    """Factors of the decayed scores Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]}, j ≤ r (see `_score_factors`)."""

    rows_BHUuZK: torch.Tensor  # e^{b_r − b_a}, a the first row of r's sub-chunk
    cols_BHUuCK: torch.Tensor  # e^{b_a − b_j} for j < a (and j in a's sub-chunk for bounded gates), else 0
    pairs_BHUuYK: torch.Tensor | None  # e^{b_r − b_j} for the causal pairs (r, j) of the diagonal blocks, or None
    k_cols_BHUuCK: torch.Tensor  # k_j ⊙ cols
    k_pairs_BHUuYK: torch.Tensor | None  # k_j ⊙ pairs


class IntraChunk(NamedTuple):
    """Everything of §3.5 that does not depend on the state, for all chunks at once."""

    decay_BHUCK: torch.Tensor  # e^{b_r}
    to_end_BHUCK: torch.Tensor  # e^{b_C − b_r}
    factors: ScoreFactors
    rows_BHUuXK: torch.Tensor  # the query and key rows of the scores' matmul, X = 2Z (see `_decayed_scores`)
    M_BHUCC: torch.Tensor  # query–key scores, j ≤ r (step 5)
    P_BHUCC: torch.Tensor  # key–key scores, j < r; A = Diag(β) P (step 1)
    T_BHUCC: torch.Tensor  # (I + A)⁻¹ (step 2)
    W_BHUCK: torch.Tensor  # T·Diag(β)·(e^b ⊙ K) (step 3)
    U_BHUCV: torch.Tensor  # T·Diag(β)·V


def _sum_after(g):
    """Σ_{i>r} g_i along axis −2 of a [..., C, K] tensor (exclusive reverse cumsum), e.g. b_C − b_r.

    Summing only the g in between keeps the fp32 digits that a difference of two long cumsums would lose.
    """
    return F.pad(g[..., 1:, :].flip(-2).cumsum(-2).flip(-2), (0, 0, 0, 1))


def _exp_decay(x):
    """e^x for a log decay x ≤ 0 (−inf for excluded pairs), flushed to 0 below ε² (ε the dtype's machine epsilon:
    e^−31.8 in fp32, e^−73.4 in float64): negligible next to the decays that matter (up to 1).

    It keeps the products of decays and of decayed values out of the subnormal range: subnormal operands and
    results make exp and multiplications many times slower on CPUs, and K3's b reaches −320 within a chunk.
    """
    floor = 2 * math.log(torch.finfo(x.dtype).eps)
    return x.clamp_min(floor).exp_().masked_fill_(x < floor, 0)


def _diagonal_pairs(C, Z, device):
    """Row and column indices r_uY, j_uY of the causal pairs j ≤ r inside each of the u diagonal Z×Z blocks."""
    r_Y, j_Y = torch.tril_indices(Z, Z, device=device)
    start_u1 = torch.arange(0, C, Z, device=device)[:, None]
    return start_u1 + r_Y, start_u1 + j_Y


def _earlier_columns(g_BHUuZK):
    """cols[a, j] = e^{b_a − b_j} for j in an earlier sub-chunk s than the anchor a, else 0: [B,H,U,u,u,Z,K].

    e^{b_a − b_j} = e^{b_a − b_e} · e^{b_e − b_j}, e the last row of s: b_e − b_j = Σ_{j<i≤e} g_i inside s, and
    b_a − b_e = g_a plus the totals of the whole sub-chunks between s and a; sums of the g in between only (§3.6).
    """
    s_u = torch.arange(g_BHUuZK.shape[-3], device=g_BHUuZK.device)
    between_uuu = (s_u[None, :, None] < s_u[None, None, :]) & (s_u[None, None, :] < s_u[:, None, None])  # s<s'<a
    totals_BHUuK = g_BHUuZK.sum(-2)
    anchor_to_end_BHUuuK = ((totals_BHUuK[..., None, None, :, :] * between_uuu[..., None]).sum(-2)
                            + g_BHUuZK[..., 0, None, :])
    anchor_to_end_BHUuuK.masked_fill_((s_u[:, None] <= s_u)[..., None], -math.inf)  # s ≥ a: excluded
    return _exp_decay(anchor_to_end_BHUuuK)[..., None, :] * _exp_decay(_sum_after(g_BHUuZK))[..., None, :, :, :]


def _score_factors(k_BHUCK, g_BHUCK, Z):
    """Factors of the intra-chunk matrices Σ_c x[r,c] k[j,c] e^{b_r[c] − b_j[c]} (j ≤ r) for x = Q and K (§3.6).

    Secondary chunking in Z×Z blocks. Off-diagonal blocks (j in an earlier sub-chunk than r) factor through
    the anchor a = first row of r's sub-chunk, j < a ≤ r: e^{b_r − b_j} = e^{b_r − b_a} · e^{b_a − b_j}, both
    exponents ≤ 0, so the blocks become matmuls. Diagonal blocks use the exact pairwise e^{b_r − b_j}
    (§13 #16), formed for the causal pairs only. No excluded pair reaches exp with a positive exponent
    (it is −inf or never formed), so values and gradients stay finite for unbounded gates. Exponents are sums
    of the g in between, not differences of the chunk cumsum b, which lose fp32 digits.

    Bounded gates (K3's g ≥ −5, §3.3): when no sub-chunk decays by more than `MAX_EXPONENT`, the diagonal blocks
    factor through the same anchor, e^{b_r − b_j} = e^{b_r − b_a} · e^{−(b_j − b_a)}, the second factor ≤ e^80
    (finite, with the same rounding as the pairwise difference of in-block cumsums), and the whole chunk is one
    matmul per sub-chunk; the entries above the diagonal are finite and masked afterwards. No pairs are formed.
    """
    g_BHUuZK = g_BHUCK.unflatten(-2, (-1, Z))
    b_from_anchor_BHUuZK = F.pad(g_BHUuZK[..., 1:, :], (0, 0, 1, 0)).cumsum(-2)  # b_r − b_a = Σ_{a<i≤r} g_i
    cols_BHUuuZK = _earlier_columns(g_BHUuZK)
    bounded = -(Z - 1) * g_BHUCK.amin() <= MAX_EXPONENT  # false for NaN too
    if bounded:  # the anchor's own sub-chunk: e^{b_a − b_j} = e^{−(b_j − b_a)} ≤ e^80
        cols_BHUuuZK.diagonal(dim1=-4, dim2=-3).copy_((-b_from_anchor_BHUuZK).exp_().movedim(-3, -1))
    # e^{b_r − b_a}: not flushed where the columns reach e^80 (its exponent is ≥ −80 there, fp32's normal range)
    rows_BHUuZK = b_from_anchor_BHUuZK.exp() if bounded else _exp_decay(b_from_anchor_BHUuZK)
    cols_BHUuCK = cols_BHUuuZK.flatten(-3, -2)
    k_cols_BHUuCK = k_BHUCK[..., None, :, :] * cols_BHUuCK
    if bounded:
        return ScoreFactors(rows_BHUuZK, cols_BHUuCK, None, k_cols_BHUuCK, None)

    r_uY, j_uY = _diagonal_pairs(g_BHUCK.shape[-2], Z, g_BHUCK.device)
    b_local_BHUCK = g_BHUuZK.cumsum(-2).flatten(-3, -2)  # cumsum restarting at every sub-chunk
    pairs_BHUuYK = (b_local_BHUCK[..., r_uY, :] - b_local_BHUCK[..., j_uY, :]).exp_()  # e^{b_r − b_j}
    k_pairs_BHUuYK = k_BHUCK[..., j_uY, :] * pairs_BHUuYK
    return ScoreFactors(rows_BHUuZK, cols_BHUuCK, pairs_BHUuYK, k_cols_BHUuCK, k_pairs_BHUuYK)


def _pairs_scores(scores_BHUCC, x_BHUCK, factors):
    """Add the diagonal blocks' causal pairs Σ_c x[r,c] k[j,c] e^{b_r − b_j} at (r, j) (unbounded gates)."""
    C = x_BHUCK.shape[-2]
    r_uY, j_uY = _diagonal_pairs(C, factors.rows_BHUuZK.shape[-2], x_BHUCK.device)
    pairs_BHUuY = (x_BHUCK[..., r_uY, :] * factors.k_pairs_BHUuYK).sum(-1)
    scores_BHUX = scores_BHUCC.flatten(-2).index_add_(-1, (r_uY * C + j_uY).flatten(), pairs_BHUuY.flatten(-2))
    return scores_BHUX.view_as(scores_BHUCC)


def _decayed_scores(q_BHUCK, k_BHUCK, factors):
    """(M, P, the rows of the matmul): M[r, j] = Σ_c q[r,c] k[j,c] e^{b_r[c] − b_j[c]} for j ≤ r and P the same
    with k in place of q for j < r (§3.5 steps 5 and 1), 0 elsewhere; [B,H,U,C,C] each.

    Per sub-chunk, the rows of q and of k (X = 2Z) meet the keys in one matmul:
    (x ⊙ e^{b_r − b_a}) (k ⊙ e^{b_a − b_j})ᵀ.
    """
    Z = factors.rows_BHUuZK.shape[-2]
    rows_BHUuXK = torch.cat([x.unflatten(-2, (-1, Z)) * factors.rows_BHUuZK for x in (q_BHUCK, k_BHUCK)], -2)
    scores_BHUuXC = rows_BHUuXK @ factors.k_cols_BHUuCK.transpose(-1, -2)
    M_BHUCC, P_BHUCC = (s.flatten(-3, -2).contiguous() for s in scores_BHUuXC.unflatten(-2, (2, Z)).unbind(-3))
    if factors.pairs_BHUuYK is not None:  # unbounded gates: the diagonal blocks pair by pair (zero so far)
        M_BHUCC, P_BHUCC = _pairs_scores(M_BHUCC, q_BHUCK, factors), _pairs_scores(P_BHUCC, k_BHUCK, factors)
    return M_BHUCC.tril_(), P_BHUCC.tril_(-1), rows_BHUuXK


def _pairs_backward(dscores_BHUCC, x_BHUCK, factors, dx_BHUCK, dk_BHUCK):
    """Add the diagonal blocks' pairs to dx and dk (unbounded gates; see `_decayed_scores_backward`)."""
    C = x_BHUCK.shape[-2]
    r_uY, j_uY = _diagonal_pairs(C, factors.rows_BHUuZK.shape[-2], x_BHUCK.device)
    d_BHUuY1 = dscores_BHUCC.flatten(-2)[..., r_uY * C + j_uY, None]
    dx_BHUCK.index_add_(-2, r_uY.flatten(), (d_BHUuY1 * factors.k_pairs_BHUuYK).flatten(-3, -2))
    dk_BHUuYK = d_BHUuY1 * x_BHUCK[..., r_uY, :] * factors.pairs_BHUuYK
    dk_BHUCK.index_add_(-2, j_uY.flatten(), dk_BHUuYK.flatten(-3, -2))


def _decayed_scores_backward(dM_BHUCC, dP_BHUCC, q_BHUCK, k_BHUCK, factors, rows_BHUuXK):
    """(dq_M, dk_P as the query side, dk of both as the key side) of `_decayed_scores` at fixed decays, for
    lower-triangular upstream gradients.

    dx[r] = Σ_j d[r,j] k_j ⊙ e^{b_r − b_j} and dk[j] = Σ_r d[r,j] x_r ⊙ e^{b_r − b_j}, through the same factors
    (d is zero above the diagonal, so the finite bounded-gate factors there contribute nothing).
    The decays' own gradient follows from these: ∂/∂b = x ⊙ dx − k ⊙ dk (the scores depend on b_r − b_j only).
    """
    Z = factors.rows_BHUuZK.shape[-2]
    d_BHUuXC = torch.cat([d.unflatten(-2, (-1, Z)) for d in (dM_BHUCC, dP_BHUCC)], -2)
    # dx = e^{b_r − b_a} ⊙ d (k ⊙ e^{b_a − b_j}); dk = Σ_a e^{b_a − b_j} ⊙ dᵀ (x ⊙ e^{b_r − b_a}) over q and k rows
    dx_BHUu2ZK = (d_BHUuXC @ factors.k_cols_BHUuCK).unflatten(-2, (2, Z)) * factors.rows_BHUuZK[..., None, :, :]
    dq_BHUCK, dk_rows_BHUCK = (dx.flatten(-3, -2) for dx in dx_BHUu2ZK.unbind(-3))
    dk_cols_BHUCK = ((d_BHUuXC.transpose(-1, -2) @ rows_BHUuXK) * factors.cols_BHUuCK).sum(-3)
    if factors.pairs_BHUuYK is not None:  # unbounded gates: the diagonal blocks pair by pair
        _pairs_backward(dM_BHUCC, q_BHUCK, factors, dq_BHUCK, dk_cols_BHUCK)
        _pairs_backward(dP_BHUCC, k_BHUCK, factors, dk_rows_BHUCK, dk_cols_BHUCK)
    return dq_BHUCK, dk_rows_BHUCK, dk_cols_BHUCK


def _wy_representation(A_BHUCC, beta_k_decayed_BHUCK, beta_v_BHUCV):
    """(T, W, U): T = (I + A)⁻¹, W = T·Diag(β)·(e^b ⊙ K), U = T·Diag(β)·V (§3.5 steps 2–3).

    T by a unit-lower-triangular solve against I, i.e. forward substitution (never a Neumann/repeated-squaring
    inverse, §3.6); with C right-hand sides instead of K + V, and W, U as matmuls, which CPUs run far faster.
    """
    eye_CC = torch.eye(A_BHUCC.shape[-1], dtype=A_BHUCC.dtype, device=A_BHUCC.device)
    T_BHUCC = torch.linalg.solve_triangular(A_BHUCC + eye_CC, eye_CC, upper=False, unitriangular=True)
    return T_BHUCC, T_BHUCC @ beta_k_decayed_BHUCK, T_BHUCC @ beta_v_BHUCV


def _intra_chunk(q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1):
    """§3.5 steps 1–3 and 5 for all chunks at once."""
    Z = math.gcd(g_BHUCK.shape[-2], SUB_CHUNK)  # 16 for C = 32, 64, …; any divisor of C is exact
    decay_BHUCK = _exp_decay(g_BHUCK.cumsum(-2))  # e^{b_r}, b_r = Σ_{i≤r} g_i (≤ 0)
    to_end_BHUCK = _exp_decay(_sum_after(g_BHUCK))  # e^{b_C − b_r}
    factors = _score_factors(k_BHUCK, g_BHUCK, Z)
    M_BHUCC, P_BHUCC, rows_BHUuXK = _decayed_scores(q_BHUCK, k_BHUCK, factors)  # steps 5 and 1
    T_BHUCC, W_BHUCK, U_BHUCV = _wy_representation(beta_BHUC1 * P_BHUCC, beta_BHUC1 * decay_BHUCK * k_BHUCK,
                                                   beta_BHUC1 * v_BHUCV)  # A = Diag(β) P (step 1)
    return IntraChunk(decay_BHUCK, to_end_BHUCK, factors, rows_BHUuXK, M_BHUCC, P_BHUCC, T_BHUCC, W_BHUCK,
                      U_BHUCV)


def _scan_chunks(S_BHKV, W_BHUCK, U_BHUCV, k_to_end_BHUCK, decay_end_BHU1K, keep_BU=None):
    """The sequential part (§3.5 steps 4 and 7), one chunk at a time; `keep_BU` false zeroes the state
    entering that chunk (a new sequence starts there).

    Returns the state entering every chunk [B,H,U,K,V], the pseudo-values Ũ [B,H,U,C,V] and the final state.
    """
    B, H, U = U_BHUCV.shape[:3]
    S_in_BHUKV = S_BHKV.new_empty(B, H, U, *S_BHKV.shape[-2:])
    u_BHUCV = torch.empty_like(U_BHUCV)
    for n in range(U):
        if keep_BU is not None:
            S_BHKV = S_BHKV * keep_BU[:, n, None, None, None]
        S_in_BHUKV[:, :, n] = S_BHKV
        u_BHCV = U_BHUCV[:, :, n] - W_BHUCK[:, :, n] @ S_BHKV  # Ũ = U − W S
        u_BHUCV[:, :, n] = u_BHCV
        S_BHKV = (decay_end_BHU1K[:, :, n].transpose(-1, -2) * S_BHKV
                  + k_to_end_BHUCK[:, :, n].transpose(-1, -2) @ u_BHCV)  # S ← Diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ Ũ
    return S_in_BHUKV, u_BHUCV, S_BHKV


def _scan_chunks_backward(dS_BHKV, qdT_do_BHUKV, MT_do_BHUCV, W_BHUCK, k_to_end_BHUCK, decay_end_BHU1K, keep_BU):
    """The reverse of `_scan_chunks`: dS carried from the last chunk to the first.

    With dS' the gradient of the state leaving chunk n: dŨ = Mᵀ dO + (K ⊙ e^{b_C − b}) dS' and
    dS = (Q ⊙ e^b)ᵀ dO + Diag(e^{b_C}) dS' − Wᵀ dŨ (then zeroed where the state was reset).
    Returns dS' of every chunk [B,H,U,K,V], dŨ [B,H,U,C,V] and the gradient of the initial state.
    """
    U = W_BHUCK.shape[2]
    dS_out_BHUKV, du_BHUCV = torch.empty_like(qdT_do_BHUKV), torch.empty_like(MT_do_BHUCV)
    for n in reversed(range(U)):
        dS_out_BHUKV[:, :, n] = dS_BHKV
        du_BHCV = MT_do_BHUCV[:, :, n] + k_to_end_BHUCK[:, :, n] @ dS_BHKV  # dŨ = Mᵀ dO + (K ⊙ e^{b_C − b}) dS'
        du_BHUCV[:, :, n] = du_BHCV
        # dS = (Q ⊙ e^b)ᵀ dO + Diag(e^{b_C}) dS' − Wᵀ dŨ
        dS_BHKV = (qdT_do_BHUKV[:, :, n] + decay_end_BHU1K[:, :, n].transpose(-1, -2) * dS_BHKV
                   - W_BHUCK[:, :, n].transpose(-1, -2) @ du_BHCV)
        if keep_BU is not None:
            dS_BHKV = dS_BHKV * keep_BU[:, n, None, None, None]
    return dS_out_BHUKV, du_BHUCV, dS_BHKV


def _state_backward(do_BHUCV, du_BHUCV, dS_out_BHUKV, S_in_BHUKV, u_BHUCV):
    """Gradients of the factors the state meets: O ∋ (Q ⊙ e^b) S + M Ũ, Ũ = U − W S,
    S' = Diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ Ũ (dŨ and dS' from `_scan_chunks_backward`).

    Returns d(Q ⊙ e^b), d(K ⊙ e^{b_C − b}), d e^{b_C} [B,H,U,1,K], dM (j ≤ r) and dW.
    """
    S_inT_BHUVK = S_in_BHUKV.transpose(-1, -2)
    dq_decayed_BHUCK = do_BHUCV @ S_inT_BHUVK  # d(Q ⊙ e^b) = dO Sᵀ
    dk_to_end_BHUCK = u_BHUCV @ dS_out_BHUKV.transpose(-1, -2)  # d(K ⊙ e^{b_C − b}) = Ũ dS'ᵀ
    ddecay_end_BHU1K = (S_in_BHUKV * dS_out_BHUKV).sum(-1)[..., None, :]  # d e^{b_C} = rowsum(S ⊙ dS')
    dM_BHUCC = (do_BHUCV @ u_BHUCV.transpose(-1, -2)).tril_()  # dM = dO Ũᵀ
    dW_BHUCK = -(du_BHUCV @ S_inT_BHUVK)  # dW = −dŨ Sᵀ
    return dq_decayed_BHUCK, dk_to_end_BHUCK, ddecay_end_BHU1K, dM_BHUCC, dW_BHUCK


def _wy_backward(ic, dW_BHUCK, dU_BHUCV):
    """Through W = T X_k, U = T X_v, T = (I + A)⁻¹ (§3.5 steps 2–3): dX = Tᵀ d[W ‖ U] and, as
    d(I + A)⁻¹ = −T dA T, dA = −(dX_k Wᵀ + dX_v Uᵀ), kept for j < r. Returns dX_k, dX_v, dA."""
    TT_BHUCC = ic.T_BHUCC.transpose(-1, -2)
    dXk_BHUCK, dXv_BHUCV = TT_BHUCC @ dW_BHUCK, TT_BHUCC @ dU_BHUCV
    dA_BHUCC = dXk_BHUCK @ ic.W_BHUCK.transpose(-1, -2) + dXv_BHUCV @ ic.U_BHUCV.transpose(-1, -2)
    return dXk_BHUCK, dXv_BHUCV, dA_BHUCC.tril_(-1).neg_()


def _gate_gradient(db_BHUCK, db_end_BHUK):
    """∂/∂g_i = Σ_{r ≥ i} ∂/∂b_r (b_r = Σ_{i≤r} g_i), with b_C's own gradient `db_end` added to the last row."""
    db_BHUCK[..., -1, :] += db_end_BHUK
    return db_BHUCK.flip(-2).cumsum(-2).flip(-2)


def _intra_chunk_backward(ic, q_BHUCK, k_BHUCK, v_BHUCV, beta_BHUC1, state_grads, du_BHUCV):
    """Gradients of q, k, v, g, β from those of the state's factors (`_state_backward`) and of Ũ."""
    dq_decayed_BHUCK, dk_to_end_BHUCK, ddecay_end_BHU1K, dM_BHUCC, dW_BHUCK = state_grads
    dXk_BHUCK, dXv_BHUCV, dA_BHUCC = _wy_backward(ic, dW_BHUCK, du_BHUCV)
    # X_k = Diag(β)(e^b ⊙ K), X_v = Diag(β) V, A = Diag(β) P
    k_decayed_BHUCK = k_BHUCK * ic.decay_BHUCK
    dbeta_BHUC = ((dXk_BHUCK * k_decayed_BHUCK).sum(-1) + (dXv_BHUCV * v_BHUCV).sum(-1)
                  + (dA_BHUCC * ic.P_BHUCC).sum(-1))
    dq_M_BHUCK, dk_Prow_BHUCK, dk_cols_BHUCK = _decayed_scores_backward(
        dM_BHUCC, beta_BHUC1 * dA_BHUCC, q_BHUCK, k_BHUCK, ic.factors, ic.rows_BHUuXK)  # dP = Diag(β) dA

    dq_BHUCK = ic.decay_BHUCK * dq_decayed_BHUCK + dq_M_BHUCK
    dk_BHUCK = (dk_Prow_BHUCK + dk_cols_BHUCK + beta_BHUC1 * ic.decay_BHUCK * dXk_BHUCK
                + ic.to_end_BHUCK * dk_to_end_BHUCK)
    # ∂/∂b_r: e^{b_r} in Q ⊙ e^b and X_k; b_r − b_j in M and P (x ⊙ dx − k ⊙ dk); b_C − b_r in K ⊙ e^{b_C − b}
    to_end_BHUCK = k_BHUCK * ic.to_end_BHUCK * dk_to_end_BHUCK
    db_BHUCK = (q_BHUCK * dq_BHUCK + beta_BHUC1 * k_decayed_BHUCK * dXk_BHUCK
                + k_BHUCK * (dk_Prow_BHUCK - dk_cols_BHUCK) - to_end_BHUCK)
    db_end_BHUK = to_end_BHUCK.sum(-2) + (ic.decay_BHUCK[..., -1:, :] * ddecay_end_BHU1K)[..., 0, :]  # e^{b_C}
    dg_BHUCK = _gate_gradient(db_BHUCK, db_end_BHUK)
    return dq_BHUCK, dk_BHUCK, beta_BHUC1 * dXv_BHUCV, dg_BHUCK, dbeta_BHUC[..., None]


class ChunkKDAFunction(torch.autograd.Function):
    """KDA over chunked inputs q, k [B,H,U,C,K] (q scaled), v [B,H,U,C,V], g [B,H,U,C,K], β [B,H,U,C,1] and the
    initial state S [B,H,K,V] (compute dtype); `keep_BU` [B,U] (compute dtype, 0 = reset) or None.
    Returns (O [B,H,U,C,V], final state [B,H,K,V]).

    Saves the inputs and the state entering every chunk; backward recomputes the intra-chunk quantities.
    """

    @staticmethod
    def forward(ctx, q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1, S_BHKV, keep_BU):
        ic = _intra_chunk(q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1)
        S_in_BHUKV, u_BHUCV, S_BHKV = _scan_chunks(S_BHKV, ic.W_BHUCK, ic.U_BHUCV, k_BHUCK * ic.to_end_BHUCK,
                                                   ic.decay_BHUCK[..., -1:, :], keep_BU)
        o_BHUCV = (q_BHUCK * ic.decay_BHUCK) @ S_in_BHUKV + ic.M_BHUCC @ u_BHUCV  # O = (Q ⊙ e^b) S + M Ũ (step 6)
        ctx.save_for_backward(q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1, S_in_BHUKV)
        ctx.keep_BU = keep_BU
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return o_BHUCV, S_BHKV

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BHUCV, dS_end_BHKV):
        q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1, S_in_BHUKV = ctx.saved_tensors
        ic = _intra_chunk(q_BHUCK, k_BHUCK, v_BHUCV, g_BHUCK, beta_BHUC1)  # recomputed
        u_BHUCV = ic.U_BHUCV - ic.W_BHUCK @ S_in_BHUKV  # Ũ = U − W S, all chunks at once
        # contiguous once: the output's gradient arrives strided and meets four matmuls
        do_BHUCV = torch.zeros_like(u_BHUCV) if do_BHUCV is None else do_BHUCV.contiguous()
        dS_end_BHKV = torch.zeros_like(S_in_BHUKV[:, :, 0]) if dS_end_BHKV is None else dS_end_BHKV
        dS_out_BHUKV, du_BHUCV, dS_BHKV = _scan_chunks_backward(
            dS_end_BHKV, (q_BHUCK * ic.decay_BHUCK).transpose(-1, -2) @ do_BHUCV,
            ic.M_BHUCC.transpose(-1, -2) @ do_BHUCV, ic.W_BHUCK, k_BHUCK * ic.to_end_BHUCK,
            ic.decay_BHUCK[..., -1:, :], ctx.keep_BU)
        state_grads = _state_backward(do_BHUCV, du_BHUCV, dS_out_BHUKV, S_in_BHUKV, u_BHUCV)
        dq, dk, dv, dg, dbeta = _intra_chunk_backward(ic, q_BHUCK, k_BHUCK, v_BHUCV, beta_BHUC1, state_grads,
                                                      du_BHUCV)
        return dq, dk, dv, dg, dbeta, dS_BHKV, None
