// Varlen causal attention over the paged KV cache, the whole batch in one call.
//
// Request b owns queries [qsl[b], qsl[b+1]); they are the last q_len of its seq_len tokens,
// so query i (0-based) sits at position p_i = seq_len - q_len + i and sees keys [0, p_i]:
//
//   keys     |0 ........................................ seq_len-1|
//   queries                            |p_0 ............ p_{q_len-1}|
//   chunk c                                  |q0 .. q0+qn-1|         (kQueryTile queries)
//   keys read for chunk c: [0, p_{q0+qn-1}]  in tiles of kKeyTile, each masked per row
//
// Work item = (request, query chunk, kv heads [g0, g0+ng)). Its rows are qn queries x the
// ng*G query heads on those kv heads (GQA: head h uses kv head h / G), so every K/V vector
// is fetched from memory once per item and reused from L1 by all its rows; a decode (qn = 1)
// still has G rows per kv head. ng = Hkv when there are enough (request, chunk) units to
// feed every thread (whole contiguous K/V rows stream best), else 1 (more, smaller items).
// Items run under OpenMP dynamic scheduling, largest first, since causal chunks differ in
// cost.
//
// K/V rows are prefetched along the item's block table, a fixed lead ahead of the keys being
// read (KvStream): blocks are scattered, so no hardware prefetcher follows them.
//
// Per row the softmax is online (flash-attention): running max m, running sum l, and an
// unnormalized accumulator acc[D]; a key tile with new max m' rescales l and acc by
// exp(m - m'). Everything is fp32. The K/V cache holds float or IEEE half (torch.float16)
// elements; a half is widened to float exactly as it is loaded, so an fp16 cache runs this
// very arithmetic on its values: same output bits as an fp32 cache holding the same values.
// A quantized cache (int8, or fp8 e4m3fn bits) is read as stored:
// each element is widened exactly and multiplied by its row's scale as it is loaded, one
// fp32 rounding, the value kvserve/ops/reference.py dequantize_kv gives it; so it too gives
// an fp32 cache's output on those values bit for bit, and no float copy of it is made.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace kvs {
namespace {

constexpr int64_t kQueryTile = 16;  // queries per item: K/V reuse vs items to balance
constexpr int64_t kKeyTile = 32;    // keys per softmax update; a multiple of 8
// Keys per softmax segment. Every row runs its online softmax separately over keys
// [0, 256), [256, 512), ... and merges the segments at the end (combine()), whatever the
// batch: a segment is the unit a decode row is split by across threads, and a row's
// arithmetic depends on its own context length only, so outputs stay batch invariant.
constexpr int64_t kSegment = 256;  // a multiple of kKeyTile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Queries [q0, q0+qn) of request b against kv heads [g0, g0+ng).
// Keys [k_lo, k_hi) only (a split decode item, see paged_attention; k_lo a multiple of
// kSegment), its unnormalized segments (m, l, acc) going to `partial` instead of the output.
struct Item {
  int64_t b, q0, qn, g0, ng, cost;
  int64_t k_lo = 0, k_hi = INT64_MAX;
  float* partial = nullptr;
};

// K/V elements T: float, uint16_t bits of an IEEE half, int8_t, or uint8_t bits of an fp8
// e4m3fn. load8 reads 8 of them as floats, to_float one; both are exact (before the scale).
#if KVS_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_to_float(p[i]);
  return _mm256_load_ps(f);
#endif
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// e4m3fn bits in arithmetic, not through the table (a gather of 8 lookups made an fp8 cache's
// attention ~5x an int8 one's on Zen 3, its model prefill ~2x): the 7 magnitude bits shifted to a float's exponent and
// mantissa (bit 20 on) and rebiased by 127 - 7 give the normals (exponent 1..15) exactly;
// exponent 0 is subnormal, m * 2^-9 (an exact conversion times a power of two); 0x7f is NaN;
// the sign bit goes to bit 31. The table's bits for every code (tests/unit/test_kv_quant.py).
inline __m256 load8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32((127 - 7) << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  __m256 x = _mm256_blendv_ps(
      normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  x = _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(x, _mm256_castsi256_ps(sign));
}
#endif
inline float to_float(float x) { return x; }
inline float to_float(uint16_t h) { return half_to_float(h); }
inline float to_float(int8_t q) { return static_cast<float>(q); }
inline float to_float(uint8_t b) { return fp8_e4m3_table()[b]; }
// Quantized element types carry a scale per K / V row (per key and kv head).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t>;

// Bytes of K and V an item keeps asked for ahead of the keys it is reading. Blocks sit
// anywhere in the cache, so the hardware prefetcher cannot follow an item from one block to
// the next; what software does not ask for ahead, a decode waits for at DRAM latency. The
// lead is topped up a little at a time as the item reads keys (KvStream::consumed), so misses
// stay outstanding while it computes. (Asking for the whole next tile at each tile start, as
// this kernel did, stalls the core while the miss queue is full, and then DRAM idles while
// the tile computes.) On the 2-core EPYC with the cache in DRAM, 32 KB ran decodes 1.25-2.3x
// faster than that (batch 8 x 300 keys: 1.4x fp32, 2x fp16); 8-16 KB gained less, 64 KB and
// more ran slower again.
constexpr int64_t kPrefetchLead = 32 << 10;

// Software prefetch along one item's keys [begin, end), in the order it reads them. prime()
// asks for the first lead; after that, one line of K and one of V per 128 bytes the item
// reports read, so the lead stays what was primed. Never past `limit` (set_limit: the end of
// the tile after the one being read): a prefill item reads every tile for many rows, reports
// far more than it streams, and so asks for the next tile as a whole, as before.
//
//   keys    |begin ........ t0 ........ t0+n ........ t0+n+kKeyTile| ........ end|
//   read                    [this tile ]
//   asked for                 [ ...... lead ...... )      limit ---^
//
// A run is the contiguous memory of the next keys: with all kv heads (len == row) keys up
// to their block's end, one block_size * Hkv * D run at most; else one key's ng * D elements.
template <typename T>
class KvStream {
 public:
  KvStream(const AttentionArgs& a, const int32_t* bt, int64_t g0, int64_t ng, int64_t begin,
           int64_t end)
      : k_(static_cast<const char*>(a.k_cache)), v_(static_cast<const char*>(a.v_cache)),
        entry_(bt + begin / a.block_size), bs_(a.block_size), row_(a.Hkv * a.D),
        head0_(g0 * a.D), len_(ng * a.D), key_(begin), in_blk_(begin % a.block_size),
        limit_(begin), end_(end) {}

  void set_limit(int64_t key) {
    limit_ = std::min(key, end_);
    idle_ = left_ == 0 && key_ >= limit_;
  }
  void prime(int64_t bytes) {
    idle_ = false;
    credit_ += bytes;
    issue();
  }
  // The item has read `bytes` more of K or V: ask for as many more ahead.
  void consumed(int64_t bytes) {
    if (idle_) return;  // at the limit, as a prefill item mostly is: kept to one branch
    credit_ += bytes;
    if (credit_ >= 128) issue();
  }

 private:
  void issue() {
    for (; credit_ >= 128; credit_ -= 128) {
      if (left_ == 0 && !next_run()) {
        credit_ = 0;
        idle_ = true;
        return;
      }
#if KVS_AVX2
      _mm_prefetch(kp_, _MM_HINT_T0);
      _mm_prefetch(vp_, _MM_HINT_T0);
#endif
      kp_ += 64;
      vp_ += 64;
      --left_;
    }
  }
  static const char* line_of(const char* p) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  }
  // Starts the run at key_, up to limit_; false at limit_. The block table is read lazily,
  // never past the entry of the last key below limit_ <= end.
  bool next_run() {
    if (key_ >= limit_) return false;
    if (in_blk_ == bs_) {
      in_blk_ = 0;
      ++entry_;
    }
    const int64_t n = len_ == row_ ? std::min(limit_ - key_, bs_ - in_blk_) : 1;
    const int64_t off = (int64_t{*entry_} * bs_ + in_blk_) * row_ + head0_;  // elements
    const int64_t bytes = (len_ == row_ ? n * row_ : len_) * static_cast<int64_t>(sizeof(T));
    const char* k = k_ + off * static_cast<int64_t>(sizeof(T));
    const char* v = v_ + off * static_cast<int64_t>(sizeof(T));
    kp_ = line_of(k);
    vp_ = line_of(v);
    left_ = (std::max(k + bytes - kp_, v + bytes - vp_) + 63) / 64;  // lines of K (and V)
    key_ += n;
    in_blk_ += n;
    return true;
  }

  const char* k_;
  const char* v_;
  const int32_t* entry_;  // block table entry of key_ (in_blk_ == bs_: of key_ - 1)
  int64_t bs_, row_, head0_, len_;
  int64_t key_, in_blk_, limit_, end_;  // keys [begin, key_) are asked for
  int64_t credit_ = 0, left_ = 0;       // left_ lines of the current run remain
  const char* kp_ = nullptr;
  const char* vp_ = nullptr;
  bool idle_ = true;
};

// R query rows (q, q + D, ...) that share one kv head go through a key tile together: each
// K and V vector is loaded once for all R rows instead of once per row, which is what bounds
// a decode row (GQA gives every kv head G = H / Hkv rows). s holds a row of kScoreStride
// scores per query row; kp[] is padded with valid pointers up to round8(n). The item's
// KvStream hears of each 4 keys read where no accumulator is live (a call there spills none).
constexpr int64_t kScoreStride = kKeyTile + 8;

// ks[j]: key j's scale (quantized T only; padded as kp).
template <int R, typename T>
inline void scores_rows(const float* q, const T* const* kp, const float* ks, int64_t n,
                        int64_t D, float* s, KvStream<T>& pf) {
#if KVS_AVX2
  for (int64_t j0 = 0; j0 < n; j0 += 4) {  // kp[] is padded with valid pointers to round8(n)
    pf.consumed(4 * D * static_cast<int64_t>(sizeof(T)));
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    [[maybe_unused]] __m256 ksv[4];
    if constexpr (kScaled<T>)
      for (int c = 0; c < 4; ++c) ksv[c] = _mm256_set1_ps(ks[j0 + c]);
    for (int64_t d = 0; d < D; d += 8) {
      __m256 kv[4];
      for (int c = 0; c < 4; ++c) {
        kv[c] = load8(kp[j0 + c] + d);
        if constexpr (kScaled<T>) kv[c] = _mm256_mul_ps(kv[c], ksv[c]);  // = dequantize_kv
      }
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + d);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s + r * kScoreStride + j0, reduce4(acc[r][0], acc[r][1], acc[r][2],
                                                       acc[r][3]));
  }
#else
  (void)pf;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float x = 0.f;  // dot_scalar's order, on the widened (and scaled) keys
      for (int64_t d = 0; d < D; ++d) {
        float k = to_float(kp[j][d]);
        if constexpr (kScaled<T>) k *= ks[j];
        x += q[r * D + d] * k;
      }
      s[r * kScoreStride + j] = x;
    }
