// Row normalisations and the Block AttnRes mix with their backward, fp32, for calls of many rows (training and
// prefill; k3/ops/norm.py, docs/architecture.md §0.2, §5.1). Each is one pass over the rows each way instead of a
// dozen torch operations over the whole tensor and their autograd nodes. Per row, n = the width (RMS) or 1 (L2):
//   norm:     r = 1/sqrt(Σ x² / n + ε), y = x r (⊙ w)
//             dx = r (g − x r² (g·x) / n) with g = dy (⊙ w),  dw = Σ_rows dy ⊙ x r
//   AttnRes:  r_s = 1/sqrt(Σ V_s² / D + ε), l_s = r_s (V_s·q), p = softmax_s(l), y = Σ_s p_s V_s
//             dp_s = dy·V_s, dl_s = p_s (dp_s − Σ_j p_j dp_j),
//             dV_s = p_s dy + dl_s r_s (q − r_s² (V_s·q) V_s / D),  dq = Σ_rows Σ_s dl_s r_s V_s
// The forward keeps r (and p) per row for the backward; the sums over rows (dw, dq) are k3::ThreadSums.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "kernel_math.h"

#include <vector>

namespace {

constexpr int64_t kRows = 16;  // rows per task

void check(const torch::Tensor &t, const char *what, int64_t width) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() && t.dim() >= 1 &&
                  t.size(-1) == width,
              "norm kernel: ", what, " must be a contiguous fp32 CPU tensor of rows of ", width);
}

// y and r [rows] of the norm (no weight: no gain)
std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, c10::optional<torch::Tensor> weight, double eps,
                                            bool mean) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  check(x, "x", C);
  if (weight) check(*weight, "the weight", C);
  auto y = torch::empty_like(x);
  auto r = torch::empty({N});
  const float *xp = x.data_ptr<float>(), *w = weight ? weight->data_ptr<float>() : nullptr;
  float *yp = y.data_ptr<float>(), *rp = r.data_ptr<float>();
  const float n = mean ? static_cast<float>(C) : 1.f;
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rp[i] = k3::normalize_row(xp + i * C, w, yp + i * C, C, n, eps);
  });
  return {y, r};
}

// dx, and dw (None without a weight)
std::vector<torch::Tensor> rms_norm_backward(torch::Tensor x, c10::optional<torch::Tensor> weight, torch::Tensor r,
                                             torch::Tensor dy, bool mean) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  check(x, "x", C);
  check(dy, "dy", C);
  TORCH_CHECK(r.numel() == N && r.is_contiguous(), "norm kernel: one r per row");
  const bool gain = weight.has_value();
  if (gain) check(*weight, "the weight", C);
  auto dx = torch::empty_like(x);
  k3::ThreadSums dw(gain ? C : 0);
  const float *xp = x.data_ptr<float>(), *w = gain ? weight->data_ptr<float>() : nullptr, *rp = r.data_ptr<float>(),
              *dyp = dy.data_ptr<float>();
  float *dxp = dx.data_ptr<float>();
  const float n = mean ? static_cast<float>(C) : 1.f;
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    std::vector<float> g(C);
    double *dw_mine = gain ? dw.mine() : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const float *xr = xp + i * C, *dyr = dyp + i * C, ri = rp[i];
      for (int64_t c = 0; c < C; ++c) g[c] = gain ? dyr[c] * w[c] : dyr[c];
      const float coef = ri * ri * k3::dot(g.data(), xr, C) / n;
      float *dxr = dxp + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxr[c] = ri * (g[c] - xr[c] * coef);
      if (gain) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) dw_mine[c] += dyr[c] * (xr[c] * ri);
      }
    }
  });
  return {dx, gain ? dw.total() : torch::Tensor()};
}

