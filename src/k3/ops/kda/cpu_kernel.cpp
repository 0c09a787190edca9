// The chunkwise KDA core for CPUs (docs/architecture.md §3.5, §3.6): the algorithm of `function.py`'s
// `ChunkKDAFunction` for K3's bounded gates, one (batch, head) at a time and one chunk at a time, so every
// intermediate lives in a few chunk-sized buffers that stay in the core's cache. Matrix products go to the BLAS that
// PyTorch links (`k3::gemm`, kernel_math.h); the element-wise steps are plain loops the compiler vectorises.
//
// Decays come as products of e^g (given, from PyTorch's vectorised exp) instead of exponentials of sums: e^{b_r} is
// the running product of e^{g_i}, e^{b_a − b_j} the product of the e^{g_i} in between. A product that falls below
// ε² (ε the dtype's machine epsilon) is flushed to 0, as `_exp_decay` does, so nothing reaches subnormal numbers.
// Only bounded gates (every 16-token sub-chunk decays by at most e^80): the reciprocal factors of the diagonal
// blocks stay finite; `cpu.py` checks the bound and otherwise uses the torch path.
//
// Shape suffixes as in function.py: U chunks of C tokens, sub-chunks of Z, u = C / Z of them per chunk.
//
// The end of the file holds the layer's short convolution of many tokens, forward and backward (k3/ops/kda/conv.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "kernel_math.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using k3::gemm;

template <typename T> T flushed(T x) {  // 0 below ε², as `_exp_decay`
  constexpr T eps = std::numeric_limits<T>::epsilon();
  return x < eps * eps ? T(0) : x;
}

