// MXFP4 rows decoded in registers inside the dot products (docs/architecture.md §11.5), shared by the MXFP4 kernel
// (k3/ops/mxfp4_kernel.cpp) and the decode kernel's routed experts (k3/ops/decode_kernel.cpp): each 32-value block of
// a weight row is decoded in registers (its 16 bytes widened to 32 FP4 codes, the codes looked up in a 16-entry
// table, the block scaled by its E8M0 factor) and consumed at once. The inputs are split once into their even and
// odd elements (`split_even_odd`), which meet the low and the high nibbles of each byte, so no lane is shuffled.
// fp32 activations and accumulation.
#pragma once

#include <torch/extension.h>

#include <array>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace k3::mxfp4 {

constexpr int64_t kGroup = 32;  // weights sharing one E8M0 exponent
constexpr int64_t kMaxRows = 8;  // rows of x one pass over a weight row serves
constexpr float kFP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// 2^(s − 127) for every E8M0 code s (s = 0 is the subnormal 2^−127; 255, NaN, is refused before the call): 256
// floats, built once per process
inline const float *e8m0_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int s = 0; s < 256; ++s) t[s] = std::ldexp(1.f, s - 127);
    return t;
  }();
  return table.data();
}

// acc[r] += Σ over one weight row of w·x_r, for the n rows r of x given as even halves xe[r] and odd halves xo[r]
// (each in/2 long); `packed` in/2 bytes, `scale` in/32 codes
inline void row_dot(const uint8_t *packed, const uint8_t *scale, int64_t in, const float *const *xe,
             const float *const *xo, int64_t n, const float *e8m0, float *out) {
  const int64_t groups = in / kGroup;
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kFP4);
  const __m512i low = _mm512_set1_epi32(0xF);
  __m512 acc[kMaxRows];
  for (int64_t r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(packed + 16 * g)));
    const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(codes, low), table);
    const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    const __m512 s = _mm512_set1_ps(e8m0[scale[g]]);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 t = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xo[r] + 16 * g),
                                       _mm512_mul_ps(even, _mm512_loadu_ps(xe[r] + 16 * g)));
      acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
    }
  }
  for (int64_t r = 0; r < n; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
  // 8 magnitudes by code & 7, the sign bit (code & 8) moved to the float's sign
  const __m256 magnitude = _mm256_loadu_ps(kFP4);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
  auto lookup = [&](__m256i c) {
    const __m256 m = _mm256_permutevar8x32_ps(magnitude, _mm256_and_si256(c, seven));
    return _mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, eight), 28)));
  };
  __m256 acc[kMaxRows];
  for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(e8m0[scale[g]]);
    for (int64_t h = 0; h < 2; ++h) {  // 8 bytes = 8 even and 8 odd elements at a time
      const int64_t j = 16 * g + 8 * h;
      const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(packed + j)));
      const __m256 even = lookup(_mm256_and_si256(codes, _mm256_set1_epi32(0xF)));
      const __m256 odd = lookup(_mm256_srli_epi32(codes, 4));
      for (int64_t r = 0; r < n; ++r) {
        const __m256 t = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xo[r] + j), _mm256_mul_ps(even, _mm256_loadu_ps(xe[r] + j)));
        acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    out[r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
#else
  for (int64_t r = 0; r < n; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.f;
      for (int64_t j = 16 * g; j < 16 * (g + 1); ++j)
        t += kFP4[packed[j] & 0xF] * xe[r][j] + kFP4[packed[j] >> 4] * xo[r][j];
      acc += t * e8m0[scale[g]];
    }
    out[r] = acc;
  }
#endif
}

// one row x [in] -> out [in]: its even elements, then its odd ones (what `row_dot` reads)
inline void split_even_odd(const float *x, int64_t in, float *out) {
  for (int64_t j = 0; j < in / 2; ++j) out[j] = x[2 * j], out[in / 2 + j] = x[2 * j + 1];
}

// x [A, in] contiguous fp32 -> [A, in]: each row split as above
inline torch::Tensor split_even_odd(const torch::Tensor &x) {
  const int64_t in = x.size(-1), A = x.numel() / in;
  auto out = torch::empty({A, in}, x.options());
  const float *xp = x.data_ptr<float>();
  float *op = out.data_ptr<float>();
  for (int64_t a = 0; a < A; ++a) split_even_odd(xp + a * in, in, op + a * in);
  return out;
}

}  // namespace k3::mxfp4
