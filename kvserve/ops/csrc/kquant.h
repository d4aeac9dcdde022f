// The packed K-quant records that qlinear_kquant.cpp (AVX2) and qlinear_kquant_avx512.cpp
// (VNNI) read: 16 weight rows x one 256-weight super-block, every stored field transposed over
// the 16 rows (kvserve/quant/kquant_pack.py says why and draws it). Offsets in one record:
//
//   Q2_K, 1344 bytes (16 x 84):
//   0                    256                                   1280     1312        1344
//   | 16 scale planes     | 16 qs chunks: 8h + l4 (h < 2, l4 < 8) | d[16]  | dmin[16] |
//     plane s = row's scale_s | min_s << 4; chunk byte 4r + j = row r's qs[32h + 4l4 + j],
//     whose bits 2c, 2c + 1 are weight 128h + 32c + 4l4 + j (sub-block 8h + 2c + l4 / 4)
//
//   Q3_K, 1760 bytes (16 x 110):
//   0                   512                        1536              1728     1760
//   | 8 hmask chunks: l4 | 16 qs chunks as Q2_K's   | 12 scale planes | d[16] |
//     hmask chunk byte 4r + j = row r's hmask[4l4 + j]: its bit 4h + c is the high bit of the
//     weight whose low 2 bits are bits 2c of qs chunk 8h + l4's byte 4r + j
//
//   Q4_K, 2304 bytes (16 x 144):
//   0        32       64                  256                                         2304
//   | d[16]  | dmin[16] | 12 scale planes | 32 chunks of 64: chunk 8c + l4 (c < 4, l4 < 8) |
//     plane p = stored scale byte p of rows 0..15; chunk byte 4r + j = row r's qs[32c + 4l4 + j]:
//     low nibble weight 64c + 4l4 + j (sub-block 2c), high nibble 64c + 32 + 4l4 + j (2c + 1)
//
//   Q5_K, 2816 bytes (16 x 176):
//   0        32       64                  256                    768                    2816
//   | d[16]  | dmin[16] | 12 scale planes | 8 qh chunks: l4 < 8  | 32 qs chunks as Q4_K's |
//     qh chunk byte 4r + j = row r's qh[4l4 + j]: its bit 2c is bit 4 of the weight in the low
//     nibble of qs chunk 8c + l4's byte 4r + j, its bit 2c + 1 that of the high nibble's
//
//   Q6_K, 3360 bytes (16 x 210):
//   0                          2048                        3072              3328     3360
//   | 32 ql chunks: 16h + l4    | 16 qh chunks: 8h + l4      | 16 scale planes | d[16] |
//     ql chunk byte 4r + j = row r's ql[64h + 4l4 + j] (l4 < 16), qh chunk: qh[32h + 4l4 + j]
//
//   IQ4_XS, 2176 bytes (16 x 136):
//   0        32            64                 128                                     2176
//   | d[16]  | scales_h[16] | 4 scale_l planes | 32 qs chunks: chunk 4s + l4 (s < 8, l4 < 4) |
//     scales_h: row r's uint16 at 32 + 2r; plane p = stored scales_l byte p of rows 0..15;
//     chunk byte 4r + j = row r's qs[16s + 4l4 + j]: its low nibble indexes weight
//     32s + 4l4 + j, its high nibble weight 32s + 16 + 4l4 + j (sub-block s both)
//
//   IQ4_X16 (kvserve's IQ2_X16 and IQ1_M16: IQ4_XS's quants, an int8 scale per 16 weights),
//   2336 bytes (16 x 146):
//   0        32                 288                                   2336
//   | d[16]  | 16 scale planes  | 32 qs chunks as IQ4_XS's             |
//     plane j = rows 0..15's scale of weights 16j .. 16j + 15: chunk 4s + l4's low nibbles
//     are scale 2s's, its high nibbles scale 2s + 1's
//
// Header-only and SSE2 only, so the AVX-512 source includes it before its target pragma.
#pragma once

#include <emmintrin.h>

#include <cstdint>
#include <type_traits>

