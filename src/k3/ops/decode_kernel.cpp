// Fused operations of a one-token step (k3/ops/decode.py, docs/architecture.md §0.6): each replaces the dozen or
// more small torch operations whose per-call cost, not their arithmetic, makes up most of a decode step on a CPU.
// A few rows; the formulas are those of the torch ops they replace (named at each function). Tensors fp32 or bf16:
// the arithmetic is fp32 — weight matrices and the caches read as stored (bf16 widened exactly), activations and
// small vectors widened once — and each result is rounded once to its activation's dtype (`k3::like`).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "kernel_math.h"
#include "matvec.h"
#include "mxfp4.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

// a tensor read (a weight matrix) or updated in place (a cache) as stored: contiguous fp32 or bf16 on the CPU, or
// fp32 only (the KDA state, fp32 by §0.4)
void check(const torch::Tensor &t, const char *what, bool fp32 = false) {
  TORCH_CHECK(k3::readable(t) && t.is_contiguous() && (!fp32 || t.scalar_type() == torch::kFloat), "decode kernel: ",
              what, fp32 ? " must be a contiguous fp32 CPU tensor" : " must be a contiguous fp32 or bf16 CPU tensor");
}

using k3::dot;
using k3::floats;
using k3::like;
using k3::rows_dot;
using k3::sigmoid;
using k3::typed;

using k3::inverse_norm;

// RMSNorm / L2 normalisation over the last axis (k3.ops.norm): y = x / sqrt(mean(x²) + ε) (`mean`) or
// x / sqrt(Σ x² + ε), times `weight` [C] when given (read as stored); in x's dtype with a weight (RMSNorm), fp32
// without (the plain norms' contract)
torch::Tensor rms_norm(const torch::Tensor &x_in, const c10::optional<torch::Tensor> &weight, double eps, bool mean) {
  const auto x = floats(x_in);
  const int64_t C = x.size(-1), N = x.numel() / C;
  TORCH_CHECK(!weight || weight->numel() == C, "decode kernel: the norm weight has ", weight->numel(),
              " entries, x rows ", C);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  const auto rows = [&](const auto *w) {
    for (int64_t n = 0; n < N; ++n) k3::normalize_row(xp + n * C, w, yp + n * C, C, mean ? C : 1, eps);
  };
  if (!weight) {
    rows(static_cast<const float *>(nullptr));
    return y;
  }
  typed(*weight, rows);
  return like(y, x_in);
}

// Block AttnRes mix (k3.model.attn_res): per row, p = softmax_s((V_s·q) / sqrt(mean(V_s²) + ε)) with the
// pseudo-query q = γ ⊙ w, then Σ_s p_s V_s in the order of the sources, in the first source's dtype. Each source is
// [N, D].
torch::Tensor attn_res_mix(const std::vector<torch::Tensor> &sources_in, const torch::Tensor &gamma_in,
                           const torch::Tensor &w_in, double eps) {
  TORCH_CHECK(!sources_in.empty(), "decode kernel: no sources to mix");
  std::vector<torch::Tensor> sources;
  for (const auto &s : sources_in) {
    sources.push_back(floats(s));
    TORCH_CHECK(s.sizes() == sources_in[0].sizes(), "decode kernel: the sources differ in shape");
  }
  const int64_t D = sources[0].size(-1), N = sources[0].numel() / D, S = sources.size();
  TORCH_CHECK(gamma_in.numel() == D && w_in.numel() == D, "decode kernel: gain and pseudo-query must have ", D,
              " entries");
  std::vector<float> q(D), p(S), r(S);
  std::vector<const float *> V(S);
  typed(gamma_in, [&](const auto *g) {  // as stored
    typed(w_in, [&](const auto *w) {
      for (int64_t d = 0; d < D; ++d) q[d] = static_cast<float>(g[d]) * static_cast<float>(w[d]);
    });
  });
  auto y = torch::empty_like(sources[0]);
  float *yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t s = 0; s < S; ++s) V[s] = sources[s].data_ptr<float>() + n * D;
    k3::mix_row(V.data(), S, q.data(), D, eps, p.data(), r.data(), yp + n * D);
  }
  return like(y, sources_in[0]);
}

// One KDA decode step of one (sequence, head) (k3.model.kda, §3.2, §3.4): short conv + SiLU of the head's q, k, v
// channels (shifting their windows), L2-normalised q·K^-1/2 and k, decay g, β = σ(b), the delta-rule update of the
// state S [K, V] in place, o = Sᵀq, and the gated norm RMSNorm(o)·w·σ(z) written to `out`. The conv windows are
// the cache's, of type T (the activation dtype: an input is rounded once as it enters its window).
template <typename T>
struct KdaStep {
  const float *proj[3], *conv_w[3], *f, *A_log, *dt_bias, *b, *z, *o_norm_w;
  T *conv_state;
  float *state, *out;
  int64_t H, K, W, P;
  float lower_bound, eps;
  bool bounded;

  void operator()(int64_t b_, int64_t h, std::vector<float> &qkv) const {
    const int64_t c0 = h * K;
    for (int s = 0; s < 3; ++s) {  // the three streams q, k, v: window [W−1 past inputs, this input]
      T *window = conv_state + (b_ * 3 + s) * (W - 1) * P;
      const float *x = proj[s] + b_ * P, *w = conv_w[s];
      for (int64_t c = c0; c < c0 + K; ++c) {
        float y = 0.f;
        for (int64_t j = 0; j < W - 1; ++j) y += w[c * W + j] * static_cast<float>(window[j * P + c]);
        y += w[c * W + W - 1] * x[c];
        for (int64_t j = 0; j + 1 < W - 1; ++j) window[j * P + c] = window[(j + 1) * P + c];
        if (W > 1) window[(W - 2) * P + c] = static_cast<T>(x[c]);
        qkv[s * K + c - c0] = y * sigmoid(y);  // SiLU
      }
    }
    float *q = qkv.data(), *k = q + K, *v = k + K, *u = v + K, *o = u + K;
    const float q_scale = inverse_norm(q, K, 1.f, 1e-6) / std::sqrt(static_cast<float>(K));
    const float k_scale = inverse_norm(k, K, 1.f, 1e-6);
    for (int64_t i = 0; i < K; ++i) q[i] = q[i] * q_scale, k[i] = k[i] * k_scale;
    const float a = std::exp(A_log[h]), beta = sigmoid(b[b_ * H + h]);
    float *S = state + (b_ * H + h) * K * K;
    for (int64_t i = 0; i < K; ++i) {  // S ← Diag(e^g) S
      const float x = f[b_ * P + c0 + i] + dt_bias[c0 + i];
      const float g = bounded ? lower_bound * sigmoid(a * x) : -a * (x > 20.f ? x : std::log1p(std::exp(x)));
      const float decay = std::exp(g);
      for (int64_t j = 0; j < K; ++j) S[i * K + j] *= decay;
    }
    for (int64_t j = 0; j < K; ++j) u[j] = 0.f, o[j] = 0.f;
    for (int64_t i = 0; i < K; ++i)  // Sᵀk
      for (int64_t j = 0; j < K; ++j) u[j] += k[i] * S[i * K + j];
    for (int64_t j = 0; j < K; ++j) u[j] = beta * (v[j] - u[j]);  // u = β (v − Sᵀk)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j) {
        S[i * K + j] += k[i] * u[j];  // S ← S + k uᵀ
        o[j] += q[i] * S[i * K + j];  // o = Sᵀq after the write
      }
    const float r = inverse_norm(o, K, static_cast<float>(K), eps);
    float *y = out + b_ * P + c0;
    for (int64_t j = 0; j < K; ++j) y[j] = o[j] * r * o_norm_w[j] * sigmoid(z[b_ * P + c0 + j]);
  }
};

