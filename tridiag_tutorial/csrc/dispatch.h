// Which kernel solves which systems, on which threads. Part of tridiag.cpp's translation unit (see
// lanes.h).
//
// Entry point: solve_dtype(dtype, L, D, U, B, X, nsys, n, k, first, pieces_min_n, fallbacks)
// solves nsys systems of n unknowns with k right-hand sides, x = A^{-1} b, for the dtype of the
// tensors (float32, float64, complex64, complex128): L, D, U, B the contiguous bands and
// right-hand sides, X the contiguous output (complex: interleaved parts, read as reals), through
// solve_all<R, Complex>. It returns nothing: X holds every system's x, `first` the smallest
// system * n + pivot over the systems that ?gtsv reports singular (left as it was where none is),
// and `fallbacks` grows by the number of systems the pieces kernel handed back. Every system is
// solved: one the pieces kernel hands back is solved again with ?gtsv's operations.
//
// Blocks of W systems (batched.h) go to torch's threads in one parallel region
// (torch::stable::parallel_for), claimed in chunks from a shared counter and with a thread budget
// that leaves the pool while its threads stall (claim_chunks, threads.h); the last block is padded
// with identity systems. Fewer than W systems use the same code with W = 1, each system solved in
// place in the output, up to kPiecesMinN unknowns; from there on a real system goes to the pieces
// kernel (pieces.h), which cuts it into pieces, eliminates them side by side and joins them
// through a small reduced system: its rounding differs from ?gtsv's, and wherever it cannot vouch
// for its answer it hands the system back to the W = 1 elimination (cpp_solve_ex takes that size
// as an argument: pieces_min_n).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/headeronly/core/ScalarType.h>

#include "batched.h"
#include "lanes.h"
#include "pieces.h"
#include "threads.h"

