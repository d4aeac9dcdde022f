// Packed GGUF K-quants (Q2_K..Q6_K) against Q8_K activations, AVX2: out[M, N] = x W^T with x
// quantized to int8 per 256 values (Q8KActs) and W in the 16-row records of kquant.h. The
// spec (integer sums, then the float order of ggml_kquants.py dot_kquant) is in kernels.h.
//
// A 64-byte chunk of a record is 16 rows x 4 quant bytes: two ymm, rows 0..7 and rows 8..15,
// each multiplied against the 4 activation bytes of its quants broadcast to all 8 lanes.
// maddubs (u8 x s8 -> int16 pairs) sums a row's products inside its own 32-bit lane, so a
// lane is a row from the first multiply to the store, and no horizontal sum is needed.
//
//   Q2_K sub-block (16 weights): q (0..3) is 2 bits of a qs chunk, 4 chunks summed in int16
//       (|sum| <= 8 * 3 * 127 = 3048), madd by the scale (0..15); mins (0..15) as Q4_K's, one
//       bsum per sub-block.
//   Q3_K sub-block (16 weights): q + 4 (0..7) is 2 bits of a qs chunk and 1 of an hmask chunk,
//       4 chunks summed in int16 (|sum| <= 7112), madd by the signed scale (-32..31); then
//       4 * sum_s scale_s * bsum_s takes the + 4 back, exactly.
//   Q4_K sub-block (32 weights): 8 chunks, their maddubs summed in int16, then one madd by the
//       row's scale (duplicated in both int16 halves of its lane) -> int32. Bound: an int16
//       lane gathers 16 products of q <= 15 by |x| <= 127: |sum| <= 30480 < 2^15.
//   Q5_K sub-block (32 weights): q (0..31) is the Q4_K nibble with bit 4 from its qh chunk;
//       2 x 4 chunks summed in int16 (|sum| <= 8 * 31 * 127 = 31496 < 2^15), each run madd by
//       the scale. Mins as Q4_K's.
//   Q6_K sub-block (16 weights): q + 32 (0..63) is assembled from its nibble and its 2 high
//       bits, 2 chunks summed in int16 (|sum| <= 4 * 63 * 127 = 32004 < 2^15), madd by the
//       scale; 32 * sum_s scale_s * bsum_s takes the + 32 back, exactly.
//   Q4_K mins: sum_s min_s * (the two bsums of s), one madd per two sub-blocks: each row's
//       (min_2t, min_2t+1) against the activations' pair of sums of 32 (which fit int16).
//   Q6_K's + 32 correction likewise: (scale_2t, scale_2t+1) against the bsum pair (2t, 2t+1).
//   IQ4_XS sub-block (32 weights): each nibble looked up (pshufb) in the 16 signed values
//       (-127..113); maddubs(|v|, x with v's sign) (|pair| <= 2 * 127 * 127 < 2^15), each
//       chunk's pairs madd by the signed scale (-32..31): no int16 sum of two would fit.
//       IQ3_S4 (a file's IQ3_S, rewritten at load) is the same with its own 16 values.
//
// The float part follows kernels.h's order exactly, one rounding per mul, add or sub
// (-ffp-contract=off, no FMA), so every tile shape here and the VNNI twin give the same bits.
//
// Parallel split (tiles.h): a tile is one 16-row group, each thread streams its slab of groups
// front to back; activation rows go in passes of ~256 KB of int8 (kept in L2), and a group's
// records are re-read from cache for every MT rows after the first tile. Q4_K at 2..8 rows
// (a speculative step's K + 1, small batches) runs Q4KRows' tiles of up to 5 rows over the packed
// records; from 3 rows (Q4_K and IQ4_XS: 9, Q6_K: 6) on, every format's groups are read as
// wide records instead, unpacked once per pass ("Wide records" below): prefill and batches.
#include <omp.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "kquant.h"
#include "simd.h"
#include "tiles.h"

#if !KVS_AVX2
// No scalar twin: kvserve/ops/cpu_extension.py always builds with -mavx2 -mfma, and
// ops/cpu.py routes a CPU without them to ReferenceOps before any kernel is built.
#error "qlinear_kquant.cpp needs AVX2 + FMA"
#endif

namespace kvs {

int64_t kquant_record_bytes(KType kt) {
  switch (kt) {
    case KType::Q2_K: return kq::kQ2KRecord;
    case KType::Q3_K: return kq::kQ3KRecord;
    case KType::Q4_K: return kq::kQ4KRecord;
    case KType::Q5_K: return kq::kQ5KRecord;
    case KType::Q6_K: return kq::kQ6KRecord;
    case KType::IQ4_XS: return kq::kIQ4XSRecord;
    case KType::IQ3_S4:  // IQ4_XS's layout
    case KType::IQ3_XXS4:
    case KType::IQ2_XXS4:
    case KType::IQ1_S4: return kq::kIQ4XSRecord;
    case KType::IQ2_X16:
    case KType::IQ1_M16: return kq::kIQ4X16Record;
  }
  return 0;
}

namespace {

using kq::kGroup;
using kq::kQK;

// Inlined whatever their size (Q4KRows' sub-blocks and dot, Q6K's chunk pairs): GCC's limits
// otherwise decide. Q6K::chunk_pairs out of line made Q6K::dot<1> too large to inline into
// tile<> (a call per record, its sums through memory: 1.06x the time of a 1-row call in
// cache). Q6K::dot itself is left to GCC: forced inline, its 2-5 row tiles ran 1.04-1.14x
// slower.
#define KVS_KQ_INLINE inline __attribute__((always_inline))

// How far ahead of the record being read its stream is prefetched, and into which cache.
// Into L1 (T0): Zen 3, 4, 8 and 16 KB within noise of each other; Zen 4 (this file under
// KVSERVE_CPU_ISA=avx2; every K-quant linear of the Qwen2.5-Coder 1.5B Q4_K_M file,
// benchmarks/kernel_ab.py, 9 paired rounds): 4 KB 0.80x, 0.88x, 0.95x the time of 8 KB at 1,
// 2, 5 rows (2 KB 0.92x, 0.79x, 0.91x). A tile's stream then went into L2 (T1) 6 KB ahead:
// 0.94x, 0.84x, 0.78x, 0.79x the time of L1 4 KB at 1, 2, 5, 8 rows (same file, Zen 4, 31
// rounds; Q6_K alone 0.71x at 1 and 5 rows, Q4_K 0.99x / 0.77x; 8 KB within noise of 6 KB),
// as in the VNNI file, which says why. On Zen 3 (AVX2 only) the two read level: L2 6 KB
// 1.00x, 1.01x, 1.01x, 1.00x the time of L1 4 KB at 1, 2, 5, 8 rows (Q4_K and Q6_K linears
// of the same file, 15 rounds, kernel_ab.py --base 1b437d5^ --formats Q4_K,Q6_K).
#ifndef KVS_KQUANT_PREFETCH_BYTES  // knobs for benchmarks/kernel_ab.py -D
#define KVS_KQUANT_PREFETCH_BYTES 4096
#endif
#ifndef KVS_KQUANT_L2_PREFETCH_BYTES
#define KVS_KQUANT_L2_PREFETCH_BYTES 6144
#endif
constexpr int64_t kPrefetchBytes = KVS_KQUANT_PREFETCH_BYTES;
constexpr int64_t kL2PrefetchBytes = KVS_KQUANT_L2_PREFETCH_BYTES;

// The lines of the `bytes` at rec + kAhead, into the cache kHint names.
template <int64_t kAhead, _mm_hint kHint>
inline void prefetch_lines(const uint8_t* rec, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec) + kAhead + o, kHint);
}