// q, k, v, f, z [B, P] projections (P = H·K), b [B, H]; conv_state [B, 3, W−1, P] (the activation dtype) and state
// [B, H, K, K] (fp32) updated in place; conv weights [P, 1, W]; A_log [H], dt_bias [P], o_norm_w [K]. `bounded`:
// g = λσ(e^A (f + dt_bias)), else g = −e^A softplus(f + dt_bias). Returns the gated-norm output [B, P] (the input of
// o_proj) in q's dtype.
torch::Tensor kda_step(const torch::Tensor &q_in, const torch::Tensor &k_in, const torch::Tensor &v_in,
                       const torch::Tensor &conv_state, const torch::Tensor &wq_in, const torch::Tensor &wk_in,
                       const torch::Tensor &wv_in, const torch::Tensor &f_in, const torch::Tensor &A_log_in,
                       const torch::Tensor &dt_bias_in, bool bounded, double lower_bound, const torch::Tensor &b_in,
                       const torch::Tensor &state, const torch::Tensor &z_in, const torch::Tensor &o_norm_w_in,
                       double eps) {
  check(conv_state, "conv_state");
  check(state, "state", true);
  const auto q = floats(q_in), k = floats(k_in), v = floats(v_in), wq = floats(wq_in), wk = floats(wk_in),
             wv = floats(wv_in), f = floats(f_in), A_log = floats(A_log_in), dt_bias = floats(dt_bias_in),
             b = floats(b_in), z = floats(z_in), o_norm_w = floats(o_norm_w_in);
  const int64_t B = state.size(0), H = state.size(1), K = state.size(2), P = H * K, W = wq.size(-1);
  TORCH_CHECK(state.dim() == 4 && state.size(3) == K, "decode kernel: the KDA state must be [B, H, K, K]");
  for (const auto *t : {&q, &k, &v, &f, &z})
    TORCH_CHECK(t->numel() == B * P, "decode kernel: a KDA projection is not [B, H·K]");
  TORCH_CHECK(conv_state.numel() == B * 3 * (W - 1) * P && wk.numel() == P * W && wv.numel() == P * W &&
                  wq.numel() == P * W && A_log.numel() == H && dt_bias.numel() == P && b.numel() == B * H &&
                  o_norm_w.numel() == K,
              "decode kernel: KDA parameter or cache shapes disagree");
  auto out = torch::empty({B, P}, q.options());
  typed(conv_state, [&](auto *windows) {
    using T = std::remove_pointer_t<decltype(windows)>;
    const KdaStep<T> step{{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>()},
                          {wq.data_ptr<float>(), wk.data_ptr<float>(), wv.data_ptr<float>()},
                          f.data_ptr<float>(), A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), b.data_ptr<float>(),
                          z.data_ptr<float>(), o_norm_w.data_ptr<float>(), windows, state.data_ptr<float>(),
                          out.data_ptr<float>(), H, K, W, P, static_cast<float>(lower_bound), static_cast<float>(eps),
                          bounded};
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(5 * K);
      for (int64_t t = begin; t < end; ++t) step(t / H, t % H, scratch);
    });
  });
  return like(out, q_in);
}

// The gated activation of the FFNs (k3.model.ffn.glu_activation): SiTU-GLU β₁tanh(g/β₁)σ(g)·β₂tanh(u/β₂) (β₂ ≤ 0:
// u uncapped), or SwiGLU silu(g)·u
struct Activation {
  bool situ;
  float beta1, beta2;
};

// h = act(g, u) over n values, in place of g
void glu(float *g, const float *u, int64_t n, const Activation &act) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t m = std::min<int64_t>(Vec::size(), n - i);
    const Vec gv = Vec::loadu(g + i, m), uv = Vec::loadu(u + i, m);
    (act.situ ? k3::situ_glu(gv, uv, act.beta1, act.beta2) : gv / (Vec(1.f) + gv.neg().exp()) * uv).store(g + i, m);
  }
}

// The routed half of a MoE layer for a few tokens (k3.model.moe, §6.3, §6.4): the sigmoid router on x [N, D]
// (scores σ(x Wᵀ), top-k of scores + bias, weights from the unbiased scores, renormalised, scaled), then
// r = Σ_e w_e · W2_e act(W1_e z, W3_e z) over the chosen experts in ascending id (the reference's order), on the
// expert inputs z [N, L]; r in z's dtype. act: SiTU-GLU β₁tanh(g/β₁)σ(g)·β₂tanh(u/β₂) (β₂ ≤ 0: u uncapped), or
// SwiGLU.
struct Expert {
  int64_t row, id;
  float weight;
};

// the assignments of each chosen expert (indices into `chosen`), one list per distinct expert
inline std::vector<std::vector<int64_t>> by_expert(const std::vector<Expert> &chosen) {
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> slot;  // expert id → its list in `groups`, or -1
  for (int64_t a = 0; a < static_cast<int64_t>(chosen.size()); ++a) {
    const int64_t id = chosen[a].id;
    if (id >= static_cast<int64_t>(slot.size())) slot.resize(id + 1, -1);
    if (slot[id] < 0) {
      slot[id] = groups.size();
      groups.emplace_back();
    }
    groups[slot[id]].push_back(a);
  }
  return groups;
}

template <typename T>
std::vector<Expert> route(const float *x, const T *gate_w, const float *bias, int64_t N, int64_t D, int64_t E,
                          int64_t k, bool renormalize, float scaling) {
  std::vector<Expert> chosen;
  std::vector<float> score(E), choice(E);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) {
      score[e] = sigmoid(dot(x + n * D, gate_w + e * D, D));
      choice[e] = score[e] + bias[e];
    }
    std::vector<Expert> row;
    float total = 0.f;
    for (int64_t j = 0; j < k; ++j) {  // the k best choices; the lowest id wins a tie
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (choice[e] > -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
      choice[best] = -INFINITY;
      row.push_back({n, best, score[best]});
      total += score[best];
    }
    std::sort(row.begin(), row.end(), [](const Expert &a, const Expert &b) { return a.id < b.id; });
    for (auto &r : row) r.weight = (renormalize ? r.weight / (total + 1e-20f) : r.weight) * scaling;
    chosen.insert(chosen.end(), row.begin(), row.end());
  }
  return chosen;
}

