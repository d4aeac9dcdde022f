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
#include <omp.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvs {
namespace {

// Distance, in floats, that the weight stream is prefetched ahead of the FMAs: 512 floats =
// 2 KB per row, enough to cover DRAM latency at ~10 GB/s per core without evicting L1.
constexpr int64_t kPrefetch = 512;

#if KVS_AVX2

template <int NT, int MT, bool kPrefetchW>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                 float* out, int64_t ldo) {
  __m256 acc[NT][MT];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_setzero_ps();

  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int n = 0; n < NT; ++n) {
      if (kPrefetchW && (k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(
                                                         w + n * K + k + kPrefetch),
                                                     _MM_HINT_T0);
      __m256 wv = _mm256_loadu_ps(w + n * K + k);
      for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  }
  if (k < K) {  // K % 8 tail: masked loads read zeros past the end, never touching it.
    __m256i mask = tail_mask(K - k);
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_maskload_ps(x + m * ldx + k, mask);
    for (int n = 0; n < NT; ++n) {
      __m256 wv = _mm256_maskload_ps(w + n * K + k, mask);
      for (int m = 0; m < MT; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
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

// All M activation rows against NT weight rows starting at w; MT rows per register tile.
template <int NT, int MT>
inline void row_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                     float* out, int64_t ldo, int64_t M) {
  int64_t m = 0;
  // The first pass streams the rows from DRAM (prefetch helps); later passes hit L1.
  bool first = true;
  for (; m + MT <= M; m += MT) {
    if (first) tile<NT, MT, true>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo);
    else tile<NT, MT, false>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo);
    first = false;
  }
  if constexpr (MT > 1) {
    const int64_t rest = M - m;
    if (rest == 2) tile<NT, 2, true>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo);
    else if (rest == 1) tile<NT, 1, true>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo);
    static_assert(MT <= 3, "the remainder switch above covers MT <= 3");
  }
}

template <int NT, int MT>
void run(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t M,
         int64_t N, int64_t K, int nthreads) {
  const int64_t tiles = N / NT;
  // Activation rows per pass over a thread's weight slab: ~256 KB of x stays in L2 while the
  // slab streams by. Small M is one pass, so weights leave DRAM once; larger M re-reads the
  // slab per pass (from L3 for layer-sized weights) instead of re-reading x per weight tile.
  const int64_t m_block = std::max<int64_t>(MT, (65536 / std::max<int64_t>(K, 1)) / MT * MT);
  // Below ~64K weights the fork/join (~2 us) costs more than the streaming it splits.
  const bool parallel = nthreads > 1 && N * K >= (1 << 16);
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
    // Contiguous static split of the weight tiles: each thread streams one slab of rows.
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t t_begin = tiles * tid / nth, t_end = tiles * (tid + 1) / nth;
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
      const int64_t mb = std::min(m_block, M - m0);
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t n = t * NT;
        row_tile<NT, MT>(x + m0 * ldx, ldx, w + n * K, K, bias ? bias + n : nullptr,
                         out + m0 * N + n, N, mb);
      }
    }
  }
  for (int64_t n = tiles * NT; n < N; ++n)  // N % NT leftover rows, one at a time
    row_tile<1, MT>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, N, M);
}

#endif  // KVS_AVX2

}  // namespace

void linear_small_m(const float* x, int64_t ldx, const float* w, const float* bias, float* out,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
#if KVS_AVX2
  if (M == 1) run<8, 1>(x, ldx, w, bias, out, M, N, K, nthreads);
  else run<4, 3>(x, ldx, w, bias, out, M, N, K, nthreads);
#else
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      out[m * N + n] = dot_scalar(x + m * ldx, w + n * K, K) + (bias ? bias[n] : 0.f);
#endif
}

}  // namespace kvs
