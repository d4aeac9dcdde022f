// Row-wise ops of a decoder layer, each a single pass over its input that writes fresh
// outputs (never the inputs): RMSNorm, residual add + RMSNorm, SiLU(gate) * up, RoPE, and
// the K/V scatter into the paged cache.
//
// At decode sizes (a few rows of 576) these take microseconds, so the gain over torch is
// fusion (one pass, no temporaries); threads are only woken for prefill-sized inputs.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace kvs {
namespace {

// Elements below which one thread does the whole op: ~32K floats is ~10 us of work,
// comfortably above the cost of an OpenMP fork/join on a warm pool. Kept high on purpose:
// a decode-sized op gains ~2 us from a second thread, but when another process holds a
// core, every fork/join can wait a scheduler tick (4-16 ms measured) for it.
constexpr int64_t kParallelElems = 1 << 15;

inline bool go_parallel(int nthreads, int64_t rows, int64_t elems) {
  return nthreads > 1 && rows > 1 && elems >= kParallelElems;
}

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if KVS_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 x0 = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
  }
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out = (x * inv) * w, the reference's order of rounding.
inline void scale_mul(const float* x, float inv, const float* w, float* out, int64_t n) {
  int64_t i = 0;
#if KVS_AVX2
  const __m256 vi = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi),
                                            _mm256_loadu_ps(w + i)));
#endif
  for (; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

inline float rms_inv(float ss, int64_t n, float eps) {
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

}  // namespace

void rms_norm(const float* x, int64_t ldx, const float* w, float* out, int64_t rows, int64_t n,
              float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (go_parallel(nthreads, rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    scale_mul(xr, rms_inv(sum_squares(xr, n), n, eps), w, out + r * n, n);
  }
}

void add_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr,
                  const float* w, float* out, float* res_out, int64_t rows, int64_t n,
                  float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (go_parallel(nthreads, rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float* rr = residual + r * ldr;
    float* h = res_out + r * n;
    // Pass 1 writes the new residual and its sum of squares; pass 2 re-reads it from L1.
    int64_t i = 0;
    float ss = 0.f;
#if KVS_AVX2
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i));
      _mm256_storeu_ps(h + i, v);
      a = _mm256_fmadd_ps(v, v, a);
    }
    ss = hsum(a);
#endif
    for (; i < n; ++i) {
      h[i] = xr[i] + rr[i];
      ss += h[i] * h[i];
    }
    scale_mul(h, rms_inv(ss, n, eps), w, out + r * n, n);
  }
}

