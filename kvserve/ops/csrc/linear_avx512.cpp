// AVX-512 twin of linear.cpp's small-M linear: out[M, N] = x[M, K] W[N, K]^T (+ bias).
//
// The extension is built with -mavx2 only; this file switches AVX-512F on for its own code
// with `#pragma GCC target`, so the binary still loads on an AVX2-only CPU. Nothing here may
// run there: linear_small_m_avx512() is reached only through bindings.cpp, which asks
// cpu_has_avx512() first. To keep AVX-512 instructions out of code that other translation
// units could pick up at link time (an inline function's COMDAT copy), every system header is
// included *before* the pragma and all code below it has internal linkage except the two
// entry points declared in kernels.h.
//
// Batch invariance: out[m, n] must not depend on M or on where row m sits in the batch. Every
// (n, m) pair, whatever tile shape computes it, gets the same arithmetic:
//   acc = 16-lane FMA chain over k = 0, 16, 32, ... (the K % 16 tail as one masked step);
//   sum = the fixed tree  A_j = a_j + a_{j+8};  B_j = A_j + A_{j+4};  C_j = B_j + B_{j+2};
//         C_0 + C_1  (reduce16() for 16 accumulators at once, hsum() for one);
//   out = sum + bias[n]  (one scalar add).
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "kernels.h"
#include "simd.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace kvs {
namespace {

// How far ahead, in bytes, of the tile being multiplied the weight stream is prefetched. A
// thread's weight slab is one contiguous run of rows, so the prefetch walks it linearly at a
// fixed distance whatever K and the tile height are.
// 2 KB .. 16 KB measured within noise of each other on Zen 5 (M = 1: 43-45 GB/s, against
// ~50 GB/s for a bare 2-thread streaming read); without any prefetch M = 1 loses ~5%.
// Into L2 (T1), as qlinear_kquant_avx512.cpp says why: Zen 4, benchmarks/kernel_ab.py, 31
// rounds, tree (L2) / base (L1) at 2, 5, 8 rows: the default model as F16 0.84, 0.78, 0.79,
// as BF16 0.83, 0.83, 0.78, as float32 0.83, 0.68, 0.72 (0.82-0.87 at 16). The one-row
// stream below stays with L1 (L2 there: 1.04-1.07x at 2 KB ahead, 0.96x at 6 KB).
constexpr int64_t kPrefetchBytes = 8192;
// A float32 tile of one row (M = 1) reads its row alone, the rows one after another: one
// linear stream per thread, the pattern the hardware prefetchers follow best (and llama.cpp's
// F32 pattern: a row at a time), prefetched this far ahead. Zen 5, the default model's 30
// layers' linears plus its lm_head at M = 1, builds alternated in one process, per-pair
// speed-up over 16 rows side by side prefetched as above: one row, 2 KB ahead, +4..+15% at
// 41-47 GB/s (1 KB, 4 KB, no prefetch, and 4 rows without prefetch within 1-4% of it; 2 rows,
// or 4 rows with each row prefetched 2 KB ahead, 15-20% slower). 16 rows with each row
// prefetched 512 B ahead had won 6-10% at 60 GB/s but lost 4-13% at 41 GB/s.
constexpr int64_t kRowAheadBytes = 2048;

// One vector's sum with the tree described at the top.
inline float hsum(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Sixteen sums at once, lane i = sum of v[i], with exactly hsum()'s tree per vector (float
// addition commutes, so only the pairing matters, not which operand is on the left).
inline __m512 reduce16(const __m512* v) {
  // The butterfly below leaves vector r + 4s in lane 4r + s; feeding slot r + 4s with vector
  // 4r + s makes lane i hold vector i.
  __m512 s1[8], s2[4], s3[2];
  auto in = [v](int slot) { return v[4 * (slot % 4) + slot / 4]; };
  for (int i = 0; i < 8; ++i) {  // A: [a.A0-3, a.A4-7, b.A0-3, b.A4-7]
    __m512 a = in(2 * i), b = in(2 * i + 1);
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // B: 128-bit lane r holds B0-3 of vector 4i + r
    __m512 c = s1[2 * i], d = s1[2 * i + 1];
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // C: lane r = [C0, C1 of 8i + r, C0, C1 of 8i + 4 + r]
    __m512 e = s2[2 * i], f = s2[2 * i + 1];
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(e, f, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(e, f, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // D: lane r = [r, 4 + r, 8 + r, 12 + r]
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[NT][MT] (16-lane partial sums) -> out[m * ldo + n] (+ bias[n]).
template <int NT, int MT>
inline void reduce_store(const __m512 (&acc)[NT][MT], const float* bias, float* out,
                         int64_t ldo) {
  constexpr int kCount = NT * MT;
  if constexpr (kCount >= 8) {
    constexpr int kGroups = (kCount + 15) / 16;
    alignas(64) float sums[kGroups * 16];
    for (int g = 0; g < kGroups; ++g) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) {
        const int j = g * 16 + i;  // j = m * NT + n
        v[i] = j < kCount ? acc[j % NT][j / NT] : _mm512_setzero_ps();
      }
      _mm512_store_ps(sums + g * 16, reduce16(v));
    }
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n)
        out[m * ldo + n] = bias ? sums[m * NT + n] + bias[n] : sums[m * NT + n];
  } else {
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n)
        out[m * ldo + n] = bias ? hsum(acc[n][m]) + bias[n] : hsum(acc[n][m]);
  }
}

// Weight format policies: load(row, k) = float32 weights k..k+15 of the row at `row`; the
// quantized ones dequantize in registers exactly as gguf-py does (see kernels.h), so the FMA
// chain sees the float32 weights' values and the result is the float32 one bit for bit.
// kStep: weight-stream bytes consumed per 16 weights, which paces the prefetch.
// kTail: takes a K % 16 tail (F16 / BF16 rows have K % 16 == 0: checked at the binding).
struct F32 {
  static constexpr bool kQuant = false, kTail = true;
  static constexpr int64_t kStep = 64;
  static __m512 load(const uint8_t* row, int64_t k) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
  }
};

struct F16 {  // widened exactly (vcvtph2ps)
  static constexpr bool kQuant = false, kTail = false;
  static constexpr int64_t kStep = 32;
  static __m512 load(const uint8_t* row, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
  }
};

struct BF16 {  // a bfloat16 is the top half of its float32
  static constexpr bool kQuant = false, kTail = false;
  static constexpr int64_t kStep = 32;
  static __m512 load(const uint8_t* row, int64_t k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k))), 16));
  }
};