// A record kPrefetchBytes ahead of the one being streamed, into L1 (the wide passes'
// unpack_group).
inline void prefetch_ahead(const uint8_t* rec, int64_t bytes) {
  prefetch_lines<kPrefetchBytes, _MM_HINT_T0>(rec, bytes);
}

// A tile's stream of records: the record kL2PrefetchBytes ahead, into L2.
inline void prefetch_tile_record(const uint8_t* rec, int64_t bytes) {
  prefetch_lines<kL2PrefetchBytes, _MM_HINT_T1>(rec, bytes);
}

// 16 per-row bytes (rows 0..15) -> int32 lanes of rows 8h .. 8h + 7, zero- or sign-extended.
inline __m256i widen_u8(__m128i b, int h) {
  return _mm256_cvtepu8_epi32(h ? _mm_srli_si128(b, 8) : b);
}
inline __m256i widen_i8(__m128i b, int h) {
  return _mm256_cvtepi8_epi32(h ? _mm_srli_si128(b, 8) : b);
}
// An int32 lane's low int16 copied into its high one: the madd factor that scales a row's two
// int16 pair sums by the same value.
inline __m256i dup16(__m256i v) { return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA); }
// An int16 broadcast with zero high halves: madd(v32, bc16(s)) = v32 * s for v32 in int16.
inline __m256i bc16(int32_t s) { return _mm256_set1_epi32(static_cast<uint16_t>(s)); }
// Every byte's bit `from` moved to bit `to` (0..7), the other bits left for the caller's mask
// of bit `to`: a 16-bit shift, and the bits it carries across a lane's two bytes never land
// there (a right shift fills bit to < 8 - (from - to) of a byte from the byte itself, a left
// shift bit to >= to - from).
inline __m256i move_bit(__m256i v, int from, int to) {
  return from >= to ? _mm256_srli_epi16(v, from - to) : _mm256_slli_epi16(v, to - from);
}

// Format policies. dot<MT>(rec, x, bs, isum, msum): for activation rows m < MT (x[m]: its
// quants at the super-block's start, bs[m]: its 16 bsums), isum[m][h] / msum[m][h] = int32
// lane r = row 8h + r's isum / msum (kernels.h). msum is left unset where kMin is false.
// kD / kDmin: the record offsets of d[16] / dmin[16]; kJoint: Q2_K's float order (one sum of
// dw * isum - dm * msum) instead of separate sums and mins.

// Q2_K / Q3_K: weight 128h + 32c + 4l4 + j (sub-block 8h + 2c + l4 / 4) has its 2 low bits at
// bits 2c of qs chunk 8h + l4 (kquant.h). isum[m][r] += sum over the 16 sub-blocks of
// scale_s * sum_{j in s} u_j * x_j, for u = Bits::get(rec, h, c, l4, r) (0..7) and the
// signed int8 scales sc[s].
template <int MT, class Bits>
inline void sub_block_sums(const uint8_t* rec, const __m128i* sc, const int8_t* const* x,
                           __m256i (*isum)[2]) {
  for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c)
      for (int half = 0; half < 2; ++half) {  // sub-block 8h + 2c + half: l4 = 4 half ..
        __m256i t[MT][2];
        for (int m = 0; m < MT; ++m) t[m][0] = t[m][1] = _mm256_setzero_si256();
        for (int e = 0; e < 4; ++e) {
          const int l4 = 4 * half + e;
          __m256i u[2];
          for (int r = 0; r < 2; ++r) u[r] = Bits::get(rec, h, c, l4, r);
          for (int m = 0; m < MT; ++m) {
            const __m256i xb = bcast4(x[m] + 128 * h + 32 * c + 4 * l4);
            for (int r = 0; r < 2; ++r)
              t[m][r] = _mm256_add_epi16(t[m][r], _mm256_maddubs_epi16(u[r], xb));
          }
        }
        for (int r = 0; r < 2; ++r) {
          const __m256i s = dup16(widen_i8(sc[8 * h + 2 * c + half], r));
          for (int m = 0; m < MT; ++m)
            isum[m][r] = _mm256_add_epi32(isum[m][r], _mm256_madd_epi16(t[m][r], s));
        }
      }
}

// sum_s v_s * bsum_s over the 16 sub-blocks of 16, for int8 v (|bsum| <= 16 * 127: an int16).
template <bool kSigned>
inline __m256i bsum_dot(const __m128i* v, const int16_t* bs, int r) {
  __m256i acc = _mm256_setzero_si256();
  for (int s = 0; s < 16; ++s)
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kSigned ? widen_i8(v[s], r)
                                                          : widen_u8(v[s], r), bc16(bs[s])));
  return acc;
}

struct Q2K {
  static constexpr int64_t kRecord = kq::kQ2KRecord;
  static constexpr int64_t kD = kq::kQ2KD, kDmin = kq::kQ2KDmin;
  static constexpr bool kMin = true, kJoint = true;
  struct Bits {  // q: bits 2c of the qs chunk
    static inline __m256i get(const uint8_t* rec, int h, int c, int l4, int r) {
      const __m256i q = load256(rec + kq::kQ2KQs + 64 * (8 * h + l4) + 32 * r);
      return _mm256_and_si256(_mm256_srli_epi16(q, 2 * c), _mm256_set1_epi8(3));
    }
  };
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*msum)[2]) {
    __m128i sc[16], mn[16];
    kq::q2k_scales(rec, sc, mn);
    sub_block_sums<MT, Bits>(rec, sc, x, isum);  // scales 0..15: as int8, the same
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < 2; ++r) msum[m][r] = bsum_dot<false>(mn, bs[m], r);
  }
};

struct Q3K {
  static constexpr int64_t kRecord = kq::kQ3KRecord;
  static constexpr int64_t kD = kq::kQ3KD, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  struct Bits {  // q + 4: bits 2c of the qs chunk | bit 4h + c of hmask chunk l4, at bit 2
    static inline __m256i get(const uint8_t* rec, int h, int c, int l4, int r) {
      const __m256i q = load256(rec + kq::kQ3KQs + 64 * (8 * h + l4) + 32 * r);
      const __m256i hm = load256(rec + 64 * l4 + 32 * r);
      return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * c), _mm256_set1_epi8(3)),
                             _mm256_and_si256(move_bit(hm, 4 * h + c, 2), _mm256_set1_epi8(4)));
    }
  };
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*)[2]) {
    __m128i sc[16];
    kq::q3k_scales(rec + kq::kQ3KScales, sc);
    sub_block_sums<MT, Bits>(rec, sc, x, isum);
    for (int m = 0; m < MT; ++m)  // - 4 * sum_s scale_s * bsum_s
      for (int r = 0; r < 2; ++r)
        isum[m][r] = _mm256_sub_epi32(isum[m][r],
                                      _mm256_slli_epi32(bsum_dot<true>(sc, bs[m], r), 2));
  }
};

