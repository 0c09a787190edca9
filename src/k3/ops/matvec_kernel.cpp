// Few-row products of decoding (k3/ops/matvec.py): the products of `matvec.h` for Python, and the products of
// experts for rows sorted by expert. fp32 or bf16 weights, fp32 sums, outputs in the input's dtype.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "matvec.h"

#include <vector>

namespace {


using k3::kExpertRows;

// x [A, in] with its rows sorted by expert, counts[e] of them for expert e; W [E, out, in] -> y [A, out],
// y[a, i] = Σ_j W[e(a), i, j] x[a, j] (grouped_mm's contract), in x's dtype. A task: kExpertRows rows of one
// expert's weight, taken with all of that expert's rows of x in register tiles (`rows_dot_many`)
torch::Tensor expert_linear(const torch::Tensor &x_in, const torch::Tensor &W, const torch::Tensor &counts) {
  k3::check_product(x_in, W);
  const auto x = k3::floats(x_in);
  const int64_t A = x.size(0), E = W.size(0), out = W.size(1), in = W.size(2);
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous() && counts.numel() == E,
              "matvec kernel: one int64 row count per expert");
  std::vector<int64_t> first(E + 1, 0);  // each expert's first row of x
  const int64_t *cp = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(cp[e] >= 0, "matvec kernel: the counts do not add up to the rows");
    first[e + 1] = first[e] + cp[e];
  }
  TORCH_CHECK(first[E] == A, "matvec kernel: the counts do not add up to the rows");
  std::vector<int64_t> used;  // the experts with rows
  for (int64_t e = 0; e < E; ++e)
    if (cp[e]) used.push_back(e);
  const int64_t blocks = (out + kExpertRows - 1) / kExpertRows;
  auto y = torch::empty({A, out}, x.options());
  const float *xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  k3::typed(W, [&](const auto *wp) {
    at::parallel_for(0, used.size() * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<const float *> xs;
      std::vector<float *> ys;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t e = used[t / blocks], r0 = (t % blocks) * kExpertRows, n = std::min(kExpertRows, out - r0);
        xs.clear(), ys.clear();
        for (int64_t a = first[e]; a < first[e + 1]; ++a) {
          xs.push_back(xp + a * in);
          ys.push_back(yp + a * out + r0);
        }
        k3::rows_dot_many(wp + (e * out + r0) * in, n, in, xs.data(), xs.size(), ys.data());
      }
    });
  });
  return k3::like(y, x_in);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &k3::linear, "x Wᵀ for a few rows of x (fp32 or bf16 weights)");
  m.def("linears", &k3::linears, "x W_kᵀ for several weights W_k in one pass, a few rows of x (fp32 or bf16 weights)");
  m.def("expert_linear", &expert_linear, "x[a] W[e(a)]ᵀ for rows sorted by expert (fp32 or bf16 weights)");
}
