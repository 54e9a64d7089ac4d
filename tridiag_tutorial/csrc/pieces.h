// The pieces kernel: one large real system solved in pieces. Part of tridiag.cpp's translation
// unit (see lanes.h).
//
// Entry point: solve_pieces<R>(L, D, U, B, X, n, k) solves A X = B for one real system (R float
// or double) of n unknowns and k >= 1 right-hand sides: L and U (n-1 each) and D (n) its bands
// (L[i] = A[i+1, i], D[i] = A[i, i], U[i] = A[i, i+1]), B and X n x k, row-major and contiguous.
// It returns 0 where it solved the system (X written), and -1 where it hands the system back: the
// caller must then solve it with real_kernel_one (batched.h), and X is undefined. When it hands
// back is listed at the end of the comment below. It runs on the calling thread, with AVX2's
// 32-byte lanes where the CPU has them (and TRIDIAG_TUTORIAL_NO_AVX2 is not set), else 16-byte
// ones; the caller (solve_all, dispatch.h) sends it real systems of kPiecesMinN unknowns or more.
//
// --------------------------------------------------------------------------------------------
// One large real system: pieces eliminated side by side, spikes, a small reduced system.
//
// ?gtsv (and real_kernel_one) is one chain of dependent divisions: each step needs the pivot the
// step before produced, so the CPU waits for every division and does little else. This kernel
// cuts the rows into P pieces of m rows (P a multiple of the lanes W; rows past n are identity
// rows with a zero right-hand side) and eliminates W pieces side by side in SIMD registers, in a
// scratch of one tile (W pieces, element i of the W pieces contiguous) that stays in cache.
// Piece q, rows s = q m .. s + m - 1, couples to the rest through a = A[s, s-1] and
// c = A[s+m-1, s+m] only:
//
//   A_q x_q = f_q - a e_1 x[s-1] - c e_m x[s+m]
//
// 1. Each piece (load, eliminate, substitute): Gaussian elimination with partial pivoting inside
//    the piece (real_kernel's steps, keeping the pivots) on k + 2 right-hand sides,
//    f_q and the spikes' a e_1 and c e_m, and back substitution: y = A_q^{-1} f_q,
//    v = A_q^{-1} a e_1, w = A_q^{-1} c e_m. Kept: their first and last rows, and the largest
//    magnitude of each column. A spike that decays is cut to zero at its first subnormal entry
//    while eliminating, and below min / eps once solved (cut_spike).
// 2. The reduced system (reduced_solve): the last unknown of piece q, b_q = x[s+m-1], and the
//    first of piece q + 1, t_{q+1} = x[s+m], for q < P - 1, from those kept rows:
//      b_q     + v_q[m-1] b_{q-1} + w_q[m-1] t_{q+1} = y_q[m-1]
//      t_{q+1} + v_{q+1}[0] b_q   + w_{q+1}[0] t_{q+2} = y_{q+1}[0]
//    2 (P - 1) unknowns in a band two wide on each side: banded elimination with partial pivoting.
// 3. Each piece's answer from its columns: x = y - v b_{q-1} - w t_{q+1} (step 1 left y in X and
//    v and w in a buffer of 2 P m values). Where that cancels, x would carry the rounding of y,
//    v and w magnified: in a tile with a piece whose max|x| is more than kCombine times smaller
//    than max|y| + max|v| |b_{q-1}| + max|w| |t_{q+1}| (spikes that decay slowly, say), each
//    piece is solved again instead, its neighbours' values moved to the right-hand side: the
//    same elimination on the caller's k columns and the whole back substitution, into X.
//
// Step 1 is ?gtsv's arithmetic on k + 2 columns, in W independent chains (8 doubles or 16 floats
// a tile) where ?gtsv has one; step 3 two multiply-adds a value. The memory it takes besides X
// is a tile's scratch, the spikes and a few values a piece, allocated for the call. One thread:
// a second one would need a join between steps 1 and 3, which stalls whenever another process
// keeps a core busy.
//
// It does not make ?gtsv's pivot decisions across the pieces' boundaries, so its rounding
// differs from ?gtsv's. Where it cannot vouch for its answer it returns -1, and the caller
// solves the system with real_kernel_one (?gtsv's operations, its INFO, its NaNs):
// - a zero pivot in a piece (A singular, or a piece singular where A is not), or one below
//   min / eps (a row or column scaled so close to the smallest normal number that the cut of the
//   spikes' subnormal entries could drop a term that matters);
// - a zero pivot in the reduced system, or one below kTinyPivot eps times its row's largest
//   entry (a singular A whose zero pivot the reduced system meets as rounding);
// - a value that is not finite;
// - cancellation: a piece whose answer is more than kCancellation times smaller than the terms
//   it is made of (max|y| + max|v| |x[s-1]| + max|w| |x[s+m]|, each column), where a nearly
//   singular piece would have amplified its rounding errors.
// --------------------------------------------------------------------------------------------

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "lanes.h"