// out[i] = a[i] * b[i] over n numbers
template <typename T> void mul(T *out, const T *a, const T *b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

struct Sizes {
  int64_t C, K, V, Z, u;
};

// The inputs of one chunk of one (batch, head): q (scaled), k, e^g [C,K], v [C,V], β [C].
template <typename T> struct ChunkIn {
  const T *q, *k, *eg, *v, *beta;
};

// §3.5 steps 1–3 and 5 for one chunk: everything that does not depend on the state (`_intra_chunk`).
template <typename T> struct IntraChunk {
  Sizes s;
  std::vector<T> decay, to_end;  // e^{b_r}, e^{b_C − b_r} [C,K]
  std::vector<T> rows;           // e^{b_r − b_a}, a the first row of r's sub-chunk [C,K]
  std::vector<T> cols, k_cols;   // per anchor sub-chunk a: e^{b_a − b_j} (j up to the end of a's sub-chunk);
                                 // k ⊙ it [u,C,K]
  std::vector<T> x_rows;         // per sub-chunk: q ⊙ rows, then k ⊙ rows [u,2Z,K]
  std::vector<T> M, P, Tm;       // query–key scores (j ≤ r), key–key scores (j < r), (I + Diag(β) P)⁻¹ [C,C]
  std::vector<T> W, Uv;          // T·Diag(β)·(e^b ⊙ K) [C,K], T·Diag(β)·V [C,V]
  std::vector<T> after, span, scratch;

  explicit IntraChunk(Sizes s)
      : s(s), decay(s.C * s.K), to_end(s.C * s.K), rows(s.C * s.K), cols(s.u * s.C * s.K), k_cols(s.u * s.C * s.K),
        x_rows(s.u * 2 * s.Z * s.K), M(s.C * s.C), P(s.C * s.C), Tm(s.C * s.C), W(s.C * s.K), Uv(s.C * s.V),
        after(s.C * s.K), span(s.K), scratch(2 * s.Z * s.C + s.C * std::max(s.K, s.V)) {}

  void compute(const ChunkIn<T> &in) {
    const int64_t C = s.C, K = s.K;
    // e^{b_r} = Π_{i≤r} e^{g_i}; e^{b_C − b_r} = Π_{i>r} e^{g_i}
    for (int64_t c = 0; c < K; ++c) decay[c] = flushed(in.eg[c]);
    for (int64_t r = 1; r < C; ++r)
      for (int64_t c = 0; c < K; ++c) decay[r * K + c] = flushed(decay[(r - 1) * K + c] * in.eg[r * K + c]);
    for (int64_t c = 0; c < K; ++c) to_end[(C - 1) * K + c] = T(1);
    for (int64_t r = C - 2; r >= 0; --r)
      for (int64_t c = 0; c < K; ++c) to_end[r * K + c] = flushed(to_end[(r + 1) * K + c] * in.eg[(r + 1) * K + c]);
    score_factors(in);
    decayed_scores(in);
    wy_representation(in);
  }

  // `_score_factors`, bounded gates: rows e^{b_r − b_a}; columns e^{b_a − b_j}: the product of the e^g in between
  // for j in an earlier sub-chunk s (within s, then across the sub-chunks up to the anchor), 1 / rows for j in a.
  void score_factors(const ChunkIn<T> &in) {
    const int64_t C = s.C, K = s.K, Z = s.Z;
    for (int64_t a0 = 0; a0 < C; a0 += Z) {
      for (int64_t c = 0; c < K; ++c) rows[a0 * K + c] = T(1);
      for (int64_t r = a0 + 1; r < a0 + Z; ++r)
        for (int64_t c = 0; c < K; ++c) rows[r * K + c] = rows[(r - 1) * K + c] * in.eg[r * K + c];
      // after[j] = e^{b_e − b_j}, e the last row of j's sub-chunk
      for (int64_t c = 0; c < K; ++c) after[(a0 + Z - 1) * K + c] = T(1);
      for (int64_t j = a0 + Z - 2; j >= a0; --j)
        for (int64_t c = 0; c < K; ++c) after[j * K + c] = flushed(after[(j + 1) * K + c] * in.eg[(j + 1) * K + c]);
    }
    for (int64_t a = 0; a < s.u; ++a) {
      const int64_t a0 = a * Z;
      T *cols_a = cols.data() + a * C * K;
      for (int64_t j = a0; j < a0 + Z; ++j)  // the anchor's own sub-chunk: e^{−(b_j − b_a)} ≤ e^80
        for (int64_t c = 0; c < K; ++c) cols_a[j * K + c] = T(1) / rows[j * K + c];
      for (int64_t c = 0; c < K; ++c) span[c] = flushed(in.eg[a0 * K + c]);  // e^{b_a − b_e}, e the end of s = a − 1
      for (int64_t s0 = a0 - Z; s0 >= 0; s0 -= Z) {
        for (int64_t j = s0; j < s0 + Z; ++j)
          for (int64_t c = 0; c < K; ++c) cols_a[j * K + c] = flushed(span[c] * after[j * K + c]);
        for (int64_t c = 0; c < K; ++c)  // across the whole sub-chunk s: e^{g_{s0}} · e^{b_e − b_{s0}}
          span[c] = flushed(span[c] * in.eg[s0 * K + c] * after[s0 * K + c]);
      }
      mul(k_cols.data() + a * C * K, in.k, cols_a, (a0 + Z) * K);
    }
  }

  // `_decayed_scores`: per sub-chunk a, (q ⊙ rows ‖ k ⊙ rows) (k ⊙ cols)ᵀ over the columns up to a's end.
  void decayed_scores(const ChunkIn<T> &in) {
    const int64_t C = s.C, K = s.K, Z = s.Z;
    T *out = scratch.data();  // [2Z, C]
    for (int64_t a = 0; a < s.u; ++a) {
      const int64_t a0 = a * Z, n = a0 + Z;
      T *x = x_rows.data() + a * 2 * Z * K;
      mul(x, in.q + a0 * K, rows.data() + a0 * K, Z * K);
      mul(x + Z * K, in.k + a0 * K, rows.data() + a0 * K, Z * K);
      gemm(false, true, 2 * Z, n, K, T(1), x, K, k_cols.data() + a * C * K, K, T(0), out, C);
      for (int64_t i = 0; i < Z; ++i) {
        const int64_t r = a0 + i;
        for (int64_t j = 0; j < C; ++j) {
          M[r * C + j] = j <= r ? out[i * C + j] : T(0);
          P[r * C + j] = j < r ? out[(Z + i) * C + j] : T(0);
        }
      }
    }
  }

  // `_wy_representation`: T = (I + A)⁻¹ by forward substitution (A = Diag(β) P, strictly lower), then W, U.
  void wy_representation(const ChunkIn<T> &in) {
    const int64_t C = s.C, K = s.K, V = s.V;
    std::fill(Tm.begin(), Tm.end(), T(0));
    for (int64_t r = 0; r < C; ++r) {
      T *t_r = Tm.data() + r * C;
      t_r[r] = T(1);
      for (int64_t i = 0; i < r; ++i) {  // row r of T: e_r − Σ_{i<r} A[r,i] T[i]
        const T a = in.beta[r] * P[r * C + i];
        const T *t_i = Tm.data() + i * C;
        for (int64_t j = 0; j <= i; ++j) t_r[j] -= a * t_i[j];
      }
    }
    T *x = scratch.data();
    for (int64_t r = 0; r < C; ++r)
      for (int64_t c = 0; c < K; ++c) x[r * K + c] = in.beta[r] * decay[r * K + c] * in.k[r * K + c];
    gemm(false, false, C, K, C, T(1), Tm.data(), C, x, K, T(0), W.data(), K);
    for (int64_t r = 0; r < C; ++r)
      for (int64_t c = 0; c < V; ++c) x[r * V + c] = in.beta[r] * in.v[r * V + c];
    gemm(false, false, C, V, C, T(1), Tm.data(), C, x, V, T(0), Uv.data(), V);
  }
};

// Where the rows of chunk n of item (b, h) lie in the token-major inputs and outputs [B, T, H, X] (T = U·C, X = K,
// V or 1 for β): C rows of X numbers, H·X apart. A chunk's rows are copied into (and its results out of) contiguous
// [C, X] blocks, so no transposed copy of the whole sequence is ever made.
struct Layout {
  int64_t U, C, H;
  int64_t row(int64_t bh, int64_t n, int64_t X) const { return (((bh / H) * U * C + n * C) * H + bh % H) * X; }
  int64_t kv(int64_t bh, int64_t n, int64_t K, int64_t V) const { return (bh * U + n) * K * V; }
  template <typename T> void gather(const T *src, int64_t bh, int64_t n, int64_t X, T *dst) const {
    const T *from = src + row(bh, n, X);
    for (int64_t r = 0; r < C; ++r) std::copy(from + r * H * X, from + r * H * X + X, dst + r * X);
  }
  template <typename T> void scatter(const T *src, int64_t bh, int64_t n, int64_t X, T *dst) const {
    T *to = dst + row(bh, n, X);
    for (int64_t r = 0; r < C; ++r) std::copy(src + r * X, src + (r + 1) * X, to + r * H * X);
  }
};

// One chunk's inputs in contiguous blocks (see Layout)
template <typename T> struct ChunkBuffers {
  std::vector<T> q, k, eg, v, beta;
  explicit ChunkBuffers(const Sizes &s) : q(s.C * s.K), k(s.C * s.K), eg(s.C * s.K), v(s.C * s.V), beta(s.C) {}
  ChunkIn<T> load(const Layout &L, const Sizes &s, int64_t bh, int64_t n, const T *q_, const T *k_, const T *eg_,
                  const T *v_, const T *beta_) {
    L.gather(q_, bh, n, s.K, q.data());
    L.gather(k_, bh, n, s.K, k.data());
    L.gather(eg_, bh, n, s.K, eg.data());
    L.gather(v_, bh, n, s.V, v.data());
    L.gather(beta_, bh, n, 1, beta.data());
    return {q.data(), k.data(), eg.data(), v.data(), beta.data()};
  }
};

template <typename T>
void forward_item(int64_t bh, const Layout &L, const Sizes &s, const T *q, const T *k, const T *eg, const T *v,
                  const T *beta, const T *keep, T *S, T *S_in, T *o) {
  const int64_t C = s.C, K = s.K, V = s.V, H = L.H;
  IntraChunk<T> ic(s);
  ChunkBuffers<T> buf(s);
  std::vector<T> ut(C * V), qd(C * K), kt(C * K), o_n(C * V);
  for (int64_t n = 0; n < L.U; ++n) {
    if (keep != nullptr && keep[(bh / H) * L.U + n] == T(0)) std::fill(S, S + K * V, T(0));
    std::copy(S, S + K * V, S_in + L.kv(bh, n, K, V));
    const ChunkIn<T> in = buf.load(L, s, bh, n, q, k, eg, v, beta);
    ic.compute(in);
    std::copy(ic.Uv.begin(), ic.Uv.end(), ut.begin());
    gemm(false, false, C, V, K, T(-1), ic.W.data(), K, S, V, T(1), ut.data(), V);  // Ũ = U − W S
    mul(qd.data(), in.q, ic.decay.data(), C * K);
    gemm(false, false, C, V, K, T(1), qd.data(), K, S, V, T(0), o_n.data(), V);  // O = (Q ⊙ e^b) S + M Ũ
    gemm(false, false, C, V, C, T(1), ic.M.data(), C, ut.data(), V, T(1), o_n.data(), V);
    L.scatter(o_n.data(), bh, n, V, o);
    const T *decay_end = ic.decay.data() + (C - 1) * K;  // S ← Diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ Ũ
    for (int64_t c = 0; c < K; ++c)
      for (int64_t j = 0; j < V; ++j) S[c * V + j] *= decay_end[c];
    mul(kt.data(), in.k, ic.to_end.data(), C * K);
    gemm(true, false, K, V, C, T(1), kt.data(), K, ut.data(), V, T(1), S, V);
  }
}

// The gradients of one chunk, given dO and dS' (the gradient of the state leaving it); see function.py's backward.
template <typename T> struct ChunkBackward {
  Sizes s;
  IntraChunk<T> ic;
  std::vector<T> ut, du, qd, kt, dq_dec, dk_end, dM, dW, dXk, dXv, dA, dq_M, dk_row, dk_col, part;
  std::vector<T> ddecay_end, db_end;

  explicit ChunkBackward(Sizes s)
      : s(s), ic(s), ut(s.C * s.V), du(s.C * s.V), qd(s.C * s.K), kt(s.C * s.K), dq_dec(s.C * s.K),
        dk_end(s.C * s.K), dM(s.C * s.C), dW(s.C * s.K), dXk(s.C * s.K), dXv(s.C * s.V), dA(s.C * s.C),
        dq_M(s.C * s.K), dk_row(s.C * s.K), dk_col(s.C * s.K), part(s.C * s.K), ddecay_end(s.K), db_end(s.K) {}

  // dS (in/out): on entry the gradient of the state leaving the chunk, on exit that of the state entering it.
  void run(const ChunkIn<T> &in, const T *S_in, const T *dO, T *dS, T *dq, T *dk, T *dv, T *dg, T *dbeta) {
    const int64_t C = s.C, K = s.K, V = s.V;
    ic.compute(in);
    std::copy(ic.Uv.begin(), ic.Uv.end(), ut.begin());
    gemm(false, false, C, V, K, T(-1), ic.W.data(), K, S_in, V, T(1), ut.data(), V);  // Ũ = U − W S
    mul(qd.data(), in.q, ic.decay.data(), C * K);
    mul(kt.data(), in.k, ic.to_end.data(), C * K);
    // the state's factors (`_state_backward`), read before dS is overwritten
    gemm(false, true, C, K, V, T(1), dO, V, S_in, V, T(0), dq_dec.data(), K);      // d(Q ⊙ e^b) = dO Sᵀ
    gemm(false, true, C, K, V, T(1), ut.data(), V, dS, V, T(0), dk_end.data(), K);  // d(K ⊙ e^{b_C − b}) = Ũ dS'ᵀ
    for (int64_t c = 0; c < K; ++c) {  // d e^{b_C} = rowsum(S ⊙ dS')
      T acc = 0;
      for (int64_t j = 0; j < V; ++j) acc += S_in[c * V + j] * dS[c * V + j];
      ddecay_end[c] = acc;
    }
    gemm(false, true, C, C, V, T(1), dO, V, ut.data(), V, T(0), dM.data(), C);  // dM = dO Ũᵀ (j ≤ r below)
    // dŨ = Mᵀ dO + (K ⊙ e^{b_C − b}) dS'
    gemm(true, false, C, V, C, T(1), ic.M.data(), C, dO, V, T(0), du.data(), V);
    gemm(false, false, C, V, K, T(1), kt.data(), K, dS, V, T(1), du.data(), V);
    // dS ← (Q ⊙ e^b)ᵀ dO + Diag(e^{b_C}) dS' − Wᵀ dŨ
    const T *decay_end = ic.decay.data() + (C - 1) * K;
    for (int64_t c = 0; c < K; ++c)
      for (int64_t j = 0; j < V; ++j) dS[c * V + j] *= decay_end[c];
    gemm(true, false, K, V, C, T(1), qd.data(), K, dO, V, T(1), dS, V);
    gemm(true, false, K, V, C, T(-1), ic.W.data(), K, du.data(), V, T(1), dS, V);
    gemm(false, true, C, K, V, T(-1), du.data(), V, S_in, V, T(0), dW.data(), K);  // dW = −dŨ Sᵀ
    intra_backward(in, dq, dk, dv, dg, dbeta);
  }

  void intra_backward(const ChunkIn<T> &in, T *dq, T *dk, T *dv, T *dg, T *dbeta) {
    const int64_t C = s.C, K = s.K, V = s.V;
    // `_wy_backward`: dX = Tᵀ d[W ‖ U], dA = −(dX_k Wᵀ + dX_v Uᵀ) for j < r
    gemm(true, false, C, K, C, T(1), ic.Tm.data(), C, dW.data(), K, T(0), dXk.data(), K);
    gemm(true, false, C, V, C, T(1), ic.Tm.data(), C, du.data(), V, T(0), dXv.data(), V);
    gemm(false, true, C, C, K, T(-1), dXk.data(), K, ic.W.data(), K, T(0), dA.data(), C);
    gemm(false, true, C, C, V, T(-1), dXv.data(), V, ic.Uv.data(), V, T(1), dA.data(), C);
    for (int64_t r = 0; r < C; ++r) {  // dβ (X_k = Diag(β)(e^b ⊙ K), X_v = Diag(β) V, A = Diag(β) P); dP = Diag(β) dA
      T acc = 0;
      for (int64_t c = 0; c < K; ++c) acc += dXk[r * K + c] * ic.decay[r * K + c] * in.k[r * K + c];
      for (int64_t c = 0; c < V; ++c) acc += dXv[r * V + c] * in.v[r * V + c];
      for (int64_t j = 0; j < r; ++j) acc += dA[r * C + j] * ic.P[r * C + j];
      dbeta[r] = acc;
      for (int64_t j = 0; j < C; ++j) {
        dA[r * C + j] = j < r ? in.beta[r] * dA[r * C + j] : T(0);
        dM[r * C + j] = j <= r ? dM[r * C + j] : T(0);
      }
      for (int64_t c = 0; c < V; ++c) dv[r * V + c] = in.beta[r] * dXv[r * V + c];
    }
    scores_backward();
    // dq, dk and ∂/∂b_r (e^{b_r} in Q ⊙ e^b and X_k; b_r − b_j in M and P; b_C − b_r in K ⊙ e^{b_C − b}), then
    // ∂/∂g_i = Σ_{r ≥ i} ∂/∂b_r with b_C's own gradient on the last row
    std::fill(db_end.begin(), db_end.end(), T(0));
    for (int64_t r = 0; r < C; ++r) {
      const T b = in.beta[r];
      for (int64_t c = 0; c < K; ++c) {
        const int64_t i = r * K + c;
        const T e = ic.decay[i], kk = in.k[i];
        const T dqi = e * dq_dec[i] + dq_M[i];
        const T to_end = kk * ic.to_end[i] * dk_end[i];
        dq[i] = dqi;
        dk[i] = dk_row[i] + dk_col[i] + b * e * dXk[i] + ic.to_end[i] * dk_end[i];
        dg[i] = in.q[i] * dqi + b * kk * e * dXk[i] + kk * (dk_row[i] - dk_col[i]) - to_end;
        db_end[c] += to_end;
      }
    }
    for (int64_t c = 0; c < K; ++c) dg[(C - 1) * K + c] += db_end[c] + ic.decay[(C - 1) * K + c] * ddecay_end[c];
    for (int64_t r = C - 2; r >= 0; --r)
      for (int64_t c = 0; c < K; ++c) dg[r * K + c] += dg[(r + 1) * K + c];
  }

  // `_decayed_scores_backward` at fixed decays: per sub-chunk a, dx = (d (k ⊙ cols)) ⊙ rows for its q and k rows,
  // dk_cols += (dᵀ (x ⊙ rows)) ⊙ cols over the columns up to a's end. d = dM for q's rows, dP for k's.
  void scores_backward() {
    const int64_t C = s.C, K = s.K, Z = s.Z;
    std::fill(dk_col.begin(), dk_col.end(), T(0));
    for (int64_t a = 0; a < s.u; ++a) {
      const int64_t a0 = a * Z, n = a0 + Z;
      const T *kc = ic.k_cols.data() + a * C * K, *x = ic.x_rows.data() + a * 2 * Z * K;
      const T *rows = ic.rows.data() + a0 * K;
      gemm(false, false, Z, K, n, T(1), dM.data() + a0 * C, C, kc, K, T(0), dq_M.data() + a0 * K, K);
      gemm(false, false, Z, K, n, T(1), dA.data() + a0 * C, C, kc, K, T(0), dk_row.data() + a0 * K, K);
      for (int64_t i = 0; i < Z * K; ++i) {
        dq_M[a0 * K + i] *= rows[i];
        dk_row[a0 * K + i] *= rows[i];
      }
      gemm(true, false, n, K, Z, T(1), dM.data() + a0 * C, C, x, K, T(0), part.data(), K);
      gemm(true, false, n, K, Z, T(1), dA.data() + a0 * C, C, x + Z * K, K, T(1), part.data(), K);
      const T *cols = ic.cols.data() + a * C * K;
      for (int64_t i = 0; i < n * K; ++i) dk_col[i] += part[i] * cols[i];
    }
  }
};

template <typename T>
void backward_item(int64_t bh, const Layout &L, const Sizes &s, const T *q, const T *k, const T *eg, const T *v,
                   const T *beta, const T *keep, const T *S_in, const T *dO, T *dS, T *dq, T *dk, T *dv, T *dg,
                   T *dbeta) {
  const int64_t C = s.C, K = s.K, V = s.V;
  ChunkBackward<T> cb(s);
  ChunkBuffers<T> buf(s);
  std::vector<T> dO_n(C * V), dq_n(C * K), dk_n(C * K), dv_n(C * V), dg_n(C * K), dbeta_n(C);
  for (int64_t n = L.U - 1; n >= 0; --n) {
    const ChunkIn<T> in = buf.load(L, s, bh, n, q, k, eg, v, beta);
    L.gather(dO, bh, n, V, dO_n.data());
    cb.run(in, S_in + L.kv(bh, n, K, V), dO_n.data(), dS, dq_n.data(), dk_n.data(), dv_n.data(), dg_n.data(),
           dbeta_n.data());
    L.scatter(dq_n.data(), bh, n, K, dq);
    L.scatter(dk_n.data(), bh, n, K, dk);
    L.scatter(dv_n.data(), bh, n, V, dv);
    L.scatter(dg_n.data(), bh, n, K, dg);
    L.scatter(dbeta_n.data(), bh, n, 1, dbeta);
    if (keep != nullptr && keep[(bh / L.H) * L.U + n] == T(0)) std::fill(dS, dS + K * V, T(0));
  }
}

Sizes sizes_of(const torch::Tensor &q, const torch::Tensor &v, int64_t C, int64_t Z) {
  return Sizes{C, q.size(3), v.size(3), Z, C / Z};
}

void check(const std::vector<torch::Tensor> &ts, const torch::Tensor &keep) {
  for (const auto &t : ts) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == ts[0].scalar_type(),
                "kda cpu kernel: inputs must be contiguous CPU tensors of one dtype");
  }
  TORCH_CHECK(!keep.defined() || (keep.is_contiguous() && keep.scalar_type() == ts[0].scalar_type()),
              "kda cpu kernel: keep must be contiguous in the compute dtype");
}