#endif
}

// acc rows [R][D] (stride D): acc[r] = acc[r] * corr[r] + sum_j p[r][j] * v_j, NV vectors of
// dims at a time, each V vector loaded once for the R rows.
// vs[j]: value j's scale (quantized T only).
template <int R, int NV, typename T>
inline void pv_rows(float* acc, int64_t D, const float* corr, const float* p,
                    const T* const* vp, const float* vs, int64_t n, int64_t d0) {
#if KVS_AVX2
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m256 c = _mm256_set1_ps(corr[r]);
    for (int v = 0; v < NV; ++v)
      a[r][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + v * 8), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = vp[j] + d0;
    [[maybe_unused]] __m256 vsc;
    if constexpr (kScaled<T>) vsc = _mm256_set1_ps(vs[j]);
    for (int v = 0; v < NV; ++v) {
      __m256 vv = load8(vj + v * 8);
      if constexpr (kScaled<T>) vv = _mm256_mul_ps(vv, vsc);  // = dequantize_kv
      for (int r = 0; r < R; ++r)
        a[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * kScoreStride + j]), vv, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + r * D + d0 + v * 8, a[r][v]);
#else
  for (int r = 0; r < R; ++r)
    for (int64_t d = d0; d < d0 + NV * 8; ++d) {
      float x = acc[r * D + d] * corr[r];
      for (int64_t j = 0; j < n; ++j) {
        float v = to_float(vp[j][d]);
        if constexpr (kScaled<T>) v *= vs[j];
        x += p[r * kScoreStride + j] * v;
      }
      acc[r * D + d] = x;
    }
