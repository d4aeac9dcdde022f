// AVX-512 VNNI kernel for packed GGUF weights against int8-quantized activations (the spec is
// in kernels.h, the layout in kvserve/quant/block_pack.py): out[m, n] = sum over blocks of the
// exact int32 dot product of the block's quants, scaled per block in float32.
//
// Why it is fast: a 64-byte chunk of a record is 16 weight rows x 4 quants, and one vpdpbusd
// multiplies it by 4 activation bytes broadcast to every lane: 64 multiply-adds, landing in
// 16 int32 lanes that are 16 output rows. No horizontal reduction is ever needed, and the
// float work (convert, scale, add) happens once per 32 weights instead of per weight. The
// 5-bit types (Q5_0, Q5_1) stream their bit 4 as a 64-byte plane beside the nibbles (5.5 / 6
// bits per weight, as stored): one vptestmb per chunk half picks the bytes whose quant has it,
// and a masked add puts it in before the vpdpbusd. IQ4_NL's nibbles index 16 values: one
// vpshufb per chunk half turns them into the values + 128 (unsigned, as vpdpbusd wants).
//
// Every tile shape gives the same bits: the int sums are exact, and the float operations per
// (m, n, block) are fixed by the spec. So the result depends neither on M nor on the ISA
// (qlinear.cpp, the AVX2 twin, gives the same bits), and prefill, decode and any batch agree.
//
// As in linear_avx512.cpp, the target pragma covers only this file's code after the system
// headers, everything is internal except qlinear_avx512(), and bindings.cpp calls it only
// when cpu_has_avx512_vnni().
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "simd.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

namespace kvs {
namespace {

// Weight-stream prefetch distance (bytes ahead of the record being multiplied), as in
// linear_avx512.cpp, into L2 (T1) rather than L1, as qlinear_kquant_avx512.cpp says why:
// Zen 4, benchmarks/kernel_ab.py, 41 rounds, tree (L2) / base (L1) at 1, 2, 5, 8 rows: the
// default model's Q4_1 file 0.95, 0.96, 0.98, 0.98; its Q8_0 requantization 0.95, 0.99,
// 0.87, 0.82; Q5_1 0.94, 0.95, 0.93, 0.96. (The AVX2 file, qlinear.cpp, read 0.97-1.04x
// the same way: it stays with L1.)
constexpr int64_t kPrefetchBytes = 8192;

#include "vnni.h"  // dpbusd_bcast

// G consecutive groups (16 rows each) against MT activation rows m0.. of `a`, records of the
// format W (kernels.h packed_format).
//   w: the first group's records; gbytes: bytes per group (K / 32 records)
//   out: out + m0 * ldo + first column; cols: valid columns from there (the last group may be
//   partial); bias: bias + first column or nullptr.
template <WType W, int G, int MT, bool kPf>
inline void tile(const QActs& a, int64_t m0, const uint8_t* w, int64_t gbytes,
                 const float* bias, float* out, int64_t ldo, int64_t cols) {
  constexpr PackedFormat F = packed_format(W);
  constexpr int64_t kRB = F.record;
  const int64_t K = a.K, nb = K / 32;
  __m512 acc[G][MT];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m) acc[g][m] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  [[maybe_unused]] const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)), _mm_set1_epi8(-128)));

  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[G][MT], hi[G][MT];  // two int chains per output vector (hide vpdpbusd latency)
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MT; ++m) lo[g][m] = hi[g][m] = _mm512_setzero_si512();
    const int8_t* xq = a.q + m0 * K + b * 32;
    for (int g = 0; g < G; ++g) {
      const uint8_t* r = block_record(F, w + g * gbytes, b).quants;  // its chunks at + F.qs
      if constexpr (kPf)  // the stream advances kRB / F.span bytes a block
        for (int64_t o = 0; o < (kRB + F.span - 1) / F.span; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(r) + kPrefetchBytes + o, _MM_HINT_T1);
      if constexpr (F.nibbles) {
        [[maybe_unused]] const __m512i plane =
            F.qh >= 0 ? _mm512_loadu_si512(r + F.qh) : _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(r + F.qs + 64 * c);
          __m512i wl = _mm512_and_si512(v, nib);
          __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          if constexpr (F.qh >= 0) {  // bit 4: plane bit c (low nibbles), 4 + c (high)
            wl = _mm512_mask_add_epi8(wl, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(
                                              static_cast<char>(1 << c))), wl, bit4);
            wh = _mm512_mask_add_epi8(wh, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(
                                              static_cast<char>(16 << c))), wh, bit4);
          }
          if constexpr (F.lookup) {  // IQ4_NL: the values + 128 the nibbles index
            wl = _mm512_shuffle_epi8(lut, wl);
            wh = _mm512_shuffle_epi8(lut, wh);
          }
          for (int m = 0; m < MT; ++m) {
            lo[g][m] = dpbusd_bcast(lo[g][m], wl, xq + m * K + 4 * c);
            hi[g][m] = dpbusd_bcast(hi[g][m], wh, xq + m * K + 16 + 4 * c);
          }
        }
      } else {
        for (int c = 0; c < 8; c += 2) {
          const __m512i v0 = _mm512_loadu_si512(r + F.qs + 64 * c);
          const __m512i v1 = _mm512_loadu_si512(r + F.qs + 64 + 64 * c);
          for (int m = 0; m < MT; ++m) {
            lo[g][m] = dpbusd_bcast(lo[g][m], v0, xq + m * K + 4 * c);
            hi[g][m] = dpbusd_bcast(hi[g][m], v1, xq + m * K + 4 * c + 4);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* r = block_record(F, w + g * gbytes, b).scales;  // d (and m): Q4_1_128's
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
      for (int m = 0; m < MT; ++m) {
        const int64_t mb = (m0 + m) * nb + b;
        __m512i isum = _mm512_add_epi32(lo[g][m], hi[g][m]);
        // Quants unsigned (Q8_0 + 128, Q4_0 + 8, Q5_0 + 16, IQ4_NL's values + 128): take back
        // offset * sum(x).
        if constexpr (F.offset != 0)
          isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(F.offset * a.sum[mb]));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[mb]));
        acc[g][m] = _mm512_add_ps(acc[g][m], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale));
      }
      if constexpr (F.m >= 0) {
        const __m512 mw =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + F.m)));
        for (int m = 0; m < MT; ++m)
          acc[g][m] = _mm512_add_ps(
              acc[g][m], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[(m0 + m) * nb + b])));
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t c = cols - 16 * g;
    if (c <= 0) break;
    const __mmask16 mask = c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * g) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const __m512 v = bias ? _mm512_add_ps(acc[g][m], bv) : acc[g][m];
      _mm512_mask_storeu_ps(out + m * ldo + 16 * g, mask, v);
    }
  }
}