// GCC's __builtin_shuffle, for the transposes of the loads and stores (elsewhere: element by
// element).
#if defined(__GNUC__) && !defined(__clang__)
#define TT_HAVE_SHUFFLE 1
#else
#define TT_HAVE_SHUFFLE 0
#endif

namespace {

// cpp_solve sends a real system of kPiecesMinN unknowns or more (one, or each of fewer than W
// systems) to this kernel (compiled.PIECES_MIN_N is the same number); cpp_solve_ex takes the
// size as an argument.
constexpr int64_t kPiecesMinN = 1024;
constexpr int64_t kPieceRows = 512;   // the target m: a tile's scratch stays in the L2 cache
constexpr double kTinyPivot = 16;
constexpr double kCancellation = 1e3;
constexpr double kCombine = 8;  // (see run_pieces, step 3)
constexpr int64_t kProbeTiles = 8;       // from this many tiles on, the first one decides early
constexpr double kAmplification = 1e3;  // (see run_pieces)
// Below this a solved spike entry is cut to zero (cut_spike): 1e-31 in float32, 1e-292 in float64.
template <typename R>
constexpr R kSpikeFloor = std::numeric_limits<R>::min() / std::numeric_limits<R>::epsilon();
constexpr int kWideVectors = 2;  // 32-byte vectors a tile (AVX2): W = 8 doubles, 16 floats

// One system: L, U n-1 and D n reals, B n x k row-major. Row r's entries, identity rows past n.
template <typename R>
struct System {
  const R *L, *D, *U, *B;
  int64_t n, k;
  R Dr(int64_t r) const { return r < n ? D[r] : R(1); }
  R Ur(int64_t r) const { return r + 1 < n ? U[r] : R(0); }  // A[r, r+1]
  R Lr(int64_t r) const { return r + 1 < n ? L[r] : R(0); }  // A[r+1, r]
  R Br(int64_t r, int64_t j) const { return r < n ? B[r * k + j] : R(0); }
};

// The rows of a tile's W pieces side by side: d, du, fl (A[i+1, i] in, the fill-in U[i, i+2]
// out), pv (the pivots), b ([m][K][W]: the right-hand sides in, x out).
template <typename R>
struct TileRows {
  R *d, *du, *fl, *pv, *b, *c;  // c: [W], the spikes' c
};

// The rows of another tile to bring into the caches while this one is eliminated (the loads of
// the next tile gather 4 W streams m rows apart, more than the hardware prefetchers follow):
// step i of the elimination asks for line i of each band and of the right-hand sides (m lines
// each: the W pieces' m rows, 8 to a 64-byte line). Nothing where `lines` is 0.
template <typename R>
struct Prefetch {
  static constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(R));
  const R* arrays[4];
  int64_t m = 0, lines = 0;  // rows a piece, lines a piece (0: nothing to fetch)
  int64_t at = 0, line = 0;  // the next line: its offset into the arrays, its index in a piece
  // Line i (called with i = 0, 1, ...) of each array.
  TT_INLINE void next() {
    if (lines == 0) return;
    for (const R* a : arrays) __builtin_prefetch(a + at, 0, 3);
    at += kPerLine;
    if (++line == lines) {  // the next piece's first line: m rows on from this piece's
      line = 0;
      at += m - lines * kPerLine;
    }
  }
};

template <typename V, int NV>
struct PieceTile {
  using R = typename Lane<V>::R;
  using I = typename Lane<V>::I;
  static constexpr int VL = static_cast<int>(sizeof(V) / sizeof(R));
  static constexpr int W = NV * VL;

