// MXFP4 expert products without a dense expert (k3/ops/mxfp4.py, docs/architecture.md §11.5): the few-row products
// decode each weight block in registers (mxfp4.h); the many-row path decodes tiles for a matrix product.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "mxfp4.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using k3::mxfp4::e8m0_table;
using k3::mxfp4::kFP4;
using k3::mxfp4::kGroup;
using k3::mxfp4::kMaxRows;
using k3::mxfp4::row_dot;

void check_pair(const torch::Tensor &packed, const torch::Tensor &scale) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && scale.scalar_type() == torch::kByte && packed.is_contiguous() &&
                  scale.is_contiguous() && packed.device().is_cpu() && scale.device().is_cpu(),
              "mxfp4 kernel: contiguous uint8 CPU weights");
  TORCH_CHECK(packed.dim() == scale.dim() && packed.size(-1) == 16 * scale.size(-1),
              "mxfp4 kernel: packed [..., in/2] and scale [..., in/32] disagree");
}

// x [A, in] fp32 with its rows sorted by expert, counts[e] of them for expert e; the experts' weights as packed
// [E, out, in/2] / scale [E, out, in/32] -> y [A, out], y[a, o] = Σ_j W[e(a), o, j] x[a, j] (grouped_mm's contract)
torch::Tensor expert_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor counts) {
  check_pair(packed, scale);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && packed.dim() == 3,
              "mxfp4 kernel: x [A, in] contiguous fp32, weights [E, out, in/2]");
  const int64_t A = x.size(0), in = x.size(1), E = packed.size(0), out = packed.size(1);
  TORCH_CHECK(in == 2 * packed.size(2) && in % kGroup == 0, "mxfp4 kernel: x and the weights disagree on the width");
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous() && counts.numel() == E,
              "mxfp4 kernel: one int64 row count per expert");
  // the experts with rows: (expert, first row, rows), each served by passes of at most kMaxRows rows
  struct Block { int64_t expert, row, n; };
  std::vector<Block> blocks;
  const int64_t *cp = counts.data_ptr<int64_t>();
  for (int64_t e = 0, a = 0; e < E; a += cp[e++]) {
    TORCH_CHECK(cp[e] >= 0 && a + cp[e] <= A, "mxfp4 kernel: the counts do not add up to the rows");
    for (int64_t c = 0; c < cp[e]; c += kMaxRows) blocks.push_back({e, a + c, std::min(kMaxRows, cp[e] - c)});
    TORCH_CHECK(e < E - 1 || a + cp[e] == A, "mxfp4 kernel: the counts do not add up to the rows");
  }
  // the rows of x split into even and odd elements: xs [A, in]
  auto xs = k3::mxfp4::split_even_odd(x);
  auto y = torch::empty({A, out}, x.options());
  const float *e8m0 = e8m0_table();
  const uint8_t *pp = packed.data_ptr<uint8_t>(), *sp = scale.data_ptr<uint8_t>();
  const float *xp = xs.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  // tasks: output rows of every block; ≈ 64 KiB of packed weights per task at the least
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) * out, std::max<int64_t>(16, (128 << 10) / in),
                   [&](int64_t begin, int64_t end) {
    const float *xe[kMaxRows], *xo[kMaxRows];
    float dots[kMaxRows];
    for (int64_t t = begin; t < end; ++t) {
      const Block &b = blocks[t / out];
      const int64_t o = t % out, row = b.expert * out + o;
      for (int64_t r = 0; r < b.n; ++r) xe[r] = xp + (b.row + r) * in, xo[r] = xe[r] + in / 2;
      row_dot(pp + row * (in / 2), sp + row * (in / kGroup), in, xe, xo, b.n, e8m0, dots);
      for (int64_t r = 0; r < b.n; ++r) yp[(b.row + r) * out + o] = dots[r];
    }
  });
  return y;
}

// one weight row decoded: `packed` in/2 bytes and `scale` in/32 codes -> out [in], fp32 or bf16 (exact: every
// MXFP4 value is a bf16 value, so the bf16 bits are the fp32 bits' upper half)
inline uint16_t upper_half(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void decode_row(const uint8_t *packed, const uint8_t *scale, int64_t in, const float *e8m0, T *out) {
  int64_t g = 0;
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kFP4);
  const __m512i low = _mm512_set1_epi32(0xF);
  // element 2j of a block is the low nibble of byte j (`even` lane j), element 2j + 1 its high nibble (`odd` lane j)
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (; g < in / kGroup; ++g) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(packed + 16 * g)));
    const __m512 s = _mm512_set1_ps(e8m0[scale[g]]);
    const __m512 even = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, low), table), s);
    const __m512 odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table), s);
    const __m512 halves[2] = {_mm512_permutex2var_ps(even, first, odd), _mm512_permutex2var_ps(even, second, odd)};
    for (int h = 0; h < 2; ++h) {
      T *o = out + kGroup * g + 16 * h;
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(o, halves[h]);
      } else {
        const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(halves[h]), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(o), bits);
      }
    }
  }