// A stacked expert weight [E, out, in] as the model holds it: dense (fp32 or bf16, read as stored) or MXFP4 (uint8
// `packed` [E, out, in/2] and E8M0 `scale` [E, out, in/32], each row decoded in registers, k3/ops/mxfp4.h)
class ExpertWeight {
 public:
  ExpertWeight(const torch::Tensor &w, const c10::optional<torch::Tensor> &scale, const char *what)
      : w_(w), scale_(scale) {
    if (scale_) {
      TORCH_CHECK(w.scalar_type() == torch::kByte && scale_->scalar_type() == torch::kByte && w.is_contiguous() &&
                      scale_->is_contiguous() && w.device().is_cpu() && scale_->device().is_cpu() && w.dim() == 3 &&
                      scale_->dim() == 3 && scale_->size(0) == w.size(0) && scale_->size(1) == w.size(1) &&
                      w.size(2) == 16 * scale_->size(2),
                  "decode kernel: ", what, " must be MXFP4 packed [E, out, in/2] and scale [E, out, in/32] uint8");
    } else {
      check(w, what);
    }
  }
  int64_t experts() const { return w_.size(0); }
  int64_t out() const { return w_.size(1); }
  int64_t in() const { return scale_ ? 2 * w_.size(2) : w_.size(2); }
  bool packed() const { return scale_.has_value(); }
  bool same_form(const ExpertWeight &o) const { return packed() == o.packed() && w_.scalar_type() == o.w_.scalar_type(); }

  // activation rows [A, in] fp32 in the layout `rows` reads: as given (dense), even then odd elements (MXFP4)
  torch::Tensor layout(const torch::Tensor &x) const { return scale_ ? k3::mxfp4::split_even_odd(x) : x; }

  // y[t][i] = (row `row` + i of the flattened [E·out, in]) · x[t] for i < n and the T rows x[t] in `layout`
  void rows(int64_t row, int64_t n, const float *const *x, int64_t T, float *const *y) const {
    const int64_t in = this->in();
    if (scale_) {
      const uint8_t *pp = w_.data_ptr<uint8_t>(), *sp = scale_->data_ptr<uint8_t>();
      const float *e8m0 = k3::mxfp4::e8m0_table();
      std::vector<const float *> xe(T), xo(T);  // each row's even, then odd elements
      for (int64_t t = 0; t < T; ++t) xe[t] = x[t], xo[t] = x[t] + in / 2;
      float part[k3::mxfp4::kMaxRows];
      for (int64_t i = 0; i < n; ++i)  // each weight row decoded once for up to kMaxRows tokens
        for (int64_t t0 = 0; t0 < T; t0 += k3::mxfp4::kMaxRows) {
          const int64_t c = std::min(k3::mxfp4::kMaxRows, T - t0);
          k3::mxfp4::row_dot(pp + (row + i) * (in / 2), sp + (row + i) * (in / k3::mxfp4::kGroup), in,
                             xe.data() + t0, xo.data() + t0, c, e8m0, part);
          for (int64_t t = 0; t < c; ++t) y[t0 + t][i] = part[t];
        }
      return;
    }
    typed(w_, [&](const auto *wp) { k3::rows_dot_many(wp + row * in, n, in, x, T, y); });
  }

 private:
  torch::Tensor w_;
  c10::optional<torch::Tensor> scale_;
};

// a pause inside a spin-wait (x86: frees the core's pipeline for its other hardware thread)
inline void relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

torch::Tensor moe_routed(const torch::Tensor &x_in, const torch::Tensor &z_in, const torch::Tensor &gate_w,
                         const torch::Tensor &bias_in, const ExpertWeight &w1, const ExpertWeight &w3,
                         const ExpertWeight &w2, int64_t k, bool renormalize, double scaling, bool situ, double beta1,
                         double beta2) {
  check(gate_w, "gate.weight");
  const auto x = floats(x_in), z = floats(z_in), bias = floats(bias_in);
  const int64_t D = x.size(-1), N = x.numel() / D, E = w1.experts(), M = w1.out(), L = w1.in();
  TORCH_CHECK(z.numel() == N * L && gate_w.numel() == E * D && bias.numel() == E && w3.experts() == E &&
                  w3.out() == M && w3.in() == L && w2.experts() == E && w2.out() == L && w2.in() == M && k >= 1 &&
                  k <= E,
              "decode kernel: MoE shapes disagree");
  TORCH_CHECK(w3.same_form(w1), "decode kernel: w1 and w3 differ in form");
  const auto chosen = typed(gate_w, [&](const auto *g) {
    return route(x.data_ptr<float>(), g, bias.data_ptr<float>(), N, D, E, k, renormalize, static_cast<float>(scaling));
  });
  const int64_t A = chosen.size();
  std::vector<float> h(A * M), u(A * M), y(A * L);
  const auto zl = w1.layout(z);
  const float *zp = zl.data_ptr<float>();
  auto groups = by_expert(chosen);
  std::stable_sort(groups.begin(), groups.end(), [](const auto &a, const auto &b) { return a.size() > b.size(); });
  const Activation act{situ, static_cast<float>(beta1), static_cast<float>(beta2)};
  const int64_t G = groups.size(), threads = at::get_num_threads();
  // each expert's rows in `slices` tasks: one, unless there are fewer experts than twice the threads (one token)
  const int64_t slices =
      std::clamp<int64_t>((2 * threads + G - 1) / std::max<int64_t>(G, 1), 1, std::max<int64_t>(1, L / 8));
  std::vector<float> laid(w2.packed() ? A * M : 0);  // the activations in w2's layout (MXFP4: even, then odd)
  std::vector<std::atomic<int64_t>> pending(G);  // each expert's up slices not yet done + 1 until its activation is
  for (auto &p : pending) p.store(slices + 1);
  std::atomic<int64_t> next{0};
  // the tasks: every expert's gate and up slices (the experts with the most tokens first), then their down slices;
  // each thread takes the next task when done. The last of an expert's up slices applies the activation; a down
  // slice waits for it (it was taken by then, so nothing waits forever).
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<const float *> xs;
    std::vector<float *> outs, us;
    for (int64_t task = next++; task < 2 * G * slices; task = next++) {
      const bool down = task >= G * slices;
      const int64_t g = (task % (G * slices)) / slices, s = task % slices, rows = down ? L : M;
      const int64_t r0 = s * rows / slices, r1 = (s + 1) * rows / slices;
      const auto &group = groups[g];
      const int64_t id = chosen[group[0]].id, T = group.size();
      xs.clear(), outs.clear(), us.clear();
      if (down) {
        while (pending[g].load(std::memory_order_acquire) > 0) relax();
        for (const int64_t a : group) {
          xs.push_back(w2.packed() ? laid.data() + a * M : h.data() + a * M);
          outs.push_back(y.data() + a * L + r0);
        }
        w2.rows(id * L + r0, r1 - r0, xs.data(), T, outs.data());
        continue;
      }
      for (const int64_t a : group) {
        xs.push_back(zp + chosen[a].row * L);
        outs.push_back(h.data() + a * M + r0);
        us.push_back(u.data() + a * M + r0);
      }
      w1.rows(id * M + r0, r1 - r0, xs.data(), T, outs.data());
      w3.rows(id * M + r0, r1 - r0, xs.data(), T, us.data());
      if (pending[g].fetch_sub(1, std::memory_order_acq_rel) == 2) {  // the expert's last up slice: its activation
        for (const int64_t a : group) {
          glu(h.data() + a * M, u.data() + a * M, M, act);
          if (w2.packed()) k3::mxfp4::split_even_odd(h.data() + a * M, M, laid.data() + a * M);
        }
        pending[g].store(0, std::memory_order_release);
      }
    }
  });
  auto out = torch::zeros({N, L}, x.options());
  float *op = out.data_ptr<float>();
  for (int64_t a = 0; a < A; ++a)
    for (int64_t l = 0; l < L; ++l) op[chosen[a].row * L + l] += chosen[a].weight * y[a * L + l];
  return like(out, z_in);
}

