// AVX-512 VNNI kernel for packed GGUF K-quants (Q2_K..Q6_K) against Q8_K activations; the
// spec is in kernels.h, the record layout in kquant.h, the AVX2 twin is qlinear_kquant.cpp.
//
// A 64-byte chunk is 16 weight rows x 4 quants, so one vpdpbusd against 4 activation bytes
// broadcast does 64 multiply-adds into 16 int32 lanes that are the group's 16 output rows;
// per sub-block the int32 sum is then scaled by each row's scale (vpmulld; a sub-block's sum
// reaches 60960 (Q4_K), 125984 (Q5_K), and does not fit the int16 factor of a madd):
//
//   Q2_K sub-block (16 weights) = 4 chunks of q (0..3, 2 bits of a qs chunk); mins as Q4_K's,
//       one bsum per sub-block.
//   Q3_K sub-block (16 weights) = 4 chunks of q + 4 (0..7: 2 qs bits, 1 hmask bit), its chain
//       started at -4 * bsum, as Q6_K's.
//   Q4_K sub-block (32 weights) = 8 chunks x { low nibbles | high nibbles } (sub-blocks 2c,
//       2c + 1 of chunk row c side by side), 2 dpbusd per chunk, 2 vpmulld per chunk row.
//   Q5_K: Q4_K's, each nibble with its bit 4 from the qh chunk (q 0..31).
//   Q6_K sub-block (16 weights) = 4 chunks of q + 32 (0..63, nibble | 2 high bits); its
//       dpbusd chain starts at -32 * bsum instead of 0, which takes the + 32 back exactly.
//   Q4_K mins: sum_s min_s * (the activations' sum over s), one vpdpwssd per two sub-blocks
//       (with_sums32).
//   IQ4_XS sub-block (32 weights) = 4 chunks x { low nibbles | high nibbles }, each nibble
//       looked up (vpshufb) in the 16 values + 128 (1..241, unsigned); the chain starts at
//       -128 * the activations' sum over the sub-block, which takes the + 128 back exactly.
//       IQ3_S4 (a file's IQ3_S, rewritten at load) is the same with its own 16 values.
//
// The integer sums are exact, the float steps per (m, n, super-block) fixed by the spec, so the
// bits equal the AVX2 twin's and the oracle's whatever the tile.
//
// From 32 activation rows a pass reads its group's records unpacked once ("wide records",
// below); on a CPU with AMX (amx_rows, below) those rows' dot products run on tiles instead.
//
// As in qlinear_avx512.cpp, the target pragma covers only this file's code after the headers,
// everything is internal except qlinear_kquant_avx512(), and bindings call it only when
// cpu_has_avx512_vnni() (and with amx only when cpu_has_amx_int8()).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "kquant.h"
#include "simd.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")