void silu_and_mul(const float* x, int64_t ldx, float* out, int64_t rows, int64_t n,
                  int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (go_parallel(nthreads, rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * ldx;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t i = 0;
#if KVS_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      // silu(g) = g / (1 + exp(-g)); exp saturates to 0 / 2.6e38, giving g or ~0 as it should.
      __m256 gv = _mm256_loadu_ps(g + i);
      __m256 e = kvs::exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

void rotary(const float* x, int64_t st, int64_t sh, float* out, int64_t T, int64_t heads,
            int64_t D, const int64_t* positions, const float* cos_sin, int64_t max_pos,
            int nthreads) {
  (void)max_pos;  // bindings.cpp checked 0 <= positions < max_pos
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (go_parallel(nthreads, T, T * heads * D))
  for (int64_t t = 0; t < T; ++t) {
    const float* cs = cos_sin + positions[t] * D;  // [cos(half) | sin(half)]
    for (int64_t h = 0; h < heads; ++h) {
      const float* x1 = x + t * st + h * sh;
      const float* x2 = x1 + half;
      float* o1 = out + (t * heads + h) * D;
      float* o2 = o1 + half;
      int64_t i = 0;
#if KVS_AVX2
      for (; i + 8 <= half; i += 8) {
        __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
        __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
        // Same products and one rounding per op as the reference: a*c - b*s, b*c + a*s.
        _mm256_storeu_ps(o1 + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
        _mm256_storeu_ps(o2 + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
      }
#endif
      for (; i < half; ++i) {
        const float c = cs[i], s = cs[half + i];
        o1[i] = x1[i] * c - x2[i] * s;
        o2[i] = x2[i] * c + x1[i] * s;
      }
    }
  }
}

// float -> IEEE half bits, rounded to nearest even (overflow to inf, subnormals kept), the
// rounding of torch's .to(float16) and of _mm256_cvtps_ph(_MM_FROUND_TO_NEAREST_INT). Plain
// bit arithmetic, so the scalar tails need no F16C; tested against torch on every range.
static uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u)  // inf, or nan kept quiet with its top payload bits
    return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 | ((x >> 13) & 0x3ff) : 0);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // >= 65520: past half of max's last ulp
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half, units of 2^-24
    // |f| = m * 2^(e - 150) -> m * 2^(e - 126) units, i.e. m >> (126 - e), rounded.
    const int shift = 126 - static_cast<int>(x >> 23);
    if (shift > 24) return sign;  // < 2^-25 (float subnormals too): rounds to zero
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;  // q = 1024 is the smallest normal: right
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias the exponent (127 -> 15), then round 23 mantissa bits to 10; a carry out
  // of the mantissa bumps the exponent, which is the right result.
  const uint32_t r = x - (112u << 23);
  return sign | static_cast<uint16_t>((r + 0xfffu + ((r >> 13) & 1)) >> 13);
}

static void floats_to_halves(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if KVS_AVX2 && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

namespace {

// The e4m3fn decode table, built at compile time from the format: sign, 4 exponent bits
// (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9); 0x7f / 0xff are NaN (no
// infinities). Every value is exact in float.
struct Fp8E4m3Table {
  alignas(64) float v[256];
  constexpr Fp8E4m3Table() : v() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x;
      if (e == 15 && m == 7) {
        x = std::numeric_limits<float>::quiet_NaN();
      } else if (e == 0) {
        x = static_cast<float>(m) / 512.f;
      } else {
        x = 1.f + static_cast<float>(m) / 8.f;
        for (int i = 7; i < e; ++i) x *= 2.f;
        for (int i = e; i < 7; ++i) x /= 2.f;
      }
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
constexpr Fp8E4m3Table kFp8E4m3;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One row of D floats -> its scale (amax / qmax) and D quants, quantize_kv's arithmetic:
// q = x / scale, one IEEE division (the vector and scalar divisions round alike), then
// rounded half to even and clamped (I8) or encoded (FP8_E4M3). amax is exact.
void quantize_row(const float* x, int64_t D, KVType kv, void* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = amax / (kv == KVType::I8 ? 127.f : 448.f);
  *scale = s;
  const float den = s > 0.f ? s : 1.f;  // an all-zero row: zeros, scale 0
  if (kv == KVType::I8) {
    int8_t* out = static_cast<int8_t*>(q);
    int64_t d = 0;
#if KVS_AVX2
    const __m256 vd = _mm256_set1_ps(den), lo = _mm256_set1_ps(-127.f),
                 hi = _mm256_set1_ps(127.f);
    for (; d + 8 <= D; d += 8) {
      __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + d), vd),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi));
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32),
                                          _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + d), _mm_packs_epi16(i16, i16));
    }
#endif
    for (; d < D; ++d)
      out[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / den))));
  } else {
    uint8_t* out = static_cast<uint8_t*>(q);
    for (int64_t d = 0; d < D; ++d) out[d] = float_to_fp8_e4m3(x[d] / den);
  }
}

}  // namespace

const float* fp8_e4m3_table() { return kFp8E4m3.v; }

