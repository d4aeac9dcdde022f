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
//   Q4_K mins: sum_s min_s * (the two bsums of s), one vpmaddwd per sub-block.
//
// The integer sums are exact, the float steps per (m, n, super-block) fixed by the spec, so the
// bits equal the AVX2 twin's and the oracle's whatever the tile.
//
// As in qlinear_avx512.cpp, the target pragma covers only this file's code after the headers,
// everything is internal except qlinear_kquant_avx512(), and bindings call it only when
// cpu_has_avx512_vnni().
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "kquant.h"
#include "simd.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

namespace kvs {
namespace {

using kq::kGroup;
using kq::kQK;

constexpr int64_t kPrefetchBytes = 8192;  // as qlinear_avx512.cpp

inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes to every 32-bit lane
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

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

// Q4_K / Q5_K: msum[m] = sum_s min_s * (the two bsums of sub-block s).
template <int MT>
inline void min_sums(const __m128i* mn, const int16_t* const* bs, __m512i* msum) {
  for (int m = 0; m < MT; ++m) {
    __m512i acc = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s)  // |bsum of 32| <= 32 * 127: an int16
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_cvtepu8_epi32(mn[s]),
                                                    bc16(bs[m][2 * s] + bs[m][2 * s + 1])));
    msum[m] = acc;
  }
}

// dot<MT>(rec, x, bs, isum, msum): isum[m] / msum[m] lane r = row r's isum / msum for
// activation row m (x[m]: its quants at the super-block, bs[m]: its 16 bsums); kD / kDmin:
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
          acc[l4 / 4][m] = _mm512_dpbusd_epi32(acc[l4 / 4][m], u,
                                               bcast4(x[m] + 128 * h + 32 * c + 4 * l4));
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
  struct Bits {  // q: bits 2c of the qs chunk
    static inline __m512i get(const uint8_t* rec, int h, int c, int l4) {
      const __m512i q = load512(rec + kq::kQ2KQs + 64 * (8 * h + l4));
      return _mm512_and_si512(_mm512_srli_epi16(q, 2 * c), _mm512_set1_epi8(3));
    }
  };
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i* msum) {
    __m128i sc[16], mn[16];  // plane s = scale_s | min_s << 4 (4 bits each)
    const __m128i m15 = _mm_set1_epi8(15);
    for (int s = 0; s < 16; ++s) {
      const __m128i p = load128(rec + 16 * s);
      sc[s] = _mm_and_si128(p, m15);
      mn[s] = _mm_and_si128(_mm_srli_epi16(p, 4), m15);
    }
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

// Q4_K and Q5_K: the same scales and 4-bit quants; Q5_K adds each weight's bit 4 from its
// qh chunks (kHighBit). One body, so the two cannot drift apart.
template <bool kHighBit>
struct Q45K {
  static constexpr int64_t kRecord = kHighBit ? kq::kQ5KRecord : kq::kQ4KRecord;
  static constexpr int64_t kScales = kHighBit ? kq::kQ5KScales : kq::kQ4KScales;
  static constexpr int64_t kQs = kHighBit ? kq::kQ5KQs : kq::kQ4KQs;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = true, kJoint = false;
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i* msum) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + kScales, sc, mn);
    const __m512i nib = _mm512_set1_epi8(15), b4 = _mm512_set1_epi8(16);
    for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m512i lo[MT], hi[MT];
      for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (int l4 = 0; l4 < 8; ++l4) {
        const __m512i v = load512(rec + kQs + 64 * (8 * c + l4));
        __m512i wl = _mm512_and_si512(v, nib);
        __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        if constexpr (kHighBit) {
          const __m512i b = load512(rec + kq::kQ5KQh + 64 * l4);
          wl = _mm512_or_si512(wl, _mm512_and_si512(move_bit(b, 2 * c, 4), b4));
          wh = _mm512_or_si512(wh, _mm512_and_si512(move_bit(b, 2 * c + 1, 4), b4));
        }
        for (int m = 0; m < MT; ++m) {
          lo[m] = _mm512_dpbusd_epi32(lo[m], wl, bcast4(x[m] + 64 * c + 4 * l4));
          hi[m] = _mm512_dpbusd_epi32(hi[m], wh, bcast4(x[m] + 64 * c + 32 + 4 * l4));
        }
      }
      const __m512i s0 = _mm512_cvtepu8_epi32(sc[2 * c]);
      const __m512i s1 = _mm512_cvtepu8_epi32(sc[2 * c + 1]);
      for (int m = 0; m < MT; ++m)
        isum[m] = _mm512_add_epi32(isum[m], _mm512_add_epi32(_mm512_mullo_epi32(lo[m], s0),
                                                             _mm512_mullo_epi32(hi[m], s1)));
    }
    min_sums<MT>(mn, bs, msum);
  }
};
using Q4K = Q45K<false>;
using Q5K = Q45K<true>;