namespace kvs {
namespace {

using kq::kGroup;
using kq::kQK;

// How far ahead of the record being read its stream is prefetched, and into which cache.
// Into L1 (T0): 2 KB ran 0.92x, 0.91x, 0.89x the time of 8 KB at 1, 2, 5 rows (Zen 4, every
// K-quant linear of the Qwen2.5-Coder 1.5B Q4_K_M file, paired rounds; 4 KB 0.94x, 0.92x,
// 0.97x; 16 KB 1.03x at 1 row). Into L2 (T1) 6 KB ahead then ran (kernel_ab.py --formats,
// 61 rounds, Zen 4) Q6_K 0.78x / 0.77x the time of L1 2 KB at 1 / 5 rows, Q5_K 0.92x / 0.72x,
// Q3_K 0.78x / 0.98x, Q4_K 0.78-0.84x at 5 rows, Q2_K and IQ4_XS 0.83-1.05x; the whole
// Q4_K_M file, as below (Q4_K's one-row tile with L1), 0.95x, 0.95x, 0.77x, 0.72x, 0.82x
// at 1, 2, 5, 8, 16 rows. Why: a burst of a record's 36-53 lines into L1 ties up its few
// miss buffers, while the L1's own prefetcher follows the lines from L2. L2 at 2 KB, or L2
// far with a near L1 prefetch beside it, lost 1.06-1.10x at 1 and 5 rows; 4-16 KB into L2
// read within noise of 6 KB. One exception: Q4_K's one-row tile, the least work per byte,
// stays with L1 at 2 KB (L2: 1.01-1.13x its time, three runs).
#ifndef KVS_KQUANT_PREFETCH_BYTES  // knobs for benchmarks/kernel_ab.py -D
#define KVS_KQUANT_PREFETCH_BYTES 2048
#endif
#ifndef KVS_KQUANT_L2_PREFETCH_BYTES
#define KVS_KQUANT_L2_PREFETCH_BYTES 6144
#endif
constexpr int64_t kPrefetchBytes = KVS_KQUANT_PREFETCH_BYTES;
constexpr int64_t kL2PrefetchBytes = KVS_KQUANT_L2_PREFETCH_BYTES;

#include "vnni.h"  // dpbusd_bcast, dpwssd_bcast

inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

inline __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

inline __m512 load_halves16(const uint8_t* p) {  // 16 fp16 -> fp32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// An int16 broadcast with zero high halves: madd(v32, bc16(s)) = v32 * s for v32 in int16.
inline __m512i bc16(int32_t s) { return _mm512_set1_epi32(static_cast<uint16_t>(s)); }

// Every byte's bit `from` moved to bit `to` (0..7), the other bits left for the caller's mask
// of bit `to` (the AVX2 twin's move_bit says why a 16-bit shift is enough).
inline __m512i move_bit(__m512i v, int from, int to) {
  return from >= to ? _mm512_srli_epi16(v, from - to) : _mm512_slli_epi16(v, to - from);
}

// a in the low and the high int16 of each int32 lane (a < 2^15): a 16-bit multiplier for
// both bytes of the lane's halves (the AMX planes, mul_bytes).
inline __m512i dup16(__m512i a) { return _mm512_or_si512(a, _mm512_slli_epi32(a, 16)); }

// Q4_K / Q5_K: msum[m] = sum_s min_s * (sub-block s's sum of 32 quants), one vpdpwssd of
// the pair (min_2t, min_2t+1) with the pair of sums (2t, 2t + 1) per two sub-blocks (exact in
// int32). bs[m]: the row's 8 sums of 32 (with_sums32); pair: min_pairs (the AMX records
// store the same pairs).
template <int MT>
inline void min_sums(const __m512i* pair, const int16_t* const* bs, __m512i* msum) {
  for (int m = 0; m < MT; ++m) {
    __m512i acc = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) acc = dpwssd_bcast(acc, pair[t], bs[m] + 2 * t);
    msum[m] = acc;
  }
}

inline void min_pairs(const __m128i* mn, __m512i* pair) {
  for (int t = 0; t < 4; ++t)
    pair[t] = _mm512_or_si512(_mm512_cvtepu8_epi32(mn[2 * t]),
                              _mm512_slli_epi32(_mm512_cvtepu8_epi32(mn[2 * t + 1]), 16));
}

// The activations' sums of 32 quants (two bsums added: |sum| <= 32 x 127, an int16), 8 per
// super-block: what Q4_K / Q5_K's mins pair with (kSumWidth 32), here and on AMX, half the
// multiply-adds of pairing each min with itself against the two bsums of its sub-block.
inline Q8KActs with_sums32(const Q8KActs& a, std::vector<int16_t>& buf) {
  const int64_t n = a.M * a.K / 32;
  buf.resize(n);
  for (int64_t t = 0; t < n; ++t)
    buf[t] = static_cast<int16_t>(a.bsums[2 * t] + a.bsums[2 * t + 1]);
  return {a.q, a.d, buf.data(), a.M, a.K};
}

// dot<MT>(rec, x, bs, isum, msum): isum[m] / msum[m] lane r = row r's isum / msum for
// activation row m (x[m]: its quants at the super-block, bs[m]: its sums of kSumWidth quants:
// the 16 bsums, or Q4_K / Q5_K's 8 sums of 32); kD / kDmin:
// the record offsets of d[16] / dmin[16]; kJoint: Q2_K's float order (kernels.h).

// Q2_K / Q3_K (kquant.h): weight 128h + 32c + 4l4 + j, sub-block 8h + 2c + l4 / 4, has its
// 2 low bits at bits 2c of qs chunk 8h + l4. isum[m] = sum_s scale_s * (start_s + sum_{j in s}
// u_j * x_j), u = Bits::get(rec, h, c, l4) (0..7), each sub-block's chain from start(m, s).
template <int MT, class Bits, class Start>
inline void sub_block_sums(const uint8_t* rec, const __m128i* sc, const int8_t* const* x,
                           Start start, __m512i* isum) {
  for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {
      __m512i acc[2][MT];  // sub-blocks 8h + 2c + half
      for (int half = 0; half < 2; ++half)
        for (int m = 0; m < MT; ++m) acc[half][m] = start(m, 8 * h + 2 * c + half);
      for (int l4 = 0; l4 < 8; ++l4) {
        const __m512i u = Bits::get(rec, h, c, l4);
        for (int m = 0; m < MT; ++m)
          acc[l4 / 4][m] = dpbusd_bcast(acc[l4 / 4][m], u, x[m] + 128 * h + 32 * c + 4 * l4);
      }
      for (int half = 0; half < 2; ++half) {
        const __m512i s = _mm512_cvtepi8_epi32(sc[8 * h + 2 * c + half]);
        for (int m = 0; m < MT; ++m)
          isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(acc[half][m], s));
      }
    }
}

struct Q2K {
  static constexpr int64_t kRecord = kq::kQ2KRecord;
  static constexpr int64_t kD = kq::kQ2KD, kDmin = kq::kQ2KDmin;
  static constexpr bool kMin = true, kJoint = true;
  static constexpr int64_t kSumWidth = 16;  // quants per activation sum bs[m] holds
  struct Bits {  // q: bits 2c of the qs chunk
    static inline __m512i get(const uint8_t* rec, int h, int c, int l4) {
      const __m512i q = load512(rec + kq::kQ2KQs + 64 * (8 * h + l4));
      return _mm512_and_si512(_mm512_srli_epi16(q, 2 * c), _mm512_set1_epi8(3));
    }
  };
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i* msum) {
    __m128i sc[16], mn[16];
    kq::q2k_scales(rec, sc, mn);
    sub_block_sums<MT, Bits>(rec, sc, x, [](int, int) { return _mm512_setzero_si512(); },
                             isum);
    for (int m = 0; m < MT; ++m) {
      __m512i acc = _mm512_setzero_si512();
      for (int s = 0; s < 16; ++s)  // |bsum| <= 16 * 127: an int16
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_cvtepu8_epi32(mn[s]),
                                                      bc16(bs[m][s])));
      msum[m] = acc;
    }
  }
};

struct Q3K {
  static constexpr int64_t kRecord = kq::kQ3KRecord;
  static constexpr int64_t kD = kq::kQ3KD, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int64_t kSumWidth = 16;  // quants per activation sum bs[m] holds
  struct Bits {  // q + 4: bits 2c of the qs chunk | bit 4h + c of hmask chunk l4, at bit 2
    static inline __m512i get(const uint8_t* rec, int h, int c, int l4) {
      const __m512i q = load512(rec + kq::kQ3KQs + 64 * (8 * h + l4));
      const __m512i hm = load512(rec + 64 * l4);
      return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 2 * c), _mm512_set1_epi8(3)),
                             _mm512_and_si512(move_bit(hm, 4 * h + c, 2), _mm512_set1_epi8(4)));
    }
  };
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    __m128i sc[16];
    kq::q3k_scales(rec + kq::kQ3KScales, sc);
    sub_block_sums<MT, Bits>(rec, sc, x,
                             [bs](int m, int s) { return _mm512_set1_epi32(-4 * bs[m][s]); },
                             isum);
  }
};

// The integer sums of the packed records and of their wide form (below) are one text: the
// chunks' quants and the scales come from a source the caller names (decoded from a packed
// record, or loaded from a wide one), the products and sums run in the same order.

// Q4_K / Q5_K: isum[m] = sum_s scale(s) * (sub-block s . activation row m), chunks(c, l4,
// &lo, &hi) giving chunk 8c + l4's quants of sub-blocks 2c (lo) and 2c + 1 (hi).
template <int MT, class Chunks, class Scale>
inline void q45k_isums(const Chunks& chunks, const Scale& scale, const int8_t* const* x,
                       __m512i* isum) {
  for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
    __m512i lo[MT], hi[MT];
    for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
    for (int l4 = 0; l4 < 8; ++l4) {
      __m512i wl, wh;
      chunks(c, l4, &wl, &wh);
      for (int m = 0; m < MT; ++m) {
        lo[m] = dpbusd_bcast(lo[m], wl, x[m] + 64 * c + 4 * l4);
        hi[m] = dpbusd_bcast(hi[m], wh, x[m] + 64 * c + 32 + 4 * l4);
      }
    }
    const __m512i s0 = scale(2 * c), s1 = scale(2 * c + 1);
    for (int m = 0; m < MT; ++m)
      isum[m] = _mm512_add_epi32(isum[m], _mm512_add_epi32(_mm512_mullo_epi32(lo[m], s0),
                                                           _mm512_mullo_epi32(hi[m], s1)));
  }
}

