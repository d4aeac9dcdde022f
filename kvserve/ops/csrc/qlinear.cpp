// Quantized linear on packed GGUF weights, AVX2: out[M, N] = x W^T with x quantized to int8
// per block of 32 (QActs) and W in the 16-row packed layout of kvserve/quant/block_pack.py
// (`pack`).
//
// One record (group g of 16 weight rows, block b of 32 weights) at w + (g * K/32 + b) * RB,
// its fields at kernels.h packed_format(wt):
//
//   Q4_1, RB = 320:  d fp16[16] | m fp16[16] | chunk 0 | chunk 1 | chunk 2 | chunk 3
//   Q4_1_128, RB = 1088 (4 blocks):  d fp16[16] | m fp16[16] | block 0's chunks 0 .. 3 | ..
//     | block 3's; each block computed as Q4_1's with the record's d and m
//   Q4_0, RB = 288:  d fp16[16] | chunk 0 .. 3   (IQ4_NL the same)
//   Q5_0, RB = 352:  d fp16[16] | qh plane | chunk 0 .. 3
//   Q5_1, RB = 384:  d fp16[16] | m fp16[16] | qh plane | chunk 0 .. 3
//   Q8_0, RB = 544:  d fp16[16] | chunk 0 | ... | chunk 7
//   chunk c, 64 bytes:  byte 4r + j (row r = 0..15, j = 0..3) =
//     nibble formats: quant 4c + j (low nibble), quant 16 + 4c + j (high nibble), unsigned
//       (IQ4_NL: the nibble indexes kIQ4Values, looked up by a byte shuffle)
//     Q8_0: quant 4c + j + 128, as uint8
//   qh plane, 64 bytes: byte 4r + j, bit b = bit 4 of row r's quant 4b + j
//
// A chunk is two ymm, rows 0..7 and rows 8..15, multiplied against the 4 activation bytes
// of its quants broadcast to all 8 lanes: maddubs (u8 x s8 -> int16 pairs) then madd with
// ones (-> int32 per row) gives every row its 4-product sum in its own lane. The 5-bit types
// OR bit 4 in first: chunk c's low nibbles take plane bit c (<< 4 - c), its high nibbles bit
// 4 + c (>> c). Quants stored unsigned (Q4_0 + 8, Q5_0 + 16) give sum(q * x) + offset *
// sum(x); the kernel takes back offset * QActs.sum per block. The int sums are exact in any
// order; the float part follows kernels.h's order exactly, one rounding per mul or add
// (-ffp-contract=off, no FMA), so every tile shape here and the VNNI twin agree.
//
// Parallel split: threads take contiguous ranges of groups (each streams its own slab of the
// weight); when there are fewer groups than threads, the spare threads split the rows too.
// Per thread, the activation rows go in passes of ~256 KB of int8 (kept in L2); per group,
// the pass's rows go in register tiles of MT rows, the first tile pulling the group's
// records from memory (prefetched ahead) and the others re-reading them from L1 (a group is
// K/32 * RB bytes: 5.8 KB at K = 576 for Q4_1, 26 KB at K = 1536 for Q8_0).
#include <omp.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvs {
namespace {

constexpr int64_t kGroup = 16;

#if KVS_AVX2

// How far ahead of the record being read its stream is prefetched. Measured on one EPYC core
// streaming 84-142 MB at M = 1: 8 KB draws ~45 GB/s against ~34 with none or 4 KB; still a
// quarter of a 32 KB L1, which holds the group being read for the row tiles after the first.
// Zen 3 (benchmarks/kernel_ab.py, the Qwen2.5-Coder 0.5B Q4_K_M file's 132 Q5_0 linears, 1
// row, 7-9 rounds): into L2 6 KB ahead (as the K-quant tiles) 1.02x the time, L1 16 KB 1.05x,
// L1 4 KB 1.03x: within noise or worse, so 8 KB into L1 stays.
#ifndef KVS_Q_PREFETCH_BYTES  // knobs for benchmarks/kernel_ab.py -D
#define KVS_Q_PREFETCH_BYTES 8192
#endif
#ifndef KVS_Q_PREFETCH_HINT
#define KVS_Q_PREFETCH_HINT _MM_HINT_T0
#endif
constexpr int64_t kPrefetchBytes = KVS_Q_PREFETCH_BYTES;

// Format policies. dot<MT>(rec, x, isum): isum[m][h] = int32 lane r = sum over the block of
// row (8h + r)'s stored quants times x[m][0..31] (x[m] = activation row m at the block's
// start); tile() takes back kOffset * sum(x).
template <WType W>
struct Nibbles {
  static constexpr PackedFormat F = packed_format(W);
  static constexpr int64_t kRecord = F.record, kMin = F.m, kSpan = F.span;
  static constexpr int32_t kOffset = F.offset;
  static constexpr bool kFive = F.qh >= 0;
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, __m256i (*isum)[2]) {
    const __m256i nib = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    const __m256i ones = _mm256_set1_epi16(1);
    // Summed in int16 before widening: an int16 lane gathers 8 maddubs pairs (4 chunks) of
    // 4-bit quants, 16 products of |q| <= 15 by |x| <= 128, so |sum| <= 30720 < 2^15; of
    // 5-bit ones only 4 pairs (2 chunks): 8 products of q <= 31 by |x| <= 127 (QActs never
    // holds -128), |sum| <= 31496 (no wrap, no saturation).
    constexpr int kWiden = kFive ? 2 : 4;
    __m256i plane[2];
    if constexpr (kFive) {
      plane[0] = load256(rec + F.qh);
      plane[1] = load256(rec + F.qh + 32);
    }
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i r0 = load256(rec + F.qs + 64 * c), r1 = load256(rec + F.qs + 32 + 64 * c);
      __m256i lo0 = _mm256_and_si256(r0, nib), lo1 = _mm256_and_si256(r1, nib);
      __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), nib);
      __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), nib);
      if constexpr (kFive) {
        // The 16-bit shifts move bits across a lane's two bytes, but never into bit 4 of
        // either for shifts 0..4; the mask keeps bit 4 only.
        lo0 = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16(plane[0], 4 - c), bit4));
        lo1 = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16(plane[1], 4 - c), bit4));
        hi0 = _mm256_or_si256(hi0, _mm256_and_si256(_mm256_srli_epi16(plane[0], c), bit4));
        hi1 = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_srli_epi16(plane[1], c), bit4));
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xl = bcast4(x[m] + 4 * c), xh = bcast4(x[m] + 16 + 4 * c);
        acc[m][0] = _mm256_add_epi16(acc[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                 _mm256_maddubs_epi16(hi0, xh)));
        acc[m][1] = _mm256_add_epi16(acc[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                 _mm256_maddubs_epi16(hi1, xh)));
      }
      // 4-bit types: keeps each running sum in its register (as qlinear_kquant.cpp's tiles
      // do). Unpinned, GCC reassociates the 4 chunks' sums into all the products first,
      // spilled to the stack, then a tree of adds; pinned, Q4_1 ran 1.2-1.4x faster at 3-48
      // rows (one EPYC core, weights in cache). The 5-bit types' two plane registers leave
      // no room: pinned they spilled more and ran 0.6-0.7x, so they stay unpinned. The int
      // sums are exact in any order: the same bits either way.
      if constexpr (!kFive)
        for (int m = 0; m < MT; ++m) asm("" : "+x"(acc[m][0]), "+x"(acc[m][1]));
      if (c % kWiden == kWiden - 1) {
        for (int m = 0; m < MT; ++m)
          for (int h = 0; h < 2; ++h) {
            const __m256i w = _mm256_madd_epi16(acc[m][h], ones);
            isum[m][h] = c < kWiden ? w : _mm256_add_epi32(isum[m][h], w);
            acc[m][h] = _mm256_setzero_si256();
          }
      }
    }
  }
};

