// Small-M linear: out[M, N] = x[M, K] W[N, K]^T (+ bias), W in nn.Linear's row-major layout.
//
// At M <= 16 a decoder step is bound by streaming W from DRAM, not by FLOPs, so the kernel is
// built around reading every weight byte from memory exactly once per call:
//
//   threads split N into contiguous ranges of rows (each thread streams its own slab);
//   a tile of NT weight rows (NT*K*4 bytes: 9 KB at K=576, 24 KB at K=1536) is pulled from
//   DRAM by the first group of MT activation rows and re-read from L1 by the next groups;
//   per tile, acc[NT][MT] are 8-lane partial dot products along K, reduced once at the end.
//
// Registers (16 ymm): NT*MT accumulators + MT activation vectors + 1 weight vector.
//   M == 1: NT = 8, MT = 1 -> 8 + 1 + 1   (8 independent FMA chains hide FMA latency)
//   M >= 2: NT = 4, MT = 3 -> 12 + 3 + 1  (0.58 loads per FMA)
//   blocks, 4 <= M <= 6: 2 x 6, 7 <= M <= 8: 1 x 8 (a block is dequantized once per step);
//   blocks, M > 2 * MT: a dequantized scratch tile, then the float32 tiles
//
// Weight formats (kernels.h WType): the tile reads its weight vectors through a format policy
// (F32, F16, BF16, Q4_1, Q8_0) whose load(row, k) returns the 8 float32 weights k..k+7 of a
// row. F16 and BF16 rows widen exactly (F16C / a 16-bit shift), so they stream half the bytes
// of float32 and give its result on the widened weights bit for bit (K % 16 == 0: no tail). The
// quantized ones dequantize in registers, so a Q4_1 row streams 5 bits per weight instead of
// 32, and since they produce the same floats in the same FMA chain, a quantized weight gives
// the float32 result on its dequantized values bit for bit.

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "tiles.h"

namespace kvs {
namespace {

// Weight tiles are prefetched whole, this many tiles ahead of the one being read (tile()).
constexpr int64_t kTilesAhead = 2;

#if KVS_AVX2

// Weight format policies: load(row, k) = float32 weights k..k+7 of the row starting at `row`.
// Float policies: kBytes per weight (paces the prefetch); kTail: takes a K % 8 tail.
struct F32 {
  static constexpr bool kQuant = false, kTail = true;
  static constexpr int64_t kBytes = 4;
  static __m256 load(const uint8_t* row, int64_t k) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  }
};

struct F16 {
  static constexpr bool kQuant = false, kTail = false;
  static constexpr int64_t kBytes = 2;
  static __m256 load(const uint8_t* row, int64_t k) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
  }
};

struct BF16 {  // a bfloat16 is the top half of its float32
  static constexpr bool kQuant = false, kTail = false;
  static constexpr int64_t kBytes = 2;
  static __m256 load(const uint8_t* row, int64_t k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))), 16));
  }
};

struct Q41 {  // k % 8 == 0: bytes (k % 16) .. +7 of the block's nibbles, low or high half
  static constexpr bool kQuant = true;
  static constexpr int64_t kBlockBytes = 20;
  static __m256 load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    __m256i q = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4 + (k & 15))));
    q = (k & 16) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
    const __m256 f = _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(b))),
                                   _mm256_cvtepi32_ps(q));
    return _mm256_add_ps(f, _mm256_set1_ps(half_to_float(load_u16(b + 2))));
  }
  // The whole block at k (k % 32 == 0) as w[0..3] = weights k..k+31, one d/m decode.
  static void load4(const uint8_t* row, int64_t k, __m256* w) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m256 d = _mm256_set1_ps(half_to_float(load_u16(b)));
    const __m256 m = _mm256_set1_ps(half_to_float(load_u16(b + 2)));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m256i lo = _mm256_cvtepu8_epi32(qs), hi = _mm256_cvtepu8_epi32(
                                                     _mm_unpackhi_epi64(qs, qs));
    const __m256i nib = _mm256_set1_epi32(15);
    const __m256i q[4] = {_mm256_and_si256(lo, nib), _mm256_and_si256(hi, nib),
                          _mm256_srli_epi32(lo, 4), _mm256_srli_epi32(hi, 4)};
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[c])), m);
  }
};

