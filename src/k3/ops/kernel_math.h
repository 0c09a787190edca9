// Helpers shared by the compiled CPU kernels of k3/ops (see k3/ops/compiled.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" {
void sgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k, const float *alpha,
            const float *a, const int *lda, const float *b, const int *ldb, const float *beta, float *c,
            const int *ldc);
void dgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k, const double *alpha,
            const double *a, const int *lda, const double *b, const int *ldb, const double *beta, double *c,
            const int *ldc);
}

namespace k3 {

// Row-major C[m×n] = alpha · op(A)[m×k] · op(B)[k×n] + beta · C (op = transpose when ta / tb), through the
// column-major BLAS: the row-major C is the column-major Cᵀ = op(B)ᵀ op(A)ᵀ.
inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float *A, int lda, const float *B,
                 int ldb, float beta, float *C, int ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  sgemm_(&tB, &tA, &n, &m, &k, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double *A, int lda, const double *B,
                 int ldb, double beta, double *C, int ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  dgemm_(&tB, &tA, &n, &m, &k, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// One vector of fp32 values from p: fp32 as stored, bf16 widened by a 16-bit shift (exact, so a bf16 weight's
// products are the fp32 products of its values; ATen's conversion for the capability the kernel is built for)
inline at::vec::Vectorized<float> load(const float *p) { return at::vec::Vectorized<float>::loadu(p); }
inline at::vec::Vectorized<float> load(const c10::BFloat16 *p) {
  at::vec::Vectorized<float> v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
}

// the first n ≤ Vectorized<float>::size() values of p, the other lanes 0
inline at::vec::Vectorized<float> load(const float *p, int64_t n) { return at::vec::Vectorized<float>::loadu(p, n); }
inline at::vec::Vectorized<float> load(const c10::BFloat16 *p, int64_t n) {
  __at_align__ float v[at::vec::Vectorized<float>::size()] = {};
  std::copy(p, p + n, v);
  return at::vec::Vectorized<float>::loadu(v);
}

// Σ_j a[j] b[j] in fp32 over four vector accumulators: independent FMA chains, so a product of a few rows runs at
// the speed memory streams a weight row, not at the latency of one chain (2–2.4× for weights in cache, measured);
// b fp32 or bf16 (a weight row as stored)
template <typename T>
inline float dot(const float *a, const T *b, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t j = 0;
  for (; j + 4 * V <= n; j += 4 * V) {
    s0 = at::vec::fmadd(Vec::loadu(a + j), load(b + j), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + j + V), load(b + j + V), s1);
    s2 = at::vec::fmadd(Vec::loadu(a + j + 2 * V), load(b + j + 2 * V), s2);
    s3 = at::vec::fmadd(Vec::loadu(a + j + 3 * V), load(b + j + 3 * V), s3);
  }
  for (; j + V <= n; j += V) s0 = at::vec::fmadd(Vec::loadu(a + j), load(b + j), s0);  // whole vectors left
  float acc = at::vec::vec_reduce_all<float>([](Vec &x, Vec &y) { return x + y; }, (s0 + s1) + (s2 + s3));
  for (; j < n; ++j) acc = std::fma(a[j], static_cast<float>(b[j]), acc);  // (see rows_dot_block)
  return acc;
}

// y[k] = Σ_j w[k·in + j] x[j] for R consecutive rows of w (fp32 or bf16), one vector accumulator each: each row's sum
// is taken in the same order whatever R, so a row's value does not depend on how the rows were split into blocks.
// A block prefetches the next one (the same place R rows on): the hardware follows one stream per 4 KiB page, and a
// block of short rows has several in one page (k3-small's 512-wide bf16 rows streamed 1.6× faster, fp32 the same).
template <int64_t R, typename T>
inline void rows_dot_block(const T *w, int64_t in, const float *x, float *y) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec s[R];
  for (int64_t k = 0; k < R; ++k) s[k] = Vec(0.f);
  int64_t j = 0;
  for (; j + V <= in; j += V) {
    const Vec xv = Vec::loadu(x + j);
    for (int64_t k = 0; k < R; ++k) {
      if (R > 1) __builtin_prefetch(w + (R + k) * in + j);
      s[k] = at::vec::fmadd(load(w + k * in + j), xv, s[k]);
    }
  }
  for (int64_t k = 0; k < R; ++k) {
    float acc = at::vec::vec_reduce_all<float>([](Vec &a, Vec &b) { return a + b; }, s[k]);
    // an explicit fma: the compiler would vectorise the products of an fp32 tail of 8 or more and add them one by
    // one, so the same sum would round differently for fp32 and bf16 weights
    for (int64_t t = j; t < in; ++t) acc = std::fma(static_cast<float>(w[k * in + t]), x[t], acc);
    y[k] = acc;
  }
}

constexpr int64_t kRowBlock = 8;  // weight rows read together by rows_dot (and the loops that feed it)

// y[r] = Σ_j W[r·in + j] x[j] for the `rows` consecutive rows of W (row stride `in`), kRowBlock rows at a time: eight
// weight streams in flight instead of one (decoding is bound by the weight traffic; 1.04–1.5× the throughput of one
// row after another on a 2-core Xeon, measured), the rest one by one
template <typename T>
inline void rows_dot(const T *W, int64_t rows, int64_t in, const float *x, float *y) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) rows_dot_block<kRowBlock>(W + r * in, in, x, y + r);
  for (; r < rows; ++r) rows_dot_block<1>(W + r * in, in, x, y + r);
}