  static TT_INLINE V vabs(V x) { return (V)((I)x & (I{} + Lane<V>::kMag)); }
  // [book: cut-spike]
  // A spike entry, zero where its magnitude is below floor. A spike decays geometrically where
  // A_q is diagonally dominant: computed to the end of its piece, it passes through subnormal
  // numbers, which some CPUs (the Intel Xeon measured) handle with a slow microcode path on
  // operations that read or write one. Cut, it stops: the entries below it stay zero. What is
  // cut is subnormal while eliminating (those values still carry their row's scale: a piece with
  // a pivot below min / eps, a row or column scaled close to the smallest normal number, where
  // the cut could drop a term that matters, is handed back), or, once solved, a value of the spike
  // itself below min / eps (kSpikeFloor), whose term in x (v x[s-1], w x[s+m]) lies far below
  // rounding. NaN and infinities are kept (the checks see them).
  static TT_INLINE V cut_spike(V x, V floor) {
#ifdef TT_SPIKE_PROBE
    TT_SPIKE_PROBE(x);  // spike_probe.cpp's count of the entries before the cut
#endif
#ifdef TT_SPIKE_KEEP
    return x;  // spike_probe.cpp's kernel without the cut
#else
    const V zero{};
    return vabs(x) < floor ? zero : x;
#endif
  }
  // [/book: cut-spike]

#if TT_HAVE_SHUFFLE
  // v[r][j] <- v[j][r] (VL vectors of VL lanes): log2(VL) butterfly stages of two-vector
  // shuffles (unpacks and lane permutes), VL log2(VL) shuffles in all.
  template <int H, std::size_t... J>
  static constexpr I low_mask(std::index_sequence<J...>) {
    return I{static_cast<typename Lane<V>::E>((J & H) == 0 ? J : VL + J - H)...};
  }
  template <int H, std::size_t... J>
  static constexpr I high_mask(std::index_sequence<J...>) {
    return I{static_cast<typename Lane<V>::E>((J & H) == 0 ? J + H : VL + J)...};
  }
  template <int H>
  static TT_INLINE void stage(V* v) {
    constexpr I lo = low_mask<H>(std::make_index_sequence<VL>{});
    constexpr I hi = high_mask<H>(std::make_index_sequence<VL>{});
    for (int r = 0; r < VL; ++r) {
      if (r & H) continue;
      const V x = v[r], y = v[r + H];
      v[r] = __builtin_shuffle(x, y, lo);
      v[r + H] = __builtin_shuffle(x, y, hi);
    }
  }
  static TT_INLINE void transpose(V* v) {
    stage<1>(v);
    if constexpr (VL > 2) stage<2>(v);
    if constexpr (VL > 4) stage<4>(v);
  }
#endif

  // Rows i0 .. i0 + VL - 1 of VL pieces (src + w * m: piece w's first row) into the lanes of
  // VL vectors at dst (row r: dst + r * W), and back.
  // (row r of the lanes: at r * stride).
  static TT_INLINE void gather(const R* src, int64_t m, int64_t i0, R* dst, int64_t stride) {
#if TT_HAVE_SHUFFLE
    V v[VL];
    for (int w = 0; w < VL; ++w) v[w] = ld<V>(src + w * m + i0);
    transpose(v);
    for (int r = 0; r < VL; ++r) st(dst + r * stride, v[r]);
#else
    for (int r = 0; r < VL; ++r) {
      V v;
      for (int w = 0; w < VL; ++w) v[w] = src[w * m + i0 + r];
      st(dst + r * stride, v);
    }
#endif
  }
  static TT_INLINE void scatter(const R* src, int64_t stride, int64_t m, int64_t i0, R* dst) {
#if TT_HAVE_SHUFFLE
    V v[VL];
    for (int r = 0; r < VL; ++r) v[r] = ld<V>(src + r * stride);
    transpose(v);
    for (int w = 0; w < VL; ++w) st(dst + w * m + i0, v[w]);
#else
    for (int r = 0; r < VL; ++r) {
      const V v = ld<V>(src + r * stride);
      for (int w = 0; w < VL; ++w) dst[w * m + i0 + r] = v[w];
    }
#endif
  }