struct Q41 {  // k % 16 == 0: the block's 16 nibble bytes, low (k % 32 == 0) or high half
  static constexpr bool kQuant = true;
  static constexpr int64_t kBlockBytes = 20, kStep = 10;
  static __m512 load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    q = (k & 16) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(half_to_float(load_u16(b))),
                                   _mm512_cvtepi32_ps(q));
    return _mm512_add_ps(f, _mm512_set1_ps(half_to_float(load_u16(b + 2))));
  }
  // The whole block at k (k % 32 == 0): weights k..k+15 and k+16..k+31, one d/m decode.
  static void load2(const uint8_t* row, int64_t k, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m512 d = _mm512_set1_ps(half_to_float(load_u16(b)));
    const __m512 m = _mm512_set1_ps(half_to_float(load_u16(b + 2)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                            _mm512_and_si512(q, _mm512_set1_epi32(15)))), m);
    w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), m);
  }
};

struct Q80 {
  static constexpr bool kQuant = true;
  static constexpr int64_t kBlockBytes = 34, kStep = 17;
  static __m512 load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m512i q = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + (k & 31))));
    return _mm512_mul_ps(_mm512_set1_ps(half_to_float(load_u16(b))), _mm512_cvtepi32_ps(q));
  }
  static void load2(const uint8_t* row, int64_t k, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m512 d = _mm512_set1_ps(half_to_float(load_u16(b)));
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))));
  }
};