// The layout every entry point checks: q, k, e^g [B,T,H,K], v [B,T,H,V], β [B,T,H], T a multiple of C, C of Z
Layout layout_of(const torch::Tensor &q, const torch::Tensor &v, const torch::Tensor &beta, int64_t C, int64_t Z) {
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4 && beta.dim() == 3 && C > 0 && Z > 0 && C % Z == 0 &&
                  q.size(1) % C == 0 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3) &&
                  beta.sizes() == q.sizes().slice(0, 3),
              "kda cpu kernel: q, k, e^g [B,T,H,K], v [B,T,H,V], beta [B,T,H] with T a multiple of the chunk size");
  return Layout{q.size(1) / C, C, q.size(2)};
}

// (o [B,T,H,V], final state [B,H,K,V], state entering every chunk [B,H,U,K,V])
std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor eg,
                                   torch::Tensor beta, torch::Tensor S0, c10::optional<torch::Tensor> keep_opt,
                                   int64_t C, int64_t Z) {
  const torch::Tensor keep = keep_opt.has_value() ? keep_opt.value() : torch::Tensor();
  check({q, k, v, eg, beta, S0}, keep);
  const Layout L = layout_of(q, v, beta, C, Z);
  const int64_t B = q.size(0), H = L.H, U = L.U;
  const Sizes s = sizes_of(q, v, C, Z);
  auto o = torch::empty_like(v);
  auto S = S0.clone();
  auto S_in = torch::empty({B, H, U, s.K, s.V}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "kda_cpu_forward", [&] {
    const scalar_t *keep_p = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh)
        forward_item<scalar_t>(bh, L, s, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), eg.data_ptr<scalar_t>(),
                               v.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), keep_p,
                               S.data_ptr<scalar_t>() + bh * s.K * s.V, S_in.data_ptr<scalar_t>(),
                               o.data_ptr<scalar_t>());
    });
  });
  return {o, S, S_in};
}