struct Q6K {
  static constexpr int64_t kRecord = kq::kQ6KRecord;
  static constexpr int64_t kD = kq::kQ6KD, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m512i* isum, __m512i*) {
    const __m512i nib = _mm512_set1_epi8(15), top = _mm512_set1_epi8(48);
    for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
    // Weight 128h + 32c + 4l4 + j (sub-block 8h + 2c + l4 / 4): low nibble in ql chunk
    // 16h + l4 (c = 0, 2: low / high nibble) or 16h + 8 + l4 (c = 1, 3), high 2 bits in bits
    // 2c of qh chunk 8h + l4.
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        __m512i acc[4][MT];  // sub-blocks 8h + 2c + half, c < 4, each from -32 * its bsum
        for (int c = 0; c < 4; ++c)
          for (int m = 0; m < MT; ++m)
            acc[c][m] = _mm512_set1_epi32(-32 * bs[m][8 * h + 2 * c + half]);
        for (int e = 0; e < 4; ++e) {
          const int l4 = 4 * half + e;
          const __m512i a = load512(rec + 64 * (16 * h + l4));
          const __m512i b = load512(rec + 64 * (16 * h + 8 + l4));
          const __m512i q = load512(rec + kq::kQ6KQh + 64 * (8 * h + l4));
          // bits 2c, 2c + 1 of the qh byte to bits 4, 5; the nibble below them
          const __m512i u[4] = {
              _mm512_or_si512(_mm512_and_si512(a, nib),
                              _mm512_and_si512(_mm512_slli_epi16(q, 4), top)),
              _mm512_or_si512(_mm512_and_si512(b, nib),
                              _mm512_and_si512(_mm512_slli_epi16(q, 2), top)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nib),
                              _mm512_and_si512(q, top)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nib),
                              _mm512_and_si512(_mm512_srli_epi16(q, 2), top))};
          for (int c = 0; c < 4; ++c)
            for (int m = 0; m < MT; ++m)
              acc[c][m] = _mm512_dpbusd_epi32(acc[c][m], u[c],
                                              bcast4(x[m] + 128 * h + 32 * c + 4 * l4));
        }
        for (int c = 0; c < 4; ++c) {
          const __m512i s = _mm512_cvtepi8_epi32(
              load128(rec + kq::kQ6KScales + 16 * (8 * h + 2 * c + half)));
          for (int m = 0; m < MT; ++m)
            isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(acc[c][m], s));
        }
      }
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
    if constexpr (kPf)
      for (int64_t o = 0; o < Fmt::kRecord; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec) + kPrefetchBytes + o, _MM_HINT_T0);
    const int8_t* x[MT];
    const int16_t* bs[MT];
    for (int m = 0; m < MT; ++m) {
      x[m] = a.q + (m0 + m) * K + i * kQK;
      bs[m] = a.bsums + (m0 + m) * (K / 16) + i * 16;
    }
    __m512i isum[MT], msum[MT];
    Fmt::template dot<MT>(rec, x, bs, isum, msum);
    const __m512 dw = load_halves16(rec + Fmt::kD);
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
  // out = mins + sums (Q2_K, Q3_K, Q6_K: +0 + sums, which turns a -0 into +0 as the oracle does)
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    __m512 v = _mm512_add_ps(mins[m], sums[m]);
    if (bias) v = _mm512_add_ps(v, bv);
    _mm512_mask_storeu_ps(out + (m0 + m) * N, mask, v);
  }
}

#include "kquant_driver.h"  // some_rows, run, run_kquant: see there why in this namespace

template <class Fmt>
void run_fmt(const Q8KActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads) {
  // Registers (32 zmm): per activation row 2 float sums, one isum and the open sub-block
  // chains (2 for Q2_K..Q5_K, 4 for Q6_K). M == 1: one row, one stream per thread; otherwise
  // 4 rows per tile share each chunk's load and decode.
  if (a.M == 1) run<Fmt, 1>(a, w, bias, out, N, nthreads);
  else run<Fmt, 4>(a, w, bias, out, N, nthreads);
}

}  // namespace

void qlinear_kquant_avx512(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                           float* out, int64_t N, int nthreads) {
  run_kquant(a, w, kt, bias, out, N, nthreads);
}

}  // namespace kvs

#pragma GCC pop_options