// IQ4_NL: the nibbles (Q4_0's chunks) looked up in kIQ4Values (-127..113), then multiplied
// as Q80 below multiplies: |v| by x carrying v's sign (no value is 0, so sign() keeps every
// x). A maddubs pair is up to 2 * 127 * 127, so each is widened at once (madd), not summed
// in int16 as the linear 4-bit types are.
struct NonLinear {
  static constexpr PackedFormat F = packed_format(WType::IQ4_NL);
  static constexpr int64_t kRecord = F.record, kMin = -1, kSpan = 1;
  static constexpr int64_t kQs = F.qs;
  static constexpr int32_t kOffset = 0;  // signed values: nothing to take back
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, __m256i (*isum)[2]) {
    const __m256i lut = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load256(rec + kQs + 64 * c + 32 * h);
        const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
        const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4),
                                                                     nib));
        const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
        for (int m = 0; m < MT; ++m) {
          const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(bcast4(x[m] + 4 * c), wl));
          const __m256i ph =
              _mm256_maddubs_epi16(ah, _mm256_sign_epi8(bcast4(x[m] + 16 + 4 * c), wh));
          isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                                     _mm256_madd_epi16(ph, ones)));
        }
      }
  }
};

struct Q80 {
  static constexpr PackedFormat F = packed_format(WType::Q8_0);
  static constexpr int64_t kRecord = F.record, kMin = -1, kSpan = 1;
  static constexpr int32_t kOffset = 0;  // multiplied signed (below): nothing to take back
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, __m256i (*isum)[2]) {
    // The stored byte (q + 128, up to 255) times x would saturate maddubs' int16 pairs, so
    // multiply |q| (<= 128, unsigned) by x carrying q's sign: pairs |sum| <= 2 * 128 * 127.
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w0 = _mm256_xor_si256(load256(rec + 32 + 64 * c), flip);
      const __m256i w1 = _mm256_xor_si256(load256(rec + 64 + 64 * c), flip);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int m = 0; m < MT; ++m) {
        const __m256i xb = bcast4(x[m] + 4 * c);
        isum[m][0] = _mm256_add_epi32(isum[m][0], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
        isum[m][1] = _mm256_add_epi32(isum[m][1], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
      }
    }
  }
};