// (dq, dk, dv, dg, dβ, dS0)
std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor eg,
                                    torch::Tensor beta, torch::Tensor S_in, c10::optional<torch::Tensor> keep_opt,
                                    torch::Tensor dO, torch::Tensor dS_end, int64_t C, int64_t Z) {
  const torch::Tensor keep = keep_opt.has_value() ? keep_opt.value() : torch::Tensor();
  check({q, k, v, eg, beta, S_in, dO, dS_end}, keep);
  const Layout L = layout_of(q, v, beta, C, Z);
  TORCH_CHECK(dO.sizes() == v.sizes(), "kda cpu kernel: dO must have v's shape");
  const int64_t B = q.size(0), H = L.H;
  const Sizes s = sizes_of(q, v, C, Z);
  auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v), dg = torch::empty_like(eg);
  auto dbeta = torch::empty_like(beta);
  auto dS = dS_end.clone();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "kda_cpu_backward", [&] {
    const scalar_t *keep_p = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh)
        backward_item<scalar_t>(bh, L, s, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), eg.data_ptr<scalar_t>(),
                                v.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), keep_p, S_in.data_ptr<scalar_t>(),
                                dO.data_ptr<scalar_t>(), dS.data_ptr<scalar_t>() + bh * s.K * s.V,
                                dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                                dg.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>());
    });
  });
  return {dq, dk, dv, dg, dbeta, dS};
}

