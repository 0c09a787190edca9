// Exact causal softmax attention in blocks for CPUs (docs/architecture.md §4.7), forward and backward: the algorithm
// of `blocked.py` with the masking, running maximum, exponentials and sums fused into one pass over each block of
// scores, so the working set is a few [query block × key block] buffers per thread whatever the length.
//
// Layout: q [B,H,T,K], k [B,G,S,K], v [B,G,S,V], G = H (the expanded form) or G = 1 (the absorbed form: one latent
// key/value head read by every head). Query t sits at position start + t = S − T + t; key s is visible to it when
// s ≤ its position and, with key_valid [B,S], s is a real token (or s is the query itself), or, with document ids
// [B,S] of every position (packed rows), s belongs to the query's document.
//
// Forward, per (b, h, query block): for each key block up to the causal limit
//   x = scale · q kᵀ (masked entries −∞);  m' = max(m, max_j x);  p = e^{x − m'}
//   l ← l e^{m − m'} + Σ_j p;  acc ← acc e^{m − m'} + p v;  m ← m'
// then o = acc / l and lse = m + ln l (kept for the backward).
// Backward, with P = e^{x − lse} recomputed block by block and δ = Σ_v dO ⊙ o per query:
//   dV += Pᵀ dO,  dS = P ⊙ (dO vᵀ − δ),  dK += scale · dSᵀ q   (per key block: no two threads write one row)
//   dQ += scale · dS k                                          (per query block)
#include <torch/extension.h>

#include "kernel_math.h"

#include <limits>

namespace {

using k3::gemm;

constexpr int64_t kQ = 128;  // queries per task
constexpr int64_t kK = 512;  // keys per block of scores

struct Problem {
  int64_t B, H, G, T, S, K, V, start;
  double scale;
  const bool *valid;     // [B, S] or nullptr
  const int64_t *doc;    // [B, S] or nullptr

  // whether key s is visible to query t of row b
  bool visible(int64_t b, int64_t t, int64_t s) const {
    const int64_t p = start + t;
    if (s > p) return false;
    if (doc) return doc[b * S + s] == doc[b * S + p];
    return !valid || valid[b * S + s] || s == p;
  }
  // whether every key of [s0, s1) is visible to every query from t0 on: no check per pair
  bool whole(int64_t t0, int64_t s1) const { return !valid && !doc && s1 - 1 <= start + t0; }
  // the keys query block [t0, t1) may see: [0, end)
  int64_t key_end(int64_t t1) const { return start + t1; }
  int64_t head_of_group(int64_t h) const { return G == 1 ? 0 : h; }
};

// the query block of task i: light and heavy causal blocks alternate, so the even split of the task range between
// threads (at::parallel_for) gives each thread the same number of scores
int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// scores x [nq × nk] of queries [t0, t0+nq) against keys [s0, s0+nk): scale · q kᵀ, invisible pairs −∞
template <typename T>
void scores(const Problem &P, int64_t b, int64_t t0, int64_t nq, int64_t s0, int64_t nk, const T *q, const T *k,
            T *x) {
  gemm(false, true, nq, nk, P.K, static_cast<T>(P.scale), q, P.K, k + s0 * P.K, P.K, T(0), x, nk);
  if (P.whole(t0, s0 + nk)) return;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j)
      if (!P.visible(b, t0 + i, s0 + j)) x[i * nk + j] = ninf;
}

// max_j row[j]
template <typename T>
T row_max(const T *row, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  T top = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= W) {
    Vec acc = Vec::loadu(row);
    for (j = W; j + W <= n; j += W) acc = at::vec::maximum(acc, Vec::loadu(row + j));
    top = at::vec::vec_reduce_all<T>([](Vec &a, Vec &c) { return at::vec::maximum(a, c); }, acc);
  }
  for (; j < n; ++j) top = std::max(top, row[j]);
  return top;
}

// row ← e^{row − m} in place (ATen's exp_u20: within 2 ulp); returns Σ e^{row − m} (m finite)
template <typename T>
T exp_sum(T *row, int64_t n, T m) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec acc(T(0));
  const Vec mv(m);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec e = (Vec::loadu(row + j) - mv).exp_u20();
    e.store(row + j);
    acc = acc + e;
  }
  T total = at::vec::vec_reduce_all<T>([](Vec &a, Vec &c) { return a + c; }, acc);
  for (; j < n; ++j) total += row[j] = std::exp(row[j] - m);
  return total;
}