// `moe_routed` as the Python side calls it: each expert weight a dense tensor, or MXFP4 packed bytes with its scale
torch::Tensor moe_routed_op(const torch::Tensor &x, const torch::Tensor &z, const torch::Tensor &gate_w,
                            const torch::Tensor &bias, const torch::Tensor &w1, const torch::Tensor &w3,
                            const torch::Tensor &w2, const c10::optional<torch::Tensor> &s1,
                            const c10::optional<torch::Tensor> &s3, const c10::optional<torch::Tensor> &s2, int64_t k,
                            bool renormalize, double scaling, bool situ, double beta1, double beta2) {
  return moe_routed(x, z, gate_w, bias, ExpertWeight(w1, s1, "w1"), ExpertWeight(w3, s3, "w3"),
                    ExpertWeight(w2, s2, "w2"), k, renormalize, scaling, situ, beta1, beta2);
}

constexpr int64_t kHeads = 8;   // most heads whose sums one pass over the latent rows accumulates together
// latent rows per block: their scores, then their weighted sum, while in L1; the next block is prefetched meanwhile.
// 3 KiB of k3-long's rows in either dtype (its step at 1M: 32 fp32 rows 1.06x faster than 64; alone over 64K
// positions: 64 bf16 rows 1.08x faster than 32)
template <typename T>
constexpr int64_t kBlock = sizeof(T) == 2 ? 64 : 32;
constexpr int64_t kSplit = 256;  // latent rows per task; the tasks' partial softmaxes are merged at the end

// out[h] = q[h] · row for KH query rows q [KH, n]: the row (fp32 or bf16, the cache's) is loaded once per vector for
// all of them
template <int64_t KH, typename T>
inline void dot_heads(const float *q, const T *row, int64_t n, float *out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec acc[KH];
  for (auto &a : acc) a = Vec(0.f);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    const Vec r = k3::load(row + j);
    for (int64_t h = 0; h < KH; ++h) acc[h] = at::vec::fmadd(Vec::loadu(q + h * n + j), r, acc[h]);
  }
  for (int64_t h = 0; h < KH; ++h) {
    out[h] = at::vec::vec_reduce_all<float>([](Vec &x, Vec &y) { return x + y; }, acc[h]);
    for (int64_t t = j; t < n; ++t) out[h] = std::fma(q[h * n + t], static_cast<float>(row[t]), out[h]);
  }
}

#if defined(__AVX2__)
// Scores of 8 latent rows at once (AVX2, also in AVX-512 builds): one accumulator per row, then one transposing sum
// of the 8 accumulators (6 hadds, 2 permutes, an add) instead of a horizontal reduction per row and head, which
// dominated the step over the narrow latents of k3-long (24 wide: 3 products, then the reduction).
constexpr int64_t kRows8MaxWidth = 1024;  // latent widths up to this (k3-full: 576); wider ones take dot_heads

inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16 *p) {  // bf16 → fp32 exactly: the 16 bits become the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// [Σ a[0], …, Σ a[7]]: each lane sum in the same order (pairs, then pairs of pairs, then the two halves)
inline __m256 sum_lanes8(const __m256 *a) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

template <typename T>
const T *zero_row() {
  static const T zeros[kRows8MaxWidth] = {};
  return zeros;
}

// out[h·stride + r] = q[h] · row r for KH query rows q [KH, L] and the n ≤ 8 rows at `rows` (row stride L, a multiple
// of 8); rows n..7 count as zeros. A row's score is summed in the same order wherever it sits in the block.
template <int64_t KH, typename T>
inline void dot_rows8(const float *q, const T *rows, int64_t L, int64_t n, float *out, int64_t stride) {
  const T *row[8];
  for (int64_t r = 0; r < 8; ++r) row[r] = r < n ? rows + r * L : zero_row<T>();
  for (int64_t h = 0; h < KH; ++h) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j += 8) {
      const __m256 qv = _mm256_loadu_ps(q + h * L + j);
      for (int64_t r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(row[r] + j), acc[r]);
    }
    _mm256_storeu_ps(out + h * stride, sum_lanes8(acc));
  }
}
#endif

// Asks for the cache lines of `bytes` bytes at p (a hint: prefetching never faults, past the cache's end included)
inline void prefetch(const void *p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char *>(p) + b);
}