// ---------------------------------------------------------------------------------------------- short convolution
// KDA's causal depthwise convolution + SiLU (k3.ops.kda.conv.short_conv, §3.2 step 2) for many tokens, fp32, each way
// one pass over the positions. x [B, T+W−1, P] holds the W−1 context inputs, then the T new ones; w [W, P] (tap-major);
// tap j of output t reads input t+j — not at all, with document ids [B, T], where that input is a context input
// or belongs to another document than output t (packed rows, §3.8).
//   y_t = silu(u_t), u_t = Σ_j w_j ⊙ x_{t+j}
//   du_t = dy_t ⊙ σ(u_t) (1 + u_t (1 − σ(u_t))),  dx_s = Σ_j w_j ⊙ du_{s−j},  dw_j = Σ_t du_t ⊙ x_{t+j}
// (dw: k3::ThreadSums)
struct ShortConv {
  const float *x, *w;
  const int64_t *doc;
  int64_t B, T, W, P;

  ShortConv(const torch::Tensor &x_, const torch::Tensor &w_, const c10::optional<torch::Tensor> &doc_)
      : x(x_.data_ptr<float>()), w(w_.data_ptr<float>()), doc(doc_ ? doc_->data_ptr<int64_t>() : nullptr),
        B(x_.size(0)), T(x_.size(1) - w_.size(0) + 1), W(w_.size(0)), P(x_.size(2)) {
    TORCH_CHECK(x_.scalar_type() == torch::kFloat && w_.scalar_type() == torch::kFloat && x_.is_contiguous() &&
                    w_.is_contiguous() && x_.dim() == 3 && w_.dim() == 2 && w_.size(1) == P && T >= 1,
                "short conv kernel: x [B, T+W−1, P] and w [W, P], contiguous fp32");
    TORCH_CHECK(!doc_ || (doc_->scalar_type() == torch::kLong && doc_->is_contiguous() && doc_->numel() == B * T),
                "short conv kernel: document ids [B, T], contiguous int64");
  }
  bool reads(int64_t b, int64_t t, int64_t j) const {  // whether tap j of output t reads input t+j
    const int64_t s = t + j - (W - 1);  // that input among the new tokens (< 0: a context input)
    return doc == nullptr || (s >= 0 && doc[b * T + s] == doc[b * T + t]);
  }
  const float *input(int64_t b, int64_t i) const { return x + (b * (T + W - 1) + i) * P; }
  void pre_activation(int64_t b, int64_t t, float *u) const {  // u = Σ_j w_j ⊙ x_{t+j}
    std::fill(u, u + P, 0.f);
    for (int64_t j = 0; j < W; ++j) {
      if (!reads(b, t, j)) continue;
      const float *xr = input(b, t + j), *wj = w + j * P;
#pragma omp simd
      for (int64_t p = 0; p < P; ++p) u[p] += wj[p] * xr[p];
    }
  }
};