// Rows m0 .. m0 + rows - 1 against G groups, MT rows per tile; the first tile streams the
// weights from DRAM (prefetching), the rest re-read them from L1.
template <WType W, int G, int MT>
inline void row_tiles(const QActs& a, int64_t m0, int64_t rows, const uint8_t* w,
                      int64_t gbytes, const float* bias, float* out, int64_t ldo,
                      int64_t cols) {
  int64_t m = 0;
  for (; m + MT <= rows; m += MT) {
    if (m == 0) tile<W, G, MT, true>(a, m0, w, gbytes, bias, out, ldo, cols);
    else tile<W, G, MT, false>(a, m0 + m, w, gbytes, bias, out + m * ldo, ldo, cols);
  }
  if constexpr (MT > 1) {
    if (m < rows)
      row_tiles<W, G, MT - 1>(a, m0 + m, rows - m, w, gbytes, bias, out + m * ldo, ldo,
                                 cols);
  }
}

template <WType W, int G, int MT>
void run(const QActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
         int nthreads) {
  const int64_t M = a.M, K = a.K, gbytes = packed_group_bytes(packed_format(W), K);
  const int64_t groups = (N + 15) / 16, tiles = (groups + G - 1) / G;
  // Activation rows per pass over a thread's weight slab: ~256 KB of quants stay in L2.
  const int64_t m_block = max64(MT, (262144 / max64(K, 1)) / MT * MT);
  const bool parallel = nthreads > 1 && N * K >= (1 << 16);
  for_each_tile(tiles, (M + m_block - 1) / m_block, nthreads, parallel,
                [&](int64_t pass, int64_t t) {
    const int64_t m0 = pass * m_block, mb = min64(m_block, M - m0);
    const int64_t g0 = t * G, n0 = g0 * 16;
    const uint8_t* wt = w + g0 * gbytes;
    const float* bt = bias ? bias + n0 : nullptr;
    float* ot = out + m0 * N + n0;
    if (g0 + G <= groups) {
      row_tiles<W, G, MT>(a, m0, mb, wt, gbytes, bt, ot, N, N - n0);
    } else {  // the last, short tile: one group at a time
      for (int64_t g = g0; g < groups; ++g)
        row_tiles<W, 1, MT>(a, m0, mb, w + g * gbytes, gbytes,
                               bias ? bias + g * 16 : nullptr, out + m0 * N + g * 16, N,
                               N - g * 16);
    }
  });
}

template <WType W>
void run_fmt(const QActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads) {
  // Tiles (32 zmm): 3 * G * MT accumulators (two int chains and a float sum per output
  // vector) + 2 weight vectors. One group at a time at every M, so each thread reads one
  // linear stream: at M == 1, 4 groups side by side streamed 12-14% slower on Zen 5; at
  // 2 <= M < 8, 2 groups x 4 rows took 1.12-1.19x the time of 1 group x M rows over the
  // default model's Q4_1 linears and 1.6-1.8x over its Q8_0 lm_head (Zen 4, builds
  // alternated in one process). M > 1: 8 rows a tile (fewer: one tile of M), the group's
  // records re-read from L1 for every 8 rows.
  if (a.M == 1) run<W, 1, 1>(a, w, bias, out, N, nthreads);
  else run<W, 1, 8>(a, w, bias, out, N, nthreads);
}

}  // namespace

void qlinear_avx512(const QActs& a, const uint8_t* w, WType wt, const float* bias, float* out,
                    int64_t N, int nthreads) {
  switch (wt) {
    case WType::Q4_0: return run_fmt<WType::Q4_0>(a, w, bias, out, N, nthreads);
    case WType::Q4_1: return run_fmt<WType::Q4_1>(a, w, bias, out, N, nthreads);
    case WType::Q4_1_128: return run_fmt<WType::Q4_1_128>(a, w, bias, out, N, nthreads);
    case WType::Q5_0: return run_fmt<WType::Q5_0>(a, w, bias, out, N, nthreads);
    case WType::Q5_1: return run_fmt<WType::Q5_1>(a, w, bias, out, N, nthreads);
    case WType::IQ4_NL: return run_fmt<WType::IQ4_NL>(a, w, bias, out, N, nthreads);
    default: return run_fmt<WType::Q8_0>(a, w, bias, out, N, nthreads);
  }
}

}  // namespace kvs

#pragma GCC pop_options

namespace kvs {

bool cpu_has_avx512_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

}  // namespace kvs