struct Sources {
  std::vector<const float *> base;
  int64_t S, D, N;
  explicit Sources(const std::vector<torch::Tensor> &sources) : S(sources.size()) {
    TORCH_CHECK(S > 0, "norm kernel: no sources to mix");
    D = sources[0].size(-1);
    N = sources[0].numel() / D;
    for (const auto &V : sources) {
      check(V, "every source", D);
      TORCH_CHECK(V.numel() == N * D, "norm kernel: the sources differ in shape");
      base.push_back(V.data_ptr<float>());
    }
  }
  void row(int64_t i, std::vector<const float *> &V) const {
    for (int64_t s = 0; s < S; ++s) V[s] = base[s] + i * D;
  }
};

// y, p [N, S] and r [N, S] of the AttnRes mix with pseudo-query q [D]
std::vector<torch::Tensor> mix_forward(std::vector<torch::Tensor> sources, torch::Tensor q, double eps) {
  const Sources src(sources);
  const int64_t S = src.S, D = src.D, N = src.N;
  check(q, "the pseudo-query", D);
  auto y = torch::empty_like(sources[0]);
  auto p = torch::empty({N, S}), r = torch::empty({N, S});
  const float *qp = q.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *pp = p.data_ptr<float>(), *rp = r.data_ptr<float>();
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    std::vector<const float *> V(S);
    for (int64_t i = begin; i < end; ++i) {
      src.row(i, V);
      k3::mix_row(V.data(), S, qp, D, eps, pp + i * S, rp + i * S, yp + i * D);
    }
  });
  return {y, p, r};
}

// the S source gradients, then dq
std::vector<torch::Tensor> mix_backward(std::vector<torch::Tensor> sources, torch::Tensor q, torch::Tensor p,
                                        torch::Tensor r, torch::Tensor dy) {
  const Sources src(sources);
  const int64_t S = src.S, D = src.D, N = src.N;
  check(q, "the pseudo-query", D);
  check(dy, "dy", D);
  check(p, "p", S);
  check(r, "r", S);
  TORCH_CHECK(p.numel() == N * S && r.numel() == N * S, "norm kernel: p and r must be [rows, sources]");
  std::vector<torch::Tensor> grads;
  std::vector<float *> dbase;
  for (const auto &V : sources) {
    grads.push_back(torch::empty_like(V));
    dbase.push_back(grads.back().data_ptr<float>());
  }
  k3::ThreadSums dq(D);
  const float *qp = q.data_ptr<float>(), *pp = p.data_ptr<float>(), *rp = r.data_ptr<float>(),
              *dyp = dy.data_ptr<float>();
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    std::vector<const float *> V(S);
    std::vector<double> dp(S), vq(S);
    double *dq_mine = dq.mine();
    for (int64_t i = begin; i < end; ++i) {
      src.row(i, V);
      const float *pi = pp + i * S, *ri = rp + i * S, *dyr = dyp + i * D;
      double mean_dp = 0.;
      for (int64_t s = 0; s < S; ++s) {
        dp[s] = k3::dot64(dyr, V[s], D);
        vq[s] = k3::dot64(V[s], qp, D);
        mean_dp += pi[s] * dp[s];
      }
      for (int64_t s = 0; s < S; ++s) {  // the three terms of dV in float64: they cancel
        const double ps = pi[s], dl = ps * (dp[s] - mean_dp), a = dl * ri[s], b = a * ri[s] * ri[s] * vq[s] / D;
        const float *v = V[s];
        float *dv = dbase[s] + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          dv[d] = static_cast<float>(ps * dyr[d] + a * qp[d] - b * v[d]);
          dq_mine[d] += a * v[d];
        }
      }
    }
  });
  grads.push_back(dq.total());
  return grads;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm / L2 normalisation of rows, and 1/norm per row (fp32)");
  m.def("rms_norm_backward", &rms_norm_backward, "their backward: dx, dw (fp32)");
  m.def("mix_forward", &mix_forward, "Block AttnRes mix of same-shaped sources: y, p, r (fp32)");
  m.def("mix_backward", &mix_backward, "its backward: the source gradients, then dq (fp32)");
}