// Q6_K: isum[m] = sum_s scale(s) * (-32 bsum_s + sub-block s . row m), chunks(h, l4, u)
// giving u[c] (q + 32) of weights 128h + 32c + 4l4 + j, in sub-block 8h + 2c + l4 / 4.
template <int MT, class Chunks, class Scale>
inline void q6k_isums(const Chunks& chunks, const Scale& scale, const int8_t* const* x,
                      const int16_t* const* bs, __m512i* isum) {
  for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h)
    for (int half = 0; half < 2; ++half) {
      __m512i acc[4][MT];  // sub-blocks 8h + 2c + half, c < 4, each from -32 * its bsum
      for (int c = 0; c < 4; ++c)
        for (int m = 0; m < MT; ++m)
          acc[c][m] = _mm512_set1_epi32(-32 * bs[m][8 * h + 2 * c + half]);
      for (int e = 0; e < 4; ++e) {
        const int l4 = 4 * half + e;
        __m512i u[4];
        chunks(h, l4, u);
        for (int c = 0; c < 4; ++c)
          for (int m = 0; m < MT; ++m)
            acc[c][m] = dpbusd_bcast(acc[c][m], u[c], x[m] + 128 * h + 32 * c + 4 * l4);
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i sc = scale(8 * h + 2 * c + half);
        for (int m = 0; m < MT; ++m)
          isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(acc[c][m], sc));
      }
    }
}

// IQ4_XS: isum[m] = sum_s scale(s) * (-128 bsum_s + sub-block s . row m), chunks(s, l4, &lo,
// &hi) giving chunk 4s + l4's values + 128 of weights 32s + 4l4 + j (lo) and 32s + 16 + 4l4 + j
// (hi); bs[m]: the sums of 32 (kSumWidth). k16 (IQ4_X16): a scale per 16 weights, scale(2s)
// the lo chunks', scale(2s + 1) the hi ones', each with its own sum of 16 (bs[m], kSumWidth 16).
template <int MT, bool k16 = false, class Chunks, class Scale>
inline void iq4xs_isums(const Chunks& chunks, const Scale& scale, const int8_t* const* x,
                        const int16_t* const* bs, __m512i* isum) {
  constexpr int kAccs = k16 ? 2 : 1;  // lo and hi apart, or one sum
  for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    __m512i acc[kAccs][MT];
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < kAccs; ++h)
        acc[h][m] = _mm512_set1_epi32(-128 * bs[m][k16 ? 2 * s + h : s]);
    for (int l4 = 0; l4 < 4; ++l4) {
      __m512i lo, hi;
      chunks(s, l4, &lo, &hi);
      for (int m = 0; m < MT; ++m) {
        acc[0][m] = dpbusd_bcast(acc[0][m], lo, x[m] + 32 * s + 4 * l4);
        acc[kAccs - 1][m] = dpbusd_bcast(acc[kAccs - 1][m], hi, x[m] + 32 * s + 16 + 4 * l4);
      }
    }
    for (int h = 0; h < kAccs; ++h) {
      const __m512i f = scale(k16 ? 2 * s + h : s);
      for (int m = 0; m < MT; ++m)
        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(acc[h][m], f));
    }
  }
}

// IQ4_XS (kquant.h): sub-block s is qs chunks 4s .. 4s + 3, low nibbles its weights 0..15,
// high nibbles 16..31. k16: IQ4_X16's record, a scale per 16 weights.
template <const int8_t* kLut, int kShift, bool k16 = false>
struct IQ4Lut {
  static constexpr bool kPer16 = k16;
  static constexpr int64_t kRecord = k16 ? kq::kIQ4X16Record : kq::kIQ4XSRecord;
  static constexpr int64_t kQs = k16 ? kq::kIQ4X16Qs : kq::kIQ4XSQs;
  static constexpr int64_t kD = 0, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int kDShift = kShift;  // d x 2^-kShift (kq::DFactor)
  static constexpr int64_t kSumWidth = k16 ? 16 : 32;  // quants per activation sum bs[m] holds
  // Chunk 4s + l4's values + 128 (IQ4_XS 1..241, the others within 66..190, unsigned): *lo
  // of its low nibbles, *hi of its high ones.
  static inline void quants(const uint8_t* rec, int s, int l4, __m512i* lo, __m512i* hi) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kLut)), _mm_set1_epi8(-128)));
    const __m512i nib = _mm512_set1_epi8(15);
    const __m512i v = load512(rec + kQs + 64 * (4 * s + l4));
    *lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, nib));
    *hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    __m128i sc[16];
    if constexpr (k16) kq::iq4x16_scales(rec, sc);
    else kq::iq4xs_scales(rec, sc);
    iq4xs_isums<MT, k16>(
        [&](int s, int l4, __m512i* lo, __m512i* hi) { quants(rec, s, l4, lo, hi); },
        [&](int j) { return _mm512_cvtepi8_epi32(sc[j]); }, x, bs, isum);
  }
};

// Q4_K and Q5_K: the same scales and 4-bit quants; Q5_K adds each weight's bit 4 from its
// qh chunks (kHighBit). One body, so the two cannot drift apart.
template <bool kHighBit>
struct Q45K {
  static constexpr int64_t kRecord = kHighBit ? kq::kQ5KRecord : kq::kQ4KRecord;
  static constexpr int64_t kScales = kHighBit ? kq::kQ5KScales : kq::kQ4KScales;
  static constexpr int64_t kQs = kHighBit ? kq::kQ5KQs : kq::kQ4KQs;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = true, kJoint = false;
  static constexpr int64_t kSumWidth = 32;  // quants per activation sum bs[m] holds
  // Chunk 8c + l4's quants: *lo those of sub-block 2c (its low nibbles), *hi of 2c + 1.
  static inline void quants(const uint8_t* rec, int c, int l4, __m512i* lo, __m512i* hi) {
    const __m512i nib = _mm512_set1_epi8(15), b4 = _mm512_set1_epi8(16);
    const __m512i v = load512(rec + kQs + 64 * (8 * c + l4));
    *lo = _mm512_and_si512(v, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    if constexpr (kHighBit) {
      const __m512i b = load512(rec + kq::kQ5KQh + 64 * l4);
      *lo = _mm512_or_si512(*lo, _mm512_and_si512(move_bit(b, 2 * c, 4), b4));
      *hi = _mm512_or_si512(*hi, _mm512_and_si512(move_bit(b, 2 * c + 1, 4), b4));
    }
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i* msum) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + kScales, sc, mn);
    q45k_isums<MT>([&](int c, int l4, __m512i* lo, __m512i* hi) { quants(rec, c, l4, lo, hi); },
                   [&](int sb) { return _mm512_cvtepu8_epi32(sc[sb]); }, x, isum);
    __m512i pair[4];
    min_pairs(mn, pair);
    min_sums<MT>(pair, bs, msum);
  }
};
using Q4K = Q45K<false>;
using Q5K = Q45K<true>;