// Q4_K / Q5_K: msum[m][h] = sum_s min_s * (the two bsums of sub-block s), rows 8h.. . One
// madd per two sub-blocks: the pair (min_2t, min_2t+1) of each row, built once for all MT
// rows, against the pair of the activation row's sums of 32 (2t, 2t + 1), as the wide
// records and the VNNI file pair them (exact in int32; |sum of 32| <= 32 * 127, an int16).
// Against one madd per sub-block (its min against a broadcast sum, zero high halves), a row's
// 16 madds and 8 broadcasts of a scalar were ~17% of a 5-row Q4KRows tile's instructions.
template <int MT>
inline void min_sums(const __m128i* mn, const int16_t* const* bs, __m256i (*msum)[2]) {
  __m256i s32[MT];  // the row's 8 sums of 32: int32 lane t = (sum 2t, sum 2t + 1), both halves
  for (int m = 0; m < MT; ++m)  // adjacent bsums added: no wrap
    s32[m] = _mm256_broadcastsi128_si256(
        _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bs[m])),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs[m] + 8))));
  for (int h = 0; h < 2; ++h) {
    __m256i pair[4];  // int32 lane r = (min_2t, min_2t+1) of row 8h + r
    for (int t = 0; t < 4; ++t) {
      const __m128i b = h ? _mm_unpackhi_epi8(mn[2 * t], mn[2 * t + 1])
                          : _mm_unpacklo_epi8(mn[2 * t], mn[2 * t + 1]);
      pair[t] = _mm256_cvtepu8_epi16(b);
    }
    for (int m = 0; m < MT; ++m)
      msum[m][h] = _mm256_add_epi32(
          _mm256_add_epi32(_mm256_madd_epi16(pair[0], _mm256_shuffle_epi32(s32[m], 0x00)),
                           _mm256_madd_epi16(pair[1], _mm256_shuffle_epi32(s32[m], 0x55))),
          _mm256_add_epi32(_mm256_madd_epi16(pair[2], _mm256_shuffle_epi32(s32[m], 0xAA)),
                           _mm256_madd_epi16(pair[3], _mm256_shuffle_epi32(s32[m], 0xFF))));
  }
}

struct Q4K {
  static constexpr int64_t kRecord = kq::kQ4KRecord;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = true, kJoint = false;
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*msum)[2]) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + kq::kQ4KScales, sc, mn);
    const __m256i nib = _mm256_set1_epi8(15);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m256i lo[MT][2], hi[MT][2];
      for (int m = 0; m < MT; ++m)
        for (int h = 0; h < 2; ++h) lo[m][h] = hi[m][h] = _mm256_setzero_si256();
      for (int l4 = 0; l4 < 8; ++l4) {
        const uint8_t* p = rec + kq::kQ4KQs + 64 * (8 * c + l4);
        __m256i wl[2], wh[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load256(p + 32 * h);
          wl[h] = _mm256_and_si256(v, nib);
          wh[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int m = 0; m < MT; ++m) {
          const __m256i xl = bcast4(x[m] + 64 * c + 4 * l4);
          const __m256i xh = bcast4(x[m] + 64 * c + 32 + 4 * l4);
          for (int h = 0; h < 2; ++h) {
            lo[m][h] = _mm256_add_epi16(lo[m][h], _mm256_maddubs_epi16(wl[h], xl));
            hi[m][h] = _mm256_add_epi16(hi[m][h], _mm256_maddubs_epi16(wh[h], xh));
          }
          // Pinned (as in Q4KRows): unpinned, GCC computed a sub-block pair's 32 products
          // first, each spilled to the stack, then added them up (1 row: 80 stack moves per
          // 16 chunks; the loop ran 8% faster in cache pinned).
          asm("" : "+x"(lo[m][0]), "+x"(lo[m][1]), "+x"(hi[m][0]), "+x"(hi[m][1]));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i s0 = dup16(widen_u8(sc[2 * c], h)), s1 = dup16(widen_u8(sc[2 * c + 1], h));
        for (int m = 0; m < MT; ++m)
          isum[m][h] = _mm256_add_epi32(isum[m][h],
                                        _mm256_add_epi32(_mm256_madd_epi16(lo[m][h], s0),
                                                         _mm256_madd_epi16(hi[m][h], s1)));
      }
    }
    min_sums<MT>(mn, bs, msum);
  }
};

// Q4_K's packed records at a few rows (a speculative step's K + 1, small batches): one
// sub-block (one nibble of 8 chunks) at a time, both 8-row halves of the group, so that up to
// 5 activation rows' int16 sums (2 a row) fit in registers beside the split chunk: each
// chunk split once for all the tile's rows, each activation broadcast once for both halves.
// (One half at a time held 8 rows but broadcast every activation twice, one maddubs each:
// against it, over the Qwen 1.5B Q4_K_M file's Q4_K linears (benchmarks/kernel_ab.py, Zen 3,
// 2 threads, 11 rounds) 0.88x the time at 2 rows, 0.94x at 3 and 4, 0.93x at 5, 0.97x at 7,
// 0.80-0.84x at 8 (4 + 4); 6 rows as 4 + 2 read 1.07x, as 3 + 3 0.97x.) The wide records'
// unpacking (store, then reload) costs about a 1-row call per group, which a few rows cannot
// amortize. Same integer sums (the int16 bound of Q4K's lo / hi), same bits.
struct Q4KRows : Q4K {
  // isum[m][h] += scale_s * (sub-block s's int16 sums), s = 2c + kHigh: the low (high)
  // nibbles of chunks 8c .. 8c + 7. The nibble is a template argument: with s % 2 tested at
  // run time, GCC kept that test in the chunk loop at 4 and 5 rows (a branch and two register
  // copies per chunk). Against that, one call in cache (8960 x 1536, 2 threads, Zen 3,
  // benchmarks/kernel_ab.py --in-cache): 0.87-0.92x the time at 2 to 5 rows, both changes of
  // this session together (with min_sums' pairs).
  template <int MT, bool kHigh>
  static KVS_KQ_INLINE void sub_block(const uint8_t* rec, int c, const int8_t* const* x,
                                      const __m128i* sc, __m256i (*isum)[2]) {
    const __m256i nib = _mm256_set1_epi8(15);
    const int s = 2 * c + kHigh;
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int l4 = 0; l4 < 8; ++l4) {
      __m256i w[2];  // rows 0..7, 8..15
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load256(rec + kq::kQ4KQs + 64 * (8 * c + l4) + 32 * h);
        w[h] = _mm256_and_si256(kHigh ? _mm256_srli_epi16(v, 4) : v, nib);
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xb = bcast4(x[m] + 32 * s + 4 * l4);
        for (int h = 0; h < 2; ++h)
          acc[m][h] = _mm256_add_epi16(acc[m][h], _mm256_maddubs_epi16(w[h], xb));
      }
      // Pinned once all rows' products are in (as in WideLayout::sums): unpinned, GCC
      // computed all 8 chunks' products first and spilled them to the stack.
      for (int m = 0; m < MT; ++m) asm("" : "+x"(acc[m][0]), "+x"(acc[m][1]));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i f = dup16(widen_u8(sc[s], h));
      for (int m = 0; m < MT; ++m)
        isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(acc[m][h], f));
    }
  }

  template <int MT>
  static KVS_KQ_INLINE void dot(const uint8_t* rec, const int8_t* const* x,
                                const int16_t* const* bs, __m256i (*isum)[2],
                                __m256i (*msum)[2]) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + kq::kQ4KScales, sc, mn);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      sub_block<MT, false>(rec, c, x, sc, isum);
      sub_block<MT, true>(rec, c, x, sc, isum);
    }
    min_sums<MT>(mn, bs, msum);
  }
};