// Activation rows m0 .. m0 + MT - 1 against one group (records from gw) -> out columns
// 0 .. cols - 1 of those rows (out points at the group's first column, rows N apart).
template <class Fmt, int MT, bool kPrefetchW>
inline void tile(const QActs& a, int64_t m0, const uint8_t* gw, const float* bias, float* out,
                 int64_t N, int64_t cols) {
  const int64_t K = a.K, nb = K / 32;
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // A record of several blocks (Q4_1_128) holds their scales once: `rec` is where this
    // block's chunks are read from (at + qs), `sc` where its d and m are.
    const auto [sc, rec] = block_record(Fmt::F, gw, b);
    if constexpr (kPrefetchW)  // the stream advances kRecord / kSpan bytes a block
      for (int64_t off = 0; off < (Fmt::kRecord + Fmt::kSpan - 1) / Fmt::kSpan; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec) + kPrefetchBytes + off,
                     KVS_Q_PREFETCH_HINT);
    const int8_t* x[MT];
    for (int m = 0; m < MT; ++m) x[m] = a.q + (m0 + m) * K + b * 32;
    __m256i isum[MT][2];
    Fmt::template dot<MT>(rec, x, isum);
    if constexpr (Fmt::kOffset != 0)
      for (int m = 0; m < MT; ++m) {
        const __m256i off = _mm256_set1_epi32(Fmt::kOffset * a.sum[(m0 + m) * nb + b]);
        isum[m][0] = _mm256_sub_epi32(isum[m][0], off);
        isum[m][1] = _mm256_sub_epi32(isum[m][1], off);
      }
    const __m256 dw[2] = {load_halves8(sc), load_halves8(sc + 16)};
    for (int m = 0; m < MT; ++m) {
      const __m256 dx = _mm256_set1_ps(a.d[(m0 + m) * nb + b]);
      for (int h = 0; h < 2; ++h)
        acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m][h]),
                                                           _mm256_mul_ps(dw[h], dx)));
    }
    if constexpr (Fmt::kMin >= 0) {
      const __m256 mw[2] = {load_halves8(sc + Fmt::kMin), load_halves8(sc + Fmt::kMin + 16)};
      for (int m = 0; m < MT; ++m) {
        const __m256 s = _mm256_set1_ps(a.s[(m0 + m) * nb + b]);
        for (int h = 0; h < 2; ++h)
          acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_mul_ps(mw[h], s));
      }
    }
  }
  if (cols == kGroup) {
    for (int m = 0; m < MT; ++m) {
      float* o = out + (m0 + m) * N;
      for (int h = 0; h < 2; ++h) {
        __m256 v = acc[m][h];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
        _mm256_storeu_ps(o + 8 * h, v);
      }
    }
  } else {  // the last group of N % 16 columns: masked, nothing read or written past N
    const __m256i mask[2] = {tail_mask(std::min<int64_t>(cols, 8)),
                             tail_mask(std::max<int64_t>(cols - 8, 0))};
    for (int m = 0; m < MT; ++m) {
      float* o = out + (m0 + m) * N;
      for (int h = 0; h < 2; ++h) {
        __m256 v = acc[m][h];
        if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + 8 * h, mask[h]));
        _mm256_maskstore_ps(o + 8 * h, mask[h], v);
      }
    }
  }
}

// The rest (1 <= rest < MT) rows at m0 as one smaller tile.
template <class Fmt, int MT>
inline void rest_tile(int64_t rest, bool prefetch, const QActs& a, int64_t m0,
                      const uint8_t* gw, const float* bias, float* out, int64_t N, int64_t cols) {
  if constexpr (MT > 1) {
    if (rest == MT - 1) {
      if (prefetch) tile<Fmt, MT - 1, true>(a, m0, gw, bias, out, N, cols);
      else tile<Fmt, MT - 1, false>(a, m0, gw, bias, out, N, cols);
    } else {
      rest_tile<Fmt, MT - 1>(rest, prefetch, a, m0, gw, bias, out, N, cols);
    }
  }
}