#endif
}

// One row's online-softmax step over a tile: s[0:n] -> exp(s - m_new) in place (lanes
// n..round8(n) are scratch), l and m updated; returns corr = exp(m - m_new), by which the
// row's accumulator is rescaled. Keys start at position 0, which every row sees, so the max
// is finite; m = -inf on the first tile gives corr = 0.
inline float softmax_tile(float& m, float& l, float* s, int64_t n) {
  const int64_t n8 = (n + 7) & ~int64_t{7};
  for (int64_t j = n; j < n8; ++j) s[j] = kNegInf;
  float mx = kNegInf;
#if KVS_AVX2
  __m256 vmx = _mm256_set1_ps(kNegInf);
  for (int64_t j = 0; j < n8; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + j));
  mx = hmax(vmx);
#else
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
#endif
  const float m_new = std::max(m, mx);
  const float corr = std::exp(m - m_new);
  float sum = 0.f;
#if KVS_AVX2
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 p = kvs::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  sum = hsum(vsum);
#else
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m_new);
    sum += s[j];
  }
#endif
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// pf hears of the V each pv_rows pass reads before it starts: inside, the accumulators are
// live in registers, which a call to the stream would spill.
template <int R, typename T>
inline void update_rows(float* m, float* l, float* acc, const float* q, const T* const* kp,
                        const float* ks, const T* const* vp, const float* vs, int64_t n,
                        int64_t D, float* s, KvStream<T>& pf) {
  scores_rows<R>(q, kp, ks, n, D, s, pf);
  float corr[R];
  for (int r = 0; r < R; ++r) corr[r] = softmax_tile(m[r], l[r], s + r * kScoreStride, n);
  constexpr int NV = R <= 3 ? 4 : 2;  // R * NV accumulators + R broadcasts + 1 V in 16 ymm
  constexpr int64_t kElem = sizeof(T);
  int64_t d0 = 0;
  for (; d0 + NV * 8 <= D; d0 += NV * 8) {
    pf.consumed(n * NV * 8 * kElem);
    pv_rows<R, NV>(acc, D, corr, s, vp, vs, n, d0);
  }
  for (; d0 < D; d0 += 8) {
    pf.consumed(n * 8 * kElem);
    pv_rows<R, 1>(acc, D, corr, s, vp, vs, n, d0);
  }
}

