// A probe of the pieces kernel's spikes, built on demand by tridiag_tutorial.bench.spikes (with
// g++; setup.py does not build it): it includes pieces.h, solves one system read from a file, and
// prints what it measured. Compile-time switches:
//   TT_SPIKE_COUNT  count every spike entry the kernel computes, before cut_spike sees it, and
//                   how many of them are subnormal (TT_SPIKE_PROBE, pieces.h's hook);
//   TT_SPIKE_KEEP   cut_spike keeps every entry: the kernel as it would be without the cut.
// Usage: spike_probe FILE REPEATS. FILE holds n (int64), the element size (int64: 4 or 8), then
// L (n-1), D (n), U (n-1) and B (n), raw. It solves the system REPEATS times (at least once) and
// prints "<return code> <seconds per solve> <spike entries> <of them subnormal>" (the counts are
// of the first solve, and -1 without TT_SPIKE_COUNT).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

static long g_entries = -1, g_subnormal = -1;
#ifdef TT_SPIKE_COUNT
static bool g_counting = true;
template <typename V>
inline void tt_count(const V& v) {
  if (!g_counting) return;
  for (unsigned w = 0; w < sizeof(V) / sizeof(v[0]); ++w) {
    ++g_entries;
    if (std::fpclassify(v[w]) == FP_SUBNORMAL) ++g_subnormal;
  }
}
#define TT_SPIKE_PROBE(x) tt_count(x)
#endif
#include "pieces.h"

template <typename R>
int run(std::FILE* f, int64_t n, long repeats, double* seconds) {
  std::vector<R> L(n - 1), D(n), U(n - 1), B(n), X(n);
  for (auto* v : {&L, &D, &U, &B}) {
    if (std::fread(v->data(), sizeof(R), v->size(), f) != v->size()) return 2;
  }
#ifdef TT_SPIKE_COUNT
  g_entries = g_subnormal = 0;
#endif
  int rc = solve_pieces<R>(L.data(), D.data(), U.data(), B.data(), X.data(), n, 1);
#ifdef TT_SPIKE_COUNT
  g_counting = false;
#endif
  const auto start = std::chrono::steady_clock::now();
  for (long i = 1; i < repeats; ++i) {
    rc |= solve_pieces<R>(L.data(), D.data(), U.data(), B.data(), X.data(), n, 1);
  }
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  *seconds = repeats > 1 ? took.count() / static_cast<double>(repeats - 1) : 0.0;
  return rc;
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* f = std::fopen(argv[1], "rb");
  int64_t head[2];
  if (f == nullptr || std::fread(head, sizeof(int64_t), 2, f) != 2) return 2;
  const long repeats = std::max(1L, std::atol(argv[2]));
  double seconds = 0;
  const int rc = head[1] == 4 ? run<float>(f, head[0], repeats, &seconds)
                              : run<double>(f, head[0], repeats, &seconds);
  std::printf("%d %.9g %ld %ld\n", rc, seconds, g_entries, g_subnormal);
  return 0;
}