struct Q5K {
  static constexpr int64_t kRecord = kq::kQ5KRecord;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = true, kJoint = false;
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*msum)[2]) {
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + kq::kQ5KScales, sc, mn);
    const __m256i nib = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m256i s0[2], s1[2];
      for (int h = 0; h < 2; ++h) {
        s0[h] = dup16(widen_u8(sc[2 * c], h));
        s1[h] = dup16(widen_u8(sc[2 * c + 1], h));
      }
      for (int half = 0; half < 2; ++half) {  // chunks l4 = 4 half .. 4 half + 3
        __m256i lo[MT][2], hi[MT][2];
        for (int m = 0; m < MT; ++m)
          for (int h = 0; h < 2; ++h) lo[m][h] = hi[m][h] = _mm256_setzero_si256();
        for (int e = 0; e < 4; ++e) {
          const int l4 = 4 * half + e;
          const uint8_t* p = rec + kq::kQ5KQs + 64 * (8 * c + l4);
          const uint8_t* qh = rec + kq::kQ5KQh + 64 * l4;
          __m256i wl[2], wh[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i v = load256(p + 32 * h), b = load256(qh + 32 * h);
            wl[h] = _mm256_or_si256(_mm256_and_si256(v, nib),
                                    _mm256_and_si256(move_bit(b, 2 * c, 4), b4));
            wh[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                    _mm256_and_si256(move_bit(b, 2 * c + 1, 4), b4));
          }
          for (int m = 0; m < MT; ++m) {
            const __m256i xl = bcast4(x[m] + 64 * c + 4 * l4);
            const __m256i xh = bcast4(x[m] + 64 * c + 32 + 4 * l4);
            for (int h = 0; h < 2; ++h) {
              lo[m][h] = _mm256_add_epi16(lo[m][h], _mm256_maddubs_epi16(wl[h], xl));
              hi[m][h] = _mm256_add_epi16(hi[m][h], _mm256_maddubs_epi16(wh[h], xh));
            }
          }
        }
        for (int m = 0; m < MT; ++m)
          for (int h = 0; h < 2; ++h)
            isum[m][h] = _mm256_add_epi32(isum[m][h],
                                          _mm256_add_epi32(_mm256_madd_epi16(lo[m][h], s0[h]),
                                                           _mm256_madd_epi16(hi[m][h], s1[h])));
      }
    }
    min_sums<MT>(mn, bs, msum);
  }
};

// Q6_K's q + 32 (0..63) of rows 8r .. 8r + 7, 4 weights each: the low nibbles of the ql
// chunk at ql (its high nibbles for c >= 2) with bits 2c, 2c + 1 of the qh chunk at qh.
inline __m256i q6_quants(const uint8_t* ql, const uint8_t* qh, int c, int r) {
  __m256i lo = load256(ql + 32 * r), hb = load256(qh + 32 * r);
  if (c >= 2) lo = _mm256_srli_epi16(lo, 4);
  // bits 2c, 2c + 1 of the qh byte up (or down) to bits 4, 5
  hb = c == 0 ? _mm256_slli_epi16(hb, 4) : c == 1 ? _mm256_slli_epi16(hb, 2)
       : c == 3 ? _mm256_srli_epi16(hb, 2) : hb;
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(15)),
                         _mm256_and_si256(hb, _mm256_set1_epi8(48)));
}

struct Q6K {
  static constexpr int64_t kRecord = kq::kQ6KRecord;
  static constexpr int64_t kD = kq::kQ6KD, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  // Runs at 1 to 5 rows (from 6 rows, WideQ6K). Per record the 16 scales' madd factors are
  // built once (each is read by its sub-block's two chunk pairs and by the + 32 correction),
  // and a qh chunk is loaded once for two of its four bit pairs. Against building the
  // factors per chunk pair, one call at 1 row (8960 x 1536 and 1536 x 8960, 2 threads, Zen 3
  // AVX2): 0.61 -> 0.39 ms with the weights in cache, 1.13-1.25 -> 0.88-0.91 ms from DRAM
  // (9-10 -> 12.4-12.9 GB/s, Q4_K's rate in the same minute: 13.7).
  // Weight 128h + 32c + 4l4 + j (sub-block 8h + 2c + l4 / 4): its low nibble is ql chunk
  // 16h + l4 (c = 0, 2: low / high nibble) or 16h + 8 + l4 (c = 1, 3), its high 2 bits are
  // bits 2c of qh chunk 8h + l4. Chunks l4 = 2p, 2p + 1 (sub-block 8h + 2c + p / 2) are
  // summed in int16, c and c + 2 from the same ql and qh loads. kC (c = kC, kC + 2) is a
  // template argument: tested at run time, GCC kept branches and shifts by a register in the
  // 2-5 row tiles' loop. With the correction's pairs, one call in cache (1536 x 8960, 2
  // threads, Zen 3, kernel_ab.py --in-cache): 0.95x the time at 1 row, 0.80-0.90x at 2 to 5.
  template <int MT, int kC>
  static KVS_KQ_INLINE void chunk_pairs(const uint8_t* rec, int h, int p,
                                        const int8_t* const* x, const __m256i (*f)[2],
                                        __m256i (*isum)[2]) {
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    for (int r = 0; r < 2; ++r) {
      __m256i lo[MT], hi[MT];  // sub-blocks 8h + 2kC + p / 2 and 8h + 2(kC + 2) + p / 2
      for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
      for (int e = 0; e < 2; ++e) {
        const int l4 = 2 * p + e;
        const __m256i a = load256(rec + 64 * (16 * h + 8 * kC + l4) + 32 * r);
        const __m256i hb = load256(rec + kq::kQ6KQh + 64 * (8 * h + l4) + 32 * r);
        // bits 2c, 2c + 1 and 2c + 4, 2c + 5 of the qh byte to bits 4, 5
        const __m256i u0 = _mm256_or_si256(
            _mm256_and_si256(a, m15), _mm256_and_si256(_mm256_slli_epi16(hb, kC ? 2 : 4), m48));
        const __m256i u1 = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(a, 4), m15),
            _mm256_and_si256(kC ? _mm256_srli_epi16(hb, 2) : hb, m48));
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = x[m] + 128 * h + 32 * kC + 4 * l4;
          lo[m] = _mm256_add_epi16(lo[m], _mm256_maddubs_epi16(u0, bcast4(xq)));
          hi[m] = _mm256_add_epi16(hi[m], _mm256_maddubs_epi16(u1, bcast4(xq + 64)));
        }
      }
      const int s = 8 * h + 2 * kC + p / 2;
      for (int m = 0; m < MT; ++m)
        isum[m][r] = _mm256_add_epi32(
            isum[m][r], _mm256_add_epi32(_mm256_madd_epi16(lo[m], f[s][r]),
                                         _mm256_madd_epi16(hi[m], f[s + 4][r])));
    }
  }

  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*)[2]) {
    __m256i f[16][2];  // f[s][r]: dup16(scale_s) of rows 8r .. 8r + 7
    for (int s = 0; s < 16; ++s) {
      const __m128i sc =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kq::kQ6KScales + 16 * s));
      for (int r = 0; r < 2; ++r) f[s][r] = dup16(widen_i8(sc, r));
    }
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 4; ++p) {
        chunk_pairs<MT, 0>(rec, h, p, x, f, isum);
        chunk_pairs<MT, 1>(rec, h, p, x, f, isum);
      }
    // - 32 * sum_s scale_s * bsum_s (|bsum| <= 16 * 127: an int16): one madd per two
    // sub-blocks, the pair (scale_2t, scale_2t+1) of each row against the activation row's
    // bsums (2t, 2t + 1) as stored (exact in int32)
    __m256i pf[8][2];
    for (int t = 0; t < 8; ++t)
      for (int r = 0; r < 2; ++r)
        pf[t][r] = _mm256_blend_epi16(f[2 * t][r], f[2 * t + 1][r], 0xAA);
    for (int m = 0; m < MT; ++m) {
      __m256i corr[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int t = 0; t < 8; ++t) {
        int32_t pair;
        std::memcpy(&pair, bs[m] + 2 * t, sizeof pair);
        const __m256i v = _mm256_set1_epi32(pair);
        for (int r = 0; r < 2; ++r)
          corr[r] = _mm256_add_epi32(corr[r], _mm256_madd_epi16(pf[t][r], v));
      }
      for (int r = 0; r < 2; ++r)
        isum[m][r] = _mm256_sub_epi32(isum[m][r], _mm256_slli_epi32(corr[r], 5));
    }
  }
};