struct Q80 {
  static constexpr bool kQuant = true;
  static constexpr int64_t kBlockBytes = 34;
  static __m256 load(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m256i q = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + (k & 31))));
    return _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(b))), _mm256_cvtepi32_ps(q));
  }
  static void load4(const uint8_t* row, int64_t k, __m256* w) {
    const uint8_t* b = row + (k >> 5) * kBlockBytes;
    const __m256 d = _mm256_set1_ps(half_to_float(load_u16(b)));
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c)))));
  }
};

// NT weight rows (w, w + rb, ...; rb bytes each) against MT activation rows.
template <class Fmt, int NT, int MT, bool kPrefetchW>
inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, int64_t K,
                 const float* bias, float* out, int64_t ldo) {
  __m256 acc[NT][MT];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_setzero_ps();

  // The tile's NT rows are one run of NT * rb bytes, and the next tiles' runs follow it.
  // Each step (8 float weights, or a 32-weight block) prefetches its share of the run
  // kTilesAhead tiles on, so a thread's weights are one sequential stream. (Prefetching each
  // row ahead of itself left NT short streams, a 576-wide F16 row being 18 lines, which the
  // hardware prefetcher did not follow: F16 rows streamed at 15 GB/s against 21-27 so, on an
  // AVX2 EPYC; benchmarks/linear_prefetch.cpp.) Prefetching never changes the arithmetic.
  // Into L2 (T1), as qlinear_kquant_avx512.cpp says why: Zen 4 under KVSERVE_CPU_ISA=avx2,
  // benchmarks/kernel_ab.py, 31 rounds, tree (L2) / base (L1) at 1, 2, 5, 8, 16 rows: the
  // default model as float32 0.87, 0.92, 0.79, 0.79, 0.86; as F16 0.90-1.03 (noise).
  const int64_t lines = NT * rb / 64;
  const int64_t steps = std::max<int64_t>(Fmt::kQuant ? K / 32 : K / 8, 1);
  const char* ahead = reinterpret_cast<const char*>(w) + kTilesAhead * NT * rb;
  auto prefetch_share = [&](int64_t s) {
    if constexpr (kPrefetchW)
      for (int64_t l = s * lines / steps; l < (s + 1) * lines / steps; ++l)
        _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
  };

  int64_t k = 0;
  if constexpr (Fmt::kQuant) {  // a block (32 weights) per step; the same FMA order
    for (int64_t s = 0; k < K; k += 32, ++s) {
      prefetch_share(s);
      for (int n = 0; n < NT; ++n) {
        __m256 wv[4];
        Fmt::load4(w + n * rb, k, wv);
        for (int m = 0; m < MT; ++m)
          for (int c = 0; c < 4; ++c)
            acc[n][m] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + m * ldx + k + 8 * c),
                                        acc[n][m]);
      }
    }
  }
  for (int64_t s = 0; k + 8 <= K; k += 8, ++s) {  // float32
    if constexpr (!Fmt::kQuant) prefetch_share(s);
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int n = 0; n < NT; ++n) {
      __m256 wv = Fmt::load(w + n * rb, k);
      for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  }
  if constexpr (!Fmt::kQuant) {
    if (Fmt::kTail && k < K) {  // K % 8 tail: masked loads read zeros past the end
      __m256i mask = tail_mask(K - k);
      __m256 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm256_maskload_ps(x + m * ldx + k, mask);
      for (int n = 0; n < NT; ++n) {
        __m256 wv = _mm256_maskload_ps(reinterpret_cast<const float*>(w + n * rb) + k, mask);
        for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
      }
    }
  }

  for (int m = 0; m < MT; ++m) {
    float* o = out + m * ldo;
    if constexpr (NT % 4 == 0) {
      for (int n = 0; n < NT; n += 4) {
        __m128 s = reduce4(acc[n][m], acc[n + 1][m], acc[n + 2][m], acc[n + 3][m]);
        if (bias) s = _mm_add_ps(s, _mm_loadu_ps(bias + n));
        _mm_storeu_ps(o + n, s);
      }
    } else {
      // reduce4()'s tree, not hsum()'s: row n's sum must not depend on whether N % NT put
      // it in a 4-row group or here (NT differs between M == 1 and M >= 2).
      for (int n = 0; n < NT; ++n) {
        const float s = _mm_cvtss_f32(reduce4(acc[n][m], acc[n][m], acc[n][m], acc[n][m]));
        o[n] = bias ? s + bias[n] : s;
      }
    }
  }
}

