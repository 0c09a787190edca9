// Few-row products of decoding, shared by the compiled kernels (k3/ops/matvec.py, k3/ops/decode.py): y = x Wᵀ for x
// with a handful of rows, the regime where a token's step reads every weight once and the time is the memory
// traffic. Each weight row is read once, its dot products with all rows of x taken while it is in cache; output
// rows are split over the threads. Weights fp32 or bf16 (widened exactly as they are read: half the bytes), sums and
// activations fp32; an input given in bf16 is widened once and its products rounded back once.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "kernel_math.h"

#include <algorithm>
#include <vector>

namespace k3 {

// the fewest output rows worth a task of their own: 64 KiB of weights (a smaller matrix is read by one thread,
// cheaper than waking the others)
inline int64_t grain(int64_t row_bytes) { return std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(row_bytes, 1)); }

// whether the kernels read t: fp32 or bf16 on the CPU
inline bool readable(const torch::Tensor &t) {
  return (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16) && t.device().is_cpu();
}

// t as a contiguous fp32 tensor: activations and small vectors given in bf16 are widened once (a few rows)
inline torch::Tensor floats(const torch::Tensor &t) {
  TORCH_CHECK(readable(t), "k3 kernel: fp32 or bf16 CPU tensors");
  return t.to(torch::kFloat).contiguous();
}

// y in the dtype of the activation x it was computed from (fp32 inside the kernels: rounded once)
inline torch::Tensor like(const torch::Tensor &y, const torch::Tensor &x) {
  return x.scalar_type() == torch::kFloat ? y : y.to(x.scalar_type());
}

// f(t's data as stored: a float or c10::BFloat16 pointer), the dtype resolved once per call, not per element (weight
// matrices, the caches written in place)
template <typename F>
decltype(auto) typed(const torch::Tensor &t, F &&f) {
  TORCH_CHECK(readable(t) && t.is_contiguous(), "k3 kernel: contiguous fp32 or bf16 CPU tensors");
  if (t.scalar_type() == torch::kBFloat16) return f(t.data_ptr<c10::BFloat16>());
  return f(t.data_ptr<float>());
}

inline void check_product(const torch::Tensor &x, const torch::Tensor &W) {
  TORCH_CHECK(readable(x) && readable(W) && W.is_contiguous(), "matvec kernel: fp32 or bf16 CPU tensors");
  TORCH_CHECK(x.size(-1) == W.size(-1), "matvec kernel: x and W disagree on the input width");
}

// y[a·y_stride + r] = Σ_j W[r·in + j] x[a·in + j] for the rows r < rows of W and the N rows a of x (`rows_dot_many`:
// each weight row read from memory once, its products with the rows of x taken in register tiles)
template <typename T>
inline void block_product(const T *W, int64_t rows, int64_t in, const float *x, int64_t N, float *y,
                          int64_t y_stride) {
  std::vector<const float *> xs(N);
  std::vector<float *> ys(N);
  for (int64_t a = 0; a < N; ++a) {
    xs[a] = x + a * in;
    ys[a] = y + a * y_stride;
  }
  rows_dot_many(W, rows, in, xs.data(), N, ys.data());
}

// x [..., in] and weights W_k [out_k, in] -> [x W_kᵀ for every k], each [..., out_k] in x's dtype: one pass over all
// the weights' rows, split over the threads (the projections of one input: fewer, larger parallel regions stream
// memory faster)
inline std::vector<torch::Tensor> linears(const torch::Tensor &x_in, const std::vector<torch::Tensor> &Ws) {
  TORCH_CHECK(!Ws.empty(), "matvec kernel: no weights");
  const auto x = floats(x_in);
  std::vector<int64_t> first{0};  // the first row of each weight in the concatenated rows
  std::vector<torch::Tensor> ys;
  for (const auto &W : Ws) {
    check_product(x, W);
    auto sizes = x.sizes().vec();
    sizes.back() = W.size(0);
    ys.push_back(torch::empty(sizes, x.options()));
    first.push_back(first.back() + W.size(0));
  }
  const int64_t in = x.size(-1), N = x.numel() / in;
  const float *xp = x.data_ptr<float>();
  std::vector<float *> yp;
  for (auto &y : ys) yp.push_back(y.data_ptr<float>());
  at::parallel_for(0, first.back(), grain(in * Ws[0].element_size()), [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (; begin < end; ++k) {  // the part of [begin, end) in each weight
      const int64_t stop = std::min(end, first[k + 1]), i = begin - first[k];
      typed(Ws[k], [&](const auto *W) {
        block_product(W + i * in, stop - begin, in, xp, N, yp[k] + i, first[k + 1] - first[k]);
      });
      begin = stop;
    }
  });
  for (auto &y : ys) y = like(y, x_in);
  return ys;
}

// Σ_k x_k W_kᵀ for pairs of x_k [..., in_k] (the same N rows) and W_k [out, in_k] -> [..., out] in the first x's
// dtype: one pass over all the weights' rows, split over the threads (two products that are summed, one parallel
// region)
inline torch::Tensor linear_sum(const std::vector<std::pair<torch::Tensor, torch::Tensor>> &terms) {
  const int64_t out = terms[0].second.size(0), N = terms[0].first.numel() / terms[0].first.size(-1);
  std::vector<torch::Tensor> xs;  // the inputs in fp32
  int64_t row_bytes = 0;          // the weights' bytes per output row, all terms
  for (const auto &[x, W] : terms) {
    check_product(x, W);
    TORCH_CHECK(W.size(0) == out && x.numel() / x.size(-1) == N, "matvec kernel: the terms of a sum disagree");
    xs.push_back(floats(x));
    row_bytes += W.size(1) * W.element_size();
  }
  auto sizes = terms[0].first.sizes().vec();
  sizes.back() = out;
  auto y = torch::zeros(sizes, xs[0].options());
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, out, grain(row_bytes), [&](int64_t begin, int64_t end) {
    std::vector<float> part(N * (end - begin));  // one term's products of these rows, [N, end − begin]
    for (size_t t = 0; t < terms.size(); ++t) {  // each row sums the terms in their order
      const int64_t in = terms[t].second.size(1);
      typed(terms[t].second, [&](const auto *W) {
        block_product(W + begin * in, end - begin, in, xs[t].data_ptr<float>(), N, part.data(), end - begin);
      });
      for (int64_t a = 0; a < N; ++a)
        for (int64_t k = 0; k < end - begin; ++k) yp[a * out + begin + k] += part[a * (end - begin) + k];
    }
  });
  return like(y, terms[0].first);
}

// x [..., in] (N rows), W [out, in] -> y [..., out] in x's dtype, y[a, i] = Σ_j W[i, j] x[a, j]
inline torch::Tensor linear(const torch::Tensor &x, const torch::Tensor &W) { return linears(x, {W})[0]; }

}  // namespace k3