// IQ4_XS (kquant.h): sub-block s is qs chunks 4s .. 4s + 3, low nibbles its weights 0..15,
// high nibbles 16..31. Packed tiles to 8 rows, WideIQ4 from 9. k16: IQ4_X16's record, a scale
// per 16 weights (the low nibbles' and the high ones').
template <const int8_t* kLut, int kShift, bool k16 = false>
struct IQ4Lut {
  static constexpr bool kPer16 = k16;
  static constexpr int64_t kRecord = k16 ? kq::kIQ4X16Record : kq::kIQ4XSRecord;
  static constexpr int64_t kQs = k16 ? kq::kIQ4X16Qs : kq::kIQ4XSQs;
  static constexpr int64_t kD = 0, kDmin = 0;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int kDShift = kShift;  // d x 2^-kShift (kq::DFactor)
  // The table's values (IQ4_XS -127..113, the rewritten i-quants' within +-62) of the
  // nibbles t (0: low, 1: high) of 32 packed quant bytes v.
  static inline __m256i values(__m256i v, int t) {
    const __m256i lut = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kLut)));
    return _mm256_shuffle_epi8(
        lut, _mm256_and_si256(t ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15)));
  }
  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const*,
                         __m256i (*isum)[2], __m256i (*)[2]) {
    __m128i sc[16];
    if constexpr (k16) kq::iq4x16_scales(rec, sc);
    else kq::iq4xs_scales(rec, sc);
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s)
      for (int r = 0; r < 2; ++r) {
        const __m256i fl = dup16(widen_i8(sc[k16 ? 2 * s : s], r));  // the low nibbles'
        const __m256i fh = k16 ? dup16(widen_i8(sc[2 * s + 1], r)) : fl;
        for (int l4 = 0; l4 < 4; ++l4) {
          const __m256i v = load256(rec + kQs + 64 * (4 * s + l4) + 32 * r);
          const __m256i wl = values(v, 0), wh = values(v, 1);
          const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
          for (int m = 0; m < MT; ++m) {  // sign() zeroes x only where the value is 0 too
            const int8_t* xq = x[m] + 32 * s + 4 * l4;
            const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(bcast4(xq), wl));
            const __m256i ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(bcast4(xq + 16), wh));
            isum[m][r] = _mm256_add_epi32(isum[m][r], _mm256_add_epi32(_mm256_madd_epi16(pl, fl),
                                                                       _mm256_madd_epi16(ph, fh)));
          }
        }
      }
  }
};

// Activation rows m0 .. m0 + MT - 1 against one group (records from gw) -> out columns
// 0 .. cols - 1 of those rows (out points at the group's first column, rows N apart).
template <class Fmt, int MT, bool kPrefetchW>
inline void tile(const Q8KActs& a, int64_t m0, const uint8_t* gw, const float* bias,
                 float* out, int64_t N, int64_t cols) {
  const int64_t K = a.K, nsb = K / kQK;
  __m256 sums[MT][2], mins[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) sums[m][h] = mins[m][h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* rec = gw + i * Fmt::kRecord;
    if constexpr (kPrefetchW) prefetch_tile_record(rec, Fmt::kRecord);
    const int8_t* x[MT];
    const int16_t* bs[MT];
    for (int m = 0; m < MT; ++m) {
      x[m] = a.q + (m0 + m) * K + i * kQK;
      bs[m] = a.bsums + (m0 + m) * (K / 16) + i * 16;
    }
    __m256i isum[MT][2], msum[MT][2];
    Fmt::template dot<MT>(rec, x, bs, isum, msum);
    __m256 dw[2] = {load_halves8(rec + Fmt::kD), load_halves8(rec + Fmt::kD + 16)};
    if constexpr (kq::DFactor<Fmt>::value != 1.0f)
      for (int h = 0; h < 2; ++h)
        dw[h] = _mm256_mul_ps(dw[h], _mm256_set1_ps(kq::DFactor<Fmt>::value));
    __m256 dm[2];
    if constexpr (Fmt::kMin) {
      dm[0] = load_halves8(rec + Fmt::kDmin);
      dm[1] = load_halves8(rec + Fmt::kDmin + 16);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 xd = _mm256_set1_ps(a.d[(m0 + m) * nsb + i]);
      for (int h = 0; h < 2; ++h) {
        const __m256 ws = _mm256_mul_ps(_mm256_mul_ps(dw[h], xd), _mm256_cvtepi32_ps(isum[m][h]));
        if constexpr (Fmt::kMin) {
          const __m256 ms = _mm256_mul_ps(_mm256_mul_ps(dm[h], xd),
                                          _mm256_cvtepi32_ps(msum[m][h]));
          if constexpr (Fmt::kJoint) {  // Q2_K: sums = sums + (dw * isum - dm * msum)
            sums[m][h] = _mm256_add_ps(sums[m][h], _mm256_sub_ps(ws, ms));
          } else {
            sums[m][h] = _mm256_add_ps(sums[m][h], ws);
            mins[m][h] = _mm256_sub_ps(mins[m][h], ms);
          }
        } else {
          sums[m][h] = _mm256_add_ps(sums[m][h], ws);
        }
      }
    }
  }
  // out = mins + sums (Q2_K, Q3_K, Q6_K: +0 + sums, which turns a -0 into +0 as the oracle does)
  const __m256i mask[2] = {tail_mask(cols < 8 ? cols : 8), tail_mask(cols > 8 ? cols - 8 : 0)};
  for (int m = 0; m < MT; ++m) {
    float* o = out + (m0 + m) * N;
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_add_ps(mins[m][h], sums[m][h]);
      if (cols == kGroup) {
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
        _mm256_storeu_ps(o + 8 * h, v);
      } else {  // the last group of N % 16 columns: nothing read or written past N
        if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + 8 * h, mask[h]));
        _mm256_maskstore_ps(o + 8 * h, mask[h], v);
      }
    }
  }
}

// --- Wide records: Q4_K, IQ4_XS at 9+ rows, Q2_K, Q3_K, Q5_K at 3+, Q6_K at 6+ ---
//
// A pass of many activation rows reads its group's records unpacked once (unpack_group) into
// "wide" records, which tile<> reads as it reads packed ones: each chunk's quants already a
// byte each (nibble split, high bits ORed in), the scales already widened to the int16 madd
// factors, the min (Q4_K / Q5_K) or the + 32 correction (Q6_K) factors as int16 pairs. The
// inner loop is then one load per 8 rows x 4 quants and, per activation row, one broadcast,
// maddubs and add; the decoding, done once per pass instead of once per 2 rows, had cost more
// than the products (one call at 512 rows, 2 threads: Q4_K 2.5x, Q6_K 3x the packed tiles).
// The integer sums are the packed kernel's, so are the bits.
//
//   wide record, kSub sub-blocks of kK chunks (a chunk: 4 quants of 16 rows, 2 x 32 bytes):
//   0        32          64            kScales             kQuants
//   | d[16]  | dmin[16] | pair factors | scales: kSub x 2 | quants: kSub x kK x 2 |
//     (Q6_K: no dmin)     (kPairs x 2)  dup16(scale), rows   sub-block s, chunk k, rows 8r..:
//                                       8r .. 8r + 7         weights kK * 4 * s + 4 k + j
//
// kSub sub-blocks of kK chunks; int16 sums of kRun chunks at a time, each madd by the scale
// (the int16 bound of the packed kernel's same format).
template <int kSub, int kK, int kRun, int kPairs>
struct WideLayout {
  static constexpr int64_t kPairsAt = 64, kScales = kPairsAt + 64 * kPairs;
  static constexpr int64_t kQuants = kScales + 64 * kSub;
  static constexpr int64_t kRecord = kQuants + 64 * kSub * kK;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kJoint = false;