  // Tile t's pieces into s: bands, the caller's k columns, and (spikes) two more columns,
  // a e_1 and c e_m. K: the columns of s.b.
  static TT_INLINE void load(const System<R>& A, int64_t m, int64_t t, int64_t K, bool spikes,
                             const TileRows<R>& s) {
    const int64_t k = A.k, first = t * W * m;
    for (int o = 0; o < NV; ++o) {
      const int64_t s0 = first + o * VL * m;
      for (int64_t i = 0; i < m; i += VL) {
        if (s0 + (VL - 1) * m + i + VL < A.n) {
          // VL rows of VL pieces inside the system, with their coupling below (U and L hold
          // n - 1 values): at once, transposed into the lanes (m is a multiple of VL).
          gather(A.D + s0, m, i, s.d + i * W + o * VL, W);
          gather(A.U + s0, m, i, s.du + i * W + o * VL, W);
          gather(A.L + s0, m, i, s.fl + i * W + o * VL, W);
          if (k == 1) gather(A.B + s0, m, i, s.b + i * K * W + o * VL, K * W);
          continue;
        }
        // Rows that reach the system's last row or the identity rows past it (the last tile's
        // last rows, VL pieces at most): one value at a time. Only these: a tile loaded one
        // value at a time took four times as long to load (measured on an Intel Xeon), which
        // left a system of one tile (float32, n = 4096) slower than ?gtsv.
        for (int r = 0; r < VL; ++r) {
          for (int w = 0; w < VL; ++w) {
            const int64_t row = s0 + w * m + i + r, e = (i + r) * W + o * VL + w;
            s.d[e] = A.Dr(row);
            s.du[e] = A.Ur(row);
            s.fl[e] = A.Lr(row);
            if (k == 1) s.b[(i + r) * K * W + o * VL + w] = A.Br(row, 0);
          }
        }
      }
      if (k == 1) continue;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          V b;
          for (int w = 0; w < VL; ++w) b[w] = A.Br(s0 + w * m + i, j);
          st(s.b + (i * K + j) * W + o * VL, b);
        }
      }
    }
    // The spikes: a e_1 (column k, its other rows written by the elimination) and c e_m
    // (column k + 1: zero but in the last two rows, which the elimination's last step writes;
    // c waits in s.c).
    const V zero{};
    if (spikes) {
      for (int64_t i = 0; i + 2 < m; ++i) {
        for (int o = 0; o < NV; ++o) st(s.b + (i * K + k + 1) * W + o * VL, zero);
      }
    }
    for (int w = 0; w < W; ++w) {
      const int64_t s0 = first + w * m, last = (m - 1) * W + w;
      if (spikes) {
        s.b[k * W + w] = s0 > 0 ? A.Lr(s0 - 1) : R(0);
        s.c[w] = s.du[last];
        if (m == 1) s.b[k + 1 + w] = s.du[last];
      }
      s.du[last] = R(0);  // the couplings out of the piece
      s.fl[last] = R(0);
    }
  }

  // Gaussian elimination with partial pivoting of the W pieces, real_kernel's steps with the
  // pivots kept. Returns false where a pivot was zero or not finite, or where a step cancelled
  // to rounding.
  // k: the caller's columns; K - k: the spikes (0 or 2).
  static TT_INLINE bool eliminate(int64_t m, int64_t k, int64_t K, const TileRows<R>& s,
                                  Prefetch<R> ahead) {
    const V zero{};
    const V one = zero + R(1);
    const V tiny = zero + R(kTinyPivot) * std::numeric_limits<R>::epsilon();
    const V floor = zero + std::numeric_limits<R>::min();  // the subnormal spike entries
    // A pivot below min / eps: its row or column is scaled so close to the smallest normal number
    // that cut_spike could drop a term that matters; the sequential kernel decides.
    const V lowest = zero + kSpikeFloor<R>;
    V bad = zero;
    for (int64_t i = 0; i + 1 < m; ++i) {
      ahead.next();
      for (int o = 0; o < NV; ++o) {
        const int64_t e = i * W + o * VL;
        const V a = ld<V>(s.d + e), l = ld<V>(s.fl + e), c = ld<V>(s.du + e);
        const V dn = ld<V>(s.d + e + W), g = ld<V>(s.du + e + W);
        const auto sw = lnot(vabs(a) >= vabs(l));  // interchange (also on NaN)
        const V p = sw ? l : a;
        const V f = (sw ? a : l) / p;
        st(s.pv + e, p);
        st(s.du + e, sw ? dn : c);
        st(s.fl + e, sw ? g : zero);
        const V keep = sw ? c : dn, take = f * (sw ? dn : c);
        const V next = keep - take;
        st(s.d + e + W, next);
        st(s.du + e + W, sw ? -(f * g) : g);
        // A pivot that is zero or not finite, or a next one that cancelled to a few ulps of its
        // terms: where ?gtsv, pivoting across the pieces' ends, meets an exact zero (a singular
        // A), the pieces can meet rounding instead; the sequential kernel decides.
        bad = (p == zero) | ((p - p) != zero) | (vabs(p) < lowest) |
                      ((next != zero) & (vabs(next) <= tiny * (vabs(keep) + vabs(take))))
                  ? one
                  : bad;
        R* b0 = s.b + i * K * W + o * VL;
        for (int64_t j = 0; j < k; ++j) {
          const V x0 = ld<V>(b0 + j * W), x1 = ld<V>(b0 + (K + j) * W);
          const V q = sw ? x1 : x0;
          st(b0 + j * W, q);
          st(b0 + (K + j) * W, (sw ? x0 : x1) - f * q);
        }
        if (K > k) {
          // a e_1: row i + 1 is zero before this step.
          const V x0 = ld<V>(b0 + k * W);
          const V q = sw ? zero : x0;
          st(b0 + k * W, q);
          st(b0 + (K + k) * W, cut_spike((sw ? x0 : zero) - f * q, floor));
          if (i + 2 == m) {  // c e_m: zero down to here, c in the last row
            const V x1 = ld<V>(s.c + o * VL);
            const V q2 = sw ? x1 : zero;
            st(b0 + (k + 1) * W, q2);
            st(b0 + (K + k + 1) * W, (sw ? zero : x1) - f * q2);
          }
        }
      }
    }
    for (int o = 0; o < NV; ++o) {
      const int64_t e = (m - 1) * W + o * VL;
      const V p = ld<V>(s.d + e);
      st(s.pv + e, p);
      bad = (p == zero) | ((p - p) != zero) | (vabs(p) < lowest) ? one : bad;
    }
    bool any = false;
    for (int w = 0; w < VL; ++w) any = any || bad[w] != R(0);
    return !any;
  }

  // After the first pass's substitution: the caller's k columns (y) of tile t into X's rows
  // below n, and the spikes' two (v, w) into Vs and Ws ([P][m]).
  static TT_INLINE void store_columns(const TileRows<R>& s, int64_t m, int64_t K, int64_t k,
                                      int64_t t, int64_t n, R* X, R* Vs, R* Ws) {
    const int64_t first = t * W * m;
    R* const out[2] = {Vs + first, Ws + first};
    for (int c = 0; c < 2; ++c) {
      for (int o = 0; o < NV; ++o) {
        for (int64_t i = 0; i < m; i += VL) {
          scatter(s.b + (i * K + k + c) * W + o * VL, K * W, m, i, out[c] + o * VL * m);
        }
      }
    }
    store_x(s, m, K, k, t, n, X);
  }

  // The caller's k columns of s.b (K columns in all) of tile t into X's rows below n.
  static TT_INLINE void store_x(const TileRows<R>& s, int64_t m, int64_t K, int64_t k, int64_t t,
                                int64_t n, R* X) {
    const int64_t first = t * W * m;
    if (k == 1 && first + W * m <= n) {  // VL rows of VL pieces at a time, transposed
      for (int o = 0; o < NV; ++o) {
        for (int64_t i = 0; i < m; i += VL) {
          scatter(s.b + i * K * W + o * VL, K * W, m, i, X + first + o * VL * m);
        }
      }
      return;
    }
    for (int64_t w = 0; w < W; ++w) {
      const int64_t s0 = first + w * m;
      const int64_t rows = std::min<int64_t>(m, n - s0);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < k; ++j) X[(s0 + i) * k + j] = s.b[(i * K + j) * W + w];
      }
    }
  }

  // Back substitution of the K columns, x in place of b; mag [K][W]: each column's max |x| (a
  // value that is not finite reaches the first row: every row's x enters the one above).
  // Columns from `spikes` on are spikes: their entries below kSpikeFloor are cut to zero.
  static TT_INLINE void substitute(int64_t m, int64_t K, int64_t spikes, const TileRows<R>& s,
                                   R* mag) {
    const V zero{};
    const V floor = zero + kSpikeFloor<R>;
    for (int64_t j = 0; j < K; ++j) {
      for (int o = 0; o < NV; ++o) st(mag + j * W + o * VL, zero);
    }
    for (int64_t i = m - 1; i >= 0; --i) {
      for (int o = 0; o < NV; ++o) {
        const int64_t e = i * W + o * VL;
        const V p = ld<V>(s.pv + e), u = ld<V>(s.du + e), f = ld<V>(s.fl + e);
        R* bi = s.b + i * K * W + o * VL;
        for (int64_t j = 0; j < K; ++j) {
          V t = ld<V>(bi + j * W);
          if (i + 1 < m) t = t - u * ld<V>(bi + (K + j) * W);
          if (i + 2 < m) t = t - f * ld<V>(bi + (2 * K + j) * W);
          const V x = j < spikes ? t / p : cut_spike(t / p, floor);
          st(bi + j * W, x);
          R* mg = mag + j * W + o * VL;
          const V ax = vabs(x), old = ld<V>(mg);
          st(mg, ax > old ? ax : old);
        }
      }
    }
  }
};

