// SiTU-GLU in one pass each way (k3/ops/activation.py, docs/architecture.md §6.1), fp32:
//   h = a(g) · c(u),  a(g) = β₁ tanh(g/β₁) σ(g),  c(u) = β₂ tanh(u/β₂) (c(u) = u when β₂ ≤ 0: uncapped)
//   ∂a/∂g = (1 − tanh²(g/β₁)) σ(g) + β₁ tanh(g/β₁) σ(g) (1 − σ(g)),  ∂c/∂u = 1 − tanh²(u/β₂)
// The backward recomputes tanh and σ from g and u instead of keeping them. ATen's vectorised exp (SLEEF) and
// kernel_math.h's tanh do the transcendental work.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "kernel_math.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrain = 4096;

// apply f(offset, count) over [0, n) in vector-sized pieces (the last one partial), split over the threads
template <typename F> void for_each_vector(int64_t n, const F &f) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += Vec::size()) f(i, std::min<int64_t>(Vec::size(), end - i));
  });
}

struct Gate {  // a(g) and ∂a/∂g
  Vec a, da;
};

Gate gate(const Vec &g, float beta1) {
  const Vec one(1.f), b1(beta1);
  const Vec t = k3::tanh(g / b1), s = one / (one + g.neg().exp());
  return {b1 * t * s, (one - t * t) * s + b1 * t * s * (one - s)};
}

void check(const std::vector<torch::Tensor> &ts) {
  for (const auto &t : ts)
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                    t.numel() == ts[0].numel(),
                "situ_glu kernel: contiguous fp32 CPU tensors of one size");
}

torch::Tensor forward(torch::Tensor g, torch::Tensor u, double beta1, double beta2) {
  check({g, u});
  auto h = torch::empty_like(g);
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float *hp = h.data_ptr<float>();
  const float b1 = beta1, b2 = beta2;
  for_each_vector(g.numel(), [&](int64_t i, int64_t n) {
    k3::situ_glu(Vec::loadu(gp + i, n), Vec::loadu(up + i, n), b1, b2).store(hp + i, n);
  });
  return h;
}

std::vector<torch::Tensor> backward(torch::Tensor g, torch::Tensor u, torch::Tensor dh, double beta1, double beta2) {
  check({g, u, dh});
  auto dg = torch::empty_like(g), du = torch::empty_like(u);
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>(), *dhp = dh.data_ptr<float>();
  float *dgp = dg.data_ptr<float>(), *dup = du.data_ptr<float>();
  const float b1 = beta1, b2 = beta2;
  for_each_vector(g.numel(), [&](int64_t i, int64_t n) {
    const Vec uv = Vec::loadu(up + i, n), d = Vec::loadu(dhp + i, n);
    Vec c = uv, dc(1.f);
    if (b2 > 0) {
      const Vec t = k3::tanh(uv / Vec(b2));
      c = Vec(b2) * t;
      dc = Vec(1.f) - t * t;
    }
    const Gate a = gate(Vec::loadu(gp + i, n), b1);
    (d * c * a.da).store(dgp + i, n);
    (d * a.a * dc).store(dup + i, n);
  });
  return {dg, du};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "SiTU-GLU forward (fp32)");
  m.def("backward", &backward, "SiTU-GLU backward (fp32)");
}
