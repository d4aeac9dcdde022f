// F16 rows at M = 1: the weight-stream prefetch of ops.linear's row kernel (kvserve/ops/
// csrc/linear.cpp) against a plain read of the same bytes, two OpenMP threads, each a
// contiguous slab of 8-row tiles, over 6 copies of the matrix (past any L3).
//
//   g++ -std=c++17 -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/linear_prefetch.cpp -o /tmp/lp
//   OMP_NUM_THREADS=2 /tmp/lp [K=576] [N=49152]
//
// Variants: NT rows per tile x U accumulators per row, each row prefetched 512 / 1024
// weights ahead of itself (the kernel before 2026-12-04) or not at all, and whole tiles
// prefetched D tiles ahead (the kernel since); F32 rows of the same bytes likewise.
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <chrono>
#include <utility>
static inline float hsum(__m256 v){__m128 a=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1));a=_mm_hadd_ps(a,a);a=_mm_hadd_ps(a,a);return _mm_cvtss_f32(a);}
// This thread's contiguous range [a, b) of the tiles.
static inline std::pair<int, int> slab(int tiles) {
  int t = omp_get_thread_num(), per = (tiles + omp_get_num_threads() - 1) / omp_get_num_threads();
  return {t * per, std::min(tiles, (t + 1) * per)};
}
// 8 weights of a row as floats: F16 widened (F16C), F32 as they are.
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// NT-row tiles, one accumulator per row: D > 0 prefetches the tile D tiles ahead, a share per
// step of 8 weights (the kernel since 2026-12-04); PF prefetches each row 512 weights ahead
// of itself (before).
template<int NT, int D, bool PF, class T>
void runtile(const T* w, const float* x, float* out, int N, int K) {
  #pragma omp parallel
  {
    const auto [a, b] = slab(N / NT);
    const int64_t tile_bytes = (int64_t)NT * K * sizeof(T), lines = tile_bytes / 64, steps = K / 8;
    for (int ti = a; ti < b; ++ti) {
      const T* wr = w + (int64_t)ti * NT * K;
      const char* nxt = (const char*)wr + D * tile_bytes;
      __m256 acc[NT];
      for (int n = 0; n < NT; ++n) acc[n] = _mm256_setzero_ps();
      for (int k = 0, s = 0; k < K; k += 8, ++s) {
        if (D > 0) for (int64_t l = s * lines / steps; l < (s + 1) * lines / steps; ++l)
          _mm_prefetch(nxt + 64 * l, _MM_HINT_T0);
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int n = 0; n < NT; ++n) {
          if (PF && (k * (int)sizeof(T)) % 64 == 0) _mm_prefetch((const char*)(wr + n * K + k + 512), _MM_HINT_T0);
          acc[n] = _mm256_fmadd_ps(load8(wr + n * K + k), xv, acc[n]);
        }
      }
      for (int n = 0; n < NT; ++n) out[ti * NT + n] = hsum(acc[n]);
    }
  }
}
template<int NT, int U, bool PF, int PFD>
void run(const uint16_t* w, const float* x, float* out, int N, int K) {
  #pragma omp parallel
  {
    const auto [a, b] = slab(N / NT);
    for (int ti = a; ti < b; ++ti) {
      const uint16_t* wr = w + (int64_t)ti * NT * K;
      __m256 acc[NT][U];
      for (int n = 0; n < NT; ++n) for (int u = 0; u < U; ++u) acc[n][u] = _mm256_setzero_ps();
      for (int k = 0; k < K; k += 8 * U) {
        for (int n = 0; n < NT; ++n) {
          if (PF && (k & 31) == 0) _mm_prefetch((const char*)(wr + n * K + k + PFD), _MM_HINT_T0);
          for (int u = 0; u < U; ++u) {
            __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wr + n * K + k + 8 * u)));
            acc[n][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k + 8 * u), acc[n][u]);
          }
        }
      }
      for (int n = 0; n < NT; ++n) { __m256 s = acc[n][0]; for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[n][u]); out[ti * NT + n] = hsum(s); }
    }
  }
}
// pure read: sum of 32-bit ints over the same bytes, same split
void readonly(const uint16_t* w, float* out, int N, int K) {
  #pragma omp parallel
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t tot = (int64_t)N * K / 16, per = (tot + nt - 1) / nt; // 32-byte chunks
    int64_t a = t * per, b = std::min(tot, a + per);
    __m256i s0 = _mm256_setzero_si256(), s1 = s0;
    const __m256i* p = (const __m256i*)w;
    for (int64_t i = a; i + 1 < b; i += 2) { s0 = _mm256_add_epi32(s0, _mm256_loadu_si256(p + i)); s1 = _mm256_add_epi32(s1, _mm256_loadu_si256(p + i + 1)); }
    out[t] = (float)_mm256_extract_epi32(_mm256_add_epi32(s0, s1), 0);
  }
}
int main(int argc, char** argv) {
  int N = 49152, K = argc > 1 ? atoi(argv[1]) : 576; if (argc > 2) N = atoi(argv[2]);
  const int C = 6; std::vector<uint16_t*> ws;
  for (int c = 0; c < C; ++c) { auto* w = (uint16_t*)aligned_alloc(64, (size_t)N * K * 2); for (size_t i = 0; i < (size_t)N * K; ++i) w[i] = 0x3c00 + (i % 7); ws.push_back(w); }
  std::vector<float> x(K, 0.5f), out(N);
  double bytes = (double)N * K * 2;
  auto bench = [&](const char* name, auto fn) {
    std::vector<double> ts;
    for (int r = 0; r < 30; ++r) { auto t0 = std::chrono::steady_clock::now(); fn(ws[r % C]); ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
    std::sort(ts.begin(), ts.end()); printf("%-28s %8.1f us  %6.1f GB/s\n", name, ts[15] * 1e6, bytes / ts[15] / 1e9);
  };
  for (int rep = 0; rep < 2; ++rep) {
    bench("read only", [&](const uint16_t* w) { readonly(w, out.data(), N, K); });
    bench("NT8 U1 pf512 (before)", [&](const uint16_t* w) { run<8, 1, true, 512>(w, x.data(), out.data(), N, K); });
    bench("NT8 U1 nopf", [&](const uint16_t* w) { run<8, 1, false, 0>(w, x.data(), out.data(), N, K); });
    bench("NT4 U2 pf512", [&](const uint16_t* w) { run<4, 2, true, 512>(w, x.data(), out.data(), N, K); });
    bench("NT4 U2 nopf", [&](const uint16_t* w) { run<4, 2, false, 0>(w, x.data(), out.data(), N, K); });
    bench("NT2 U4 nopf", [&](const uint16_t* w) { run<2, 4, false, 0>(w, x.data(), out.data(), N, K); });
    bench("NT1 U4 nopf", [&](const uint16_t* w) { run<1, 4, false, 0>(w, x.data(), out.data(), N, K); });
    bench("NT8 next-tile pf D=1", [&](const uint16_t* w) { runtile<8, 1, false>(w, x.data(), out.data(), N, K); });
    bench("NT8 next-tile pf D=2 (now)", [&](const uint16_t* w) { runtile<8, 2, false>(w, x.data(), out.data(), N, K); });
    bench("NT8 next-tile pf D=4", [&](const uint16_t* w) { runtile<8, 4, false>(w, x.data(), out.data(), N, K); });
    bench("F32 (rows N/2) per-row pf (before)", [&](const uint16_t* w) { runtile<8, 0, true>((const float*)w, x.data(), out.data(), N / 2, K); });
    bench("F32 (rows N/2) next-tile D=2", [&](const uint16_t* w) { runtile<8, 2, false>((const float*)w, x.data(), out.data(), N / 2, K); });
    bench("NT8 U1 pf1024", [&](const uint16_t* w) { run<8, 1, true, 1024>(w, x.data(), out.data(), N, K); });
  }
}