namespace kvs {
namespace kq {

constexpr int64_t kQK = 256;    // weights per super-block
constexpr int64_t kGroup = 16;  // rows per record
constexpr int64_t kQ2KRecord = 1344, kQ2KQs = 256, kQ2KD = 1280, kQ2KDmin = 1312;
constexpr int64_t kQ3KRecord = 1760, kQ3KQs = 512, kQ3KScales = 1536, kQ3KD = 1728;
constexpr int64_t kQ4KRecord = 2304, kQ4KScales = 64, kQ4KQs = 256;
constexpr int64_t kQ5KRecord = 2816, kQ5KScales = 64, kQ5KQh = 256, kQ5KQs = 768;
constexpr int64_t kQ6KRecord = 3360, kQ6KQh = 2048, kQ6KScales = 3072, kQ6KD = 3328;
constexpr int64_t kIQ4XSRecord = 2176, kIQ4XSScalesH = 32, kIQ4XSScalesL = 64, kIQ4XSQs = 128;
constexpr int64_t kIQ4X16Record = 2336, kIQ4X16Scales = 32, kIQ4X16Qs = 288;

// Q4_K's (and Q5_K's) 12 scale planes -> 8 scales and 8 mins (6 bits) of rows 0..15, a
// byte each:
//   j < 4:  sc[j] = p[j] & 63                    mn[j] = p[4 + j] & 63
//           sc[j + 4] = p[8 + j] & 15 | (p[j] >> 6) << 4
//           mn[j + 4] = p[8 + j] >> 4 | (p[4 + j] >> 6) << 4
// SSE has no byte shifts: a 16-bit shift drags bits across from the lane's other byte, and
// each mask keeps only bits that came from the byte itself.
inline void q4k_scales(const uint8_t* planes, __m128i* sc, __m128i* mn) {
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
  for (int j = 0; j < 4; ++j) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * j));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * (4 + j)));
    const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * (8 + j)));
    sc[j] = _mm_and_si128(p, m63);
    mn[j] = _mm_and_si128(q, m63);
    // (x >> 6) << 4: bits 6, 7 down to 4, 5
    sc[j + 4] = _mm_or_si128(_mm_and_si128(r, m15), _mm_and_si128(_mm_srli_epi16(p, 2), m48));
    mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(r, 4), m15),
                             _mm_and_si128(_mm_srli_epi16(q, 2), m48));
  }
}

// Q2_K's 16 planes (plane s = scale_s | min_s << 4) -> its 16 scales and 16 mins (0..15) of
// rows 0..15, an int8 each. The 16-bit shift keeps only bits of the byte itself once masked.
inline void q2k_scales(const uint8_t* planes, __m128i* sc, __m128i* mn) {
  const __m128i m15 = _mm_set1_epi8(15);
  for (int s = 0; s < 16; ++s) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * s));
    sc[s] = _mm_and_si128(p, m15);
    mn[s] = _mm_and_si128(_mm_srli_epi16(p, 4), m15);
  }
}

// Q3_K's 12 scale planes -> its 16 scales (6 bits stored + 32, so -32..31) of rows 0..15, an
// int8 each:
//   low 4 bits:  p[s] & 15 (s < 8), p[s - 8] >> 4 (s >= 8)
//   high 2 bits: bits 2 (s / 4), 2 (s / 4) + 1 of p[8 + s % 4]
// The 16-bit shifts keep only bits of the byte itself, as q4k_scales says.
inline void q3k_scales(const uint8_t* planes, __m128i* sc) {
  const __m128i m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48), k32 = _mm_set1_epi8(32);
  for (int s = 0; s < 16; ++s) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * (s % 8)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * (8 + s % 4)));
    const __m128i lo = _mm_and_si128(s < 8 ? p : _mm_srli_epi16(p, 4), m15);
    // bits 2 (s / 4), + 1 to bits 4, 5
    const int at = 2 * (s / 4);
    const __m128i hi = _mm_and_si128(at == 0 ? _mm_slli_epi16(q, 4) : at == 2 ? _mm_slli_epi16(q, 2)
                                     : at == 4 ? q : _mm_srli_epi16(q, 2), m48);
    sc[s] = _mm_sub_epi8(_mm_or_si128(lo, hi), k32);
  }
}

// IQ4_XS's scales (kIQ4XSScalesH, kIQ4XSScalesL of a record) -> its 8 scales (6 bits stored +
// 32, so -32..31) of rows 0..15, an int8 each:
//   low 4 bits:  plane s / 2, nibble s % 2      high 2 bits: bits 2s, 2s + 1 of the row's uint16
// The 16-bit shifts keep only bits of the byte (or uint16) itself once masked; the two halves
// of the high bits pack (unsigned saturation of values <= 3) to rows 0..15 in order.
inline void iq4xs_scales(const uint8_t* rec, __m128i* sc) {
  const __m128i m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi16(3), k32 = _mm_set1_epi8(32);
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kIQ4XSScalesH));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kIQ4XSScalesH + 16));
  for (int s = 0; s < 8; ++s) {
    const __m128i p =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kIQ4XSScalesL + 16 * (s / 2)));
    const __m128i lo = _mm_and_si128(s % 2 ? _mm_srli_epi16(p, 4) : p, m15);
    const __m128i hi = _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(h0, 2 * s), m3),
                                        _mm_and_si128(_mm_srli_epi16(h1, 2 * s), m3));
    sc[s] = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), k32);
  }
}

// IQ4_X16's 16 scale planes -> sc[j], the int8 scale of weights 16j .. 16j + 15 of rows 0..15.
inline void iq4x16_scales(const uint8_t* rec, __m128i* sc) {
  for (int j = 0; j < 16; ++j)
    sc[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kIQ4X16Scales + 16 * j));
}

// What a format's fp16 d is multiplied by, exactly, before it scales the sums: 2^-kDShift
// where the format declares one (IQ4Lut's: 0 to 3, ggml_kquants.IQ4_FAMILY), else 1.
template <class F, class = void>
struct DFactor {
  static constexpr float value = 1.0f;
};
template <class F>
struct DFactor<F, std::void_t<decltype(F::kDShift)>> {
  static constexpr float value = 1.0f / static_cast<float>(1 << F::kDShift);
};

}  // namespace kq
}  // namespace kvs