// y[m][col + k] = Σ_j w[k·in + j] x[m][j] for R consecutive rows of w and M rows x[m] (anywhere): each weight vector
// is loaded once for the M rows, R·M sums in registers; each sum is rows_dot_block's, in the same order, so a value
// does not depend on how many rows were taken together (batched == alone). With `ahead`, the next R rows are
// prefetched as in rows_dot_block.
template <int64_t R, int64_t M, bool ahead, typename T>
inline void rows_dot_tile(const T *w, int64_t in, const float *const *x, float *const *y, int64_t col) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec s[M][R];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < R; ++k) s[m][k] = Vec(0.f);
  int64_t j = 0;
  for (; j + V <= in; j += V) {
    Vec wv[R];
    for (int64_t k = 0; k < R; ++k) {
      if (ahead) __builtin_prefetch(w + (R + k) * in + j);
      wv[k] = load(w + k * in + j);
    }
    for (int64_t m = 0; m < M; ++m) {
      const Vec xv = Vec::loadu(x[m] + j);
      for (int64_t k = 0; k < R; ++k) s[m][k] = at::vec::fmadd(wv[k], xv, s[m][k]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < R; ++k) {
      float acc = at::vec::vec_reduce_all<float>([](Vec &a, Vec &b) { return a + b; }, s[m][k]);
      for (int64_t t = j; t < in; ++t) acc = std::fma(static_cast<float>(w[k * in + t]), x[m][t], acc);
      y[m][col + k] = acc;
    }
}

constexpr int64_t kExpertRows = 16;  // weight rows of one expert a task takes with all of that expert's inputs
constexpr int64_t kTileRows = 4;  // weight rows of a tile of rows_dot_tile: with 3 inputs, 12 sums in registers

// rows_dot_tile of R weight rows at w and the inputs x[0..M) (any M), into y[m][col…]: tiles of 3 inputs, the last
// 4 or 2 as tiles of 2
template <int64_t R, bool ahead, typename T>
inline void rows_dot_inputs(const T *w, int64_t in, const float *const *x, int64_t M, float *const *y, int64_t col) {
  int64_t m = 0;
  if (M >= 3 && M != 4) {
    rows_dot_tile<R, 3, ahead>(w, in, x, y, col);
    for (m = 3; M - m >= 3 && M - m != 4; m += 3) rows_dot_tile<R, 3, false>(w, in, x + m, y + m, col);
  }
  for (; M - m >= 2; m += 2)
    if (m == 0) rows_dot_tile<R, 2, ahead>(w, in, x, y, col);
    else rows_dot_tile<R, 2, false>(w, in, x + m, y + m, col);
  if (m < M) {
    if (m == 0) rows_dot_tile<R, 1, ahead>(w, in, x, y, col);
    else rows_dot_tile<R, 1, false>(w, in, x + m, y + m, col);
  }
}

constexpr int64_t kStreamInputs = 6;  // up to this many inputs, rows_dot_many takes the weight rows one at a time

// rows_dot_tile of the one weight row at w and the M ≤ kStreamInputs inputs x[0..M), into y[m][col]
template <typename T>
inline void row_dot_inputs(const T *w, int64_t in, const float *const *x, int64_t M, float *const *y, int64_t col) {
  switch (M) {
    case 1: return rows_dot_tile<1, 1, false>(w, in, x, y, col);
    case 2: return rows_dot_tile<1, 2, false>(w, in, x, y, col);
    case 3: return rows_dot_tile<1, 3, false>(w, in, x, y, col);
    case 4: return rows_dot_tile<1, 4, false>(w, in, x, y, col);
    case 5: return rows_dot_tile<1, 5, false>(w, in, x, y, col);
    default: return rows_dot_tile<1, 6, false>(w, in, x, y, col);
  }
}

// y[m][r] = Σ_j W[r·in + j] x[m][j] for the `rows` consecutive rows of W and the M rows x[m]. One input: rows_dot.
// A few (2 to kStreamInputs): one weight row after another with all inputs, the products bound by the weight traffic
// and the weights read in address order, one stream the hardware prefetches well (a MoE call of 16 tokens, about 2
// per expert, took 1.085x as long in tiles of 4 rows on the EPYC machine). More: tiles of kTileRows weight rows,
// each read from memory once (by its first tile of inputs, which prefetches the next rows) and taken with every input
// while in cache.
template <typename T>
inline void rows_dot_many(const T *W, int64_t rows, int64_t in, const float *const *x, int64_t M, float *const *y) {
  if (M == 1) return rows_dot(W, rows, in, x[0], y[0]);  // one input: eight weight streams in flight, not four
  if (M <= kStreamInputs) {
    for (int64_t r = 0; r < rows; ++r) row_dot_inputs(W + r * in, in, x, M, y, r);
    return;
  }
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) rows_dot_inputs<kTileRows, true>(W + r * in, in, x, M, y, r);
  for (; r < rows; ++r) rows_dot_inputs<1, false>(W + r * in, in, x, M, y, r);
}