// Row offsets (in elements) of kv head g for keys [begin, begin + n) of one request, walking
// the block table without a division per key; and each key's flat slot (its scale of kv
// head g sits at slot * Hkv + g).
inline void key_offsets(const AttentionArgs& a, const int32_t* bt, int64_t g, int64_t begin,
                        int64_t n, int64_t* off, int64_t* slot) {
  const int64_t bs = a.block_size, row = a.Hkv * a.D;
  const int32_t* entry = bt + begin / bs;
  int64_t in_blk = begin % bs;
  int64_t blk0 = int64_t{*entry} * bs;
  for (int64_t j = 0; j < n; ++j) {
    if (in_blk == bs) {  // advance lazily: never read the table past the last key's block
      in_blk = 0;
      blk0 = int64_t{*++entry} * bs;
    }
    slot[j] = blk0 + in_blk++;
    off[j] = slot[j] * row + g * a.D;
  }
}

// One row's segments, each (m, l, acc[D]) over its own keys, merged as flash-decoding does:
// rescale each by exp(m_p - max m), in segment order. A segment the row sees no key of
// (m = -inf, l = 0, acc = 0) adds exact zeros; a single segment gives acc / l exactly.
void combine(const float* parts, int64_t n_parts, int64_t stride, int64_t D, float* out) {
  float mx = kNegInf;
  for (int64_t p = 0; p < n_parts; ++p) mx = std::max(mx, parts[p * stride]);
  float l = 0.f;
  std::fill(out, out + D, 0.f);
  for (int64_t p = 0; p < n_parts; ++p) {
    const float* part = parts + p * stride;
    const float w = std::exp(part[0] - mx);
    l += part[1] * w;
    for (int64_t d = 0; d < D; ++d) out[d] += part[2 + d] * w;
  }
  const float inv = 1.f / l;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

template <typename T>
void attend(const AttentionArgs& a, const Item& it, std::vector<float>& scratch) {
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int64_t G = a.H / a.Hkv, D = a.D;
  const int64_t HG = it.ng * G;  // query heads of the item
  const int64_t seq_len = a.seq_lens[it.b];
  const int64_t q_begin = a.query_start_loc[it.b];
  const int64_t q_len = a.query_start_loc[it.b + 1] - q_begin;
  const int64_t pos0 = seq_len - q_len + it.q0;  // position of the item's first query
  const int64_t kv_end = std::min(pos0 + it.qn, it.k_hi);  // keys [k_lo, kv_end) are read
  // Row r = query r / HG, head g0*G + r % HG, whose kv head is g0 + (r % HG) / G.
  const int64_t R = it.qn * HG;
  const int32_t* bt = a.block_tables + it.b * a.bt_stride;
  auto out_row = [&](int64_t r) { return (q_begin + it.q0 + r / HG) * a.H + it.g0 * G + r % HG; };

  const int64_t n_seg = (kv_end - it.k_lo + kSegment - 1) / kSegment;
  const int64_t seg_floats = R * (D + 2);  // segment si of row r at segs + si*seg_floats + r*(D+2)
  scratch.resize(R * D * 2 + R * 2 + 4 * kScoreStride + n_seg * seg_floats);
  float* qs = scratch.data();  // scaled queries, so scores need no extra multiply
  float* acc = qs + R * D;
  float* m = acc + R * D;
  float* l = m + R;
  float* s = l + R;
  float* segs = s + 4 * kScoreStride;
  // Ends a segment: its rows' (m, l, acc) to slot si, and the rows start afresh.
  auto flush = [&](int64_t si) {
    for (int64_t r = 0; r < R; ++r) {
      float* p = segs + si * seg_floats + r * (D + 2);
      p[0] = m[r];
      p[1] = l[r];
      std::copy(acc + r * D, acc + (r + 1) * D, p + 2);
      std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
      m[r] = kNegInf;
      l[r] = 0.f;
    }
  };
  for (int64_t r = 0; r < R; ++r) {
    const float* src = a.q + (q_begin + it.q0 + r / HG) * a.q_st + (it.g0 * G + r % HG) * a.q_sh;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * a.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    m[r] = kNegInf;
    l[r] = 0.f;
  }

  KvStream<T> pf(a, bt, it.g0, it.ng, it.k_lo, kv_end);
  pf.set_limit(it.k_lo + 2 * kKeyTile);
  pf.prime(kPrefetchLead);
  int64_t off[kKeyTile], slot[kKeyTile];  // of kv head g0, for the tile's keys
  const T* kp[kKeyTile];
  const T* vp[kKeyTile];
  float ks[kKeyTile], vs[kKeyTile];  // their scales (quantized T)
  for (int64_t t0 = it.k_lo; t0 < kv_end; t0 += kKeyTile) {
    if (t0 > it.k_lo && t0 % kSegment == 0) flush((t0 - it.k_lo) / kSegment - 1);
    const int64_t n = std::min(kKeyTile, kv_end - t0);
    key_offsets(a, bt, it.g0, t0, n, off, slot);
    pf.set_limit(t0 + n + kKeyTile);
    for (int64_t gl = 0; gl < it.ng; ++gl) {
      for (int64_t j = 0; j < n; ++j) {
        kp[j] = k_cache + off[j] + gl * D;
        vp[j] = v_cache + off[j] + gl * D;
      }
      if constexpr (kScaled<T>)
        for (int64_t j = 0; j < n; ++j) {
          ks[j] = a.k_scales[slot[j] * a.Hkv + it.g0 + gl];
          vs[j] = a.v_scales[slot[j] * a.Hkv + it.g0 + gl];
        }
      for (int64_t j = n; j < ((n + 7) & ~int64_t{7}); ++j) {
        kp[j] = kp[0];
        if constexpr (kScaled<T>) ks[j] = ks[0];
      }
      // Query i sees keys up to its own position pos0 + i: tile lanes [0, nv). Queries
      // before t0 - pos0 see none of this tile (it lies in their future). Its G rows on this
      // kv head go through the tile together, up to 4 at a time.
      for (int64_t i = std::max<int64_t>(0, t0 - pos0); i < it.qn; ++i) {
        const int64_t nv = std::min(n, pos0 + i + 1 - t0);
        const int64_t r_end = i * HG + (gl + 1) * G;
        for (int64_t r = i * HG + gl * G; r < r_end;) {
          const int64_t rn = std::min<int64_t>(4, r_end - r);
          const float* qr = qs + r * D;
          float* mr = m + r;
          float* lr = l + r;
          float* ar = acc + r * D;
          if (rn == 4) update_rows<4>(mr, lr, ar, qr, kp, ks, vp, vs, nv, D, s, pf);
          else if (rn == 3) update_rows<3>(mr, lr, ar, qr, kp, ks, vp, vs, nv, D, s, pf);
          else if (rn == 2) update_rows<2>(mr, lr, ar, qr, kp, ks, vp, vs, nv, D, s, pf);
          else update_rows<1>(mr, lr, ar, qr, kp, ks, vp, vs, nv, D, s, pf);
          r += rn;
        }
      }
    }
  }

  flush(n_seg - 1);
  if (it.partial) {  // a split item: the rows' segments are merged after the loop
    std::copy(segs, segs + n_seg * seg_floats, it.partial);
    return;
  }
  for (int64_t r = 0; r < R; ++r)
    combine(segs + r * (D + 2), n_seg, seg_floats, D, a.out + out_row(r) * D);
}

}  // namespace