  // isum[m][r] = sum_s scale_s * sum over s's weights of q * x, rows 8r..
  template <int MT>
  static inline void sums(const uint8_t* rec, const int8_t* const* x, __m256i (*isum)[2]) {
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int s = 0; s < kSub; ++s) {
      const uint8_t* sp = rec + kScales + 64 * s;
      const __m256i sc[2] = {load256(sp), load256(sp + 32)};
      for (int k0 = 0; k0 < kK; k0 += kRun) {
        __m256i acc[MT][2];
        for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int k = k0; k < k0 + kRun; ++k) {
          const uint8_t* q = rec + kQuants + 64 * (kK * s + k);
          const __m256i w0 = load256(q), w1 = load256(q + 32);
          for (int m = 0; m < MT; ++m) {
            const __m256i xb = bcast4(x[m] + 4 * (kK * s + k));
            acc[m][0] = _mm256_add_epi16(acc[m][0], _mm256_maddubs_epi16(w0, xb));
            acc[m][1] = _mm256_add_epi16(acc[m][1], _mm256_maddubs_epi16(w1, xb));
          }
          // Keeps each running sum in its register: unpinned, GCC reassociates the chain
          // into all the products first, spilled to the stack, then a tree of adds. Pinned
          // once per chunk, after all rows' products (inside the row loop the pins cost 4
          // extra register moves per chunk: 1.10x slower on Q4_K).
          for (int m = 0; m < MT; ++m) asm("" : "+x"(acc[m][0]), "+x"(acc[m][1]));
        }
        for (int m = 0; m < MT; ++m)
          for (int r = 0; r < 2; ++r)
            isum[m][r] = _mm256_add_epi32(isum[m][r], _mm256_madd_epi16(acc[m][r], sc[r]));
      }
    }
  }

  // sum_t madd(pair factors t, rows 8r.., the int16 pair v[t] in every lane)
  template <int kN>
  static inline __m256i pair_dot(const uint8_t* rec, int r, const int32_t* v) {
    __m256i acc = _mm256_setzero_si256();
    for (int t = 0; t < kN; ++t)
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(load256(rec + kPairsAt + 64 * t + 32 * r),
                                                    _mm256_set1_epi32(v[t])));
    return acc;
  }

  // pair_dot against each row's bsum pairs (2t, 2t + 1) as stored, rows m < MT: the
  // layouts of 16-weight sub-blocks (kPairs = 8; |bsum| <= 16 * 127).
  template <int MT>
  static inline void stored_pair_dots(const uint8_t* rec, const int16_t* const* bs,
                                      __m256i (*pd)[2]) {
    static_assert(kPairs == 8, "the 16 bsums of a super-block as 8 int32 pairs");
    for (int m = 0; m < MT; ++m) {
      int32_t v[kPairs];
      std::memcpy(v, bs[m], sizeof v);
      for (int r = 0; r < 2; ++r) pd[m][r] = pair_dot<kPairs>(rec, r, v);
    }
  }

  // A record of 16-weight sub-blocks' factors from 16 signed int8 planes (rows 0..15 each):
  // pair factors (pf_2t, pf_2t+1), t < 8, and each sub-block's scale as its madd factor.
  static inline void store_factors(uint8_t* dst, const __m128i* pf, const __m128i* sc) {
    static_assert(kPairs == 8 && kSub == 16, "16-weight sub-blocks");
    for (int r = 0; r < 2; ++r) {
      for (int t = 0; t < 8; ++t)
        store(dst + kPairsAt + 64 * t + 32 * r,
              pair16(widen_i8(pf[2 * t], r), widen_i8(pf[2 * t + 1], r)));
      for (int s = 0; s < 16; ++s)
        store(dst + kScales + 64 * s + 32 * r, dup16(widen_i8(sc[s], r)));
    }
  }

  static inline void store(uint8_t* dst, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
  // Two int32 lane vectors' low int16s as one vector of (a, b) pairs.
  static inline __m256i pair16(__m256i a, __m256i b) {
    return _mm256_blend_epi16(a, _mm256_slli_epi32(b, 16), 0xAA);
  }
};

// Q4_K / Q5_K wide: sub-block s (32 weights) = 8 chunks; pair factors t < 4: (min_2t,
// min_2t+1), against the pair (bsum of sub-block 2t, of 2t + 1), 32 weights each.
template <bool kHighBit>
struct WideQ45K : WideLayout<8, 8, kHighBit ? 4 : 8, 4> {
  using L = WideLayout<8, 8, kHighBit ? 4 : 8, 4>;
  static constexpr bool kMin = true;
  // Measured per kernel call (Q4_K 8960 x 1536 and 1536 x 8960, 2 threads): from 3 rows the
  // unpacking costs less than the 2-row packed tiles' decoding (even at 2: 0.7x-1.3x). Q4_K
  // reaches here from 9 rows only: below, Q4KRows' tiles beat both.
  static constexpr int64_t kMinRows = 3;
  // Activation rows per tile (run_wide). Q4_K: 3, whose 6 int16 sums, 6 int32 sums, the
  // chunk's 2 weight vectors and the broadcast fit AVX2's 16 ymm; at 4 rows (19) GCC spilled
  // the int32 sums at every sub-block's end, and a third of the tile's time was spent outside
  // its chunk loop (perf annotate at 512 rows). Against 4 rows, Zen 3, 2 threads: in cache
  // (benchmarks/kernel_ab.py --in-cache 30, 8960 x 1536) 0.93 / 0.90 / 0.89 / 0.83x the time
  // at 9 / 16 / 64 / 512 rows; the Qwen 1.5B Q4_K_M file's 168 Q4_K linears from DRAM
  // (--rounds 5) 0.89 / 0.86 / 0.88x at 9 / 64 / 512. Q5_K (its int16 sums in runs of 4
  // chunks) measured level at 3 (1.00-1.04x, SmolLM2's Q5_K_M), so stays at 4; so do Q6_K
  // (1.02-1.05x at 3), IQ4_XS (0.99-1.03x) and Q2_K / Q3_K (not measured).
  static constexpr int kTileRows = kHighBit ? 4 : 3;
  static constexpr int64_t kQs = kHighBit ? kq::kQ5KQs : kq::kQ4KQs;

  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    std::memcpy(dst, rec, 64);  // d, dmin: the packed record's first 64 bytes
    __m128i sc[8], mn[8];
    kq::q4k_scales(rec + (kHighBit ? kq::kQ5KScales : kq::kQ4KScales), sc, mn);
    for (int r = 0; r < 2; ++r) {
      for (int t = 0; t < 4; ++t)
        L::store(dst + L::kPairsAt + 64 * t + 32 * r,
                 L::pair16(widen_u8(mn[2 * t], r), widen_u8(mn[2 * t + 1], r)));
      for (int s = 0; s < 8; ++s)
        L::store(dst + L::kScales + 64 * s + 32 * r, dup16(widen_u8(sc[s], r)));
    }
    const __m256i nib = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
    for (int s = 0; s < 8; ++s)  // low nibbles of chunks 8c + k (s = 2c), high (s = 2c + 1)
      for (int k = 0; k < 8; ++k)
        for (int r = 0; r < 2; ++r) {
          const __m256i v = load256(rec + kQs + 64 * (8 * (s / 2) + k) + 32 * r);
          __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, nib);
          if constexpr (kHighBit)  // bit s of qh chunk k
            q = _mm256_or_si256(q, _mm256_and_si256(
                move_bit(load256(rec + kq::kQ5KQh + 64 * k + 32 * r), s, 4), b4));
          L::store(dst + L::kQuants + 64 * (8 * s + k) + 32 * r, q);
        }
  }

  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*msum)[2]) {
    L::template sums<MT>(rec, x, isum);
    for (int m = 0; m < MT; ++m) {
      int32_t v[4];  // (bsum of 2t, of 2t + 1): |bsum of 32| <= 32 * 127, an int16
      for (int t = 0; t < 4; ++t) {
        const int16_t* b = bs[m] + 4 * t;
        v[t] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(b[2] + b[3]))
                                    << 16 | static_cast<uint16_t>(b[0] + b[1]));
      }
      for (int r = 0; r < 2; ++r) msum[m][r] = L::template pair_dot<4>(rec, r, v);
    }
  }
};

