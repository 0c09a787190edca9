// Fused operations of a one-token step (k3/ops/decode.py, docs/architecture.md §0.6): each replaces the dozen or
// more small torch operations whose per-call cost, not their arithmetic, makes up most of a decode step on a CPU.
// fp32, a few rows; the formulas are those of the torch ops they replace (named at each function).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

void check(const torch::Tensor &t, const char *what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(), "decode kernel: ", what,
              " must be a contiguous fp32 CPU tensor");
}

inline float dot(const float *a, const float *b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// 1 / sqrt(Σ x² / n + ε): n = the width for RMS statistics, 1 for the L2 norm
inline float inverse_norm(const float *x, int64_t width, float n, double eps) {
  return 1.f / std::sqrt(dot(x, x, width) / n + static_cast<float>(eps));
}

// RMSNorm / L2 normalisation over the last axis (k3.ops.norm): y = x / sqrt(mean(x²) + ε) (`mean`) or
// x / sqrt(Σ x² + ε), times `weight` [C] when given
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> weight, double eps, bool mean) {
  check(x, "x");
  const int64_t C = x.size(-1), N = x.numel() / C;
  const float *w = nullptr;
  if (weight) {
    check(*weight, "weight");
    TORCH_CHECK(weight->numel() == C, "decode kernel: the norm weight has ", weight->numel(), " entries, x rows ", C);
    w = weight->data_ptr<float>();
  }
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float *xr = xp + n * C;
    float *yr = yp + n * C;
    const float r = inverse_norm(xr, C, mean ? static_cast<float>(C) : 1.f, eps);
    for (int64_t c = 0; c < C; ++c) yr[c] = w ? w[c] * (xr[c] * r) : xr[c] * r;
  }
  return y;
}

// Block AttnRes mix (k3.model.attn_res): per row, p = softmax_s((V_s·q) / sqrt(mean(V_s²) + ε)) with the
// pseudo-query q = γ ⊙ w, then Σ_s p_s V_s in the order of the sources. Each source is [N, D].
torch::Tensor attn_res_mix(std::vector<torch::Tensor> sources, torch::Tensor gamma, torch::Tensor w, double eps) {
  TORCH_CHECK(!sources.empty(), "decode kernel: no sources to mix");
  for (const auto &s : sources) {
    check(s, "every source");
    TORCH_CHECK(s.sizes() == sources[0].sizes(), "decode kernel: the sources differ in shape");
  }
  check(gamma, "the norm gain");
  check(w, "the pseudo-query");
  const int64_t D = sources[0].size(-1), N = sources[0].numel() / D, S = sources.size();
  TORCH_CHECK(gamma.numel() == D && w.numel() == D, "decode kernel: gain and pseudo-query must have ", D, " entries");
  std::vector<float> q(D), p(S);
  for (int64_t d = 0; d < D; ++d) q[d] = gamma.data_ptr<float>()[d] * w.data_ptr<float>()[d];
  auto y = torch::zeros_like(sources[0]);
  float *yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const float *v = sources[s].data_ptr<float>() + n * D;
      p[s] = dot(v, q.data(), D) * inverse_norm(v, D, static_cast<float>(D), eps);
      top = std::max(top, p[s]);
    }
    for (int64_t s = 0; s < S; ++s) total += (p[s] = std::exp(p[s] - top));
    float *yr = yp + n * D;
    for (int64_t s = 0; s < S; ++s) {
      const float *v = sources[s].data_ptr<float>() + n * D, ps = p[s] / total;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yr[d] += ps * v[d];
    }
  }
  return y;
}

// One KDA decode step of one (sequence, head) (k3.model.kda, §3.2, §3.4): short conv + SiLU of the head's q, k, v
// channels (shifting their windows), L2-normalised q·K^-1/2 and k, decay g, β = σ(b), the delta-rule update of the
// state S [K, V] in place, o = Sᵀq, and the gated norm RMSNorm(o)·w·σ(z) written to `out`.
struct KdaStep {
  const float *proj[3], *conv_w[3], *f, *A_log, *dt_bias, *b, *z, *o_norm_w;
  float *conv_state, *state, *out;
  int64_t H, K, W, P;
  float lower_bound, eps;
  bool bounded;

