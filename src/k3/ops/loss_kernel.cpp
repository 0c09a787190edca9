// The next-token cross-entropy over rows of logits, fp32, with its backward (k3/ops/loss.py, docs/architecture.md
// §9.9, §0.6). Per row n with target t (rows whose target is the ignore index score 0 and get no gradient):
//   lse = m + log Σ_v exp(x_v − m),  m = max_v x_v;   loss_n = lse − x_t
//   dx_v = g_n (exp(x_v − lse) − [v = t])
// The forward keeps lse per row; the backward recomputes the softmax from it. Each row is read once per pass while
// it stays in L1 — no [N, V] log-softmax, no zero-filled gradient to scatter into.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 4;  // rows per task

void check(const torch::Tensor &logits, const torch::Tensor &targets) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat && logits.is_contiguous() && logits.device().is_cpu() &&
                  logits.dim() == 2,
              "loss kernel: logits must be a contiguous fp32 CPU tensor [rows, vocabulary]");
  TORCH_CHECK(targets.scalar_type() == torch::kLong && targets.is_contiguous() && targets.numel() == logits.size(0),
              "loss kernel: one int64 target per row");
}

bool scored(int64_t t, int64_t V, int64_t ignore_index) {
  if (t == ignore_index) return false;
  TORCH_CHECK(t >= 0 && t < V, "loss kernel: target ", t, " is outside the vocabulary 0..", V - 1);
  return true;
}

// (loss per row [N], lse per row [N])
std::vector<torch::Tensor> forward(torch::Tensor logits, torch::Tensor targets, int64_t ignore_index) {
  check(logits, targets);
  const int64_t N = logits.size(0), V = logits.size(1);
  auto loss = torch::zeros({N}), lse = torch::zeros({N});
  const float *xp = logits.data_ptr<float>();
  const int64_t *tp = targets.data_ptr<int64_t>();
  float *lp = loss.data_ptr<float>(), *sp = lse.data_ptr<float>();
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (!scored(tp[n], V, ignore_index)) continue;
      const float *x = xp + n * V;
      const float m = at::vec::reduce_all<float>([](Vec &a, Vec &b) { return at::vec::maximum(a, b); }, x, V);
      const float total = at::vec::map_reduce_all<float>([m](Vec v) { return (v - Vec(m)).exp(); },
                                                          [](Vec &a, Vec &b) { return a + b; }, x, V);
      sp[n] = m + std::log(total);
      lp[n] = sp[n] - x[tp[n]];
    }
  });
  return {loss, lse};
}

// dlogits [N, V] from the per-row loss gradients g [N]
torch::Tensor backward(torch::Tensor logits, torch::Tensor targets, torch::Tensor lse, torch::Tensor grad,
                       int64_t ignore_index) {
  check(logits, targets);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(lse.numel() == N && grad.numel() == N && lse.is_contiguous() && grad.is_contiguous() &&
                  grad.scalar_type() == torch::kFloat,
              "loss kernel: one lse and one fp32 gradient per row");
  auto dx = torch::empty_like(logits);
  const float *xp = logits.data_ptr<float>(), *sp = lse.data_ptr<float>(), *gp = grad.data_ptr<float>();
  const int64_t *tp = targets.data_ptr<int64_t>();
  float *dp = dx.data_ptr<float>();
  at::parallel_for(0, N, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float *d = dp + n * V;
      if (!scored(tp[n], V, ignore_index)) {
        std::fill(d, d + V, 0.f);
        continue;
      }
      const float s = sp[n], g = gp[n];
      at::vec::map([s, g](Vec v) { return (v - Vec(s)).exp() * Vec(g); }, d, xp + n * V, V);
      d[tp[n]] -= g;
    }
  });
  return dx;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "cross-entropy per row and its log-sum-exp (fp32)");
  m.def("backward", &backward, "the gradient of the per-row cross-entropy with respect to the logits (fp32)");
}
