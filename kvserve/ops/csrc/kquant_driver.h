// The K-quant kernels' driver, one text for both ISAs: qlinear_kquant.cpp (AVX2) and
// qlinear_kquant_avx512.cpp (VNNI) each include it INSIDE their anonymous namespace, after
// their own tile<Fmt, MT, kPrefetch>(a, m0, gw, bias, out, N, cols). So each file gets its own
// copy, compiled for its ISA and of internal linkage: the two never meet at link time.
//
// Needs, from the including file: Q8KActs, kGroup, kQK, min64 / max64 (simd.h),
// for_each_tile (tiles.h) and prefetch_ahead(rec, bytes).

// rows (1 <= rows <= MT) at m0 as one tile of exactly that many rows.
template <class Fmt, int MT>
inline void some_rows(int64_t rows, bool prefetch, const Q8KActs& a, int64_t m0,
                      const uint8_t* gw, const float* bias, float* out, int64_t N,
                      int64_t cols) {
  if (rows == MT) {
    if (prefetch) tile<Fmt, MT, true>(a, m0, gw, bias, out, N, cols);
    else tile<Fmt, MT, false>(a, m0, gw, bias, out, N, cols);
  } else if constexpr (MT > 1) {
    some_rows<Fmt, MT - 1>(rows, prefetch, a, m0, gw, bias, out, N, cols);
  }
}

// out [M, N] for a packed weight of record_bytes per super-block, split into (pass, group)
// work items: pass(p0, p1, gw, bias, out, cols) computes activation rows [p0, p1) against the
// 16-row group at gw (out and bias at its first column). A pass holds a multiple of MT rows
// whose int8 activations take about act_bytes, so that they stay in L2 while it streams.
template <int MT, class Pass>
void run_passes(const Q8KActs& a, const uint8_t* w, int64_t record_bytes, const float* bias,
                float* out, int64_t N, int nthreads, int64_t act_bytes, const Pass& pass) {
  const int64_t M = a.M, K = a.K, groups = (N + kGroup - 1) / kGroup;
  const int64_t group_bytes = K / kQK * record_bytes;
  const int64_t m_block = max64(MT, act_bytes / max64(K, 1) / MT * MT);
  // Below ~64K multiply-adds the fork/join (~2 us) costs more than it saves.
  const bool parallel = nthreads > 1 && M * N * K >= (1 << 16);
  for_each_tile(groups, (M + m_block - 1) / m_block, nthreads, parallel,
                [&](int64_t p, int64_t g) {
    const int64_t n0 = g * kGroup;
    pass(p * m_block, min64(M, (p + 1) * m_block), w + g * group_bytes,
         bias ? bias + n0 : nullptr, out + n0, min64(kGroup, N - n0));
  });
}

// A group's nsb packed records (record bytes each, from gw) unpacked by unpack(rec, dst) into
// `bytes` each, in this thread's 64-byte aligned buffer (kept for its next group): the form a
// pass of many activation rows reads instead of the packed records (AMX's tiles, the AVX2
// kernel's wide records). Each record is read once, streamed from memory (prefetched ahead).
template <class Unpack>
const uint8_t* unpack_group(const uint8_t* gw, int64_t nsb, int64_t record, int64_t bytes,
                            const Unpack& unpack) {
  thread_local std::vector<uint8_t> buf;
  if (static_cast<int64_t>(buf.size()) < nsb * bytes + 64) buf.resize(nsb * bytes + 64);
  uint8_t* ub = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  for (int64_t i = 0; i < nsb; ++i) {
    prefetch_ahead(gw + i * record, record);
    unpack(gw + i * record, ub + i * bytes);
  }
  return ub;
}

// out [M, N] for a packed weight w of format Fmt read as its wide records (WideFmt: kRecord,
// unpack, and the dot and float fields tile<> reads): a pass of ~pass_bytes of activations
// unpacks its group once (unpack_group), then MT rows per tile read it from cache.
template <class Fmt, class WideFmt, int MT>
void run_wide(const Q8KActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
              int nthreads, int64_t pass_bytes) {
  run_passes<MT>(a, w, Fmt::kRecord, bias, out, N, nthreads, pass_bytes,
                 [&](int64_t p0, int64_t p1, const uint8_t* gw, const float* bg, float* o,
                     int64_t cols) {
    const uint8_t* ub = unpack_group(gw, a.K / kQK, Fmt::kRecord, WideFmt::kRecord,
                                     WideFmt::unpack);
    for (int64_t m = p0; m < p1; m += MT)
      some_rows<WideFmt, MT>(min64(MT, p1 - m), false, a, m, ub, bg, o, N, cols);
  });
}