void paged_attention(const AttentionArgs& a, int nthreads) {
  // Work units are (request, query chunk). With enough of them per thread, an item takes all
  // kv heads: a token's K (and V) rows for every head are one contiguous Hkv*D run, and a
  // block one contiguous block_size*Hkv*D run, which DRAM streams best. With few units (a
  // small decode batch) items split by kv head instead, so every thread has work.
  // A small decode batch with long rows is the exception: the key split below (whole
  // 256-key segments) already gives every thread work, so its items keep all kv heads and
  // stream contiguous blocks too (batch 1 at 600 keys: the step's attention ~0.6 -> ~0.3 ms).
  // The rows' arithmetic does not depend on ng.
  int64_t units = 0, segs = 0;
  bool decode = true;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    units += (q_len + kQueryTile - 1) / kQueryTile;
    segs += (a.seq_lens[b] + kSegment - 1) / kSegment;
    decode &= q_len == 1;
  }
  const int64_t ng = units >= 2 * nthreads || (decode && segs > nthreads) ? a.Hkv : 1;
  std::vector<Item> items;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    const int64_t seq_len = a.seq_lens[b];
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryTile) {
      const int64_t qn = std::min(kQueryTile, q_len - q0);
      const int64_t cost = qn * (seq_len - q_len + q0 + qn) * ng;  // rows x keys per head
      for (int64_t g0 = 0; g0 < a.Hkv; g0 += ng) items.push_back({b, q0, qn, g0, ng, cost});
    }
  }
  // Fewer items than ~4 per thread (a small decode batch) leave threads idle or waiting on
  // one long context: single-query items are split along their keys at segment boundaries
  // (flash-decoding). Each part writes its rows' segments to `partials`, and the rows are
  // merged after the loop, exactly as an unsplit item merges its segments itself.
  struct Split {
    int64_t rows, base, n_seg;  // segment si of row r at base + (si * rows + r) * (D + 2)
    int64_t out_row0;           // output row of row 0 (the rows are contiguous heads)
  };
  std::vector<Split> splits;
  std::vector<float> partials;
  const int64_t target = 4 * nthreads, G = a.H / a.Hkv, row_floats = a.D + 2;
  if (nthreads > 1 && !items.empty() && static_cast<int64_t>(items.size()) < target) {
    const int64_t per = (target + static_cast<int64_t>(items.size()) - 1) /
                        static_cast<int64_t>(items.size());
    std::vector<Item> kept;
    std::vector<std::pair<Item, int64_t>> parts;  // (part, index of its split)
    int64_t floats = 0;
    for (const Item& it : items) {
      const int64_t q_len = a.query_start_loc[it.b + 1] - a.query_start_loc[it.b];
      const int64_t keys = a.seq_lens[it.b] - q_len + it.q0 + 1;  // the one query sees these
      const int64_t n_seg = (keys + kSegment - 1) / kSegment;
      const int64_t n_parts = it.qn == 1 ? std::min(per, n_seg) : 1;
      if (n_parts < 2) {
        kept.push_back(it);
        continue;
      }
      const int64_t chunk = (n_seg + n_parts - 1) / n_parts * kSegment;
      const int64_t rows = it.ng * G;
      splits.push_back({rows, floats, n_seg,
                        (a.query_start_loc[it.b] + it.q0) * a.H + it.g0 * G});
      for (int64_t k_lo = 0; k_lo < keys; k_lo += chunk) {
        Item part = it;
        part.k_lo = k_lo;
        part.k_hi = std::min(keys, k_lo + chunk);
        part.cost = it.ng * (part.k_hi - part.k_lo);
        parts.push_back({part, static_cast<int64_t>(splits.size()) - 1});
      }
      floats += n_seg * rows * row_floats;
    }
    partials.resize(floats);
    for (auto& [part, si] : parts) {
      const Split& sp = splits[si];
      part.partial = partials.data() + sp.base + part.k_lo / kSegment * sp.rows * row_floats;
      kept.push_back(part);
    }
    items.swap(kept);
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  // (split index, row) pairs to combine, one per output row of a split item.
  std::vector<std::pair<int64_t, int64_t>> merges;
  for (int64_t si = 0; si < static_cast<int64_t>(splits.size()); ++si)
    for (int64_t r = 0; r < splits[si].rows; ++r) merges.push_back({si, r});
  const int64_t n_merges = static_cast<int64_t>(merges.size());
  const int64_t total_cost = [&] {
    int64_t c = 0;
    for (const Item& it : items) c += it.cost;
    return c;
  }();
  // A tiny batch (a few hundred key rows) is cheaper than waking the other threads.
  const bool parallel = nthreads > 1 && n_items > 1 && total_cost * a.D >= (1 << 14);
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      switch (a.kv_type) {
        case KVType::F16: attend<uint16_t>(a, items[i], scratch); break;
        case KVType::I8: attend<int8_t>(a, items[i], scratch); break;
        case KVType::FP8_E4M3: attend<uint8_t>(a, items[i], scratch); break;
        default: attend<float>(a, items[i], scratch);
      }
    }
    // (the loop's barrier: every part is written before any merge reads it)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_merges; ++i) {
      const Split& sp = splits[merges[i].first];
      const int64_t r = merges[i].second;
      combine(partials.data() + sp.base + r * row_floats, sp.n_seg, sp.rows * row_floats, a.D,
              a.out + (sp.out_row0 + r) * a.D);
    }
  }
}

}  // namespace kvs