template <typename T>
void forward_task(const Problem &P, int64_t b, int64_t h, int64_t t0, int64_t nq, const T *q, const T *k, const T *v,
                  T *o, T *lse) {
  const int64_t g = P.head_of_group(h), end = P.key_end(t0 + nq);
  const T *qb = q + ((b * P.H + h) * P.T + t0) * P.K;
  const T *kb = k + (b * P.G + g) * P.S * P.K, *vb = v + (b * P.G + g) * P.S * P.V;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  std::vector<T> x(nq * kK), acc(nq * P.V, T(0)), m(nq, ninf), l(nq, T(0));
  for (int64_t s0 = 0; s0 < end; s0 += kK) {
    const int64_t nk = std::min(kK, end - s0);
    scores(P, b, t0, nq, s0, nk, qb, kb, x.data());
    for (int64_t i = 0; i < nq; ++i) {
      T *row = x.data() + i * nk;
      const T m_new = std::max(m[i], row_max(row, nk));
      if (m_new == ninf) {  // nothing visible yet in this row
        std::fill(row, row + nk, T(0));
        continue;
      }
      const T rescale = std::exp(m[i] - m_new);  // 0 on the first visible block (m = −∞)
      l[i] = l[i] * rescale + exp_sum(row, nk, m_new);
      if (rescale != T(1))
        for (int64_t c = 0; c < P.V; ++c) acc[i * P.V + c] *= rescale;
      m[i] = m_new;
    }
    gemm(false, false, nq, P.V, nk, T(1), x.data(), nk, vb + s0 * P.V, P.V, T(1), acc.data(), P.V);
  }
  T *ob = o + ((b * P.H + h) * P.T + t0) * P.V, *lb = lse + (b * P.H + h) * P.T + t0;
  for (int64_t i = 0; i < nq; ++i) {  // every query sees itself: l > 0
    for (int64_t c = 0; c < P.V; ++c) ob[i * P.V + c] = acc[i * P.V + c] / l[i];
    lb[i] = m[i] + std::log(l[i]);
  }
}

// P = e^{x − lse} and dS = P ⊙ (dO vᵀ − δ) of one block, in x and dp (invisible pairs: x = −∞, so P = 0)
template <typename T>
void probabilities_and_grads(const Problem &P, int64_t nq, int64_t nk, const T *dob, const T *vk, const T *lse,
                             const T *delta, T *x, T *dp) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  gemm(false, true, nq, nk, P.V, T(1), dob, P.V, vk, P.V, T(0), dp, nk);
  for (int64_t i = 0; i < nq; ++i) {
    T *xr = x + i * nk, *dr = dp + i * nk;
    const T li = lse[i], di = delta[i];
    int64_t j = 0;
    for (; j + W <= nk; j += W) {
      const Vec p = (Vec::loadu(xr + j) - Vec(li)).exp_u20();
      p.store(xr + j);
      (p * (Vec::loadu(dr + j) - Vec(di))).store(dr + j);
    }
    for (; j < nk; ++j) {
      xr[j] = std::exp(xr[j] - li);
      dr[j] = xr[j] * (dr[j] - di);
    }
  }
}

struct Grads {
  const void *q, *k, *v, *dO, *lse, *delta;
  void *dq, *dk, *dv;
};

// dK and dV of key block [s0, s0+nk) of group g: every head of the group, every query block that sees it
template <typename T>
void key_task(const Problem &P, const Grads &a, int64_t b, int64_t g, int64_t s0, int64_t nk) {
  const T *q = static_cast<const T *>(a.q), *k = static_cast<const T *>(a.k), *v = static_cast<const T *>(a.v);
  const T *dO = static_cast<const T *>(a.dO), *lse = static_cast<const T *>(a.lse);
  const T *delta = static_cast<const T *>(a.delta);
  const T *kb = k + (b * P.G + g) * P.S * P.K, *vb = v + (b * P.G + g) * P.S * P.V;
  T *dk = static_cast<T *>(a.dk) + ((b * P.G + g) * P.S + s0) * P.K;
  T *dv = static_cast<T *>(a.dv) + ((b * P.G + g) * P.S + s0) * P.V;
  std::vector<T> x(kQ * nk), dp(kQ * nk);
  const int64_t h0 = P.G == 1 ? 0 : g, h1 = P.G == 1 ? P.H : g + 1;
  const int64_t first = std::max<int64_t>(0, s0 - P.start);  // the first query whose position reaches s0
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t row = (b * P.H + h) * P.T;
    for (int64_t t0 = first; t0 < P.T; t0 += kQ) {
      const int64_t nq = std::min(kQ, P.T - t0);
      const T *qb = q + (row + t0) * P.K, *dob = dO + (row + t0) * P.V;
      scores(P, b, t0, nq, s0, nk, qb, kb, x.data());
      probabilities_and_grads(P, nq, nk, dob, vb + s0 * P.V, lse + row + t0, delta + row + t0, x.data(), dp.data());
      gemm(true, false, nk, P.V, nq, T(1), x.data(), nk, dob, P.V, T(1), dv, P.V);
      gemm(true, false, nk, P.K, nq, static_cast<T>(P.scale), dp.data(), nk, qb, P.K, T(1), dk, P.K);
    }
  }
}