// out [M, N] for a packed weight w of format Fmt, MT activation rows per tile, ~256 KB of
// activations per pass. The first tile of a pass streams the group from memory (prefetch);
// the others hit cache. Every tile decodes the group's weights again, and a tile of one row
// costs nearly a decode alone; so with kJoinOne the tiles hold MT - 1 rows and a pass's lone
// last row joins its first tile (MT rows): 17 rows at MT = 5 are 5 + 4 + 4 + 4, not 4 + 4 +
// 4 + 4 + 1. Without it, tiles of MT and one of the rest: the AVX2 file's choice but for
// Q4KRows, whose K-quant linears ran 1.04-1.07x slower at 7 to 17 rows with the other loop
// beside this one, where that changed no tile there (wide records from 9 rows).
template <class Fmt, int MT, bool kJoinOne = false>
void run(const Q8KActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
         int nthreads) {
  run_passes<MT>(a, w, Fmt::kRecord, bias, out, N, nthreads, 1 << 18,
                 [&](int64_t p0, int64_t p1, const uint8_t* gw, const float* bg, float* o,
                     int64_t cols) {
    if constexpr (kJoinOne) {
      const int64_t lone = (p1 - p0) % (MT - 1) == 1 ? 1 : 0;
      for (int64_t m = p0; m < p1;) {
        const int64_t rows = min64(MT - 1 + (m == p0 ? lone : 0), p1 - m);
        some_rows<Fmt, MT>(rows, m == p0, a, m, gw, bg, o, N, cols);
        m += rows;
      }
    } else {
      for (int64_t m = p0; m < p1; m += MT)
        some_rows<Fmt, MT>(min64(MT, p1 - m), m == p0, a, m, gw, bg, o, N, cols);
    }
  });
}

// Each file's own choice of rows per tile for a format (run<Fmt, MT> above), defined there;
// amx: the AVX-512 file's AMX tiles may run (the AVX2 file has none and ignores it).
template <class Fmt>
void run_fmt(const Q8KActs& a, const uint8_t* w, const float* bias, float* out, int64_t N,
             int nthreads, bool amx);

// IQ4_XS's values, and the i-quants a file's IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S are rewritten as
// at load (IQ4_XS's layout, kvserve/quant/ggml_kquants.py): the same records and arithmetic,
// another table and factor. IQ2_XS and IQ2_S become IQ2X16 (IQ2_XXS's values), IQ1_M IQ1M16
// (IQ1_S's): a scale per 16 weights. One list for both files, each with its own IQ4Lut.
using IQ4XS = IQ4Lut<kIQ4Values, 0>;
using IQ3S4 = IQ4Lut<kIQ3SValues, 0>;
using IQ3XXS4 = IQ4Lut<kIQ3XXSValues, 2>;
using IQ2XXS4 = IQ4Lut<kIQ2XXSValues, 3>;
using IQ1S4 = IQ4Lut<kIQ1SValues, 3>;
using IQ2X16 = IQ4Lut<kIQ2XXSValues, 3, true>;
using IQ1M16 = IQ4Lut<kIQ1SValues, 3, true>;

// The named format's run_fmt. Needs, from the including file: the format structs Q2K .. Q6K
// and the template IQ4Lut<table, shift, k16>.
inline void run_kquant(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                       float* out, int64_t N, int nthreads, bool amx = false) {
  if (a.M == 0 || N == 0) return;
  switch (kt) {
    case KType::Q2_K: return run_fmt<Q2K>(a, w, bias, out, N, nthreads, amx);
    case KType::Q3_K: return run_fmt<Q3K>(a, w, bias, out, N, nthreads, amx);
    case KType::Q4_K: return run_fmt<Q4K>(a, w, bias, out, N, nthreads, amx);
    case KType::Q5_K: return run_fmt<Q5K>(a, w, bias, out, N, nthreads, amx);
    case KType::Q6_K: return run_fmt<Q6K>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ4_XS: return run_fmt<IQ4XS>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ3_S4: return run_fmt<IQ3S4>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ3_XXS4: return run_fmt<IQ3XXS4>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ2_XXS4: return run_fmt<IQ2XXS4>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ1_S4: return run_fmt<IQ1S4>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ2_X16: return run_fmt<IQ2X16>(a, w, bias, out, N, nthreads, amx);
    case KType::IQ1_M16: return run_fmt<IQ1M16>(a, w, bias, out, N, nthreads, amx);
  }
}