#endif
  for (; g < in / kGroup; ++g) {
    const float s = e8m0[scale[g]];
    for (int64_t j = 16 * g; j < 16 * (g + 1); ++j)
      for (int h = 0; h < 2; ++h) {
        const float v = kFP4[h ? packed[j] >> 4 : packed[j] & 0xF] * s;
        if constexpr (std::is_same_v<T, float>)
          out[2 * j + h] = v;
        else
          out[2 * j + h] = c10::BFloat16(upper_half(v), c10::BFloat16::from_bits());
      }
  }
}

// packed [R, in/2] / scale [R, in/32] -> out [R, in], fp32 or bf16 (a tile of experts, for the matmul of many rows)
void dequantize(torch::Tensor packed, torch::Tensor scale, torch::Tensor out) {
  check_pair(packed, scale);
  TORCH_CHECK((out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16) && out.is_contiguous() &&
                  out.numel() == 2 * packed.numel(),
              "mxfp4 kernel: out must be contiguous fp32 or bf16 with two values per packed byte");
  const int64_t bytes = packed.size(-1), in = 2 * bytes, rows = packed.numel() / std::max<int64_t>(bytes, 1);
  const float *e8m0 = e8m0_table();
  const uint8_t *pp = packed.data_ptr<uint8_t>(), *sp = scale.data_ptr<uint8_t>();
  const auto decode = [&](auto *op) {
    at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bytes, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) decode_row(pp + r * bytes, sp + r * (in / kGroup), in, e8m0, op + r * in);
    });
  };
  if (out.scalar_type() == torch::kBFloat16)
    decode(out.data_ptr<c10::BFloat16>());
  else
    decode(out.data_ptr<float>());
}

// nearest FP4 code of |v| (0..7) with ties to the even code, saturating at 6: the count of the grid's midpoints
// below |v|, or of those at most |v| where the first count is odd (k3.ops.mxfp4._round_to_fp4_codes)
inline uint8_t fp4_code(float magnitude) {
  constexpr float kMidpoints[7] = {.25f, .75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  uint8_t below = 0, at_most = 0;
  for (float m : kMidpoints) below += m < magnitude, at_most += m <= magnitude;
  return below % 2 == 0 ? below : at_most;
}

// w [R, in] fp32 -> packed [R, in/2], scale [R, in/32] (k3.ops.mxfp4.encode_mxfp4): per group of 32 the E8M0 code
// s = clamp(floor(log2 max|x|) − 2 + 127, 0, 254) (0 for a zero group), codes of x · 2^(127 − s)
void quantize(torch::Tensor w, torch::Tensor packed, torch::Tensor scale) {
  check_pair(packed, scale);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == 2 * packed.numel(),
              "mxfp4 kernel: w must be contiguous fp32 with two values per packed byte");
  const int64_t groups = scale.numel();
  const float *wp = w.data_ptr<float>();
  uint8_t *pp = packed.data_ptr<uint8_t>(), *sp = scale.data_ptr<uint8_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, groups, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float *x = wp + g * kGroup;
      float amax = 0.f;
      bool group_finite = true;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i])), group_finite &= std::isfinite(x[i]);
      if (!group_finite) finite = false;
      int exponent = 0;
      std::frexp(amax, &exponent);  // amax = m · 2^exponent, m in [0.5, 1): floor(log2 amax) = exponent − 1
      const uint8_t s = amax > 0.f ? static_cast<uint8_t>(std::clamp(exponent - 1 - 2 + 127, 0, 254)) : 0;
      sp[g] = s;
      for (int64_t i = 0; i < kGroup; i += 2) {
        uint8_t byte = 0;
        for (int64_t h = 0; h < 2; ++h) {
          const float v = std::ldexp(x[i + h], 127 - s);
          byte |= static_cast<uint8_t>(fp4_code(std::fabs(v)) | (std::signbit(v) ? 8 : 0)) << (4 * h);
        }
        pp[g * (kGroup / 2) + i / 2] = byte;
      }
    }
  });
  TORCH_CHECK(finite.load(), "cannot MXFP4-encode a weight containing inf or NaN");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("expert_linear", &expert_linear, "x[a] W[e(a)]ᵀ for rows sorted by expert, W in MXFP4 (fp32 x)");
  m.def("dequantize", &dequantize, "MXFP4 rows decoded into an fp32 or bf16 buffer");
  m.def("quantize", &quantize, "fp32 rows encoded to MXFP4 (OCP-MX rounding)");
}