// dQ of query block [t0, t0+nq) of head h
template <typename T>
void query_task(const Problem &P, const Grads &a, int64_t b, int64_t h, int64_t t0, int64_t nq) {
  const T *q = static_cast<const T *>(a.q), *k = static_cast<const T *>(a.k), *v = static_cast<const T *>(a.v);
  const T *dO = static_cast<const T *>(a.dO), *lse = static_cast<const T *>(a.lse);
  const T *delta = static_cast<const T *>(a.delta);
  const int64_t g = P.head_of_group(h), row = (b * P.H + h) * P.T + t0, end = P.key_end(t0 + nq);
  const T *kb = k + (b * P.G + g) * P.S * P.K, *vb = v + (b * P.G + g) * P.S * P.V;
  T *dq = static_cast<T *>(a.dq) + row * P.K;
  std::vector<T> x(nq * kK), dp(nq * kK);
  for (int64_t s0 = 0; s0 < end; s0 += kK) {
    const int64_t nk = std::min(kK, end - s0);
    scores(P, b, t0, nq, s0, nk, q + row * P.K, kb, x.data());
    probabilities_and_grads(P, nq, nk, dO + row * P.V, vb + s0 * P.V, lse + row, delta + row, x.data(), dp.data());
    gemm(false, false, nq, P.K, nk, static_cast<T>(P.scale), dp.data(), nk, kb + s0 * P.K, P.K, T(1), dq, P.K);
  }
}

Problem problem_of(const torch::Tensor &q, const torch::Tensor &k, const torch::Tensor &v, double scale,
                   const c10::optional<torch::Tensor> &valid, const c10::optional<torch::Tensor> &doc) {
  for (const auto &t : {q, k, v})
    TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.scalar_type() == q.scalar_type(),
                "attention cpu kernel: q, k, v must be contiguous 4-d tensors of one dtype");
  Problem P{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), k.size(2) - q.size(2),
            scale, nullptr, nullptr};
  TORCH_CHECK(k.size(0) == P.B && v.size(0) == P.B && v.size(1) == P.G && v.size(2) == P.S && k.size(3) == P.K,
              "attention cpu kernel: k [B,G,S,K] and v [B,G,S,V] must match q [B,H,T,K]");
  TORCH_CHECK((P.G == 1 || P.G == P.H) && P.start >= 0, "attention cpu kernel: G must be 1 or H and S ≥ T");
  if (valid.has_value()) {
    TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() && valid->numel() == P.B * P.S,
                "attention cpu kernel: key_valid must be a contiguous bool [B, S]");
    P.valid = valid->data_ptr<bool>();
  }
  if (doc.has_value()) {
    TORCH_CHECK(doc->scalar_type() == at::kLong && doc->is_contiguous() && doc->numel() == P.B * P.S,
                "attention cpu kernel: document ids must be a contiguous int64 [B, S]");
    P.doc = doc->data_ptr<int64_t>();
  }
  return P;
}

int64_t blocks(int64_t n, int64_t size) { return (n + size - 1) / size; }

// (o [B,H,T,V], lse [B,H,T])
std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                   c10::optional<torch::Tensor> valid, c10::optional<torch::Tensor> doc) {
  const Problem P = problem_of(q, k, v, scale, valid, doc);
  auto o = torch::empty({P.B, P.H, P.T, P.V}, q.options()), lse = torch::empty({P.B, P.H, P.T}, q.options());
  const int64_t nb = blocks(P.T, kQ);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_cpu_forward", [&] {
    at::parallel_for(0, P.B * P.H * nb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t0 = zigzag(i % nb, nb) * kQ, bh = i / nb;
        forward_task<scalar_t>(P, bh / P.H, bh % P.H, t0, std::min(kQ, P.T - t0), q.data_ptr<scalar_t>(),
                               k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(),
                               lse.data_ptr<scalar_t>());
      }
    });
  });
  return {o, lse};
}

// (dq, dk, dv); delta = Σ_v dO ⊙ o [B,H,T]
std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor dO,
                                    torch::Tensor lse, torch::Tensor delta, double scale,
                                    c10::optional<torch::Tensor> valid, c10::optional<torch::Tensor> doc) {
  const Problem P = problem_of(q, k, v, scale, valid, doc);
  for (const auto &t : {dO, lse, delta})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == q.scalar_type(), "attention cpu kernel: dO, lse, delta");
  auto dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
  const Grads a{q.data_ptr(), k.data_ptr(), v.data_ptr(), dO.data_ptr(), lse.data_ptr(), delta.data_ptr(),
                dq.data_ptr(), dk.data_ptr(), dv.data_ptr()};
  const int64_t nk = blocks(P.S, kK), nq = blocks(P.T, kQ);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_cpu_backward", [&] {
    at::parallel_for(0, P.B * P.G * nk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s0 = zigzag(i % nk, nk) * kK, bg = i / nk;
        key_task<scalar_t>(P, a, bg / P.G, bg % P.G, s0, std::min(kK, P.S - s0));
      }
    });
    at::parallel_for(0, P.B * P.H * nq, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t0 = zigzag(i % nq, nq) * kQ, bh = i / nq;
        query_task<scalar_t>(P, a, bh / P.H, bh % P.H, t0, std::min(kQ, P.T - t0));
      }
    });
  });
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "blocked causal softmax attention: (o, lse)");
  m.def("backward", &backward, "its backward: (dq, dk, dv)");
}