  void operator()(int64_t b_, int64_t h, std::vector<float> &qkv) const {
    const int64_t c0 = h * K;
    for (int s = 0; s < 3; ++s) {  // the three streams q, k, v: window [W−1 past inputs, this input]
      float *window = conv_state + (b_ * 3 + s) * (W - 1) * P;
      const float *x = proj[s] + b_ * P, *w = conv_w[s];
      for (int64_t c = c0; c < c0 + K; ++c) {
        float y = 0.f;
        for (int64_t j = 0; j < W - 1; ++j) y += w[c * W + j] * window[j * P + c];
        y += w[c * W + W - 1] * x[c];
        for (int64_t j = 0; j + 1 < W - 1; ++j) window[j * P + c] = window[(j + 1) * P + c];
        if (W > 1) window[(W - 2) * P + c] = x[c];
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

// q, k, v, f, z [B, P] projections (P = H·K), b [B, H]; conv_state [B, 3, W−1, P] and state [B, H, K, K] updated in
// place; conv weights [P, 1, W]; A_log [H], dt_bias [P], o_norm_w [K]. `bounded`: g = λσ(e^A (f + dt_bias)), else
// g = −e^A softplus(f + dt_bias). Returns the gated-norm output [B, P] (the input of o_proj).
torch::Tensor kda_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor conv_state, torch::Tensor wq,
                       torch::Tensor wk, torch::Tensor wv, torch::Tensor f, torch::Tensor A_log, torch::Tensor dt_bias,
                       bool bounded, double lower_bound, torch::Tensor b, torch::Tensor state, torch::Tensor z,
                       torch::Tensor o_norm_w, double eps) {
  const std::vector<std::pair<const torch::Tensor *, const char *>> all = {
      {&q, "q"}, {&k, "k"}, {&v, "v"}, {&conv_state, "conv_state"}, {&wq, "q_conv1d"}, {&wk, "k_conv1d"},
      {&wv, "v_conv1d"}, {&f, "f"}, {&A_log, "A_log"}, {&dt_bias, "dt_bias"}, {&b, "b"}, {&state, "state"},
      {&z, "z"}, {&o_norm_w, "o_norm"}};
  for (const auto &[t, name] : all) check(*t, name);
  const int64_t B = state.size(0), H = state.size(1), K = state.size(2), P = H * K, W = wq.size(-1);
  TORCH_CHECK(state.dim() == 4 && state.size(3) == K, "decode kernel: the KDA state must be [B, H, K, K]");
  for (const auto *t : {&q, &k, &v, &f, &z})
    TORCH_CHECK(t->numel() == B * P, "decode kernel: a KDA projection is not [B, H·K]");
  TORCH_CHECK(conv_state.numel() == B * 3 * (W - 1) * P && wk.numel() == P * W && wv.numel() == P * W &&
                  wq.numel() == P * W && A_log.numel() == H && dt_bias.numel() == P && b.numel() == B * H &&
                  o_norm_w.numel() == K,
              "decode kernel: KDA parameter or cache shapes disagree");
  auto out = torch::empty({B, P}, q.options());
  const KdaStep step{{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>()},
                     {wq.data_ptr<float>(), wk.data_ptr<float>(), wv.data_ptr<float>()},
                     f.data_ptr<float>(), A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), b.data_ptr<float>(),
                     z.data_ptr<float>(), o_norm_w.data_ptr<float>(), conv_state.data_ptr<float>(),
                     state.data_ptr<float>(), out.data_ptr<float>(), H, K, W, P, static_cast<float>(lower_bound),
                     static_cast<float>(eps), bounded};
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(5 * K);
    for (int64_t t = begin; t < end; ++t) step(t / H, t % H, scratch);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMS or L2 normalisation of the rows, times an optional gain (fp32)");
  m.def("attn_res_mix", &attn_res_mix, "the Block AttnRes softmax mix of same-shaped sources (fp32)");
  m.def("kda_step", &kda_step, "one fused KDA decode step after the projections (fp32)");
}