struct Q6K {
  static constexpr int64_t kRecord = kq::kQ6KRecord;
  static constexpr int64_t kD = kq::kQ6KD, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int64_t kSumWidth = 16;  // quants per activation sum bs[m] holds
  // u[c] (q + 32, 0..63) of weights 128h + 32c + 4l4 + j, j < 4, of the 16 rows: the low
  // nibble from ql chunk 16h + l4 (c = 0, 2: its low / high nibble) or 16h + 8 + l4 (c = 1,
  // 3), bits 2c, 2c + 1 of qh chunk 8h + l4 above it.
  static inline void quants(const uint8_t* rec, int h, int l4, __m512i* u) {
    const __m512i nib = _mm512_set1_epi8(15), top = _mm512_set1_epi8(48);
    const __m512i a = load512(rec + 64 * (16 * h + l4));
    const __m512i b = load512(rec + 64 * (16 * h + 8 + l4));
    const __m512i q = load512(rec + kq::kQ6KQh + 64 * (8 * h + l4));
    u[0] = _mm512_or_si512(_mm512_and_si512(a, nib),
                           _mm512_and_si512(_mm512_slli_epi16(q, 4), top));
    u[1] = _mm512_or_si512(_mm512_and_si512(b, nib),
                           _mm512_and_si512(_mm512_slli_epi16(q, 2), top));
    u[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nib),
                           _mm512_and_si512(q, top));
    u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nib),
                           _mm512_and_si512(_mm512_srli_epi16(q, 2), top));
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    q6k_isums<MT>([&](int h, int l4, __m512i* u) { quants(rec, h, l4, u); },
                  [&](int sb) {
                    return _mm512_cvtepi8_epi32(load128(rec + kq::kQ6KScales + 16 * sb));
                  },
                  x, bs, isum);
  }
};

// --- Wide records: Q4_K, Q5_K, Q6_K, IQ4_XS at kWideMinRows+ rows where AMX's tiles do not run
//
// A pass of many activation rows reads its group's records unpacked once (unpack_group) into
// "wide" records, which tile<> reads as it reads packed ones: each chunk's 16 x 4 quants
// already a byte each (the packed format's own quants(), stored), each sub-block's scales
// already int32 lanes, Q4_K / Q5_K's min pairs already int16 pairs. The inner loop is then
// one load per chunk and a vpdpbusd per activation row: the decoding (and, shift, or per
// chunk), which a packed tile of 4 rows repeats for every 4 rows, is done once per pass. The
// products and sums are the packed dot's, in its order, so the bits are too.
//
// Zen 4, every K-quant linear of the Qwen2.5-Coder 1.5B Q4_K_M file against the packed tiles
// (benchmarks/kernel_ab.py, paired rounds): 0.90-0.92x the time at 512 rows, 0.90-0.96x at 64,
// 0.94x at 32 and 48; 1.02x at 24, 1.09x at 16, 1.27x at 8: below ~32 rows the unpacking (5
// KB written per record and pass) costs more than the decoding it saves. 6 rows a tile: the
// same as 4; 8: 1.05x (spills).
//
//   Q4_K / Q5_K  | d[16] dmin[16] | min pairs: 4 x 64 | scales: 8 x 64 | quants: 64 x 64 |
//                  quants chunk 2 (8c + l4) + 0 / 1: sub-block 2c / 2c + 1, of chunk row c
//   Q6_K         | d[16], 32 unused | scales: 16 x 64 (sub-block s) | quants: 64 x 64 |
//                  quants chunk 4 (8h + l4) + c: Q6K::quants(h, l4)[c]
// Knobs for benchmarks/kernel_ab.py -D: where the wide records start, their rows per tile, a
// pass's activation bytes (against 1 MB at 64 and 512 rows: 256 KB 1.02-1.04x, 2 MB 0.98-1.01x,
// 4 MB 0.98-1.06x).
#ifndef KVS_WIDE_MIN_ROWS
#define KVS_WIDE_MIN_ROWS 32
#endif
#ifndef KVS_WIDE_MT
#define KVS_WIDE_MT 4
#endif
#ifndef KVS_WIDE_PASS_BYTES
#define KVS_WIDE_PASS_BYTES (1 << 20)
#endif
constexpr int64_t kWideMinRows = KVS_WIDE_MIN_ROWS;
constexpr int kWideMT = KVS_WIDE_MT;

inline void store512(uint8_t* p, __m512i v) { _mm512_storeu_si512(p, v); }

// A wide record's 32 chunk pairs from quants(i, &lo, &hi), chunk i's at dst + 128 i (lo) and
// + 64 (hi): Q4_K / Q5_K's sub-blocks 2c, 2c + 1 (i = 8c + l4), IQ4_XS's low and high nibbles.
template <class Quants>
inline void store_chunk_pairs(uint8_t* dst, const Quants& quants) {
  for (int i = 0; i < 32; ++i) {
    __m512i lo, hi;
    quants(i, &lo, &hi);
    store512(dst + 128 * i, lo);
    store512(dst + 128 * i + 64, hi);
  }
}

template <bool kHighBit>
struct WideQ45K {
  using Packed = Q45K<kHighBit>;
  static constexpr int64_t kMins = 64, kScales = 320, kQuants = 832;
  static constexpr int64_t kRecord = kQuants + 64 * 64;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = true, kJoint = false;
  static constexpr int64_t kSumWidth = 32;  // quants per activation sum bs[m] holds
  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    __builtin_memcpy(dst, rec, 64);  // d, dmin: the packed record's first 64 bytes
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + Packed::kScales, sc, mn);
    __m512i pair[4];
    min_pairs(mn, pair);
    for (int t = 0; t < 4; ++t) store512(dst + kMins + 64 * t, pair[t]);
    for (int s = 0; s < 8; ++s) store512(dst + kScales + 64 * s, _mm512_cvtepu8_epi32(sc[s]));
    store_chunk_pairs(dst + kQuants, [&](int i, __m512i* lo, __m512i* hi) {
      Packed::quants(rec, i / 8, i % 8, lo, hi);
    });
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i* msum) {
    q45k_isums<MT>(
        [&](int c, int l4, __m512i* lo, __m512i* hi) {
          *lo = load512(rec + kQuants + 128 * (8 * c + l4));
          *hi = load512(rec + kQuants + 128 * (8 * c + l4) + 64);
        },
        [&](int sb) { return load512(rec + kScales + 64 * sb); }, x, isum);
    __m512i pair[4];
    for (int t = 0; t < 4; ++t) pair[t] = load512(rec + kMins + 64 * t);
    min_sums<MT>(pair, bs, msum);
  }
};

