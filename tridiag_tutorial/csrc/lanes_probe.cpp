// A probe of the batched kernel's block width W, built on demand by tridiag_tutorial.bench.lanes
// (with g++; setup.py does not build it): it includes batched.h, solves a batch of float64
// systems with run_kernel<double, false, W> in the kernel's interleaved layout, and prints the
// time. W is fixed at compile time: -DPROBE_W=1, 2, 4, 8 or 16. The extension builds W = 8 only
// (lanes.h's Pack<double, 8>); the other widths are declared below the same way: W / 2 SSE2
// vectors of 2 doubles side by side (W = 1: one double, the kernel's branching real_kernel_one).
// Usage: lanes_probe FILE REPEATS OUT. FILE holds S (int64, a multiple of W) and n (int64), then
// for each system L (n-1), D (n), U (n-1), B (n), float64, raw. It solves the batch REPEATS times
// (at least once), each time from fresh copies, writes the first solve's answers to OUT (S rows of
// n doubles) and prints "<seconds per solve of the batch> <systems flagged>"; only the kernel is
// timed, not the copies.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "batched.h"

#ifndef PROBE_W
#define PROBE_W 8
#endif

namespace {
template <int W>
struct SsePack {  // W doubles as W / 2 vectors of 2: what lanes.h's Pack<double, 8> is for W = 8
  using V = v2d;
  using I = v2l;
  static constexpr int VL = 2;
  static TT_INLINE V abs(V x) { return (V)((I)x & (I{} + INT64_MAX)); }
};
template <>
struct Pack<double, 2> : SsePack<2> {};
template <>
struct Pack<double, 4> : SsePack<4> {};
template <>
struct Pack<double, 16> : SsePack<16> {};
}  // namespace

int main(int argc, char** argv) {
  constexpr int W = PROBE_W;
  if (argc != 4) return 2;
  std::FILE* f = std::fopen(argv[1], "rb");
  int64_t head[2];
  if (f == nullptr || std::fread(head, sizeof(int64_t), 2, f) != 2) return 2;
  const int64_t S = head[0], n = head[1];
  if (S <= 0 || n < 2 || S % W != 0) return 3;
  const long repeats = std::max(1L, std::atol(argv[2]));
  // interleaved: block q of W systems holds element i of its systems at [q][i][W]
  std::vector<double> d0(S * n), u0(S * n, 0.0), l0(S * n, 0.0), b0(S * n), row(n);
  auto put = [&](std::vector<double>& dst, int64_t s, int64_t count) {
    const int64_t q = s / W, w = s % W;
    for (int64_t i = 0; i < count; ++i) dst[(q * n + i) * W + w] = row[i];
  };
  for (int64_t s = 0; s < S; ++s) {
    std::vector<double>* bands[4] = {&l0, &d0, &u0, &b0};
    for (int c = 0; c < 4; ++c) {
      const int64_t count = (c == 0 || c == 2) ? n - 1 : n;  // du, dl padded to n with zero
      if (std::fread(row.data(), sizeof(double), count, f) != static_cast<size_t>(count)) return 2;
      put(*bands[c], s, count);
    }
  }
  std::fclose(f);
  std::vector<double> d(S * n), u(S * n), l(S * n), b(S * n), flag(W);
  double seconds = 0;
  int64_t flagged = 0;
  for (long r = 0; r < repeats; ++r) {
    d = d0, u = u0, l = l0, b = b0;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t q = 0; q < S / W; ++q) {
      const int64_t at = q * n * W;
      run_kernel<double, false, W>(n, 1, d.data() + at, u.data() + at, l.data() + at, b.data() + at,
                                   flag.data());
      if (r == 0) {
        for (int w = 0; w < W; ++w) flagged += flag[w] != 0;
      }
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (r > 0 || repeats == 1) seconds += took.count();  // the first solve warms up
    if (r == 0) {
      std::FILE* out = std::fopen(argv[3], "wb");
      if (out == nullptr) return 2;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t q = s / W, w = s % W;
        for (int64_t i = 0; i < n; ++i) row[i] = b[(q * n + i) * W + w];
        std::fwrite(row.data(), sizeof(double), n, out);
      }
      std::fclose(out);
    }
  }
  std::printf("%.9g %lld\n", seconds / static_cast<double>(repeats > 1 ? repeats - 1 : 1),
              static_cast<long long>(flagged));
  return 0;
}
