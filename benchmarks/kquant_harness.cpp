// The K-quant kernels' batch-1 tile, one matrix shape at a time, against a plain read of the
// same bytes by the same 2 threads in the same rounds (issue 11's bandwidth share, per call):
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -ffp-contract=off -DNDEBUG -std=c++17 \
//       -Ikvserve/ops/csrc -include functional -include cstring \
//       benchmarks/kquant_harness.cpp -o /tmp/kquant_harness
//   /tmp/kquant_harness q4k|q6k N K [copies] [rounds]
//
// copies of an N x K packed weight (random quants, sane fp16 scales) are streamed one call
// each, so every call reads DRAM. Rows: the kernel as kvserve calls it (qlinear_kquant), a
// plain OpenMP sum over the bytes, and the MT = 1 tile taken apart: whole (with and without
// its software prefetch), its integer dot alone, its loads alone. "cache": one copy 40 times.
// It compiles qlinear_kquant.cpp into itself, so a variant of the kernel file is tried by
// pointing -I at a copy of csrc/ (the prefetch distances and hints in results/quant_notes.md).
#include "qlinear_kquant.cpp"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <random>

namespace kvs { namespace {

// Variant tiles for MT = 1, Q4_K.
// mode 0: exact copy of tile<Q4K,1,PF>
// mode 1: dot only (no float steps): isum accumulated in int
// mode 2: loads only (xor of the record's 36 lines)
template <class Fmt, int kMode, bool kPF>
inline void vtile(const Q8KActs& a, const uint8_t* gw, float* out, int64_t cols, __m256i* sink) {
  const int64_t K = a.K, nsb = K / kQK;
  if constexpr (kMode == 0) {
    tile<Fmt, 1, kPF>(a, 0, gw, nullptr, out, 16, cols);
    return;
  }
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* rec = gw + i * Fmt::kRecord;
    if constexpr (kPF) prefetch_tile_record(rec, Fmt::kRecord);  // as tile<> does
    if constexpr (kMode == 1) {
      const int8_t* x[1] = {a.q + i * kQK};
      const int16_t* bs[1] = {a.bsums + i * 16};
      __m256i isum[1][2], msum[1][2];
      Fmt::template dot<1>(rec, x, bs, isum, msum);
      if constexpr (!Fmt::kMin) msum[0][0] = msum[0][1] = _mm256_setzero_si256();
      acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_add_epi32(isum[0][0], isum[0][1]),
                                                   _mm256_add_epi32(msum[0][0], msum[0][1])));
    } else {
      for (int o = 0; o + 64 <= Fmt::kRecord; o += 64)
        acc = _mm256_xor_si256(acc, _mm256_xor_si256(load256(rec + o), load256(rec + o + 32)));
    }
  }
  *sink = _mm256_xor_si256(*sink, acc);
}

}}  // namespace

using namespace kvs;
using clk = std::chrono::steady_clock;