struct WideQ6K {
  static constexpr int64_t kScales = 64, kQuants = 1088, kRecord = kQuants + 64 * 64;
  static constexpr int64_t kD = 0, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int64_t kSumWidth = 16;  // quants per activation sum bs[m] holds
  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    __builtin_memcpy(dst, rec + kq::kQ6KD, 32);
    for (int sb = 0; sb < 16; ++sb)
      store512(dst + kScales + 64 * sb,
               _mm512_cvtepi8_epi32(load128(rec + kq::kQ6KScales + 16 * sb)));
    for (int h = 0; h < 2; ++h)
      for (int l4 = 0; l4 < 8; ++l4) {
        __m512i u[4];
        Q6K::quants(rec, h, l4, u);
        for (int c = 0; c < 4; ++c) store512(dst + kQuants + 64 * (4 * (8 * h + l4) + c), u[c]);
      }
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    q6k_isums<MT>(
        [&](int h, int l4, __m512i* u) {
          for (int c = 0; c < 4; ++c) u[c] = load512(rec + kQuants + 64 * (4 * (8 * h + l4) + c));
        },
        [&](int sb) { return load512(rec + kScales + 64 * sb); }, x, bs, isum);
  }
};

// IQ4_XS wide (every IQ4Lut's): | d[16], 32 unused | scales: 8 x 64 (sub-block s; k16: 16, of
// the 16 weights j) | quants: 64 x 64 |
//   quants chunk 2 (4s + l4) + 0 / 1: IQ4Lut::quants(s, l4) low / high (values + 128)
// Against the packed tiles, every linear of the Qwen 1.5B IQ4_XS file (Zen 4, kernel_ab.py, 7
// rounds): 0.89x the time at 512 rows, 0.95x at 64, level at 32.
template <class Packed>
struct WideIQ4 {
  static constexpr int kNScales = Packed::kPer16 ? 16 : 8;
  static constexpr int64_t kScales = 64, kQuants = kScales + 64 * kNScales;
  static constexpr int64_t kRecord = kQuants + 64 * 64;
  static constexpr int64_t kD = 0, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int kDShift = Packed::kDShift;  // d copied as stored, scaled in tile()
  static constexpr int64_t kSumWidth = Packed::kSumWidth;  // quants per activation sum bs[m]
  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    __builtin_memcpy(dst, rec, 32);  // d: the packed record's first 32 bytes
    __m128i sc[16];
    if constexpr (Packed::kPer16) kq::iq4x16_scales(rec, sc);
    else kq::iq4xs_scales(rec, sc);
    for (int j = 0; j < kNScales; ++j)
      store512(dst + kScales + 64 * j, _mm512_cvtepi8_epi32(sc[j]));
    store_chunk_pairs(dst + kQuants, [&](int i, __m512i* lo, __m512i* hi) {
      Packed::quants(rec, i / 4, i % 4, lo, hi);
    });
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    iq4xs_isums<MT, Packed::kPer16>(
        [&](int s, int l4, __m512i* lo, __m512i* hi) {
          *lo = load512(rec + kQuants + 128 * (4 * s + l4));
          *hi = load512(rec + kQuants + 128 * (4 * s + l4) + 64);
        },
        [&](int j) { return load512(rec + kScales + 64 * j); }, x, bs, isum);
  }
};

// The lines of the `bytes` at rec + kAhead, into the cache kHint names.
template <int64_t kAhead, _mm_hint kHint>
inline void prefetch_lines(const uint8_t* rec, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec) + kAhead + o, kHint);
}

// A record kPrefetchBytes ahead of the one being streamed, into L1 (the wide and AMX passes'
// unpack_group).
inline void prefetch_ahead(const uint8_t* rec, int64_t bytes) {
  prefetch_lines<kPrefetchBytes, _MM_HINT_T0>(rec, bytes);
}

// A tile's stream of records: the record kL2PrefetchBytes ahead into L2, except for Q4_K's
// one-row tile (kPrefetchBytes into L1); the measurements are at kL2PrefetchBytes.
template <class Fmt, int MT>
inline void prefetch_tile_record(const uint8_t* rec) {
  if constexpr (std::is_same_v<Fmt, Q4K> && MT == 1) prefetch_ahead(rec, Fmt::kRecord);
  else prefetch_lines<kL2PrefetchBytes, _MM_HINT_T1>(rec, Fmt::kRecord);
}

// A group's output columns 0 .. cols - 1 of one row: mins + sums (+ bias), the spec's last
// step (Q2_K, Q3_K, Q6_K: +0 + sums, which turns a -0 into +0 as the oracle does).
struct OutCols {
  __mmask16 mask;
  __m512 bv;
  bool bias;
  OutCols(const float* b, int64_t cols)
      : mask(cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1)),
        bv(b ? _mm512_maskz_loadu_ps(mask, b) : _mm512_setzero_ps()), bias(b != nullptr) {}
  void store(float* dst, __m512 mins, __m512 sums) const {
    __m512 v = _mm512_add_ps(mins, sums);
    if (bias) v = _mm512_add_ps(v, bv);
    _mm512_mask_storeu_ps(dst, mask, v);
  }
};

// MT activation rows m0.. against one group (records from gw) -> out columns 0 .. cols - 1 of
// those rows (out points at the group's first column, rows N apart).
template <class Fmt, int MT, bool kPf>
inline void tile(const Q8KActs& a, int64_t m0, const uint8_t* gw, const float* bias,
                 float* out, int64_t N, int64_t cols) {
  const int64_t K = a.K, nsb = K / kQK;
  __m512 sums[MT], mins[MT];
  for (int m = 0; m < MT; ++m) sums[m] = mins[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* rec = gw + i * Fmt::kRecord;
    if constexpr (kPf) prefetch_tile_record<Fmt, MT>(rec);
    const int8_t* x[MT];
    const int16_t* bs[MT];
    for (int m = 0; m < MT; ++m) {
      x[m] = a.q + (m0 + m) * K + i * kQK;
      bs[m] = a.bsums + (m0 + m) * (K / Fmt::kSumWidth) + i * (kQK / Fmt::kSumWidth);
    }
    __m512i isum[MT], msum[MT];
    Fmt::template dot<MT>(rec, x, bs, isum, msum);
    __m512 dw = load_halves16(rec + Fmt::kD);
    if constexpr (kq::DFactor<Fmt>::value != 1.0f)
      dw = _mm512_mul_ps(dw, _mm512_set1_ps(kq::DFactor<Fmt>::value));
    __m512 dm = _mm512_setzero_ps();
    if constexpr (Fmt::kMin) dm = load_halves16(rec + Fmt::kDmin);
    for (int m = 0; m < MT; ++m) {
      const __m512 xd = _mm512_set1_ps(a.d[(m0 + m) * nsb + i]);
      const __m512 ws = _mm512_mul_ps(_mm512_mul_ps(dw, xd), _mm512_cvtepi32_ps(isum[m]));
      if constexpr (Fmt::kMin) {
        const __m512 ms = _mm512_mul_ps(_mm512_mul_ps(dm, xd), _mm512_cvtepi32_ps(msum[m]));
        if constexpr (Fmt::kJoint) {  // Q2_K: sums = sums + (dw * isum - dm * msum)
          sums[m] = _mm512_add_ps(sums[m], _mm512_sub_ps(ws, ms));
        } else {
          sums[m] = _mm512_add_ps(sums[m], ws);
          mins[m] = _mm512_sub_ps(mins[m], ms);
        }
      } else {
        sums[m] = _mm512_add_ps(sums[m], ws);
      }
    }
  }
  const OutCols oc(bias, cols);
  for (int m = 0; m < MT; ++m) oc.store(out + (m0 + m) * N, mins[m], sums[m]);
}