// Banded elimination with partial pivoting of the reduced system: N unknowns, row r's entries in
// columns r - 2 .. r + 2 (coef(r, e): e[0..4], zero outside [0, N)), rhs(r, y): k values.
// z: [N][k]. Returns false on a zero pivot, or one below kTinyPivot eps of its row's largest
// entry.
template <typename R, typename Coef, typename Rhs>
bool reduced_solve(int64_t N, int64_t k, Coef coef, Rhs rhs, R* z) {
  constexpr int kW = 5;
  const R tiny = R(kTinyPivot) * std::numeric_limits<R>::epsilon();
  std::vector<R> ue(N * kW), ub(N * k);
  struct Slot {
    R e[kW];
    R scale;
  };
  Slot slot[3];
  std::vector<R> sb(3 * k);
  R* b[3] = {sb.data(), sb.data() + k, sb.data() + 2 * k};
  // Row r into slot i, its entries relative to column c.
  auto load = [&](int i, int64_t r, int64_t c) {
    R e[kW];
    coef(r, e);
    R scale = 0;
    for (int o = 0; o < kW; ++o) {
      const int64_t col = r - 2 + o;
      if (col < 0 || col >= N) e[o] = R(0);
      scale = std::max(scale, std::abs(e[o]));
    }
    for (int o = 0; o < kW; ++o) slot[i].e[o] = R(0);
    for (int o = 0; o < kW; ++o) {
      const int64_t rel = r - 2 + o - c;
      if (rel >= 0 && rel < kW) slot[i].e[rel] = e[o];
    }
    slot[i].scale = scale;
    rhs(r, b[i]);
  };
  int rows = 0;  // slots in use
  for (int64_t r = 0; r < std::min<int64_t>(N, 2); ++r) load(rows++, r, 0);
  for (int64_t c = 0; c < N; ++c) {
    if (c + 2 < N) load(rows++, c + 2, c);
    int best = 0;
    for (int i = 1; i < rows; ++i) {
      if (std::abs(slot[i].e[0]) > std::abs(slot[best].e[0])) best = i;
    }
    if (best != 0) {
      std::swap(slot[0], slot[best]);
      std::swap(b[0], b[best]);
    }
    const R p = slot[0].e[0];
    if (!(std::abs(p) > tiny * slot[0].scale)) return false;  // also NaN
    for (int i = 1; i < rows; ++i) {
      const R f = slot[i].e[0] / p;
      for (int o = 1; o < kW; ++o) slot[i].e[o] -= f * slot[0].e[o];
      for (int64_t j = 0; j < k; ++j) b[i][j] -= f * b[0][j];
    }
    std::copy(slot[0].e, slot[0].e + kW, &ue[c * kW]);
    std::copy(b[0], b[0] + k, &ub[c * k]);
    // Shift: the remaining rows move up, their entries one column left.
    R* first = b[0];
    for (int i = 1; i < rows; ++i) {
      for (int o = 0; o + 1 < kW; ++o) slot[i - 1].e[o] = slot[i].e[o + 1];
      slot[i - 1].e[kW - 1] = R(0);
      slot[i - 1].scale = slot[i].scale;
      b[i - 1] = b[i];
    }
    b[rows - 1] = first;
    --rows;
  }
  for (int64_t c = N - 1; c >= 0; --c) {
    for (int64_t j = 0; j < k; ++j) {
      R t = ub[c * k + j];
      for (int o = 1; o < kW && c + o < N; ++o) t -= ue[c * kW + o] * z[(c + o) * k + j];
      z[c * k + j] = t / ue[c * kW];
    }
  }
  return true;
}