// tanh(y) within 1 ulp of the exact value (0.92 measured against float64 over [-12, 12]) at a fraction of SLEEF's
// cost: |y| < 1: y + y³ P(y²), P of degree 7 fitted by least squares on
// Chebyshev nodes of y² ∈ [0, 1], weighted for relative error; else sign(y) (1 − 2 / (e^{2|y|} + 1)), where nothing
// cancels. A vector without a lane beyond 1 (most SiTU inputs: g/β₁, u/β₂) skips the exponential.
inline at::vec::Vectorized<float> tanh(const at::vec::Vectorized<float> &y) {
  using Vec = at::vec::Vectorized<float>;
  constexpr float P[] = {-0.333333284f, 0.13333191f,    -0.0539523624f, 0.0217818469f,
                         -0.00858901907f, 0.00307145878f, -0.000836785766f, 0.000120391873f};
  const Vec s = y * y;
  Vec p(P[7]);
  for (int i = 6; i >= 0; --i) p = at::vec::fmadd(p, s, Vec(P[i]));
  const Vec small = at::vec::fmadd(y * s, p, y), a = y.abs();
  if (at::vec::vec_reduce_all<float>([](Vec &u, Vec &v) { return at::vec::maximum(u, v); }, a) < 1.f) return small;
  const Vec big = Vec(1.f) - Vec(2.f) / ((a + a).exp() + Vec(1.f));
  return Vec::blendv(Vec::blendv(big, big.neg(), y < Vec(0.f)), small, a < Vec(1.f));
}