// --- AMX tiles (Q4_K, Q5_K, Q6_K at M >= kAmxMinRows) ---
//
// TDPBSUD multiplies an A tile (up to 16 activation rows x 64 int8) by a B tile (16 rows of
// 64 bytes: row r holds, for each of 16 output columns n, the 4 unsigned weights of k = 4r ..
// 4r + 3) into 16 x 16 int32 sums. The VNNI tile scales each sub-block's sum by the row's
// scale before adding them up; a tile sums 64 k of two or four sub-blocks at once, so the
// scales go into the weights instead, split into parts small enough that quant x part is
// still a byte ("planes"):
//
//   Q4_K / Q5_K: scale = lo + 8 hi (lo, hi < 8; quant x part <= 31 x 7 = 217)
//     isum = C(quant x lo) + 8 C(quant x hi)
//   Q6_K: scale = d0 + 4 d1 + 16 d2 + 64 (d3 - 2) (d_b < 4; u x d_b <= 63 x 3 = 189, and
//     u x (d3 - 2) in -126..63, a signed byte: TDPBSSD for that plane)
//     isum = sum_b 4^b C(plane b) - 32 sum_s scale_s bsum_s
//
// C(B) is the tile product over the whole super-block, each sum over s of scale_s x (the
// sub-block's dot product) is the same integer as the VNNI tile's, and the float steps are
// its steps: the same bits. The mins (and Q6_K's bsum term) are int16 pairs: vpdpwssd.
//
// A pass unpacks its group's records once (unpack: the planes, the pair vectors and d, dmin
// as floats) into a per-thread buffer, then runs every 16 rows of the pass through it.

constexpr int64_t kAmxMinTile = 4;  // a pass's tail under this many rows runs on VNNI

struct TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures tiles t < 8 with rows[t] rows of 64 bytes (16 int32 or 64 int8); a tile of 0
// rows is unused (then its width must be 0 too, or LDTILECFG faults).
inline void amx_config(const int (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// Every byte of v times the int16 lane's multiplier: exact while each product is < 256.
inline __m512i mul_bytes(__m512i v, __m512i m16) { return _mm512_mullo_epi16(v, m16); }

// sum_j pair_j . (bs[2j], bs[2j + 1]), j < n: int16 pairs, exact in int32.
template <int n>
inline __m512i pair_dots(const uint8_t* pairs, const int16_t* bs) {
  __m512i acc = _mm512_setzero_si512();
  for (int j = 0; j < n; ++j)
    acc = dpwssd_bcast(acc, _mm512_load_si512(pairs + 64 * j), bs + 2 * j);
  return acc;
}

// Unpacked record layout: plane p's K-chunk c (64 weights) at 4096 p + 1024 c, B-tile rows
// of 64 bytes; then kPairs pair vectors, then d and dmin as 16 floats.
template <bool kHighBit>
struct AmxQ45K : Q45K<kHighBit> {
  using F = Q45K<kHighBit>;
  static constexpr int kPlanes = 2, kPairs = 4;
  static constexpr int64_t kPairsAt = 4096 * kPlanes, kDAt = kPairsAt + 64 * kPairs;
  static constexpr int64_t kBytes = kDAt + 128;
  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + F::kScales, sc, mn);
    __m512i lo[8], hi[8];  // scale & 7, scale >> 3 as 16-bit multipliers
    for (int s = 0; s < 8; ++s) {
      const __m512i v = _mm512_cvtepu8_epi32(sc[s]);
      lo[s] = dup16(_mm512_and_si512(v, _mm512_set1_epi32(7)));
      hi[s] = dup16(_mm512_srli_epi32(v, 3));
    }
    __m512i pair[4];  // mins: (min 2j, min 2j + 1) . (bsum32 2j, bsum32 2j + 1)
    min_pairs(mn, pair);
    for (int j = 0; j < 4; ++j) _mm512_store_si512(dst + kPairsAt + 64 * j, pair[j]);
    for (int c = 0; c < 4; ++c)  // B rows 0..7: sub-block 2c's chunks, 8..15: 2c + 1's
      for (int l4 = 0; l4 < 8; ++l4) {
        __m512i ql, qh;
        F::quants(rec, c, l4, &ql, &qh);
        uint8_t* row = dst + 1024 * c + 64 * l4;
        _mm512_store_si512(row, mul_bytes(ql, lo[2 * c]));
        _mm512_store_si512(row + 512, mul_bytes(qh, lo[2 * c + 1]));
        _mm512_store_si512(row + 4096, mul_bytes(ql, hi[2 * c]));
        _mm512_store_si512(row + 4096 + 512, mul_bytes(qh, hi[2 * c + 1]));
      }
    _mm512_store_ps(dst + kDAt, load_halves16(rec + F::kD));
    _mm512_store_ps(dst + kDAt + 64, load_halves16(rec + F::kDmin));
  }
  // Two sets of tiles, so that a super-block's products need not wait for the previous one's
  // to be stored: set S's tiles (literal numbers: they are instruction operands) 4S, 4S + 1
  // C, 4S + 2 A (mt rows), 4S + 3 B (16 rows).
  static inline void configure(int64_t mt) {
    const int r = static_cast<int>(mt);
    amx_config({r, r, r, 16, r, r, r, 16});
  }
  // cb[p] = C(plane p): the super-block's A tiles (xa, rows K apart) times the planes at u,
  // on set 0 (products0) or 1.
#define KVS_AMX_Q45K_PRODUCTS(name, C0, C1, A, B)                                       \
  static inline void name(const int8_t* xa, int64_t K, const uint8_t* u,                 \
                          int32_t (*cb)[16][16]) {                                       \
    _tile_zero(C0);                                                                      \
    _tile_zero(C1);                                                                      \
    for (int c = 0; c < 4; ++c) {                                                        \
      _tile_loadd(A, xa + 64 * c, K);                                                    \
      _tile_loadd(B, u + 1024 * c, 64);                                                  \
      _tile_dpbsud(C0, A, B);                                                            \
      _tile_loadd(B, u + 4096 + 1024 * c, 64);                                           \
      _tile_dpbsud(C1, A, B);                                                            \
    }                                                                                    \
    _tile_stored(C0, cb[0], 64);                                                         \
    _tile_stored(C1, cb[1], 64);                                                         \
  }
  KVS_AMX_Q45K_PRODUCTS(products0, 0, 1, 2, 3)
  KVS_AMX_Q45K_PRODUCTS(products1, 4, 5, 6, 7)
#undef KVS_AMX_Q45K_PRODUCTS
  // isum and msum of a row from its planes' sums (c[p]: 16 int32) and its activations' int16
  // pairs at pa (the sums of 32 quants, 8 per super-block: with_sums32).
  static inline void sums(const int32_t* const* c, const uint8_t* u, const int16_t* pa,
                          __m512i* isum, __m512i* msum) {
    *isum = _mm512_add_epi32(_mm512_load_si512(c[0]),
                             _mm512_slli_epi32(_mm512_load_si512(c[1]), 3));
    *msum = pair_dots<4>(u + kPairsAt, pa);
  }
};