// Row r of the reduced system (unknown 2q: b_q, the last of piece q; 2q + 1: t_{q+1}, the first
// of piece q + 1), its entries in columns r - 2 .. r + 2, from the kept first and last rows
// (top, bot: [P][K], the spikes' columns k and k + 1).
template <typename R>
inline void reduced_row(int64_t r, const R* top, const R* bot, int64_t K, int64_t k, R* e) {
  const int64_t q = r / 2;
  for (int o = 0; o < 5; ++o) e[o] = R(0);
  e[2] = R(1);
  if (r % 2 == 0) {  // the last row of piece q: columns b_{q-1}, b_q, t_{q+1}
    e[0] = bot[q * K + k];
    e[3] = bot[q * K + k + 1];
  } else {  // the first row of piece q + 1: columns b_q, t_{q+1}, t_{q+2}
    e[1] = top[(q + 1) * K + k];
    e[4] = top[(q + 1) * K + k + 1];
  }
}

// Solve one real system with W pieces a tile (Tile: PieceTile<V, NV>). Returns 0 where it solved
// it (X written), -1 where it could not vouch for an answer (X undefined).
template <typename Tile, typename R>
TT_INLINE int run_pieces(const System<R>& A, R* X, int64_t m, int64_t P) {
  constexpr int64_t W = Tile::W;
  const int64_t k = A.k, K = k + 2, tiles = P / W;
  // A tile's scratch; each piece's first and last rows of y, v, w and their magnitudes.
  std::unique_ptr<R[]> scratch(new R[m * W * (4 + K) + K * W + W]);
  R* mag = scratch.get() + m * W * (4 + K);
  const TileRows<R> s{scratch.get(), scratch.get() + m * W, scratch.get() + 2 * m * W,
                      scratch.get() + 3 * m * W, scratch.get() + 4 * m * W, mag + K * W};
  std::unique_ptr<R[]> kept(new R[3 * P * K]);
  R *top = kept.get(), *bot = top + P * K, *big = bot + P * K;
  // The next tile's rows, while this one is eliminated (k == 1: the right-hand side's rows are
  // as long as a band's), where the whole tile lies inside the system.
  auto ahead = [&](int64_t t) {
    Prefetch<R> p{{A.D, A.U, A.L, A.B}};
    if (k == 1 && t < tiles && (t + 1) * W * m < A.n) {
      p.m = m;
      p.lines = std::max<int64_t>(1, m / Prefetch<R>::kPerLine);
      p.at = t * W * m;
    }
    return p;
  };
  // The spikes of every piece, v and w ([P][m] each), and y in X: step 3 combines them.
  std::unique_ptr<R[]> spikes(new R[2 * P * m]);
  R *Vs = spikes.get(), *Ws = Vs + P * m;
  for (int64_t t = 0; t < tiles; ++t) {
    Tile::load(A, m, t, K, true, s);
    if (!Tile::eliminate(m, k, K, s, ahead(t + 1))) return -1;
    Tile::substitute(m, K, k, s, mag);
    Tile::store_columns(s, m, K, k, t, A.n, X, Vs, Ws);
    for (int64_t w = 0; w < W; ++w) {
      const int64_t q = t * W + w;
      for (int64_t j = 0; j < K; ++j) {
        if (!std::isfinite(s.b[j * W + w])) return -1;
        top[q * K + j] = s.b[j * W + w];
        bot[q * K + j] = s.b[((m - 1) * K + j) * W + w];
        big[q * K + j] = mag[j * W + w];
      }
    }
    if (t == 0 && tiles >= kProbeTiles) {
      // Decide early: the reduced system of the first tile's pieces, on a right-hand side of
      // ones. Where it amplifies that by more than kAmplification, the coupling decays too
      // slowly across a piece (tridiag(-1, 2, -1), say), and the rounding of the pieces,
      // compounded through the reduced system, can exceed ?gtsv's error: hand the system back
      // now, having spent one tile of kProbeTiles or more.
      const int64_t N1 = 2 * (W - 1);
      std::unique_ptr<R[]> probe(new R[N1]);
      auto coef1 = [&](int64_t r, R* e) { reduced_row(r, top, bot, K, k, e); };
      auto ones = [](int64_t, R* y) { y[0] = R(1); };
      if (!reduced_solve<R>(N1, 1, coef1, ones, probe.get())) return -1;
      for (int64_t r = 0; r < N1; ++r) {
        if (!(std::abs(probe[r]) <= R(kAmplification))) return -1;
      }
    }
  }
  // The reduced system: unknown 2q is b_q, 2q + 1 is t_{q+1}.
  const int64_t N = 2 * (P - 1);
  std::unique_ptr<R[]> z(new R[std::max<int64_t>(N, 1) * k]);
  auto coef = [&](int64_t r, R* e) { reduced_row(r, top, bot, K, k, e); };
  auto rhs = [&](int64_t r, R* y) {
    const int64_t q = r / 2;
    const R* from = r % 2 == 0 ? &bot[q * K] : &top[(q + 1) * K];
    std::copy(from, from + k, y);
  };
  if (N > 0 && !reduced_solve<R>(N, k, coef, rhs, z.get())) return -1;
  // 3. x = y - v b_{q-1} - w t_{q+1}, piece by piece, in place of y in X. A tile with a piece
  // whose answer is more than kCombine times smaller than the terms it is made of is solved
  // again instead.
  std::vector<int64_t> again;
  for (int64_t t = 0; t < tiles; ++t) {
    bool redo = false;
    for (int64_t q = t * W; q < (t + 1) * W && q * m < A.n && !redo; ++q) {
      const int64_t s0 = q * m, rows = std::min<int64_t>(m, A.n - s0);
      const R* v = Vs + s0;
      const R* wv = Ws + s0;
      for (int64_t j = 0; j < k; ++j) {
        const R left = q > 0 ? z[(2 * (q - 1)) * k + j] : R(0);
        const R right = q + 1 < P ? z[(2 * q + 1) * k + j] : R(0);
        R* x = X + s0 * k + j;
        R mag_x = 0, probe = 0;  // probe: NaN where an x is not finite (inf * 0 is NaN)
        for (int64_t i = 0; i < rows; ++i) {
          const R xi = x[i * k] - v[i] * left - wv[i] * right;
          x[i * k] = xi;
          mag_x = std::max(mag_x, std::abs(xi));
          probe += xi * R(0);
        }
        const R terms = big[q * K + j] + big[q * K + k] * std::abs(left) +
                        big[q * K + k + 1] * std::abs(right);
        // (x not finite: the solve again decides, and hands the system back where it is too)
        if (probe != R(0) || (!(terms <= R(kCombine) * mag_x) && terms != R(0))) redo = true;
      }
    }
    if (redo) again.push_back(t);
  }
  // Those tiles again, each piece with its neighbours' values moved to the right-hand side.
  for (const int64_t t : again) {
    Tile::load(A, m, t, k, false, s);
    for (int64_t w = 0; w < W; ++w) {
      const int64_t q = t * W + w, s0 = q * m;
      if (q > 0) {
        const R a = A.Lr(s0 - 1);
        for (int64_t j = 0; j < k; ++j) s.b[j * W + w] -= a * z[(2 * (q - 1)) * k + j];
      }
      if (q + 1 < P) {
        const R c = A.Ur(s0 + m - 1);
        for (int64_t j = 0; j < k; ++j) s.b[((m - 1) * k + j) * W + w] -= c * z[(2 * q + 1) * k + j];
      }
    }
    if (!Tile::eliminate(m, k, k, s, Prefetch<R>{{A.D, A.U, A.L, A.B}})) return -1;
    Tile::substitute(m, k, k, s, mag);
    for (int64_t w = 0; w < W; ++w) {
      const int64_t q = t * W + w, s0 = q * m;
      for (int64_t j = 0; j < k; ++j) {
        if (!std::isfinite(s.b[j * W + w])) return -1;
        const R left = q > 0 ? std::abs(z[(2 * (q - 1)) * k + j]) : R(0);
        const R right = q + 1 < P ? std::abs(z[(2 * q + 1) * k + j]) : R(0);
        const R terms = big[q * K + j] + big[q * K + k] * left + big[q * K + k + 1] * right;
        if (!(terms <= R(kCancellation) * mag[j * W + w])) {
          if (terms != R(0)) return -1;
        }
      }
    }
    Tile::store_x(s, m, k, k, t, A.n, X);
  }
  return 0;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TT_HAVE_AVX2 1
#define TT_AVX2 __attribute__((target("avx2")))
TT_AVX2 int pieces_avx2(const System<double>& A, double* X, int64_t m, int64_t P) {
  return run_pieces<PieceTile<v4d, kWideVectors>>(A, X, m, P);
}
TT_AVX2 int pieces_avx2(const System<float>& A, float* X, int64_t m, int64_t P) {
  return run_pieces<PieceTile<v8f, kWideVectors>>(A, X, m, P);
}
// TRIDIAG_TUTORIAL_NO_AVX2=1 in the environment when the library loads: the 16-byte lanes that
// plain x86-64 and aarch64 use (the tests run them that way on any CPU).
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") &&
                          std::getenv("TRIDIAG_TUTORIAL_NO_AVX2") == nullptr;
  return has;
}
#else
#define TT_HAVE_AVX2 0
#endif