// Q6_K wide: sub-block s (16 weights) = 4 chunks of q + 32; pair factors t < 8: (scale_2t,
// scale_2t+1), against the pair of bsums (2t, 2t + 1), for the - 32 * sum_s scale_s * bsum_s.
struct WideQ6K : WideLayout<16, 4, 2, 8> {
  static constexpr bool kMin = false;
  static constexpr int kTileRows = 4;  // rows per tile (WideQ45K says why Q4_K's is 3)
  // Q6_K's packed tiles at 2 and 3 rows beat the wide records' unpacking (one call from
  // DRAM, 1536 x 8960, 2 threads, Zen 3: 1.09-1.12x against 1.55-1.77x a 1-row call at 2
  // rows, 1.38-1.45x against 1.63-1.87x at 3). At 4 and 5 rows (a verify step's 1 + K) the
  // 3-row tile and the rest from cache beat them too, over every Q6_K linear of the Qwen
  // 1.5B Q4_K_M file (its 151936 x 1536 lm_head the most), 3 alternating pairs: 4 rows
  // 27.0-29.7 ms against 30.7-35.2, 5 rows 31.1-34.3 against 33.7-44.4; level at 6. (Now
  // one tile of 4 or 5 rows, which beats those: run_fmt.)
  static constexpr int64_t kMinRows = 6;

  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    std::memcpy(dst, rec + kq::kQ6KD, 32);
    std::memset(dst + 32, 0, 32);
    __m128i sc[16];
    for (int s = 0; s < 16; ++s)
      sc[s] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kq::kQ6KScales + 16 * s));
    store_factors(dst, sc, sc);
    // Sub-block s = 8h + 2c + half, chunk k: weight 128h + 32c + 4l4 + j for l4 = 4 half + k,
    // assembled as Q6K::dot does.
    for (int s = 0; s < 16; ++s) {
      const int h = s / 8, c = s % 8 / 2, half = s % 2;
      for (int k = 0; k < 4; ++k) {
        const int l4 = 4 * half + k;
        const uint8_t* ql = rec + 64 * (16 * h + 8 * (c & 1) + l4);
        const uint8_t* qh = rec + kq::kQ6KQh + 64 * (8 * h + l4);
        for (int r = 0; r < 2; ++r)
          store(dst + kQuants + 64 * (4 * s + k) + 32 * r, q6_quants(ql, qh, c, r));
      }
    }
  }

  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*)[2]) {
    sums<MT>(rec, x, isum);
    __m256i pd[MT][2];
    stored_pair_dots<MT>(rec, bs, pd);
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < 2; ++r)
        isum[m][r] = _mm256_sub_epi32(isum[m][r], _mm256_slli_epi32(pd[m][r], 5));
  }
};

// Q2_K / Q3_K wide: sub-block s (16 weights) = 4 chunks of Bits::get's quants (Q2_K q, 0..3;
// Q3_K q + 4, 0..7), summed in int16 over the whole sub-block (|sum| <= 4 * 2 * 7 * 127 =
// 7112) and madd by its scale (Q2_K 0..15, Q3_K -32..31); pair factors t < 8: Q2_K (min_2t,
// min_2t+1), the msum; Q3_K (scale_2t, scale_2t+1), for the - 4 * sum_s scale_s * bsum_s.
// Both against the bsum pairs (2t, 2t + 1) as stored. Against the 2-row packed tiles, whose
// bit decoding every 2 rows repeat, over every Q2_K / Q3_K linear of the Qwen 1.5B file
// requantized to Q2_K (2 threads, Zen 3, 2 alternating pairs): 3 rows 1.3x, 8 rows 1.8x,
// 64 rows 2.2-2.5x (Q2_K 296-298 ms against 657-750, Q3_K 173-186 against 397-467).
template <class Fmt>
struct WideQ23K : WideLayout<16, 4, 4, 8> {
  static constexpr bool kQ2 = std::is_same_v<Fmt, Q2K>;
  static constexpr bool kMin = kQ2, kJoint = kQ2;
  static constexpr int kTileRows = 4;  // rows per tile (WideQ45K says why Q4_K's is 3)
  static constexpr int64_t kMinRows = 3;

  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    std::memcpy(dst, rec + Fmt::kD, 32);
    if constexpr (kQ2) std::memcpy(dst + 32, rec + Fmt::kDmin, 32);
    else std::memset(dst + 32, 0, 32);
    __m128i sc[16], pf[16];  // scales, pair factors' values
    if constexpr (kQ2) {
      kq::q2k_scales(rec, sc, pf);
    } else {
      kq::q3k_scales(rec + kq::kQ3KScales, sc);
      for (int s = 0; s < 16; ++s) pf[s] = sc[s];
    }
    store_factors(dst, pf, sc);
    for (int s = 0; s < 16; ++s) {  // s = 8h + 2c + half, chunk k: l4 = 4 half + k
      const int h = s / 8, c = s % 8 / 2, half = s % 2;
      for (int k = 0; k < 4; ++k)
        for (int r = 0; r < 2; ++r)
          store(dst + kQuants + 64 * (4 * s + k) + 32 * r,
                Fmt::Bits::get(rec, h, c, 4 * half + k, r));
    }
  }

  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const* bs,
                         __m256i (*isum)[2], __m256i (*msum)[2]) {
    sums<MT>(rec, x, isum);
    if constexpr (kQ2) {
      stored_pair_dots<MT>(rec, bs, msum);
    } else {
      __m256i pd[MT][2];
      stored_pair_dots<MT>(rec, bs, pd);
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < 2; ++r)
          isum[m][r] = _mm256_sub_epi32(isum[m][r], _mm256_slli_epi32(pd[m][r], 2));
    }
  }
};

// IQ4_XS wide (every IQ4Lut's): each chunk's low and high nibbles' values v stored twice, as
// |v| and as v (the sign that sign(x, v) moves onto the activation), so that the inner loop is
// IQ4Lut::dot's without the lookups; each scale (sub-block s's, or k16: of the 16 weights j)
// as its madd factor.
//   | d[16], 32 unused | scales: 8 (16) x 64 | chunk-halves 8s + 2l4 + t (t: low 0, high 1):
//   |v|, v |
template <class Packed>
struct WideIQ4 {
  static constexpr int kNScales = Packed::kPer16 ? 16 : 8;
  static constexpr int64_t kScales = 64, kQuants = kScales + 64 * kNScales;
  static constexpr int64_t kRecord = kQuants + 128 * 64;
  static constexpr int64_t kD = 0, kDmin = 32;
  static constexpr bool kMin = false, kJoint = false;
  static constexpr int kDShift = Packed::kDShift;  // d copied as stored, scaled in tile()
  // Against the 2-row packed tiles, which look every nibble up again per 2 rows, over every
  // linear of the Qwen 1.5B IQ4_XS file (Zen 4, kernels avx2, benchmarks/kernel_ab.py, 5
  // rounds): 0.74x the time at 512 rows, 0.76x at 64, 0.95x at 9, level at 8 and 7, but
  // 1.09x at 6, 1.15x at 5 and 1.36x at 3 (the sign op per row and chunk costs more than a
  // lookup shared by 2 rows there). So from 9 rows, as Q4_K's.
  static constexpr int64_t kMinRows = 9;
  static constexpr int kTileRows = 4;  // rows per tile (WideQ45K says why Q4_K's is 3)