// The scores q[h] · row r of KH heads and n ≤ kBlock latent rows, into p[h·kBlock + r] (r < n); with `ahead`, the
// next block's rows are prefetched a group at a time while these are scored (the hardware's prefetcher alone leaves
// the core waiting on memory after each block's arithmetic: k3-long at 1M, 1.1x)
template <int64_t KH, typename T>
inline void block_scores(const float *q_lat, const T *latent, int64_t L, int64_t n, float *p, bool ahead) {
  const int64_t row_bytes = L * static_cast<int64_t>(sizeof(T));
#if defined(__AVX2__)
  static_assert(kBlock<T> % 8 == 0, "a block is whole groups of 8 rows");
  if (L % 8 == 0 && L <= kRows8MaxWidth) {
    for (int64_t r0 = 0; r0 < n; r0 += 8) {
      if (ahead) prefetch(latent + (kBlock<T> + r0) * L, 8 * row_bytes);
      dot_rows8<KH>(q_lat, latent + r0 * L, L, std::min<int64_t>(8, n - r0), p + r0, kBlock<T>);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < n; ++r) {
    if (ahead) prefetch(latent + (kBlock<T> + r) * L, row_bytes);
    float sc[KH];
    dot_heads<KH>(q_lat, latent + r * L, L, sc);
    for (int64_t h = 0; h < KH; ++h) p[h * kBlock<T> + r] = sc[h];
  }
}

// o[h, c0 .. c0 + 8·CV) += Σ_r p[h·kBlock + r] ĉ_r over the same columns, for KH heads (o [KH, C]): each row's CV
// vectors loaded once for all heads, and where fewer than 8 sums are live, even and odd rows into separate sums (KH·CV
// chains of dependent FMAs alone would wait on the FMA latency)
template <int64_t KH, int64_t CV, typename T>
inline void add_weighted(const float *p, const T *latent, int64_t L, int64_t n, float *o, int64_t C, int64_t c0) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size(), CH = KH * CV >= 8 ? 1 : 2;
  Vec acc[CH][KH][CV];
  for (int64_t h = 0; h < KH; ++h)
    for (int64_t v = 0; v < CV; ++v) {
      acc[0][h][v] = Vec::loadu(o + h * C + c0 + v * V);
      for (int64_t c = 1; c < CH; ++c) acc[c][h][v] = Vec(0.f);
    }
  int64_t r = 0;
  for (; r + CH <= n; r += CH)  // unrolled whole, or the sums leave the registers (GCC: 1.3x k3-tiny's step)
    _Pragma("GCC unroll 16") for (int64_t c = 0; c < CH; ++c) {
      Vec x[CV];
      _Pragma("GCC unroll 16") for (int64_t v = 0; v < CV; ++v) x[v] = k3::load(latent + (r + c) * L + c0 + v * V);
      _Pragma("GCC unroll 16") for (int64_t h = 0; h < KH; ++h)
        _Pragma("GCC unroll 16") for (int64_t v = 0; v < CV; ++v)
            acc[c][h][v] = at::vec::fmadd(Vec(p[h * kBlock<T> + r + c]), x[v], acc[c][h][v]);
    }
  for (; r < n; ++r)  // the odd last row of a block that ends the cache
    for (int64_t v = 0; v < CV; ++v) {
      const Vec x = k3::load(latent + r * L + c0 + v * V);
      for (int64_t h = 0; h < KH; ++h) acc[0][h][v] = at::vec::fmadd(Vec(p[h * kBlock<T> + r]), x, acc[0][h][v]);
    }
  for (int64_t h = 0; h < KH; ++h)
    for (int64_t v = 0; v < CV; ++v) {
      for (int64_t c = 1; c < CH; ++c) acc[0][h][v] = acc[0][h][v] + acc[c][h][v];
      acc[0][h][v].store(o + h * C + c0 + v * V);
    }
}

// The same for the last m < 8 columns from c0
template <int64_t KH, typename T>
inline void add_weighted_tail(const float *p, const T *latent, int64_t L, int64_t n, float *o, int64_t C, int64_t c0,
                              int64_t m) {
  using Vec = at::vec::Vectorized<float>;
  Vec acc[KH];
  for (int64_t h = 0; h < KH; ++h) acc[h] = Vec::loadu(o + h * C + c0, m);
  for (int64_t r = 0; r < n; ++r) {
    const Vec x = k3::load(latent + r * L + c0, m);
    for (int64_t h = 0; h < KH; ++h) acc[h] = at::vec::fmadd(Vec(p[h * kBlock<T> + r]), x, acc[h]);
  }
  for (int64_t h = 0; h < KH; ++h) acc[h].store(o + h * C + c0, m);
}

constexpr float kHeadroom = 8.f;  // a block's weights e^(score − m) may reach e^8 before the shift m is moved

// The running softmax of every head over some latent rows (online softmax): a shift m no smaller than any score
// seen so far minus kHeadroom (moved to a block's largest score only where one exceeds it, rarely past the first
// blocks: most blocks skip the reduction to their maximum and the rescaling; with the blocks of 64 bf16 rows, k3-long's
// step over a bf16 cache at 1M 1.12x faster, over fp32 the same), the sum
// Σ_s e^(score_s − m) kept per vector lane, and o = Σ_s e^(score_s − m) ĉ_s; heads padded to whole blocks of KH
// (1, 2, 4 or 8: the fewest that hold a model's heads, so 2 heads do not pay for 8)
struct RunningSoftmax {
  using Vec = at::vec::Vectorized<float>;
  static constexpr int64_t kLanes = Vec::size();
  int64_t heads, C;
  float *max, *total, *o;  // [heads], [heads, kLanes], [heads, C]

  // take the next n ≤ kBlock latent rows of one sequence (from `latent`, row stride L) for the queries q_lat
  // [heads, L] (scaled: their products with the rows are the scores); `flatten` inlines every helper (GCC left some
  // calls in place, their sums in memory: 1.2x k3-long's step)
  template <int64_t KH, typename T>
  __attribute__((flatten)) void take(const float *q_lat, const T *latent, int64_t L, int64_t n) {
    constexpr int64_t B = kBlock<T>;
    static_assert(B % kLanes == 0, "a block of scores is whole vectors");
    float p[KH * B];  // scores, then their weights e^(score − m), of a block of KH heads
    for (int64_t h0 = 0; h0 < heads; h0 += KH) {
      block_scores<KH>(q_lat + h0 * L, latent, L, n, p, h0 == 0);
      for (int64_t h = 0; h < KH; ++h) std::fill(p + h * B + n, p + (h + 1) * B, -INFINITY);
      for (int64_t h = h0; h < h0 + KH; ++h) {
        float *ph = p + (h - h0) * B;
        Vec over(0.f);  // the lanes of scores above m + headroom (the first block: all of them, m = −∞)
        const Vec limit(max[h] + kHeadroom);
        for (int64_t r = 0; r < B; r += kLanes) over = over | (Vec::loadu(ph + r) > limit);
        if (over.zero_mask() != (1 << kLanes) - 1) shift_to_max(h, ph, B);
        const Vec m(max[h]);
        Vec sum(0.f);
        for (int64_t r = 0; r < B; r += kLanes) {
          const Vec e = (Vec::loadu(ph + r) - m).exp_u20();
          e.store(ph + r);
          sum = sum + e;
        }
        (Vec::loadu(total + h * kLanes) + sum).store(total + h * kLanes);
      }
      // o += Σ_r p_r ĉ_r: as many columns at once as fit 4 sums per head block (KH = 1: 4 vectors, 2: 2, more: 1)
      constexpr int64_t V = Vec::size(), CV = KH >= 4 ? 1 : 4 / KH;
      int64_t c0 = 0;
      for (; c0 + CV * V <= C; c0 += CV * V) add_weighted<KH, CV>(p, latent, L, n, o + h0 * C, C, c0);
      for (; c0 + V <= C; c0 += V) add_weighted<KH, 1>(p, latent, L, n, o + h0 * C, C, c0);
      if (c0 < C) add_weighted_tail<KH>(p, latent, L, n, o + h0 * C, C, c0, C - c0);
    }
  }