template <typename R>
struct Narrow;  // 16-byte vectors: what plain x86-64 (SSE2) and aarch64 (NEON) have
template <>
struct Narrow<double> {
  using T = PieceTile<v2d, 4>;
};
template <>
struct Narrow<float> {
  using T = PieceTile<v4f, 4>;
};

// Solve one real system on the pieces kernel: 0 where it solved it, -1 where the caller must
// solve it with real_kernel_one (X is then undefined).
template <typename R>
int solve_pieces(const R* L, const R* D, const R* U, const R* B, R* X, int64_t n, int64_t k) {
#if TT_HAVE_AVX2
  const bool wide = cpu_has_avx2();
#else
  const bool wide = false;
#endif
  const int64_t W = wide ? kWideVectors * 32 / static_cast<int64_t>(sizeof(R)) : Narrow<R>::T::W;
  int64_t P = std::max<int64_t>(W, (n + kPieceRows - 1) / kPieceRows);
  P = (P + W - 1) / W * W;
  int64_t m = (n + P - 1) / P;
  m = (m + 7) / 8 * 8;  // a multiple of the lanes of a vector (the transposes)
  // The gather reads W pieces side by side, m rows apart: a distance close to a multiple of
  // 4 KiB puts them in one set of the L1 cache, which then misses on every row (measured: the
  // loads took 2.4 times as long at m = 511 as at m = 500). Move away from it.
  while (m * static_cast<int64_t>(sizeof(R)) > 4096 - 512) {
    const int64_t off = (m * static_cast<int64_t>(sizeof(R))) % 4096;
    if (off >= 512 && off <= 4096 - 512) break;
    P += W;
    m = ((n + P - 1) / P + 7) / 8 * 8;
  }
  if (k < 1) return -1;
  const System<R> A{L, D, U, B, n, k};
#if TT_HAVE_AVX2
  if (wide) return pieces_avx2(A, X, m, P);
#endif
  return run_pieces<typename Narrow<R>::T>(A, X, m, P);
}

}  // namespace