// NT weight rows (w, w + rb, ...; rb bytes each) against MT activation rows. kPf: prefetch
// the weight bytes that lie kPrefetchBytes past this tile (the next tiles of the same slab).
template <class Fmt, int NT, int MT, bool kPf>
inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, int64_t K,
                 const float* bias, float* out, int64_t ldo) {
  __m512 acc[NT][MT];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_setzero_ps();
  // The tile consumes NT * Fmt::kStep bytes per step; a line is prefetched, kPrefetchBytes
  // ahead, each time that running count crosses a 64-byte boundary, which covers one tile's
  // worth of the stream (float32: NT lines per step). A one-row tile: kRowAheadBytes.
  const char* pf = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  int64_t consumed = 0;

  int64_t k = 0;
  if constexpr (Fmt::kQuant) {  // a block (32 weights) per step; the same FMA order
    for (; k < K; k += 32) {
      __m512 xa[MT], xb[MT];
      for (int m = 0; m < MT; ++m) {
        xa[m] = _mm512_loadu_ps(x + m * ldx + k);
        xb[m] = _mm512_loadu_ps(x + m * ldx + k + 16);
      }
      for (int n = 0; n < NT; ++n) {
        if constexpr (kPf) {
          if (((consumed + 2 * Fmt::kStep) >> 6) != (consumed >> 6))
            _mm_prefetch(pf + (consumed & ~int64_t{63}), _MM_HINT_T1);
          consumed += 2 * Fmt::kStep;
        }
        __m512 w0, w1;
        Fmt::load2(w + n * rb, k, w0, w1);
        for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_fmadd_ps(w0, xa[m], acc[n][m]);
        for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_fmadd_ps(w1, xb[m], acc[n][m]);
      }
    }
  }
  for (; k + 16 <= K; k += 16) {  // float32
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(x + m * ldx + k);
    for (int n = 0; n < NT; ++n) {
      if constexpr (kPf && NT == 1) {  // one row: a linear stream (kRowAheadBytes)
        _mm_prefetch(reinterpret_cast<const char*>(w) + Fmt::kStep / 16 * k + kRowAheadBytes,
                     _MM_HINT_T0);
      } else if constexpr (kPf) {
        if (((consumed + Fmt::kStep) >> 6) != (consumed >> 6))
          _mm_prefetch(pf + (consumed & ~int64_t{63}), _MM_HINT_T1);
        consumed += Fmt::kStep;
      }
      __m512 wv = Fmt::load(w + n * rb, k);
      for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  }
  if constexpr (!Fmt::kQuant) {
    if (Fmt::kTail && k < K) {  // K % 16 tail: masked lanes load as zero, never touch memory
      const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
      for (int n = 0; n < NT; ++n) {
        if constexpr (kPf && NT > 1) {
          _mm_prefetch(pf + consumed, _MM_HINT_T1);
          consumed += 64;
        }
        __m512 wv = _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(w + n * rb) + k);
        for (int m = 0; m < MT; ++m) acc[n][m] = _mm512_fmadd_ps(wv, xv[m], acc[n][m]);
      }
    }
  }
  reduce_store<NT, MT>(acc, bias, out, ldo);
}

// The M % MT leftover rows of a row_tile, as one tile of `rest` rows (1 <= rest < MT).
template <class Fmt, int NT, int MT>
inline void rest_tile(int64_t rest, const float* x, int64_t ldx, const uint8_t* w, int64_t rb,
                      int64_t K, const float* bias, float* out, int64_t ldo, bool pf) {
  if constexpr (MT > 1) {
    if (rest == MT - 1) {
      if (pf) tile<Fmt, NT, MT - 1, true>(x, ldx, w, rb, K, bias, out, ldo);
      else tile<Fmt, NT, MT - 1, false>(x, ldx, w, rb, K, bias, out, ldo);
    } else {
      rest_tile<Fmt, NT, MT - 1>(rest, x, ldx, w, rb, K, bias, out, ldo, pf);
    }
  }
}

// All M activation rows against NT weight rows starting at w, MT rows per register tile.
template <class Fmt, int NT, int MT>
inline void row_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, int64_t K,
                     const float* bias, float* out, int64_t ldo, int64_t M) {
  if constexpr (Fmt::kQuant) {
    if (M > 2 * MT) {
      // Many activation rows: dequantize the NT weight rows once into an L1-sized scratch
      // and run the float32 tiles over it (same values, same order: same result), instead of
      // dequantizing again for every group of MT rows.
      // (malloc, not std::vector: no template may be instantiated under the AVX-512 pragma.)
      thread_local float* buf = nullptr;
      thread_local int64_t cap = 0;
      if (cap < NT * K) {
        std::free(buf);
        buf = static_cast<float*>(std::malloc(sizeof(float) * NT * K));
        cap = buf ? NT * K : 0;
      }
      if (!buf) std::abort();  // out of memory for a few KB: nothing sensible is left to do
      for (int n = 0; n < NT; ++n)
        for (int64_t k = 0; k < K; k += 32) {
          __m512 w0, w1;
          Fmt::load2(w + n * rb, k, w0, w1);
          _mm512_storeu_ps(buf + n * K + k, w0);
          _mm512_storeu_ps(buf + n * K + k + 16, w1);
        }
      row_tile<F32, NT, MT>(x, ldx, reinterpret_cast<const uint8_t*>(buf), K * 4, K, bias, out,
                            ldo, M);
      return;
    }
  }
  // The first pass streams the weight rows from DRAM (prefetch ahead); later passes hit L1.
  int64_t m = 0;
  if (M >= MT) {
    tile<Fmt, NT, MT, true>(x, ldx, w, rb, K, bias, out, ldo);
    for (m = MT; m + MT <= M; m += MT)
      tile<Fmt, NT, MT, false>(x + m * ldx, ldx, w, rb, K, bias, out + m * ldo, ldo);
  }
  if (m < M)
    rest_tile<Fmt, NT, MT>(M - m, x + m * ldx, ldx, w, rb, K, bias, out + m * ldo, ldo,
                           m == 0);
}

