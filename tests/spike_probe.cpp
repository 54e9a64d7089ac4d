// A test harness for the pieces kernel's spikes (tests/test_pieces.py builds it with g++): it
// includes csrc/pieces.h with TT_SPIKE_PROBE defined, so that every spike entry the kernel
// computes is counted before cut_spike sees it, solves one system, and prints
//   <return code> <spike entries computed> <of them subnormal>
// Usage: spike_probe FILE, FILE holding n (int64), the element size (int64: 4 or 8), then L (n-1),
// D (n), U (n-1) and B (n), raw.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

static long g_entries = 0, g_subnormal = 0;
template <typename V>
inline void tt_probe(const V& v) {
  for (unsigned w = 0; w < sizeof(V) / sizeof(v[0]); ++w) {
    ++g_entries;
    if (std::fpclassify(v[w]) == FP_SUBNORMAL) ++g_subnormal;
  }
}
#define TT_SPIKE_PROBE(x) tt_probe(x)
#include "pieces.h"

template <typename R>
int solve(std::FILE* f, int64_t n) {
  std::vector<R> L(n - 1), D(n), U(n - 1), B(n), X(n);
  for (auto* v : {&L, &D, &U, &B}) {
    if (std::fread(v->data(), sizeof(R), v->size(), f) != v->size()) return 2;
  }
  return solve_pieces<R>(L.data(), D.data(), U.data(), B.data(), X.data(), n, 1);
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::FILE* f = std::fopen(argv[1], "rb");
  int64_t head[2];
  if (f == nullptr || std::fread(head, sizeof(int64_t), 2, f) != 2) return 2;
  const int rc = head[1] == 4 ? solve<float>(f, head[0]) : solve<double>(f, head[0]);
  std::printf("%d %ld %ld\n", rc, g_entries, g_subnormal);
  return 0;
}