// c10's fp8e4m3fn_from_fp32_value, step for step (torch's CPU cast gives its bits).
uint8_t float_to_fp8_e4m3(float f) {
  constexpr uint32_t kFp8Max = UINT32_C(1087) << 20;      // 480.0f, the first past 448's range
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;   // 2^14: its ulp is e4m3's 2^-9
  uint32_t bits = float_bits(f);
  const uint32_t sign = bits & UINT32_C(0x80000000);
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = 0x7f;  // NaN: |f| >= 480 after rounding, inf, NaN
  } else if (bits < (UINT32_C(121) << 23)) {
    // Below 2^-6, e4m3's smallest normal: adding 2^14 rounds f to a multiple of 2^-9 (to
    // nearest even, in the FPU), which lands in the sum's low mantissa bits.
    result = static_cast<uint8_t>(float_bits(bits_float(bits) + bits_float(kDenormMask)) -
                                  kDenormMask);
  } else {
    const uint32_t mant_odd = (bits >> 20) & 1;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;  // rebias, round half ...
    bits += mant_odd;                                           // ... to even
    result = static_cast<uint8_t>(bits >> 20);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

void write_kv(const float* key, int64_t k_st, int64_t k_sh, const float* value, int64_t v_st,
              int64_t v_sh, void* k_cache, void* v_cache, KVType kv, float* k_scales,
              float* v_scales, const int64_t* slots, int64_t T, int64_t Hkv, int64_t D) {
  // A token's [Hkv, D] row is contiguous in the cache; the source may be a strided view
  // (k, v split from the fused qkv output), so copy head by head when it is not dense.
  // A quantized row gets its scale here, once: it is never re-quantized (kv/layout.py).
  const size_t head_bytes = static_cast<size_t>(D) * sizeof(float);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // PAD_SLOT_ID: no write
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = (slot * Hkv + h) * D;  // in elements
      const float* ks = key + t * k_st + h * k_sh;
      const float* vs = value + t * v_st + h * v_sh;
      if (kv_quantized(kv)) {  // one-byte elements
        quantize_row(ks, D, kv, static_cast<uint8_t*>(k_cache) + dst, k_scales + slot * Hkv + h);
        quantize_row(vs, D, kv, static_cast<uint8_t*>(v_cache) + dst, v_scales + slot * Hkv + h);
      } else if (kv == KVType::F16) {
        floats_to_halves(ks, static_cast<uint16_t*>(k_cache) + dst, D);
        floats_to_halves(vs, static_cast<uint16_t*>(v_cache) + dst, D);
      } else {
        std::memcpy(static_cast<float*>(k_cache) + dst, ks, head_bytes);
        std::memcpy(static_cast<float*>(v_cache) + dst, vs, head_bytes);
      }
    }
  }
}

// One block of 32 values: its amax, and its 32 int8 quants against inv = 127 / amax (of the
// block, or of the whole row for quantize_acts_per_token) with their sum. Scalar and vector
// paths agree bit for bit: max and the int conversions are exact, and both compute x * inv
// with one fp32 multiply rounded half to even (nearbyintf under the default rounding mode).
static float block_amax(const float* x) {
#if KVS_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i)
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  return hmax(mx);
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
#endif
}

static void quantize_block_at(const float* x, float inv, int8_t* q, int32_t* sum) {
#if KVS_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vinv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 -> int8 keeping order: the packs interleave 128-bit lanes, the permute undoes it.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                       _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  *sum = _mm_cvtsi128_si32(s4);
#else
  int32_t total = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    total += q[i];
  }
  *sum = total;
#endif
}

void quantize_acts(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d,
                   float* s, int32_t* sum, int nthreads) {
  const int64_t nb = K / 32;
#pragma omp parallel for num_threads(nthreads) if (go_parallel(nthreads, M, M * K))
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = m * nb + b;
      const float amax = block_amax(x + m * ldx + 32 * b);
      quantize_block_at(x + m * ldx + 32 * b, amax > 0.f ? 127.f / amax : 0.f,
                        q + m * K + 32 * b, sum + i);
      d[i] = amax / 127.f;
      s[i] = d[i] * static_cast<float>(sum[i]);
    }
}

void quantize_acts_per_token(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q,
                             float* d, float* s, int32_t* sum, int nthreads) {
  const int64_t nb = K / 32;
#pragma omp parallel for num_threads(nthreads) if (go_parallel(nthreads, M, M * K))
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t b = 0; b < nb; ++b) amax = std::max(amax, block_amax(x + m * ldx + 32 * b));
    const float inv = amax > 0.f ? 127.f / amax : 0.f, dm = amax / 127.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = m * nb + b;
      quantize_block_at(x + m * ldx + 32 * b, inv, q + m * K + 32 * b, sum + i);
      d[i] = dm;
      s[i] = dm * static_cast<float>(sum[i]);
    }
  }
}

}  // namespace kvs
