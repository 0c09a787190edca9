// Helpers shared by the compiled CPU kernels of k3/ops (see k3/ops/compiled.py).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

namespace k3 {

// Σ_j a[j] b[j] in fp32 over four vector accumulators: independent FMA chains, so a product of a few rows runs at
// the speed memory streams a weight row, not at the latency of one chain (2–2.4× for weights in cache, measured).
inline float dot(const float *a, const float *b, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t j = 0;
  for (; j + 4 * V <= n; j += 4 * V) {
    s0 = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + j + V), Vec::loadu(b + j + V), s1);
    s2 = at::vec::fmadd(Vec::loadu(a + j + 2 * V), Vec::loadu(b + j + 2 * V), s2);
    s3 = at::vec::fmadd(Vec::loadu(a + j + 3 * V), Vec::loadu(b + j + 3 * V), s3);
  }
  float acc = at::vec::vec_reduce_all<float>([](Vec &x, Vec &y) { return x + y; }, (s0 + s1) + (s2 + s3));
  for (; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// SiTU-GLU of §6.1 on one vector: β₁ tanh(g/β₁) σ(g) · β₂ tanh(u/β₂), with u uncapped where β₂ ≤ 0
inline at::vec::Vectorized<float> situ_glu(const at::vec::Vectorized<float> &g, const at::vec::Vectorized<float> &u,
                                           float beta1, float beta2) {
  using Vec = at::vec::Vectorized<float>;
  const Vec one(1.f), b1(beta1), c = beta2 > 0 ? Vec(beta2) * (u / Vec(beta2)).tanh() : u;
  return b1 * (g / b1).tanh() * (one / (one + g.neg().exp())) * c;
}

}  // namespace k3