// kRun: tiles per work item of the split (tiles.h), so that one-row tiles are not claimed
// one at a time.
template <class Fmt, int NT, int MT, int kRun = 1>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, const float* bias,
         float* out, int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t tiles = N / NT;
  // Activation rows per pass over a thread's weight slab: ~256 KB of x stays in L2 while the
  // slab streams by (see linear.cpp).
  const int64_t m_block = max64(MT, (65536 / max64(K, 1)) / MT * MT);
  // Below ~64K weights the fork/join (~2 us) costs more than the streaming it splits.
  const bool parallel = nthreads > 1 && N * K >= (1 << 16);
  // One slab of weight tiles per thread, each streamed once per block of activation rows;
  // a thread done early takes tiles from the back of another's (tiles.h).
  for_each_tile((tiles + kRun - 1) / kRun, (M + m_block - 1) / m_block, nthreads, parallel,
                [&](int64_t pass, int64_t item) {
                  const int64_t m0 = pass * m_block;
                  for (int64_t t = item * kRun; t < min64(tiles, (item + 1) * kRun); ++t) {
                    const int64_t n = t * NT;
                    row_tile<Fmt, NT, MT>(x + m0 * ldx, ldx, w + n * rb, rb, K,
                                          bias ? bias + n : nullptr, out + m0 * N + n, N,
                                          min64(m_block, M - m0));
                  }
                });
  for (int64_t n = tiles * NT; n < N; ++n)  // N % NT leftover rows, one at a time
    row_tile<Fmt, 1, MT>(x, ldx, w + n * rb, rb, K, bias ? bias + n : nullptr, out + n, N, M);
}

template <class Fmt>
void run_fmt(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, const float* bias,
             float* out, int64_t M, int64_t N, int64_t K, int nthreads) {
  // Tile shapes (32 zmm): NT * MT accumulators + MT activation vectors + 1 weight vector.
  //   M == 1, float32: 1 x 1, rows one after another, 16 rows per work item (see
  //     kRowAheadBytes); blocks: 16 x 1 (16 FMA chains; one reduce16 per tile)
  //   M >= 2: 4 x 6  (24 + 6 + 1 registers; 0.42 loads per FMA)
  //   blocks, 2 <= M <= 4: 4 x 4; 5 <= M <= 8: 2 x 8 (each block dequantized once per step)
  if (M == 1 && !Fmt::kQuant) run<Fmt, 1, 1, 16>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else if (M == 1) run<Fmt, 16, 1>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else if (Fmt::kQuant && M <= 4) run<Fmt, 4, 4>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else if (Fmt::kQuant && M <= 8) run<Fmt, 2, 8>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else run<Fmt, 4, 6>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
}

}  // namespace

void linear_small_m_avx512(const float* x, int64_t ldx, const void* w, WType wt,
                           const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                           int nthreads) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const int64_t rb = row_bytes(wt, K);
  switch (wt) {
    case WType::Q4_1: return run_fmt<Q41>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::Q8_0: return run_fmt<Q80>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::F16: return run_fmt<F16>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::BF16: return run_fmt<BF16>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    default: return run_fmt<F32>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
  }
}

}  // namespace kvs

#pragma GCC pop_options

namespace kvs {

bool cpu_has_avx512() {
  // GCC's check includes the OS enabling the zmm state (XCR0), not just the CPUID bit.
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
}

}  // namespace kvs
