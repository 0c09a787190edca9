// Few-row products of decoding (k3/ops/matvec.py): y = x Wᵀ for x with a handful of rows, the regime where a
// token's step reads every weight once and the time is the memory traffic. Each weight row is read once, its dot
// products with all rows of x taken while it is in cache; output rows are split over the threads. fp32 only.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "kernel_math.h"

#include <algorithm>
#include <vector>

namespace {

// the fewest output rows worth a task of their own: 64 KiB of weights (a smaller matrix is read by one thread,
// cheaper than waking the others)
inline int64_t grain(int64_t in) { return std::max<int64_t>(16, (64 << 10) / (4 * std::max<int64_t>(in, 1))); }

using k3::dot;

void check(const torch::Tensor &x, const torch::Tensor &W) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && W.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  W.is_contiguous() && x.device().is_cpu() && W.device().is_cpu(),
              "matvec kernel: contiguous fp32 CPU tensors");
  TORCH_CHECK(x.size(-1) == W.size(-1), "matvec kernel: x and W disagree on the input width");
}

// x [..., in] (N rows), W [out, in] -> y [..., out], y[a, i] = Σ_j W[i, j] x[a, j]
torch::Tensor linear(torch::Tensor x, torch::Tensor W) {
  x = x.contiguous();
  check(x, W);
  const int64_t out = W.size(0), in = W.size(1), N = x.numel() / in;
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, out, grain(in), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t a = 0; a < N; ++a) yp[a * out + i] = dot(wp + i * in, xp + a * in, in);
  });
  return y;
}

// x [..., in] and weights W_k [out_k, in] -> [x W_kᵀ for every k]: one pass over all the weights' rows, split over
// the threads (the projections of one input: fewer, larger parallel regions stream memory faster)
std::vector<torch::Tensor> linears(torch::Tensor x, std::vector<torch::Tensor> Ws) {
  x = x.contiguous();
  std::vector<int64_t> first{0};  // the first row of each weight in the concatenated rows
  std::vector<torch::Tensor> ys;
  for (const auto &W : Ws) {
    check(x, W);
    auto sizes = x.sizes().vec();
    sizes.back() = W.size(0);
    ys.push_back(torch::empty(sizes, x.options()));
    first.push_back(first.back() + W.size(0));
  }
  const int64_t in = x.size(-1), N = x.numel() / in;
  const float *xp = x.data_ptr<float>();
  std::vector<const float *> wp;
  std::vector<float *> yp;
  for (size_t k = 0; k < Ws.size(); ++k) wp.push_back(Ws[k].data_ptr<float>()), yp.push_back(ys[k].data_ptr<float>());
  at::parallel_for(0, first.back(), grain(in), [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t r = begin; r < end; ++r) {
      while (r >= first[k + 1]) ++k;
      const int64_t i = r - first[k], out = first[k + 1] - first[k];
      for (int64_t a = 0; a < N; ++a) yp[k][a * out + i] = dot(wp[k] + i * in, xp + a * in, in);
    }
  });
  return ys;
}

// x [A, in] with its rows sorted by expert, counts[e] of them for expert e; W [E, out, in] -> y [A, out],
// y[a, i] = Σ_j W[e(a), i, j] x[a, j] (grouped_mm's contract)
torch::Tensor expert_linear(torch::Tensor x, torch::Tensor W, torch::Tensor counts) {
  check(x, W);
  const int64_t A = x.size(0), E = W.size(0), out = W.size(1), in = W.size(2);
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous() && counts.numel() == E,
              "matvec kernel: one int64 row count per expert");
  std::vector<int64_t> expert(A);
  const int64_t *cp = counts.data_ptr<int64_t>();
  for (int64_t e = 0, a = 0; e < E; ++e) {
    TORCH_CHECK(cp[e] >= 0 && a + cp[e] <= A, "matvec kernel: the counts do not add up to the rows");
    for (int64_t c = 0; c < cp[e]; ++c) expert[a++] = e;
    TORCH_CHECK(e < E - 1 || a == A, "matvec kernel: the counts do not add up to the rows");
  }
  auto y = torch::empty({A, out}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, A * out, grain(in), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / out, i = r % out;
      yp[r] = dot(wp + (expert[a] * out + i) * in, xp + a * in, in);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x Wᵀ for a few rows of x (fp32)");
  m.def("linears", &linears, "x W_kᵀ for several weights W_k in one pass, a few rows of x (fp32)");
  m.def("expert_linear", &expert_linear, "x[a] W[e(a)]ᵀ for rows sorted by expert (fp32)");
}
