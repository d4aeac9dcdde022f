// How the weight-streaming kernels (linear, qlinear) share a weight among threads.
//
// Each thread owns one contiguous slab of the weight's tiles and streams it front to back, so
// its prefetches run along one run of rows. A static split alone leaves the faster thread
// waiting at the join whenever the cores stream at different speeds (another tenant on a
// shared machine, a core that started late): on the 2-core EPYC, OpenMP's join wait was ~8%
// of all samples in a batch-1 float32 decode. So a thread whose slab is done takes tiles from
// the back of the slab with the most left, until none is left anywhere. Which thread computes
// a tile never changes its bits: every kernel gives each output the same arithmetic whatever
// tile or thread computes it.
//
// Header-only and free of any ISA-specific code, so the AVX-512 sources may include it
// before their target pragma (see linear_avx512.cpp).
#pragma once

#include <omp.h>

#include <cstdint>

namespace kvs {

// Work items are (pass, tile): `passes` runs over the tiles (blocks of activation rows, each
// streaming the weight once). Slab s holds tiles [tiles * s / n, tiles * (s + 1) / n) of every
// pass, pass-major, and hands them out front first (its owner) or back first (a thief).
class TileSplit {
 public:
  static constexpr int kMaxSlabs = 64;  // more threads than this only steal

  TileSplit(int64_t tiles, int64_t passes, int nslabs) : tiles_(tiles) {
    n_ = nslabs < 1 ? 1 : nslabs > kMaxSlabs ? kMaxSlabs : nslabs;
    for (int s = 0; s < n_; ++s) {
      const int64_t len = tiles * (s + 1) / n_ - tiles * s / n_;
      slabs_[s].range = len * passes;  // front 0 (high half), back len * passes (low half)
    }
  }

  // The next item for thread tid: false when none is left.
  bool next(int tid, int64_t* pass, int64_t* tile) {
    if (tid < n_ && take(tid, true, pass, tile)) return true;
    for (;;) {  // steal from the back of the slab with the most left
      int best = -1;
      int64_t most = 0;
      for (int s = 0; s < n_; ++s) {
        const int64_t left = size(__atomic_load_n(&slabs_[s].range, __ATOMIC_RELAXED));
        if (left > most) most = left, best = s;
      }
      if (best < 0) return false;
      if (take(best, false, pass, tile)) return true;
    }
  }

 private:
  struct alignas(64) Slab {
    int64_t range;  // front << 32 | back: items [front, back) are left
  };
  static int64_t size(int64_t r) { return (r & 0xffffffff) - (r >> 32); }

  bool take(int s, bool front, int64_t* pass, int64_t* tile) {
    int64_t r = __atomic_load_n(&slabs_[s].range, __ATOMIC_RELAXED);
    for (;;) {
      const int64_t f = r >> 32, b = r & 0xffffffff;
      if (f >= b) return false;
      const int64_t item = front ? f : b - 1;
      const int64_t want = front ? ((f + 1) << 32) | b : (f << 32) | (b - 1);
      if (__atomic_compare_exchange_n(&slabs_[s].range, &r, want, true, __ATOMIC_ACQ_REL,
                                      __ATOMIC_RELAXED)) {
        const int64_t t0 = tiles_ * s / n_, len = tiles_ * (s + 1) / n_ - t0;
        *pass = item / len;
        *tile = t0 + item % len;
        return true;
      }
    }
  }

  int64_t tiles_;
  int n_;
  Slab slabs_[kMaxSlabs];
};

// fn(pass, tile) once for every pass < passes and tile < tiles, on nthreads threads (one when
// !parallel), split as TileSplit says.
template <class F>
void for_each_tile(int64_t tiles, int64_t passes, int nthreads, bool parallel, const F& fn) {
  if (tiles <= 0 || passes <= 0) return;
  TileSplit split(tiles, passes, parallel ? nthreads : 1);
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
    const int tid = omp_get_thread_num();
    int64_t pass, tile;
    while (split.next(tid, &pass, &tile)) fn(pass, tile);
  }
}

}  // namespace kvs
