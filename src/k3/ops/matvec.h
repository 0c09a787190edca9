// Few-row products of decoding, shared by the compiled kernels (k3/ops/matvec.py, k3/ops/decode.py): y = x Wᵀ for x
// with a handful of rows, the regime where a token's step reads every weight once and the time is the memory
// traffic. Each weight row is read once, its dot products with all rows of x taken while it is in cache; output
// rows are split over the threads. fp32 only.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "kernel_math.h"

#include <algorithm>
#include <vector>

namespace k3 {

// the fewest output rows worth a task of their own: 64 KiB of weights (a smaller matrix is read by one thread,
// cheaper than waking the others)
inline int64_t grain(int64_t in) { return std::max<int64_t>(16, (64 << 10) / (4 * std::max<int64_t>(in, 1))); }

inline void check_product(const torch::Tensor &x, const torch::Tensor &W) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && W.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  W.is_contiguous() && x.device().is_cpu() && W.device().is_cpu(),
              "matvec kernel: contiguous fp32 CPU tensors");
  TORCH_CHECK(x.size(-1) == W.size(-1), "matvec kernel: x and W disagree on the input width");
}

// y[a·y_stride + r] = Σ_j W[r·in + j] x[a·in + j] for the rows r < rows of W and the N rows a of x: blocks of
// kRowBlock weight rows (`rows_dot`), each block taken with every row of x while it is in cache
inline void block_product(const float *W, int64_t rows, int64_t in, const float *x, int64_t N, float *y,
                          int64_t y_stride) {
  for (int64_t r = 0; r < rows; r += kRowBlock)
    for (int64_t a = 0; a < N; ++a)
      rows_dot(W + r * in, std::min(kRowBlock, rows - r), in, x + a * in, y + a * y_stride + r);
}

// x [..., in] and weights W_k [out_k, in] -> [x W_kᵀ for every k], each [..., out_k]: one pass over all the
// weights' rows, split over the threads (the projections of one input: fewer, larger parallel regions stream
// memory faster)
inline std::vector<torch::Tensor> linears(torch::Tensor x, const std::vector<torch::Tensor> &Ws) {
  x = x.contiguous();
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
  std::vector<const float *> wp;
  std::vector<float *> yp;
  for (size_t k = 0; k < Ws.size(); ++k) wp.push_back(Ws[k].data_ptr<float>()), yp.push_back(ys[k].data_ptr<float>());
  at::parallel_for(0, first.back(), grain(in), [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (; begin < end; ++k) {  // the part of [begin, end) in each weight
      const int64_t stop = std::min(end, first[k + 1]), i = begin - first[k];
      block_product(wp[k] + i * in, stop - begin, in, xp, N, yp[k] + i, first[k + 1] - first[k]);
      begin = stop;
    }
  });
  return ys;
}

// Σ_k x_k W_kᵀ for pairs of x_k [..., in_k] (the same N rows) and W_k [out, in_k] -> [..., out] of the first x: one
// pass over all the weights' rows, split over the threads (two products that are summed, one parallel region)
inline torch::Tensor linear_sum(const std::vector<std::pair<torch::Tensor, torch::Tensor>> &terms) {
  const int64_t out = terms[0].second.size(0), N = terms[0].first.numel() / terms[0].first.size(-1);
  for (const auto &[x, W] : terms) {
    check_product(x, W);
    TORCH_CHECK(W.size(0) == out && x.numel() / x.size(-1) == N, "matvec kernel: the terms of a sum disagree");
  }
  auto sizes = terms[0].first.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, terms[0].first.options());
  float *yp = y.data_ptr<float>();
  struct Term {
    const float *x, *W;
    int64_t in;
  };
  std::vector<Term> ts;
  int64_t row_width = 0;  // the weights' numbers per output row, all terms
  for (const auto &[x, W] : terms) {
    ts.push_back({x.data_ptr<float>(), W.data_ptr<float>(), W.size(1)});
    row_width += W.size(1);
  }
  at::parallel_for(0, out, grain(row_width), [&](int64_t begin, int64_t end) {
    float part[kRowBlock];
    for (int64_t i = begin; i < end; i += kRowBlock) {  // blocks of rows, as in block_product
      const int64_t n = std::min(kRowBlock, end - i);
      for (int64_t a = 0; a < N; ++a) {
        float *y_a = yp + a * out + i;
        std::fill(y_a, y_a + n, 0.f);
        for (const auto &t : ts) {
          rows_dot(t.W + i * t.in, n, t.in, t.x + a * t.in, part);
          for (int64_t k = 0; k < n; ++k) y_a[k] += part[k];
        }
      }
    }
  });
  return y;
}

// x [..., in] (N rows), W [out, in] -> y [..., out], y[a, i] = Σ_j W[i, j] x[a, j]
inline torch::Tensor linear(const torch::Tensor &x, const torch::Tensor &W) { return linears(x, {W})[0]; }

}  // namespace k3
