// The band gradients of the reverse mode (cpp_solve_backward). Part of tridiag.cpp's translation
// unit (see lanes.h).
//
// Entry point: band_products<R, Complex>(V, X, GL, GD, GU, nsys, n, k) writes into GL, GD and GU
// ((nsys, n-1), (nsys, n) and (nsys, n-1) values, C-contiguous) what is below; it returns nothing
// and cannot fail.
// The bands of -v x^H summed over the k columns (rules.band_gradients), for nsys systems of n
// rows, v and x (nsys, n, k) C-contiguous (complex: interleaved parts):
//   grad_lower[i] = -sum_j v[i+1, j] conj(x[i, j]), grad_diag[i] = -sum_j v[i, j] conj(x[i, j]),
//   grad_upper[i] = -sum_j v[i, j] conj(x[i+1, j]).
// One pass over v and x in chunks of rows, three short loops a chunk. The pass is a few
// nanoseconds a row, so threads share it only in chunks of kBandRowsPerThread rows: with a
// shorter share, a thread on a core that another process keeps busy stalls the whole pass (one
// system of 1e5 rows, forward + backward on two threads with one core busy: 3.5 times the time
// on one thread, when every 16384 rows went to a thread).

#pragma once

#include <algorithm>
#include <cstdint>

#include <torch/csrc/stable/ops.h>

namespace {

constexpr int64_t kBandRowsPerThread = int64_t(1) << 22;

template <typename R, bool Complex>
void band_products(const R* V, const R* X, R* GL, R* GD, R* GU, int64_t nsys, int64_t n,
                   int64_t k) {
  constexpr int C = Complex ? 2 : 1;
  // -v[a] conj(x[b]) summed over the columns, into out (C values).
  auto product = [&](const R* v, const R* x, R* out) {
    if constexpr (Complex) {
      R re = 0, im = 0;
      for (int64_t j = 0; j < k; ++j) {
        const R a = v[2 * j], b = v[2 * j + 1], c = x[2 * j], d = x[2 * j + 1];
        re += a * c + b * d;
        im += b * c - a * d;
      }
      out[0] = -re;
      out[1] = -im;
    } else {
      R sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += v[j] * x[j];
      out[0] = -sum;
    }
  };
  const int64_t row = k * C;  // values per row of v and x
  torch::stable::parallel_for(0, nsys * n, kBandRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end;) {
      const int64_t s = r / n, i0 = r - s * n, i1 = std::min(n, i0 + (end - r));
      const R* v = V + s * n * row;
      const R* x = X + s * n * row;
      R* gd = GD + s * n * C;
      R* gl = GL + s * (n - 1) * C;
      R* gu = GU + s * (n - 1) * C;
      if (!Complex && k == 1) {  // one column: plain products, which the compiler vectorizes
        for (int64_t i = i0; i < i1; ++i) gd[i] = -(v[i] * x[i]);
        for (int64_t i = i0; i < std::min(i1, n - 1); ++i) gu[i] = -(v[i] * x[i + 1]);
        for (int64_t i = std::max<int64_t>(i0, 1); i < i1; ++i) gl[i - 1] = -(v[i] * x[i - 1]);
      } else {
        for (int64_t i = i0; i < i1; ++i) product(v + i * row, x + i * row, gd + i * C);
        for (int64_t i = i0; i < std::min(i1, n - 1); ++i) {
          product(v + i * row, x + (i + 1) * row, gu + i * C);
        }
        for (int64_t i = std::max<int64_t>(i0, 1); i < i1; ++i) {
          product(v + i * row, x + (i - 1) * row, gl + (i - 1) * C);
        }
      }
      r += i1 - i0;
    }
  });
}

}  // namespace