// mt (kAmxMinTile <= mt <= 16) activation rows at m0 against one group whose nsb records
// are unpacked at ub, as tile<Fmt, mt> computes them; the tiles configured for mt rows.
// Its activations' sums (a.bsums) are of Fmt::kSumWidth quants each. First every super-block's
// tile products into cb (on the two tile sets in turn, so that none waits for the last one's
// stores), then per row its sums in registers.
template <class Fmt>
void amx_rows(int64_t mt, const Q8KActs& a, int64_t m0, const uint8_t* ub, const float* bias,
              float* out, int64_t N, int64_t cols) {
  constexpr int P = Fmt::kPlanes;
  const int64_t K = a.K, nsb = K / kQK;
  thread_local std::vector<int32_t> cbuf;  // [nsb][P][16][16]
  if (static_cast<int64_t>(cbuf.size()) < nsb * P * 256 + 16) cbuf.resize(nsb * P * 256 + 16);
  int32_t (*cb)[P][16][16] = reinterpret_cast<int32_t (*)[P][16][16]>(
      (reinterpret_cast<uintptr_t>(cbuf.data()) + 63) & ~uintptr_t(63));
  for (int64_t i = 0; i < nsb; ++i) {
    const int8_t* xa = a.q + m0 * K + i * kQK;
    if (i % 2) Fmt::products1(xa, K, ub + i * Fmt::kBytes, cb[i]);
    else Fmt::products0(xa, K, ub + i * Fmt::kBytes, cb[i]);
  }
  const OutCols oc(bias, cols);
  for (int64_t m = 0; m < mt; ++m) {
    __m512 sums = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    const int16_t* prow = a.bsums + (m0 + m) * (K / Fmt::kSumWidth);
    const float* xd_row = a.d + (m0 + m) * nsb;
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* u = ub + i * Fmt::kBytes;
      const int32_t* c[P];
      for (int p = 0; p < P; ++p) c[p] = cb[i][p][m];
      __m512i isum, msum;
      Fmt::sums(c, u, prow + i * (kQK / Fmt::kSumWidth), &isum, &msum);
      const __m512 xd = _mm512_set1_ps(xd_row[i]);
      const __m512 dw = _mm512_load_ps(u + Fmt::kDAt);
      sums = _mm512_add_ps(sums, _mm512_mul_ps(_mm512_mul_ps(dw, xd), _mm512_cvtepi32_ps(isum)));
      if constexpr (Fmt::kMin) {
        const __m512 dm = _mm512_load_ps(u + Fmt::kDAt + 64);
        mins = _mm512_sub_ps(mins, _mm512_mul_ps(_mm512_mul_ps(dm, xd), _mm512_cvtepi32_ps(msum)));
      }
    }
    oc.store(out + (m0 + m) * N, mins, sums);
  }
}

// Q6_K: the digits d_b of scale + 128 (base 4), planes 0..2 u x d_b, plane 3 u x (d3 - 2).
// B row r of K-chunk c is weight 64c + 4r + j: quants(c / 2, r % 8)[2 (c % 2) + r / 8], of
// sub-block 4c + r / 4.
struct AmxQ6K : Q6K {
  static constexpr int kPlanes = 4, kPairs = 8;
  static constexpr int64_t kPairsAt = 4096 * kPlanes, kDAt = kPairsAt + 64 * kPairs;
  static constexpr int64_t kBytes = kDAt + 128;
  static constexpr bool kMin = false;
  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    __m512i mul[16][4];  // sub-block s's d_b as 16-bit multipliers
    for (int s = 0; s < 16; ++s) {
      const __m512i e = _mm512_add_epi32(
          _mm512_cvtepi8_epi32(load128(rec + kq::kQ6KScales + 16 * s)), _mm512_set1_epi32(128));
      for (int b = 0; b < 4; ++b)
        mul[s][b] = dup16(_mm512_and_si512(_mm512_srli_epi32(e, 2 * b), _mm512_set1_epi32(3)));
    }
    for (int j = 0; j < 8; ++j) {  // (scale 2j, scale 2j + 1) . (bsum 2j, bsum 2j + 1)
      const __m512i lo = _mm512_cvtepi8_epi32(load128(rec + kq::kQ6KScales + 32 * j));
      const __m512i hi = _mm512_cvtepi8_epi32(load128(rec + kq::kQ6KScales + 32 * j + 16));
      _mm512_store_si512(dst + kPairsAt + 64 * j,
                         _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)),
                                         _mm512_slli_epi32(hi, 16)));
    }
    for (int h = 0; h < 2; ++h)
      for (int l4 = 0; l4 < 8; ++l4) {
        __m512i u[4];
        quants(rec, h, l4, u);
        for (int cc = 0; cc < 4; ++cc) {
          const int c = 2 * h + cc / 2, r = 8 * (cc % 2) + l4, s = 4 * c + r / 4;
          uint8_t* row = dst + 1024 * c + 64 * r;
          for (int b = 0; b < 3; ++b)
            _mm512_store_si512(row + 4096 * b, mul_bytes(u[cc], mul[s][b]));
          // u x (d3 - 2) = u x d3 - 2u, bytewise (mod 256: the signed byte)
          _mm512_store_si512(row + 4096 * 3,
                             _mm512_sub_epi8(mul_bytes(u[cc], mul[s][3]),
                                             _mm512_add_epi8(u[cc], u[cc])));
        }
      }
    _mm512_store_ps(dst + kDAt, load_halves16(rec + kq::kQ6KD));
  }
  // Tiles 0..3: C, 4: A, 5: B. One set: 4 planes leave no room for a second.
  static inline void configure(int64_t mt) {
    const int r = static_cast<int>(mt);
    amx_config({r, r, r, r, r, 16, 0, 0});
  }
  static inline void products(const int8_t* xa, int64_t K, const uint8_t* u,
                              int32_t (*cb)[16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < 4; ++c) {
      _tile_loadd(4, xa + 64 * c, K);
      _tile_loadd(5, u + 1024 * c, 64);
      _tile_dpbsud(0, 4, 5);
      _tile_loadd(5, u + 4096 + 1024 * c, 64);
      _tile_dpbsud(1, 4, 5);
      _tile_loadd(5, u + 2 * 4096 + 1024 * c, 64);
      _tile_dpbsud(2, 4, 5);
      _tile_loadd(5, u + 3 * 4096 + 1024 * c, 64);
      _tile_dpbssd(3, 4, 5);
    }
    _tile_stored(0, cb[0], 64);
    _tile_stored(1, cb[1], 64);
    _tile_stored(2, cb[2], 64);
    _tile_stored(3, cb[3], 64);
  }
  static inline void products0(const int8_t* xa, int64_t K, const uint8_t* u,
                               int32_t (*cb)[16][16]) {
    products(xa, K, u, cb);
  }
  static inline void products1(const int8_t* xa, int64_t K, const uint8_t* u,
                               int32_t (*cb)[16][16]) {
    products(xa, K, u, cb);
  }
  static inline void sums(const int32_t* const* c, const uint8_t* u, const int16_t* pa,
                          __m512i* isum, __m512i*) {
    __m512i v = _mm512_load_si512(c[0]);
    v = _mm512_add_epi32(v, _mm512_slli_epi32(_mm512_load_si512(c[1]), 2));
    v = _mm512_add_epi32(v, _mm512_slli_epi32(_mm512_load_si512(c[2]), 4));
    v = _mm512_add_epi32(v, _mm512_slli_epi32(_mm512_load_si512(c[3]), 6));
    *isum = _mm512_sub_epi32(v, _mm512_slli_epi32(pair_dots<8>(u + kPairsAt, pa), 5));
  }
};