  // m ← the largest of head h's n scores ph where that is larger, its sums rescaled to it
  void shift_to_max(int64_t h, const float *ph, int64_t n) {
    Vec most(-INFINITY);
    for (int64_t r = 0; r < n; r += kLanes) most = at::vec::maximum(most, Vec::loadu(ph + r));
    const float top = at::vec::vec_reduce_all<float>([](Vec &x, Vec &y) { return at::vec::maximum(x, y); }, most);
    if (!(top > max[h])) return;
    const Vec alpha(std::exp(max[h] - top));  // 0 for the first block (m = −∞)
    at::vec::map([alpha](Vec x) { return x * alpha; }, total + h * kLanes, total + h * kLanes, kLanes);
    at::vec::map([alpha](Vec x) { return x * alpha; }, o + h * C, o + h * C, C);
    max[h] = top;
  }
};

// One absorbed-MLA step over a cache (k3.model.mla, §4.4), for each sequence b and head h with q = [q_nope ‖ q_pe]
// [B, H, N+R], the latent cache [B, capacity, C+R] of which the first S positions are read (of row b from
// `first[b]` on, where given: the left padding of a batch of sequences of different lengths), and kv_b_proj's weight
// [H·(N+Vh), C] (W_UK: the first N rows of each head, W_UV: the next Vh):
//   p = softmax_s([W_UKᵀ q_nope ‖ q_pe] · latent_s · scale),  o = W_UV Σ_s p_s ĉ_s,  times σ(gate) when given.
// One pass over the latent: the positions are split into tasks of kSplit rows, each keeps a running softmax of every
// head over its rows (scores and weighted sum of a block of kBlock rows while they are in L1), and the tasks' sums
// are merged at the end (the softmax of the whole row, rescaled to its maximum). Returns [B, H·Vh] in q's dtype.
torch::Tensor mla_step(const torch::Tensor &q_in, const torch::Tensor &latent, int64_t S, const torch::Tensor &kv_b,
                       int64_t N, int64_t Vh, const c10::optional<torch::Tensor> &gate_in, double scale,
                       const c10::optional<torch::Tensor> &first_in) {
  check(latent, "the latent cache");
  check(kv_b, "kv_b_proj.weight");
  const auto q = floats(q_in);
  const int64_t B = latent.size(0), cap = latent.size(1), L = latent.size(2), H = kv_b.size(0) / (N + Vh),
                C = kv_b.size(1), R = L - C;
  // each row's first real position (left padding before it: a batch of sequences of different lengths), or 0
  torch::Tensor first_t;
  if (first_in) {
    first_t = first_in->to(torch::kLong).contiguous();
    TORCH_CHECK(first_t.numel() == B, "decode kernel: one first position per sequence");
  }
  const int64_t *firsts = first_in ? first_t.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; firsts && b < B; ++b)
    TORCH_CHECK(firsts[b] >= 0 && firsts[b] < S, "decode kernel: a sequence's first position is outside the cache");
  TORCH_CHECK(S >= 1 && S <= cap && q.numel() == B * H * (N + R) && kv_b.size(0) == H * (N + Vh),
              "decode kernel: MLA shapes disagree");
  torch::Tensor gate;
  if (gate_in) {
    gate = floats(*gate_in);
    TORCH_CHECK(gate.numel() == B * H * Vh, "decode kernel: the MLA output gate is not [B, H·Vh]");
  }
  const float *g = gate_in ? gate.data_ptr<float>() : nullptr;
  auto out = torch::empty({B, H * Vh}, q.options());
  const float *qp = q.data_ptr<float>();
  float *op = out.data_ptr<float>();
  const int64_t KH = H >= kHeads ? kHeads : H > 2 ? 4 : H;  // heads per block; q_lat padded with zero heads to whole
  const int64_t Hp = (H + KH - 1) / KH * KH;                   // blocks
  std::vector<float> q_lat(B * Hp * L, 0.f);
  typed(kv_b, [&](const auto *wp) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {  // the query in latent space: [W_UKᵀ q_nope ‖ q_pe]
      for (int64_t bh = begin; bh < end; ++bh) {
        const float *qh = qp + bh * (N + R);
        const auto *w_uk = wp + (bh % H) * (N + Vh) * C;
        float *ql = q_lat.data() + ((bh / H) * Hp + bh % H) * L;
        for (int64_t n = 0; n < N; ++n)
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) ql[c] += qh[n] * static_cast<float>(w_uk[n * C + c]);
        for (int64_t r = 0; r < R; ++r) ql[C + r] = qh[N + r];
        for (int64_t c = 0; c < L; ++c) ql[c] *= static_cast<float>(scale);  // the scores come out scaled
      }
    });
  });
  const int64_t splits = (S + kSplit - 1) / kSplit, tasks = B * splits;
  constexpr int64_t lanes = RunningSoftmax::kLanes;
  std::vector<float> max(tasks * Hp, -INFINITY), total(tasks * Hp * lanes, 0.f), o_task(tasks * Hp * C, 0.f);
  typed(latent, [&](const auto *lp) {
    constexpr int64_t block = kBlock<std::remove_const_t<std::remove_pointer_t<decltype(lp)>>>;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / splits, last = std::min(S, (t % splits + 1) * kSplit),
                      first = std::max((t % splits) * kSplit, firsts ? firsts[b] : 0);  // none: an empty task
        RunningSoftmax run{Hp, C, max.data() + t * Hp, total.data() + t * Hp * lanes, o_task.data() + t * Hp * C};
        for (int64_t s = first; s < last; s += block) {
          const float *ql = q_lat.data() + b * Hp * L;
          const auto *rows = lp + (b * cap + s) * L;
          const int64_t n = std::min(block, last - s);
          switch (KH) {
            case 1: run.take<1>(ql, rows, L, n); break;
            case 2: run.take<2>(ql, rows, L, n); break;
            case 4: run.take<4>(ql, rows, L, n); break;
            default: run.take<kHeads>(ql, rows, L, n);
          }
        }
      }
    });
  });
  typed(kv_b, [&](const auto *wp) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {  // merge the tasks; o = W_UV o_lat, gated
      std::vector<float> o_lat(C), o(Vh);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        float top = -INFINITY, sum = 0.f;
        for (int64_t t = b * splits; t < (b + 1) * splits; ++t) top = std::max(top, max[t * Hp + h]);
        std::fill(o_lat.begin(), o_lat.end(), 0.f);
        for (int64_t t = b * splits; t < (b + 1) * splits; ++t) {
          const float w = std::exp(max[t * Hp + h] - top);
          sum += w * std::accumulate(&total[(t * Hp + h) * lanes], &total[(t * Hp + h + 1) * lanes], 0.f);
          const float *ot = o_task.data() + (t * Hp + h) * C;
          for (int64_t c = 0; c < C; ++c) o_lat[c] += w * ot[c];
        }
        rows_dot(wp + (h * (N + Vh) + N) * C, Vh, C, o_lat.data(), o.data());
        for (int64_t v = 0; v < Vh; ++v) op[bh * Vh + v] = g ? o[v] / sum * sigmoid(g[bh * Vh + v]) : o[v] / sum;
      }
    });
  });
  return like(out, q_in);
}