// The M % MT leftover rows of a row_tile, as one tile of `rest` rows (1 <= rest < MT).
template <class Fmt, int NT, int MT>
inline void rest_tile(int64_t rest, const float* x, int64_t ldx, const uint8_t* w, int64_t rb,
                      int64_t K, const float* bias, float* out, int64_t ldo) {
  if constexpr (MT > 1) {
    if (rest == MT - 1) tile<Fmt, NT, MT - 1, true>(x, ldx, w, rb, K, bias, out, ldo);
    else rest_tile<Fmt, NT, MT - 1>(rest, x, ldx, w, rb, K, bias, out, ldo);
  }
}

// All M activation rows against NT weight rows starting at w; MT rows per register tile.
template <class Fmt, int NT, int MT>
inline void row_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, int64_t K,
                     const float* bias, float* out, int64_t ldo, int64_t M) {
  if constexpr (Fmt::kQuant) {
    if (M > 2 * MT) {
      // Many activation rows: dequantize the NT weight rows once into an L1-sized scratch
      // and run the float32 tiles over it (same values, same order: same result) instead of
      // dequantizing again for every group of MT rows.
      thread_local std::vector<float> scratch;
      if (scratch.size() < static_cast<size_t>(NT * K)) scratch.resize(NT * K);
      float* buf = scratch.data();
      for (int n = 0; n < NT; ++n)
        for (int64_t k = 0; k < K; k += 32) {
          __m256 t[4];
          Fmt::load4(w + n * rb, k, t);
          for (int c = 0; c < 4; ++c) _mm256_storeu_ps(buf + n * K + k + 8 * c, t[c]);
        }
      row_tile<F32, NT, MT>(x, ldx, reinterpret_cast<const uint8_t*>(buf), K * 4, K, bias, out,
                            ldo, M);
      return;
    }
  }
  int64_t m = 0;
  // The first pass streams the rows from DRAM (prefetch helps); later passes hit L1.
  bool first = true;
  for (; m + MT <= M; m += MT) {
    if (first) tile<Fmt, NT, MT, true>(x + m * ldx, ldx, w, rb, K, bias, out + m * ldo, ldo);
    else tile<Fmt, NT, MT, false>(x + m * ldx, ldx, w, rb, K, bias, out + m * ldo, ldo);
    first = false;
  }
  if (m < M) rest_tile<Fmt, NT, MT>(M - m, x + m * ldx, ldx, w, rb, K, bias, out + m * ldo, ldo);
}