template <class Fmt> struct Wide { using type = void; };
template <> struct Wide<Q4K> { using type = WideQ45K<false>; };
template <> struct Wide<Q5K> { using type = WideQ45K<true>; };
template <> struct Wide<Q6K> { using type = WideQ6K; };
template <const int8_t* V, int S, bool K16>
struct Wide<IQ4Lut<V, S, K16>> {
  using type = WideIQ4<IQ4Lut<V, S, K16>>;
};

template <class Fmt> struct Amx { using type = void; };
template <> struct Amx<Q4K> { using type = AmxQ45K<false>; };
template <> struct Amx<Q5K> { using type = AmxQ45K<true>; };
template <> struct Amx<Q6K> { using type = AmxQ6K; };

#include "kquant_driver.h"  // some_rows, run, run_kquant: see there why in this namespace

template <class Fmt>
void run_fmt(const Q8KActs& acts, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads, bool amx) {
  thread_local std::vector<int16_t> sums32;
  const Q8KActs a = Fmt::kSumWidth == 32 ? with_sums32(acts, sums32) : acts;
  using AmxFmt = typename Amx<Fmt>::type;
  if constexpr (!std::is_void_v<AmxFmt>) {
    if (amx && a.M >= kAmxMinRows) {
      // A pass of ~1 MB of activations unpacks its group once, then 16 rows per tile.
      run_passes<16>(a, w, Fmt::kRecord, bias, out, N, nthreads, 1 << 20,
                     [&](int64_t p0, int64_t p1, const uint8_t* gw, const float* bg, float* o,
                         int64_t cols) {
        const uint8_t* ub = unpack_group(gw, a.K / kQK, Fmt::kRecord, AmxFmt::kBytes,
                                         AmxFmt::unpack);
        int64_t configured = 0;  // LDTILECFG costs as much as a tile's work: once per shape
        for (int64_t m = p0; m < p1; m += 16) {
          const int64_t rows = min64(16, p1 - m);
          if (rows < kAmxMinTile) {
            some_rows<Fmt, 4>(rows, false, a, m, gw, bg, o, N, cols);
            continue;
          }
          if (rows != configured) AmxFmt::configure(configured = rows);
          amx_rows<AmxFmt>(rows, a, m, ub, bg, o, N, cols);
        }
        if (configured) _tile_release();
      });
      return;
    }
  }
  using WideFmt = typename Wide<Fmt>::type;
  if constexpr (!std::is_void_v<WideFmt>) {
    if (a.M >= kWideMinRows) {
      run_wide<Fmt, WideFmt, kWideMT>(a, w, bias, out, N, nthreads, KVS_WIDE_PASS_BYTES);
      return;
    }
  }
  // Registers (32 zmm): per activation row 2 float sums, one isum and the open sub-block
  // chains (2 for Q2_K..Q5_K, 4 for Q6_K). M == 1: one row, one stream per thread; otherwise
  // 4 rows per tile share each chunk's load and decode, and a lone last row joins the first
  // tile (5 rows; M == 5 is a speculative step's K + 1 rows at K = 4, 17 at K = 16): 0.96x
  // the time of 4 + 4 + 1 at 9 rows and of 4 x 4 + 1 at 17. Tiles of 5 elsewhere lose: 5 + 5
  // at 10 rows 1.03x of 4 + 4 + 2, 3 + 3 at 6 1.03x of 4 + 2 (Zen 4, every K-quant linear of
  // the Qwen2.5-Coder 1.5B file, kernel_ab.py). Q6_K's four chains a row do not fit 5 rows in
  // registers: at 5 and 6 rows (K = 4, 5) its tiles of 3 (3 + 2, 3 + 3) run 0.85-0.9x the
  // time of 5 or 4 + 2 (Zen 4, the same file's Q6_K linears).
  if (a.M == 1) {
    run<Fmt, 1>(a, w, bias, out, N, nthreads);
  } else if constexpr (std::is_same_v<Fmt, Q6K>) {
    if (a.M == 5 || a.M == 6) run<Fmt, 3>(a, w, bias, out, N, nthreads);
    else run<Fmt, 4>(a, w, bias, out, N, nthreads);
  } else {
    run<Fmt, 5, true>(a, w, bias, out, N, nthreads);
  }
}

}  // namespace

void qlinear_kquant_avx512(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                           float* out, int64_t N, int nthreads, bool amx) {
  run_kquant(a, w, kt, bias, out, N, nthreads, amx);
}

}  // namespace kvs

#pragma GCC pop_options

namespace kvs {

bool cpu_has_amx_int8() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!cpu_has_avx512_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    // Linux hands out the 8 KB of tile state only on request (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA), for the whole process; without it the first tile op is a SIGILL.
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace kvs