template <class Fmt, int MT>
void run(const QActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
         int nthreads) {
  const int64_t M = a.M, K = a.K, groups = (N + kGroup - 1) / kGroup;
  if (M == 0 || groups == 0) return;
  const int64_t group_bytes = packed_group_bytes(Fmt::F, K);
  const int64_t row_tiles = (M + MT - 1) / MT;
  // Rows per pass over the slab: ~256 KB of int8 activations stay in L2 while it streams.
  const int64_t m_block = std::max<int64_t>(MT, (1 << 18) / std::max<int64_t>(K, 1) / MT * MT);
  // Below ~64K multiply-adds the fork/join (~2 us) costs more than it saves.
  const bool parallel = nthreads > 1 && M * N * K >= (1 << 16);
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t tg = std::min(nth, groups);
    const int64_t tm = std::min(std::max<int64_t>(nth / tg, 1), row_tiles);
    if (tid < tg * tm) {
      const int64_t gi = tid % tg, mi = tid / tg;
      const int64_t g_begin = groups * gi / tg, g_end = groups * (gi + 1) / tg;
      const int64_t m_begin = row_tiles * mi / tm * MT;
      const int64_t m_end = std::min(M, row_tiles * (mi + 1) / tm * MT);
      for (int64_t p0 = m_begin; p0 < m_end; p0 += m_block) {
        const int64_t p1 = std::min(p0 + m_block, m_end);
        for (int64_t g = g_begin; g < g_end; ++g) {
          const uint8_t* gw = w + g * group_bytes;
          const int64_t n0 = g * kGroup, cols = std::min(kGroup, N - n0);
          const float* bg = bias ? bias + n0 : nullptr;
          // The first tile streams the group from memory (prefetch); the others hit L1.
          int64_t m = p0;
          if (m + MT <= p1) {
            tile<Fmt, MT, true>(a, m, gw, bg, out + n0, N, cols);
            for (m += MT; m + MT <= p1; m += MT)
              tile<Fmt, MT, false>(a, m, gw, bg, out + n0, N, cols);
          }
          if (m < p1) rest_tile<Fmt, MT>(p1 - m, m == p0, a, m, gw, bg, out + n0, N, cols);
        }
      }
    }
  }
}

template <class Fmt>
void run_fmt(const QActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads) {
  // Tile rows: accumulators take 4 ymm per row (2 float, 2 int). MT = 3 leaves 4 for the
  // weight chunk and broadcasts; MT = 4 spills and measured ~5% slower (MT = 2 about equal).
  if (a.M == 1) run<Fmt, 1>(a, w, bias, out, N, nthreads);
  else run<Fmt, 3>(a, w, bias, out, N, nthreads);
}

#endif  // KVS_AVX2

}  // namespace

void qlinear(const QActs& a, const uint8_t* w, WType wt, const float* bias, float* out,
             int64_t N, int nthreads) {
#if KVS_AVX2
  switch (wt) {
    case WType::Q4_0: return run_fmt<Nibbles<WType::Q4_0>>(a, w, bias, out, N, nthreads);
    case WType::Q4_1: return run_fmt<Nibbles<WType::Q4_1>>(a, w, bias, out, N, nthreads);
    case WType::Q4_1_128:
      return run_fmt<Nibbles<WType::Q4_1_128>>(a, w, bias, out, N, nthreads);
    case WType::Q5_0: return run_fmt<Nibbles<WType::Q5_0>>(a, w, bias, out, N, nthreads);
    case WType::Q5_1: return run_fmt<Nibbles<WType::Q5_1>>(a, w, bias, out, N, nthreads);
    case WType::IQ4_NL: return run_fmt<NonLinear>(a, w, bias, out, N, nthreads);
    default: return run_fmt<Q80>(a, w, bias, out, N, nthreads);
  }
#else
  // Scalar: the same integers and the same float operations in the same order.
  const PackedFormat f = packed_format(wt);
  const int64_t M = a.M, K = a.K, nb = K / 32, gb = packed_group_bytes(f, K);
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kGroup, r = n % kGroup;
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const auto [sc, rec] = block_record(f, w + g * gb, b);
        const int8_t* x = a.q + m * K + b * 32;
        int32_t isum = 0;
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t c = i % 16 / 4, j = i % 4;
          int32_t q = f.nibbles ? (rec[f.qs + 64 * c + 4 * r + j] >> (i < 16 ? 0 : 4)) & 15
                                : rec[f.qs + 64 * (i / 4) + 4 * r + j];
          if (f.qh >= 0) q |= (rec[f.qh + 4 * r + j] >> (i / 4) & 1) << 4;
          isum += (f.lookup ? kIQ4Values[q] : q - f.offset) * x[i];
        }
        acc = acc + static_cast<float>(isum) *
                        (half_to_float(load_u16(sc + 2 * r)) * a.d[m * nb + b]);
        if (f.m >= 0) acc = acc + half_to_float(load_u16(sc + f.m + 2 * r)) * a.s[m * nb + b];
      }
      out[m * N + n] = bias ? acc + bias[n] : acc;
    }
  }
#endif
}

}  // namespace kvs