constexpr int64_t kConvRows = 8;  // positions per task

torch::Tensor short_conv_forward(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> doc) {
  using Vec = at::vec::Vectorized<float>;
  const ShortConv conv(x, w, doc);
  auto y = torch::empty({conv.B, conv.T, conv.P}, x.options());
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, conv.B * conv.T, kConvRows, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      float *yr = yp + bt * conv.P;
      conv.pre_activation(bt / conv.T, bt % conv.T, yr);
      at::vec::map([](Vec u) { return u / (Vec(1.f) + u.neg().exp()); }, yr, yr, conv.P);
    }
  });
  return y;
}

// dx [B, T+W−1, P] and dw [W, P]
std::vector<torch::Tensor> short_conv_backward(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> doc,
                                               torch::Tensor dy) {
  using Vec = at::vec::Vectorized<float>;
  const ShortConv conv(x, w, doc);
  const int64_t B = conv.B, T = conv.T, W = conv.W, P = conv.P, S = T + W - 1;
  TORCH_CHECK(dy.is_contiguous() && dy.scalar_type() == torch::kFloat && dy.numel() == B * T * P,
              "short conv kernel: dy [B, T, P], contiguous fp32");
  auto du = torch::empty({B, T, P}, x.options());
  const float *dyp = dy.data_ptr<float>();
  float *dup = du.data_ptr<float>();
  at::parallel_for(0, B * T, kConvRows, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      float *dur = dup + bt * P;
      conv.pre_activation(bt / T, bt % T, dur);
      at::vec::map2([](Vec u, Vec d) {
        const Vec sig = Vec(1.f) / (Vec(1.f) + u.neg().exp());
        return d * sig * (Vec(1.f) + u * (Vec(1.f) - sig));
      }, dur, dur, dyp + bt * P, P);
    }
  });
  auto dx = torch::empty_like(x);
  k3::ThreadSums dw_sums(W * P);
  float *dxp = dx.data_ptr<float>();
  at::parallel_for(0, B * S, kConvRows, [&](int64_t begin, int64_t end) {
    double *dw = dw_sums.mine();
    for (int64_t bs = begin; bs < end; ++bs) {
      const int64_t b = bs / S, s = bs % S;
      float *dxr = dxp + bs * P;
      const float *xr = conv.input(b, s);
      std::fill(dxr, dxr + P, 0.f);
      for (int64_t j = 0; j < W; ++j) {
        const int64_t t = s - j;  // the output whose tap j reads input s
        if (t < 0 || t >= T || !conv.reads(b, t, j)) continue;
        const float *dur = dup + (b * T + t) * P, *wj = conv.w + j * P;
        double *dwj = dw + j * P;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) {
          dxr[p] += wj[p] * dur[p];
          dwj[p] += dur[p] * xr[p];
        }
      }
    }
  });
  return {dx, dw_sums.total().view({W, P})};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "chunkwise KDA forward (bounded gates)");
  m.def("backward", &backward, "chunkwise KDA backward (bounded gates)");
  m.def("short_conv_forward", &short_conv_forward, "KDA short convolution + SiLU of many tokens (fp32)");
  m.def("short_conv_backward", &short_conv_backward, "its backward: dx (context included), dw [W, P] (fp32)");
}