// ---- A whole decoder layer of a one-token step (k3.inference.compiled_step, docs/architecture.md §0.6) ----

// The tensors of a decoder layer by their checkpoint names relative to the layer ("self_attn.q_proj.weight", …)
class Weights {
 public:
  explicit Weights(py::dict tensors) : tensors_(std::move(tensors)) {}
  // whether the kernel takes every tensor: fp32 or bf16 (a bf16 model's weights, its §0.4 tensors fp32), or the
  // uint8 pair of an MXFP4 expert weight, on the CPU, no tensor subclass that dispatches in Python (a DTensor, say)
  // — checked here, once per call, at a fraction of the cost of the same checks in Python
  bool served() const {
    for (const auto &item : tensors_) {
      const auto t = item.second.cast<torch::Tensor>();
      if (!(k3::readable(t) || (t.scalar_type() == torch::kByte && t.device().is_cpu() && mxfp4_part(item.first))) ||
          t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python))
        return false;
    }
    return true;
  }
  bool has(const std::string &name) const { return tensors_.contains(name); }
  torch::Tensor operator()(const std::string &name) const {
    auto t = raw(name);
    check(t, name.c_str());
    return t;
  }
  // the stacked routed-expert weight `name` ("block_sparse_moe.experts.w1"): dense, or its MXFP4 pair
  ExpertWeight experts(const std::string &name) const {
    if (has(name + ".weight_packed"))
      return ExpertWeight(raw(name + ".weight_packed"), raw(name + ".weight_scale"), name.c_str());
    return ExpertWeight((*this)(name), c10::nullopt, name.c_str());
  }

 private:
  static bool mxfp4_part(const py::handle &name) {
    const auto n = name.cast<std::string>();
    const auto ends = [&](const std::string &tail) {
      return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
    };
    return ends(".weight_packed") || ends(".weight_scale");
  }
  torch::Tensor raw(const std::string &name) const {
    TORCH_CHECK(has(name), "decode kernel: the layer has no tensor ", name);
    auto t = tensors_[py::str(name)].cast<torch::Tensor>();
    if (!t.is_contiguous()) t = t.contiguous();  // (a parameter always is: no dispatch on the usual path)
    return t;
  }

 private:
  py::dict tensors_;
};

// The numbers of the configuration a layer step reads (k3.inference.compiled_step.options names them)
struct Options {
  double eps, lora_eps, scale, scaling;
  c10::optional<double> lower_bound;  // KDA's bounded gate; none: the softplus form
  int64_t nope_dim, v_dim, top_k;
  bool renormalize;
  Activation act;

  explicit Options(const py::dict &d)
      : eps(d["eps"].cast<double>()), lora_eps(d["lora_eps"].cast<double>()), scale(d["scale"].cast<double>()),
        scaling(d["scaling"].cast<double>()), lower_bound(d["lower_bound"].cast<c10::optional<double>>()),
        nope_dim(d["nope_dim"].cast<int64_t>()), v_dim(d["v_dim"].cast<int64_t>()), top_k(d["top_k"].cast<int64_t>()),
        renormalize(d["renormalize"].cast<bool>()),
        act{d["situ"].cast<bool>(), d["beta1"].cast<float>(), d["beta2"].cast<float>()} {}
};

// KDA (the steps of k3.model.kda.KimiDeltaAttention.forward): the six projections of x in one pass, the step, o_proj
torch::Tensor kda_mixer(const torch::Tensor &x, const Weights &w, const Options &o, const torch::Tensor &conv_state,
                        const torch::Tensor &state) {
  const bool full_rank = w.has("self_attn.g_proj.weight");
  auto p = k3::linears(x, {w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight"),
                           w("self_attn.f_a_proj.weight"), w("self_attn.b_proj.weight"),
                           w(full_rank ? "self_attn.g_proj.weight" : "self_attn.g_a_proj.weight")});
  const auto f = k3::linear(p[3], w("self_attn.f_b_proj.weight"));
  const auto z = full_rank ? p[5] : k3::linear(p[5], w("self_attn.g_b_proj.weight"));
  const auto out = kda_step(p[0], p[1], p[2], conv_state, w("self_attn.q_conv1d.weight"),
                            w("self_attn.k_conv1d.weight"), w("self_attn.v_conv1d.weight"), f, w("self_attn.A_log"),
                            w("self_attn.dt_bias"), o.lower_bound.has_value(), o.lower_bound.value_or(0.0), p[4],
                            state, z, w("self_attn.o_norm.weight"), o.eps);
  return k3::linear(out, w("self_attn.o_proj.weight"));
}