  static inline void unpack(const uint8_t* rec, uint8_t* dst) {
    std::memcpy(dst, rec, 32);  // d: the packed record's first 32 bytes
    std::memset(dst + 32, 0, 32);
    __m128i sc[16];
    if constexpr (Packed::kPer16) kq::iq4x16_scales(rec, sc);
    else kq::iq4xs_scales(rec, sc);
    for (int j = 0; j < kNScales; ++j)
      for (int r = 0; r < 2; ++r) store(dst + kScales + 64 * j + 32 * r, dup16(widen_i8(sc[j], r)));
    for (int s = 0; s < 8; ++s)
      for (int l4 = 0; l4 < 4; ++l4)
        for (int r = 0; r < 2; ++r) {
          const __m256i v = load256(rec + Packed::kQs + 64 * (4 * s + l4) + 32 * r);
          for (int t = 0; t < 2; ++t) {
            const __m256i w = Packed::values(v, t);
            uint8_t* q = dst + kQuants + 128 * (8 * s + 2 * l4 + t);
            store(q + 32 * r, _mm256_abs_epi8(w));
            store(q + 64 + 32 * r, w);
          }
        }
  }

  template <int MT>
  static inline void dot(const uint8_t* rec, const int8_t* const* x, const int16_t* const*,
                         __m256i (*isum)[2], __m256i (*)[2]) {
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      __m256i f[2][2];  // [t][r]: the low (t = 0) and high nibbles' factors
      for (int t = 0; t < 2; ++t) {
        const uint8_t* sc = rec + kScales + 64 * (Packed::kPer16 ? 2 * s + t : s);
        f[t][0] = load256(sc);
        f[t][1] = load256(sc + 32);
      }
      for (int l4 = 0; l4 < 4; ++l4)
        for (int t = 0; t < 2; ++t) {
          const uint8_t* q = rec + kQuants + 128 * (8 * s + 2 * l4 + t);
          const __m256i a[2] = {load256(q), load256(q + 32)};
          const __m256i w[2] = {load256(q + 64), load256(q + 96)};
          for (int m = 0; m < MT; ++m) {
            const __m256i xb = bcast4(x[m] + 32 * s + 16 * t + 4 * l4);
            for (int r = 0; r < 2; ++r)
              isum[m][r] = _mm256_add_epi32(
                  isum[m][r], _mm256_madd_epi16(
                                  _mm256_maddubs_epi16(a[r], _mm256_sign_epi8(xb, w[r])), f[t][r]));
          }
        }
    }
  }

  static inline void store(uint8_t* dst, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
};

template <class Fmt> struct Wide { using type = void; };
template <> struct Wide<Q2K> { using type = WideQ23K<Q2K>; };
template <> struct Wide<Q3K> { using type = WideQ23K<Q3K>; };
template <> struct Wide<Q4K> { using type = WideQ45K<false>; };
template <> struct Wide<Q5K> { using type = WideQ45K<true>; };
template <> struct Wide<Q6K> { using type = WideQ6K; };
template <const int8_t* V, int S, bool K16>
struct Wide<IQ4Lut<V, S, K16>> {
  using type = WideIQ4<IQ4Lut<V, S, K16>>;
};

#include "kquant_driver.h"  // some_rows, run, run_kquant: see there why in this namespace

// Q4_K at 2..8 rows: Q4KRows, one tile to 5 rows, two from 6. Against the wide records (then
// 8-row tiles), one call from DRAM (8960 x 1536, 2 threads, Zen 3): 1.2-1.27x at 3 to 6
// rows, 1.13x at 8, even at 12, slower at 16.
constexpr int kQ4KRowsMax = 8;

template <class Fmt>
void run_fmt(const Q8KActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads, bool) {
  using WideFmt = typename Wide<Fmt>::type;
  if constexpr (std::is_same_v<Fmt, Q4K>) {
    if (a.M >= 2 && a.M <= kQ4KRowsMax) {
      if (a.M == 6) run<Q4KRows, 4, true>(a, w, bias, out, N, nthreads);  // 3 + 3
      else run<Q4KRows, 5, true>(a, w, bias, out, N, nthreads);  // one tile to 5, 4 + 3, 4 + 4
      return;
    }
  }
  if constexpr (!std::is_void_v<WideFmt>) {
    if (a.M >= WideFmt::kMinRows) {
      // Wide records: a pass of ~1 MB of activations (as AMX's), kTileRows rows per tile
      // (Q4_K 3, the others 4). Against ~256 KB: 1.07-1.16x at K = 8960 (a 256 KB pass there
      // is 28 rows), the same at K = 1536.
      run_wide<Fmt, WideFmt, WideFmt::kTileRows>(a, w, bias, out, N, nthreads, 1 << 20);
      return;
    }
  }
  // MT = 1 at decode: one stream, the accumulators in registers. Otherwise (Q2_K, Q3_K and
  // Q5_K at 2 rows; Q6_K at 2 to 5) 2 rows share each chunk's load and split (16 ymm cannot
  // hold more rows' accumulators). Q6_K (its int16 sums 2 a row) runs 2 to 5 rows as one
  // tile, one decoding of the record for all of them: against 3-row tiles and the rest (3 +
  // 1, 3 + 2), over the Qwen 1.5B Q4_K_M file's Q6_K linears (benchmarks/kernel_ab.py, Zen 3,
  // 2 threads, 11 and 15 rounds) 0.91-0.94x the time at 4 rows, 0.96-1.01x at 5.
  if (a.M == 1) run<Fmt, 1>(a, w, bias, out, N, nthreads);
  else if constexpr (std::is_same_v<Fmt, Q6K>) run<Fmt, 5>(a, w, bias, out, N, nthreads);
  else run<Fmt, 2>(a, w, bias, out, N, nthreads);
}

// One Q8_K block of 256 values (kernels.h). The peak's sign matters (iscale = -127 / peak),
// so after the max of |x| the first element reaching it is found again by compare.
inline void q8k_block(const float* x, int8_t* q, float* d, int16_t* bsums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int j = 0; j < 256; j += 8)
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  const float amax = hmax(vmax);
  if (!(amax > 0.f)) {  // all zeros
    std::memset(q, 0, 256);
    std::memset(bsums, 0, 16 * sizeof(int16_t));
    *d = 0.f;
    return;
  }
  float peak = 0.f;
  for (int j = 0; j < 256; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(
        _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
    if (hit) {
      peak = x[j + __builtin_ctz(hit)];
      break;
    }
  }
  const float iscale = -127.f / peak;
  const __m256 iv = _mm256_set1_ps(iscale);
  const __m256i cap = _mm256_set1_epi32(127);
  for (int j = 0; j < 256; j += 32) {
    __m256i r[4];
    for (int v = 0; v < 4; ++v)
      r[v] = _mm256_min_epi32(cap, _mm256_cvtps_epi32(_mm256_round_ps(
          _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * v), iv),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    // int32 -> int8 keeping order: the packs interleave 128-bit lanes, the permute undoes it.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                         _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int half = 0; half < 2; ++half) {  // values 16 half .. 16 half + 15 of these 32
      const __m256i s = _mm256_add_epi32(r[2 * half], r[2 * half + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      bsums[j / 16 + half] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
    }
  }
  *d = 1.f / iscale;
}

}  // namespace

void quantize_acts_q8k(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d,
                       int16_t* bsums, int nthreads) {
  const int64_t nsb = K / kQK;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && M * K >= (1 << 16))
  for (int64_t i = 0; i < M * nsb; ++i) {
    const int64_t m = i / nsb, b = i % nsb;
    q8k_block(x + m * ldx + b * kQK, q + m * K + b * kQK, d + i, bsums + m * (K / 16) + 16 * b);
  }
}

void qlinear_kquant(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                    float* out, int64_t N, int nthreads) {
  run_kquant(a, w, kt, bias, out, N, nthreads);
}

}  // namespace kvs
