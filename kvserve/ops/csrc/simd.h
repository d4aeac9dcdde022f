// Small AVX2/FMA helpers shared by the kernels. Every helper has a scalar twin under
// #else so the sources still compile (slowly) for a target without AVX2; the Python side
// only builds with -mavx2 -mfma, so in practice the vector path is the one that runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVS_AVX2 1
#else
#define KVS_AVX2 0
#endif

namespace kvs {

// int64 min/max for the AVX-512 files: std::min / std::max would be template instances made
// under their target pragma (see linear_avx512.cpp); these are compiled here, for the base ISA.
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#if KVS_AVX2

// Mask selecting the first n (0..8) lanes: 8 ones then 8 zeros, read at offset 8 - n.
inline __m256i tail_mask(int64_t n) {
  alignas(32) static const int32_t kBits[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kBits + 8 - n));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Horizontal sums of four vectors at once -> [sum a, sum b, sum c, sum d]. Three hadds
// replace four independent reductions, which matters when K (or D) is only 64..576 long.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b);     // a01 a23 b01 b23 | a45 a67 b45 b67
  __m256 cd = _mm256_hadd_ps(c, d);
  __m256 abcd = _mm256_hadd_ps(ab, cd); // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Eight horizontal sums -> one vector, lane i = sum of v[i].
inline __m256 reduce8(const __m256* v) {
  __m256 ab = _mm256_hadd_ps(v[0], v[1]);
  __m256 cd = _mm256_hadd_ps(v[2], v[3]);
  __m256 ef = _mm256_hadd_ps(v[4], v[5]);
  __m256 gh = _mm256_hadd_ps(v[6], v[7]);
  __m256 abcd = _mm256_hadd_ps(ab, cd);  // a b c d (low half) | a b c d (high half)
  __m256 efgh = _mm256_hadd_ps(ef, gh);
  __m256 lo = _mm256_permute2f128_ps(abcd, efgh, 0x20);
  __m256 hi = _mm256_permute2f128_ps(abcd, efgh, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Loads the int8-activation kernels (qlinear.cpp, qlinear_kquant.cpp) share.
inline __m256i bcast4(const int8_t* p) {  // the 4 activation bytes at p, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256 load_halves8(const uint8_t* p) {  // 8 fp16 -> fp32, exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp(x) for fp32 lanes: x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to
// degree 7 (truncation error r^8/8! < 6e-9, below fp32 rounding), times 2^n built in the
// exponent bits. Inputs below -87.3 give 0 (so exp(-inf) = 0, which masking relies on).
inline __m256 exp(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.37f);
  const __m256 lo = _mm256_set1_ps(-87.33f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in a part exact in fp32 and a correction, so n * ln2_hi has no rounding error.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

#endif  // KVS_AVX2

// IEEE half -> float (exact). F16C where the build has it, else bit arithmetic.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && KVS_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, 2);
  return v;
}

// Scalar twins, used for tails and by the non-AVX2 build.
inline float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace kvs