// Gated MLA, absorbed (k3.model.mla.GatedMLA.attend_absorbed, NoPE form): the latent [RMSNorm(c) ‖ k_pe] of this token
// written at `start`, the query from c_q = RMSNorm(x W_qaᵀ), the step over the first start + 1 positions, o_proj
torch::Tensor mla_mixer(const torch::Tensor &x, const Weights &w, const Options &o, const torch::Tensor &latent,
                        int64_t start, const c10::optional<torch::Tensor> &first) {
  const bool gated = w.has("self_attn.g_proj.weight");
  std::vector<torch::Tensor> weights{w("self_attn.q_a_proj.weight"), w("self_attn.kv_a_proj_with_mqa.weight")};
  if (gated) weights.push_back(w("self_attn.g_proj.weight"));
  const auto p = k3::linears(x, weights);
  const auto c_norm = w("self_attn.kv_a_layernorm.weight");
  const int64_t B = latent.size(0), cap = latent.size(1), L = latent.size(2), C = c_norm.numel();
  TORCH_CHECK(start >= 0 && start < cap && p[1].numel() == B * L, "decode kernel: MLA latent shapes disagree");
  const auto kv = p[1].view({B, L});
  const auto c = rms_norm(kv.narrow(1, 0, C).contiguous(), c_norm, o.lora_eps, true);
  const float *kvp = kv.data_ptr<float>(), *cp = c.data_ptr<float>();
  typed(latent, [&](auto *lp) {  // in the cache's dtype: rounded once
    for (int64_t b = 0; b < B; ++b) {
      auto *row = lp + (b * cap + start) * L;
      std::copy(cp + b * C, cp + (b + 1) * C, row);
      std::copy(kvp + b * L + C, kvp + (b + 1) * L, row + C);
    }
  });
  const auto q = k3::linear(rms_norm(p[0], w("self_attn.q_a_layernorm.weight"), o.lora_eps, true),
                            w("self_attn.q_b_proj.weight"));
  const auto out = mla_step(q, latent, start + 1, w("self_attn.kv_b_proj.weight"), o.nope_dim, o.v_dim,
                            gated ? c10::optional<torch::Tensor>(p[2]) : c10::nullopt, o.scale, first);
  return k3::linear(out, w("self_attn.o_proj.weight"));
}

// down(act(gate, up)) of a SiTU MLP whose gate and up products are done (k3.model.ffn.SiTUMLP)
torch::Tensor mlp_down(torch::Tensor gate, const torch::Tensor &up, const torch::Tensor &down, const Activation &act) {
  glu(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel(), act);
  return k3::linear(gate, down);
}

// Stable LatentMoE (k3.model.moe.StableLatentMoE): the down projection to the latent and the shared experts' gate and
// up products in one pass, router and routed experts, the latent norm, then the up projection and the shared experts'
// down projection summed in one pass
torch::Tensor moe(const torch::Tensor &x, const Weights &w, const Options &o) {
  const bool shared = w.has("block_sparse_moe.shared_experts.gate_proj.weight");
  std::vector<torch::Tensor> weights{w("block_sparse_moe.routed_expert_down_proj.weight")};
  if (shared) {
    weights.push_back(w("block_sparse_moe.shared_experts.gate_proj.weight"));
    weights.push_back(w("block_sparse_moe.shared_experts.up_proj.weight"));
  }
  const auto p = k3::linears(x, weights);
  auto r = moe_routed(x, p[0], w("block_sparse_moe.gate.weight"), w("block_sparse_moe.gate.e_score_correction_bias"),
                      w.experts("block_sparse_moe.experts.w1"), w.experts("block_sparse_moe.experts.w3"),
                      w.experts("block_sparse_moe.experts.w2"), o.top_k, o.renormalize, o.scaling, o.act.situ, o.act.beta1,
                      o.act.beta2);
  if (w.has("block_sparse_moe.routed_expert_norm.weight"))
    r = rms_norm(r, w("block_sparse_moe.routed_expert_norm.weight"), o.eps, true);
  const auto up = w("block_sparse_moe.routed_expert_up_proj.weight");
  if (!shared) return k3::linear(r, up).view_as(x);
  glu(p[1].data_ptr<float>(), p[2].data_ptr<float>(), p[1].numel(), o.act);  // the shared experts' activation
  return k3::linear_sum({{r, up}, {p[1], w("block_sparse_moe.shared_experts.down_proj.weight")}}).view_as(x);
}

// One decoder layer of §5.3 for one token per sequence (k3.model.k3.K3DecoderLayer.forward): the AttnRes mix of
// bank + [cur], input norm, KDA or MLA, the mix of the (new) bank + [prefix], post norm, dense FFN or MoE. `cur`
// [B, 1, D] is the block's partial sum (the embedding before layer 0); a layer that starts a block banks it first
// (the caller appends it to its bank). `cache`: [conv_state, state] (KDA) or [latent] (MLA), updated in place at
// position `start`; `first` [B]: each sequence's first real cache position (left padding), or none. Returns the new
// partial sum, or None (nothing done) where the kernel does not take the layer's tensors (`Weights::served`). The activations are fp32 inside whatever the model's dtype: cur and the bank are
// widened on entry and the new partial sum is rounded once to cur's dtype (a bf16 model's modules round after every
// operation; the layer's inputs, outputs and caches keep their dtypes).
c10::optional<torch::Tensor> layer_step(std::vector<torch::Tensor> bank, const torch::Tensor &cur_in,
                                        bool starts_block, py::dict tensors, py::dict options,
                                        std::vector<torch::Tensor> cache, int64_t start,
                                        const c10::optional<torch::Tensor> &first) {
  const Weights w(std::move(tensors));
  if (!w.served()) return c10::nullopt;
  const Options o(options);
  const auto cur = floats(cur_in);
  for (auto &source : bank) source = floats(source);
  bank.push_back(cur);
  const auto h = bank.size() == 1 ? cur
                                  : attn_res_mix(bank, w("self_attention_res_norm.weight"),
                                                 w("self_attention_res_proj.weight"), o.eps);
  if (!starts_block) bank.pop_back();  // a layer that starts a block keeps cur among the sources
  const auto x = rms_norm(h, w("input_layernorm.weight"), o.eps, true);
  const bool kda = w.has("self_attn.A_log");
  TORCH_CHECK(cache.size() == (kda ? 2u : 1u), "decode kernel: a KDA layer takes two caches, an MLA layer one");
  const auto a =
      (kda ? kda_mixer(x, w, o, cache[0], cache[1]) : mla_mixer(x, w, o, cache[0], start, first)).view_as(cur);
  const auto prefix = starts_block ? a : cur + a;
  bank.push_back(prefix);
  const auto x2 = rms_norm(attn_res_mix(bank, w("mlp_res_norm.weight"), w("mlp_res_proj.weight"), o.eps),
                           w("post_attention_layernorm.weight"), o.eps, true);
  if (!w.has("mlp.gate_proj.weight")) return like(prefix + moe(x2, w, o), cur_in);
  const auto gu = k3::linears(x2, {w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")});
  return like(prefix + mlp_down(gu[0], gu[1], w("mlp.down_proj.weight"), o.act), cur_in);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMS or L2 normalisation of the rows, times an optional gain (fp32 or bf16)");
  m.def("attn_res_mix", &attn_res_mix, "the Block AttnRes softmax mix of same-shaped sources (fp32 or bf16)");
  m.def("kda_step", &kda_step, "one fused KDA decode step after the projections (fp32 or bf16)");
  m.def("moe_routed", &moe_routed_op,
        "router and routed experts of a MoE layer for a few tokens (fp32 or bf16; experts dense or MXFP4)");
  m.def("mla_step", &mla_step, "one absorbed-MLA step over the latent cache (fp32 or bf16)");
  m.def("layer_step", &layer_step, "one decoder layer for one token per sequence (fp32 or bf16)");
}