namespace {

void record_singular(std::atomic<int64_t>& first, int64_t code) {
  int64_t seen = first.load();
  while (code < seen && !first.compare_exchange_weak(seen, code)) {
  }
}

// Solve nsys systems of size n with k right-hand sides. L, D, U, Bm, X are the contiguous
// inputs and output as reals (complex: interleaved parts). first: min over singular systems of
// system * n + pivot.
template <typename R, bool Complex>
void solve_all(const R* L, const R* D, const R* U, const R* Bm, R* X, int64_t nsys, int64_t n,
               int64_t k, std::atomic<int64_t>& first, int64_t pieces_min_n,
               int64_t& fallbacks) {
  constexpr int C = Complex ? 2 : 1;
  constexpr int W = kLanes<R>;
  const int64_t band = (n - 1) * C, dsize = n * C, bsize = n * k * C;
  const int64_t work = std::max<int64_t>(1, n * (k + 3));  // per system, roughly
  std::vector<int64_t> sequential;  // the systems that the elimination below solves
  bool pieces = false;
  if constexpr (!Complex) {
    pieces = nsys < W && n >= pieces_min_n && k >= 1;
    if (pieces) {
      // A few large systems, each on the pieces kernel by one thread (a system is enough work
      // for one); a system it hands back is solved below, sequentially.
      std::vector<char> handed_back(nsys, 0);
      claim_chunks(nsys, 1, [&](NextIndex& next) {
        for (int64_t s; next(s);) {
          handed_back[s] = solve_pieces<R>(L + s * band, D + s * dsize, U + s * band,
                                           Bm + s * bsize, X + s * bsize, n, k) != 0;
        }
      });
      for (int64_t s = 0; s < nsys; ++s) {
        if (handed_back[s]) sequential.push_back(s);
      }
      fallbacks += static_cast<int64_t>(sequential.size());
      if (sequential.empty()) return;
    }
  }
  if (nsys < W) {
    if (!pieces) {
      for (int64_t s = 0; s < nsys; ++s) sequential.push_back(s);
    }
    // Few systems (one large system, say): W = 1, each system solved in place in the output.
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / work);
    const int64_t count = static_cast<int64_t>(sequential.size());
    claim_chunks(count, grain, [&](NextIndex& next) {
      std::unique_ptr<R[]> ws(new R[3 * dsize]);  // uninitialised: every element is written below
      R* d = ws.get();
      R* du = d + dsize;
      R* dl = du + dsize;
      for (int64_t t; next(t);) {
        const int64_t s = sequential[t];
        std::copy(D + s * dsize, D + (s + 1) * dsize, d);
        std::copy(U + s * band, U + (s + 1) * band, du);
        std::copy(L + s * band, L + (s + 1) * band, dl);
        std::fill(du + band, du + dsize, R(0));
        std::fill(dl + band, dl + dsize, R(0));
        R* b = X + s * bsize;
        std::copy(Bm + s * bsize, Bm + (s + 1) * bsize, b);
        R flag[1];
        run_kernel<R, Complex, 1>(n, k, d, du, dl, b, flag);
        if (flag[0] != R(0)) {
          record_singular(first, s * n + first_zero_pivot<R, Complex, 1>(d, n, 0));
        }
      }
    });
    return;
  }
  const int64_t nblocks = (nsys + W - 1) / W;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / (work * W));
  claim_chunks(nblocks, grain, [&](NextIndex& next) {
    std::unique_ptr<R[]> ws(new R[(3 * dsize + bsize) * W]);  // uninitialised, filled below
    R* d = ws.get();
    R* du = d + dsize * W;
    R* dl = du + dsize * W;
    R* b = dl + dsize * W;
    for (int64_t blk; next(blk);) {
      const int64_t s0 = blk * W;
      const int m = static_cast<int>(std::min<int64_t>(W, nsys - s0));
      for (int w = 0; w < m; ++w) {
        const int64_t s = s0 + w;
        gather<R, W>(d, D + s * dsize, dsize, w);
        gather<R, W>(du, U + s * band, band, w);
        gather<R, W>(dl, L + s * band, band, w);
        gather<R, W>(b, Bm + s * bsize, bsize, w);
      }
      for (int64_t q = band; q < dsize; ++q) {  // padding element n-1 of the off-diagonals
        for (int w = 0; w < W; ++w) du[q * W + w] = dl[q * W + w] = R(0);
      }
      for (int w = m; w < W; ++w) {  // tail: identity systems with zero rhs
        for (int64_t q = 0; q < dsize; ++q) d[q * W + w] = (q % C == 0) ? R(1) : R(0);
        for (int64_t q = 0; q < band; ++q) du[q * W + w] = dl[q * W + w] = R(0);
        for (int64_t q = 0; q < bsize; ++q) b[q * W + w] = R(0);
      }
      R flag[W];
      run_kernel<R, Complex, W>(n, k, d, du, dl, b, flag);
      for (int w = 0; w < m; ++w) {
        if (flag[w] != R(0)) {
          record_singular(first, (s0 + w) * n + first_zero_pivot<R, Complex, W>(d, n, w));
        }
        scatter<R, W>(X + (s0 + w) * bsize, b, bsize, w);
      }
    }
  });
}

using torch::headeronly::ScalarType;

// x = M^{-1} b for nsys systems, dispatched on dtype. L, D, U are M's bands (contiguous).
void solve_dtype(ScalarType dtype, const void* L, const void* D, const void* U, const void* B,
                 void* X, int64_t nsys, int64_t n, int64_t k, std::atomic<int64_t>& first,
                 int64_t pieces_min_n, int64_t& fallbacks) {
  switch (dtype) {
    case ScalarType::Float:
      solve_all<float, false>(static_cast<const float*>(L), static_cast<const float*>(D),
                              static_cast<const float*>(U), static_cast<const float*>(B),
                              static_cast<float*>(X), nsys, n, k, first, pieces_min_n,
                              fallbacks);
      break;
    case ScalarType::Double:
      solve_all<double, false>(static_cast<const double*>(L), static_cast<const double*>(D),
                               static_cast<const double*>(U), static_cast<const double*>(B),
                               static_cast<double*>(X), nsys, n, k, first, pieces_min_n,
                              fallbacks);
      break;
    case ScalarType::ComplexFloat:  // interleaved (re, im) pairs, read as reals
      solve_all<float, true>(static_cast<const float*>(L), static_cast<const float*>(D),
                             static_cast<const float*>(U), static_cast<const float*>(B),
                             static_cast<float*>(X), nsys, n, k, first, pieces_min_n,
                              fallbacks);
      break;
    default:
      solve_all<double, true>(static_cast<const double*>(L), static_cast<const double*>(D),
                              static_cast<const double*>(U), static_cast<const double*>(B),
                              static_cast<double*>(X), nsys, n, k, first, pieces_min_n,
                              fallbacks);
  }
}

}  // namespace