template <class Fmt, int NT, int MT>
void run(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, const float* bias,
         float* out, int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t tiles = N / NT;
  // Activation rows per pass over a thread's weight slab: ~256 KB of x stays in L2 while the
  // slab streams by. Small M is one pass, so weights leave DRAM once; larger M re-reads the
  // slab per pass (from L3 for layer-sized weights) instead of re-reading x per weight tile.
  const int64_t m_block = std::max<int64_t>(MT, (65536 / std::max<int64_t>(K, 1)) / MT * MT);
  // Below ~64K weights the fork/join (~2 us) costs more than the streaming it splits.
  const bool parallel = nthreads > 1 && N * K >= (1 << 16);
  // One slab of weight tiles per thread, each streamed once per block of activation rows;
  // a thread done early takes tiles from the back of another's (tiles.h).
  for_each_tile(tiles, (M + m_block - 1) / m_block, nthreads, parallel,
                [&](int64_t pass, int64_t t) {
                  const int64_t m0 = pass * m_block, n = t * NT;
                  row_tile<Fmt, NT, MT>(x + m0 * ldx, ldx, w + n * rb, rb, K,
                                        bias ? bias + n : nullptr, out + m0 * N + n, N,
                                        std::min(m_block, M - m0));
                });
  for (int64_t n = tiles * NT; n < N; ++n)  // N % NT leftover rows, one at a time
    row_tile<Fmt, 1, MT>(x, ldx, w + n * rb, rb, K, bias ? bias + n : nullptr, out + n, N, M);
}

template <class Fmt>
void run_fmt(const float* x, int64_t ldx, const uint8_t* w, int64_t rb, const float* bias,
             float* out, int64_t M, int64_t N, int64_t K, int nthreads) {
  if (M == 1) run<Fmt, 8, 1>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else if (Fmt::kQuant && M >= 4 && M <= 6)
    run<Fmt, 2, 6>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else if (Fmt::kQuant && M >= 7 && M <= 8)
    run<Fmt, 1, 8>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
  else run<Fmt, 4, 3>(x, ldx, w, rb, bias, out, M, N, K, nthreads);
}

#endif  // KVS_AVX2

// One weight of a row, exactly as the vector loads compute it.
inline float dequant_one(const uint8_t* row, WType wt, int64_t k) {
  if (wt == WType::F32) return reinterpret_cast<const float*>(row)[k];
  if (wt == WType::F16) return half_to_float(load_u16(row + 2 * k));
  if (wt == WType::BF16) {
    const uint32_t bits = static_cast<uint32_t>(load_u16(row + 2 * k)) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (wt == WType::Q4_1) {
    const uint8_t* b = row + (k >> 5) * 20;
    const uint8_t q = b[4 + (k & 15)];
    const float d = half_to_float(load_u16(b)), mn = half_to_float(load_u16(b + 2));
    return d * static_cast<float>((k & 16) ? q >> 4 : q & 15) + mn;
  }
  const uint8_t* b = row + (k >> 5) * 34;
  return half_to_float(load_u16(b)) * static_cast<float>(static_cast<int8_t>(b[2 + (k & 31)]));
}

}  // namespace

int64_t row_bytes(WType wt, int64_t K) {
  switch (wt) {
    case WType::Q4_1: return K / 32 * 20;
    case WType::Q8_0: return K / 32 * 34;
    case WType::F16: case WType::BF16: return K * 2;
    default: return K * 4;
  }
}

void dequantize_rows(const void* w, WType wt, float* out, int64_t N, int64_t K, int nthreads) {
  const auto* base = static_cast<const uint8_t*>(w);
  const int64_t rb = row_bytes(wt, K);
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) out[n * K + k] = dequant_one(base + n * rb, wt, k);
}

void linear_small_m(const float* x, int64_t ldx, const void* w, WType wt, const float* bias,
                    float* out, int64_t M, int64_t N, int64_t K, int nthreads) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const int64_t rb = row_bytes(wt, K);
#if KVS_AVX2
  switch (wt) {
    case WType::Q4_1: return run_fmt<Q41>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::Q8_0: return run_fmt<Q80>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::F16: return run_fmt<F16>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    case WType::BF16: return run_fmt<BF16>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
    default: return run_fmt<F32>(x, ldx, wb, rb, bias, out, M, N, K, nthreads);
  }
#else
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k)
        s += x[m * ldx + k] * dequant_one(wb + n * rb, wt, k);
      out[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
}

}  // namespace kvs