template <class Fmt> int bench_main(int argc, char** argv, KType kt, int64_t N, int64_t K) {
  const int nthreads = 2;
  const int copies = argc > 4 ? atoi(argv[4]) : 40;
  const int rounds = argc > 5 ? atoi(argv[5]) : 7;
  const int64_t nsb = K / 256, groups = N / 16, gbytes = nsb * Fmt::kRecord;
  const int64_t wbytes = groups * gbytes;
  std::mt19937 rng(1);
  std::vector<uint8_t*> ws(copies);
  for (int c = 0; c < copies; ++c) {
    ws[c] = static_cast<uint8_t*>(aligned_alloc(64, wbytes));
    uint32_t* p = reinterpret_cast<uint32_t*>(ws[c]);
    for (int64_t j = 0; j < wbytes / 4; ++j) p[j] = rng();
    for (int64_t r = 0; r < groups * nsb; ++r) {
      uint8_t* rec = ws[c] + r * Fmt::kRecord;
      uint16_t* d = reinterpret_cast<uint16_t*>(rec + (Fmt::kD ? Fmt::kD : 0));
      for (int j = 0; j < 16; ++j) d[j] = 0x2C00 + (rng() & 0xff);
      if (Fmt::kMin) { d = reinterpret_cast<uint16_t*>(rec + Fmt::kDmin); for (int j = 0; j < 16; ++j) d[j] = 0x2C00 + (rng() & 0xff); }
    }
  }
  std::vector<int8_t> q(K);
  std::vector<float> d(nsb, 0.01f);
  std::vector<int16_t> bs(K / 16);
  for (int64_t j = 0; j < K; ++j) q[j] = int8_t(int(rng() % 255) - 127);
  for (int64_t b = 0; b < K / 16; ++b) { int s = 0; for (int j = 0; j < 16; ++j) s += q[16*b+j]; bs[b] = s; }
  Q8KActs a{q.data(), d.data(), bs.data(), 1, K};
  std::vector<float> out(N);
  __m256i sinks[64];
  for (auto& s : sinks) s = _mm256_setzero_si256();
  auto time_it = [&](auto&& fn) {
    auto t0 = clk::now();
    for (int c = 0; c < copies; ++c) fn(ws[c]);
    return std::chrono::duration<double>(clk::now() - t0).count();
  };
  auto kernel = [&](const uint8_t* w) { qlinear_kquant(a, w, kt, nullptr, out.data(), N, nthreads); };
  auto read = [&](const uint8_t* w) {
    const int64_t* p = reinterpret_cast<const int64_t*>(w);
    int64_t s = 0;
#pragma omp parallel for reduction(+:s) num_threads(nthreads)
    for (int64_t j = 0; j < wbytes / 8; ++j) s += p[j];
    if (s == 42) printf("!");
  };
  auto variant = [&](auto mode_pf) {
    return [&, mode_pf](const uint8_t* w) {
      constexpr int kMode = decltype(mode_pf)::first_type::value;
      constexpr bool kPF = decltype(mode_pf)::second_type::value;
      for_each_tile(groups, 1, nthreads, true, [&](int64_t, int64_t g) {
        vtile<Fmt, kMode, kPF>(a, w + g * gbytes, out.data() + g * 16, 16, &sinks[omp_get_thread_num() * 2]);
      });
    };
  };
  using T0 = std::integral_constant<int, 0>; using T1 = std::integral_constant<int, 1>;
  using T2 = std::integral_constant<int, 2>;
  using Y = std::true_type; using Nn = std::false_type;
  struct V { const char* name; std::function<void(const uint8_t*)> fn; };
  std::vector<V> vs = {
    {"kernel", kernel}, {"read", read},
    {"tile_pf", variant(std::pair<T0, Y>{})}, {"tile_nopf", variant(std::pair<T0, Nn>{})},
    {"dot_pf", variant(std::pair<T1, Y>{})}, {"dot_nopf", variant(std::pair<T1, Nn>{})},
    {"load_pf", variant(std::pair<T2, Y>{})}, {"load_nopf", variant(std::pair<T2, Nn>{})},
  };
  const double gb = double(wbytes) * copies / 1e9;
  std::vector<std::vector<double>> rate(vs.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t v = 0; v < vs.size(); ++v) rate[v].push_back(gb / time_it(vs[v].fn));
  // in cache: one copy many times
  std::vector<double> cache(vs.size());
  for (size_t v = 0; v < vs.size(); ++v) {
    auto t0 = clk::now();
    for (int it = 0; it < 40; ++it) vs[v].fn(ws[0]);
    cache[v] = double(wbytes) * 40 / 1e9 / std::chrono::duration<double>(clk::now() - t0).count();
  }
  printf("%.0f MB, %d rounds; GB/s median (min-max); in L3 (one %.1f MB copy x40)\n", gb * 1e3, rounds, wbytes / 1e6);
  for (size_t v = 0; v < vs.size(); ++v) {
    auto s = rate[v]; std::sort(s.begin(), s.end());
    std::vector<double> ratio;
    for (int r = 0; r < rounds; ++r) ratio.push_back(rate[v][r] / rate[1][r]);
    std::sort(ratio.begin(), ratio.end());
    printf("%-10s %6.1f (%5.1f-%5.1f)  of read %.2f   cache %6.1f\n", vs[v].name, s[rounds/2], s[0], s.back(), ratio[rounds/2], cache[v]);
  }
  return 0;
}

int main(int argc, char** argv) {
  const char* f = argc > 1 ? argv[1] : "q4k";
  int64_t N = argc > 2 ? atoll(argv[2]) : 8960, K = argc > 3 ? atoll(argv[3]) : 1536;
  if (!strcmp(f, "q6k")) return bench_main<Q6K>(argc, argv, KType::Q6_K, N, K);
  return bench_main<Q4K>(argc, argv, KType::Q4_K, N, K);
}