// 1 / sqrt(Σ x² / n + ε): n = the width for RMS statistics, 1 for the L2 norm
inline float inverse_norm(const float *x, int64_t width, float n, double eps) {
  return 1.f / std::sqrt(dot(x, x, width) / n + static_cast<float>(eps));
}

// one row of RMSNorm / L2 normalisation (k3.ops.norm): y = x r, times w where given (w ⊙ (x r), the torch ops'
// order; w fp32 or bf16), r = inverse_norm(x); returns r
template <typename W>
inline float normalize_row(const float *x, const W *w, float *y, int64_t width, float n, double eps) {
  const float r = inverse_norm(x, width, n, eps);
  for (int64_t c = 0; c < width; ++c) y[c] = w ? static_cast<float>(w[c]) * (x[c] * r) : x[c] * r;
  return r;
}

// Σ_j a[j] b[j] accumulated in float64 (the AttnRes mix's few scalars per row: the backward's terms cancel)
inline double dot64(const float *a, const float *b, int64_t n) {
  double acc = 0.;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(a[j]) * b[j];
  return acc;
}

// one row of the Block AttnRes mix (k3.model.attn_res): r_s = 1 / sqrt(mean(V_s²) + ε), p = softmax_s(r_s (V_s·q)),
// the scalars in float64 and rounded once, y = Σ_s p_s V_s in the order of the sources; V[s] points at the row of
// source s, p and r get S values each
inline void mix_row(const float *const *V, int64_t S, const float *q, int64_t D, double eps, float *p, float *r,
                    float *y) {
  thread_local std::vector<double> logit;
  logit.resize(S);
  double top = -INFINITY, total = 0.;
  for (int64_t s = 0; s < S; ++s) {
    const double r_s = 1. / std::sqrt(dot64(V[s], V[s], D) / D + eps);
    r[s] = static_cast<float>(r_s);
    logit[s] = dot64(V[s], q, D) * r_s;
    top = std::max(top, logit[s]);
  }
  for (int64_t s = 0; s < S; ++s) total += logit[s] = std::exp(logit[s] - top);
  for (int64_t s = 0; s < S; ++s) p[s] = static_cast<float>(logit[s] / total);
  for (int64_t d = 0; d < D; ++d) y[d] = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    const float *v = V[s], ps = p[s];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] += ps * v[d];
  }
}

// Sums over rows taken inside an `at::parallel_for` (a gradient summed over tokens: dw, dq): each thread adds into
// its own row of a [threads, width] float64 buffer — a long fp32 running sum would lose digits as the rows grow —
// and `total()` adds the rows and rounds to fp32.
struct ThreadSums {
  at::Tensor sums;
  explicit ThreadSums(int64_t width) : sums(at::zeros({at::get_num_threads(), width}, at::kDouble)) {}
  double *mine() { return sums.data_ptr<double>() + at::get_thread_num() * sums.size(1); }
  at::Tensor total() const { return sums.sum(0).to(at::kFloat); }
};

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// SiTU-GLU of §6.1 on one vector: β₁ tanh(g/β₁) σ(g) · β₂ tanh(u/β₂), with u uncapped where β₂ ≤ 0
inline at::vec::Vectorized<float> situ_glu(const at::vec::Vectorized<float> &g, const at::vec::Vectorized<float> &u,
                                           float beta1, float beta2) {
  using Vec = at::vec::Vectorized<float>;
  const Vec one(1.f), b1(beta1), c = beta2 > 0 ? Vec(beta2) * k3::tanh(u / Vec(beta2)) : u;
  return b1 * k3::tanh(g / b1) * (one / (one + g.neg().exp())) * c;
}

}  // namespace k3
