// The batched kernel: ?gtsv's elimination for the W systems of a block at once, the same bits as
// LAPACK's sgtsv, dgtsv, cgtsv and zgtsv. Part of tridiag.cpp's translation unit (see lanes.h).
//
// Entry point: run_kernel<R, Complex, W>(n, k, d, du, dl, b, flag) solves W systems of n unknowns
// and k right-hand sides in place, R the reals (float or double; a complex number is two of
// them), in the block layout of real_kernel and complex_kernel below: d, du, dl the diagonal, the
// superdiagonal and the subdiagonal of the W systems (du and dl padded to n elements), b their
// right-hand sides. It returns nothing: on return b holds the W answers x, d the pivots, du and dl
// the rest of U (dl the fill-in of its second superdiagonal), and flag[w] (W values) is nonzero
// where system w met a zero pivot that ?gtsv reports; first_zero_pivot then gives the row where
// ?gtsv stops (INFO - 1). It never hands a system back: every system is solved with ?gtsv's
// operations, and a flagged one is the caller's to report. W = 1 is one system, with branches
// instead of selects where it is real (real_kernel_one); gather and scatter move a system into
// and out of lane w of a block.
//
// The arithmetic of the batched kernel is ?gtsv's, operation for operation: Gaussian elimination
// with partial pivoting
// (rows i and i+1 swap when |lower[i]| > |d[i]|, or when either magnitude is NaN, as the Fortran
// test ABS(D(I)) .GE. ABS(DL(I)) fails; |re| + |im| for complex, zgtsv's CABS1), the fill-in of
// the second superdiagonal after a swap, then back substitution. zgtsv skips a step whose
// subdiagonal entry is exactly zero, and so does the complex kernel here; complex products and
// quotients are written out the way gfortran evaluates them (Fortran rules: (ac - bd, ad + bc),
// and Smith's division), so that the results can match the library bit for bit.
//
// Speed: systems are processed in blocks of W (a compile-time constant: 8 doubles or 16 floats,
// one 64-byte line per element) in a batch-interleaved layout, element i of the W systems
// contiguous ([n][W] for a band, [n][k][W] for rhs, real and imaginary parts in separate rows of
// W for complex). Every operation acts on the W systems of the block at once, written with
// GCC/Clang vector types (16-byte SSE2 vectors of 2 doubles or 4 floats on plain x86-64, W / VL
// of them side by side), and the pivot choice is a select, not a branch. The gain is mostly
// that the W systems' eliminations are independent chains of divisions, which the CPU overlaps,
// where one system's elimination is a single chain that waits for each division.
//
// A system is reported exactly where ?gtsv returns INFO > 0: dgtsv/sgtsv check for a zero pivot
// only in the step without interchange (d[i] = 0 with |d[i]| >= |lower[i]|) and at d[n-1]; the
// interchange step is never checked (a NaN d[i] above a zero lower[i] gives NaN, not an error).
// zgtsv/cgtsv check only where lower[i] is zero. Systems never mix, so a NaN or infinity stays in
// its own system.

#pragma once

#include <cmath>
#include <cstdint>

#include "lanes.h"

namespace {

// --------------------------------------------------------------------------------------------
// Real kernel (sgtsv / dgtsv). Layout: d, du, dl [n][W]; b [n][k][W]. du[n-1] and dl[n-1] are
// zero padding (read by the last step, never used by the back substitution). dl receives the
// fill-in (LAPACK keeps it in DL as well). flag[w] becomes nonzero if system w met a zero pivot.
// --------------------------------------------------------------------------------------------
template <typename R, int W>
void real_kernel(int64_t n, int64_t k, R* __restrict__ d, R* __restrict__ du,
                 R* __restrict__ dl, R* __restrict__ b, R* __restrict__ flag) {
  using P = Pack<R, W>;
  using V = typename P::V;
  constexpr int VL = P::VL;
  const V zero{};
  const V one = zero + R(1);
  V bad[W / VL];
  for (int o = 0; o < W; o += VL) bad[o / VL] = zero;
  for (int64_t i = 0; i + 1 < n; ++i) {
    for (int o = 0; o < W; o += VL) {
      R* d0 = d + i * W + o;
      R* u0 = du + i * W + o;
      R* l0 = dl + i * W + o;
      const V a = ld<V>(d0), l = ld<V>(l0), c = ld<V>(u0), e = ld<V>(d0 + W), g = ld<V>(u0 + W);
      const auto s = lnot(P::abs(a) >= P::abs(l));  // interchange (also on NaN, as in dgtsv)
      const V p = s ? l : a;
      const V f = (s ? a : l) / p;
      st(d0, p);
      st(u0, s ? e : c);
      // swap: du[i] - f d[i+1];  no swap: d[i+1] - f du[i]
      st(d0 + W, (s ? c : e) - f * (s ? e : c));
      st(l0, s ? g : zero);  // fill-in U[i, i+2]
      st(u0 + W, s ? -(f * g) : g);
      // dgtsv stops (INFO = i+1) only on a zero pivot in the branch without interchange; the
      // interchange branch is never checked (a NaN d[i] above a zero lower[i] divides by zero
      // and gives NaN, with INFO = 0).
      bad[o / VL] = (lnot(s) & (a == zero)) ? one : bad[o / VL];
      for (int64_t j = 0; j < k; ++j) {
        R* b0 = b + (i * k + j) * W + o;
        R* b1 = b0 + k * W;
        const V x0 = ld<V>(b0), x1 = ld<V>(b1);
        const V q = s ? x1 : x0;
        st(b0, q);
        st(b1, (s ? x0 : x1) - f * q);
      }
    }
  }
  for (int o = 0; o < W; o += VL) {
    const V dn = ld<V>(d + (n - 1) * W + o);
    st(flag + o, dn == zero ? one : bad[o / VL]);
  }
  for (int64_t j = 0; j < k; ++j) {
    for (int o = 0; o < W; o += VL) {
      R* bn = b + ((n - 1) * k + j) * W + o;
      const R* dn = d + (n - 1) * W + o;
      st(bn, ld<V>(bn) / ld<V>(dn));
      if (n > 1) {
        R* bm = bn - k * W;
        st(bm, (ld<V>(bm) - ld<V>(du + (n - 2) * W + o) * ld<V>(bn)) / ld<V>(dn - W));
      }
    }
    for (int64_t i = n - 3; i >= 0; --i) {
      for (int o = 0; o < W; o += VL) {
        R* bi = b + (i * k + j) * W + o;
        const V x1 = ld<V>(bi + k * W), x2 = ld<V>(bi + 2 * k * W);
        const V t = ld<V>(bi) - ld<V>(du + i * W + o) * x1 - ld<V>(dl + i * W + o) * x2;
        st(bi, t / ld<V>(d + i * W + o));
      }
    }
  }
}

// --------------------------------------------------------------------------------------------
// Complex arithmetic as gfortran evaluates it (-fcx-fortran-rules, its default).
// --------------------------------------------------------------------------------------------
template <typename V>
TT_INLINE void cmul(V ar, V ai, V br, V bi, V& cr, V& ci) {
  cr = ar * br - ai * bi;
  ci = ar * bi + ai * br;
}

// Smith's division in GCC's operation order, with selects.
template <typename P, typename V>
TT_INLINE void cdiv(V ar, V ai, V br, V bi, V& cr, V& ci) {
  const auto t = P::abs(br) < P::abs(bi);
  const V num = t ? br : bi;
  const V den = t ? bi : br;
  const V ratio = num / den;
  const V div = num * ratio + den;
  const V tr = t ? ar * ratio + ai : ai * ratio + ar;
  const V ti = t ? ai * ratio - ar : ai - ar * ratio;
  cr = tr / div;
  ci = ti / div;
}

// --------------------------------------------------------------------------------------------
// Complex kernel (cgtsv / zgtsv). Layout: element i, part c (0 real, 1 imaginary), lane w of a
// band at [(2 i + c) W + w]; of rhs column j at [(2 (i k + j) + c) W + w].
// --------------------------------------------------------------------------------------------
template <typename R, int W>
void complex_kernel(int64_t n, int64_t k, R* __restrict__ d, R* __restrict__ du,
                    R* __restrict__ dl, R* __restrict__ b, R* __restrict__ flag) {
  using P = Pack<R, W>;
  using V = typename P::V;
  constexpr int VL = P::VL;
  constexpr int64_t E = 2 * W;  // one complex element of all lanes
  const V zero{};
  const V one = zero + R(1);
  V bad[W / VL];
  for (int o = 0; o < W; o += VL) bad[o / VL] = zero;
  for (int64_t i = 0; i + 1 < n; ++i) {
   for (int o = 0; o < W; o += VL) {
    R* d0 = d + i * E + o;
    R* u0 = du + i * E + o;
    R* l0 = dl + i * E + o;
    const V ar = ld<V>(d0), ai = ld<V>(d0 + W);
    const V lr = ld<V>(l0), li = ld<V>(l0 + W);
    const V cr = ld<V>(u0), ci = ld<V>(u0 + W);
    const V er = ld<V>(d0 + E), ei = ld<V>(d0 + E + W);
    const V gr = ld<V>(u0 + E), gi = ld<V>(u0 + E + W);
    const auto z = (lr == zero) & (li == zero);  // zgtsv: no elimination needed
    const auto s = lnot(z) & lnot(P::abs(ar) + P::abs(ai) >= P::abs(lr) + P::abs(li));
    const V pr = s ? lr : ar, pi = s ? li : ai;
    V qr, qi;
    cdiv<P>(s ? ar : lr, s ? ai : li, pr, pi, qr, qi);
    st(d0, pr);
    st(d0 + W, pi);
    st(u0, s ? er : cr);
    st(u0 + W, s ? ei : ci);
    // d[i+1]: swap: du[i] - f d[i+1]; no swap: d[i+1] - f du[i]; zero subdiagonal: unchanged
    V tr, ti;
    cmul(qr, qi, s ? er : cr, s ? ei : ci, tr, ti);
    st(d0 + E, z ? er : (s ? cr : er) - tr);
    st(d0 + E + W, z ? ei : (s ? ci : ei) - ti);
    V hr, hi;
    cmul(qr, qi, gr, gi, hr, hi);
    st(l0, s ? gr : zero);
    st(l0 + W, s ? gi : zero);
    st(u0 + E, s ? -hr : gr);
    st(u0 + E + W, s ? -hi : gi);
    bad[o / VL] = (pr == zero) & (pi == zero) ? one : bad[o / VL];
    for (int64_t j = 0; j < k; ++j) {
      R* b0 = b + (i * k + j) * E + o;
      R* b1 = b0 + k * E;
      const V x0r = ld<V>(b0), x0i = ld<V>(b0 + W), x1r = ld<V>(b1), x1i = ld<V>(b1 + W);
      const V yr = s ? x1r : x0r, yi = s ? x1i : x0i;
      V mr, mi;
      cmul(qr, qi, yr, yi, mr, mi);
      st(b0, yr);
      st(b0 + W, yi);
      st(b1, z ? x1r : (s ? x0r : x1r) - mr);
      st(b1 + W, z ? x1i : (s ? x0i : x1i) - mi);
    }
   }
  }
  for (int o = 0; o < W; o += VL) {
    const R* dn = d + (n - 1) * E + o;
    st(flag + o, (ld<V>(dn) == zero) & (ld<V>(dn + W) == zero) ? one : bad[o / VL]);
  }
  for (int64_t j = 0; j < k; ++j) {
   for (int o = 0; o < W; o += VL) {
    const R* dn = d + (n - 1) * E + o;
    const V dnr = ld<V>(dn), dni = ld<V>(dn + W);
    R* bn = b + ((n - 1) * k + j) * E + o;
    V xr, xi;
    cdiv<P>(ld<V>(bn), ld<V>(bn + W), dnr, dni, xr, xi);
    st(bn, xr);
    st(bn + W, xi);
    if (n > 1) {
      R* bm = bn - k * E;
      const R* um = du + (n - 2) * E + o;
      const R* dm = dn - E;
      V tr, ti, yr, yi;
      cmul(ld<V>(um), ld<V>(um + W), xr, xi, tr, ti);
      cdiv<P>(ld<V>(bm) - tr, ld<V>(bm + W) - ti, ld<V>(dm), ld<V>(dm + W), yr, yi);
      st(bm, yr);
      st(bm + W, yi);
    }
   }
    for (int64_t i = n - 3; i >= 0; --i) {
     for (int o = 0; o < W; o += VL) {
      R* bi = b + (i * k + j) * E + o;
      const R* x1 = bi + k * E;
      const R* x2 = bi + 2 * k * E;
      const R* di = d + i * E + o;
      const R* ui = du + i * E + o;
      const R* li = dl + i * E + o;
      V tr, ti, sr, si, yr, yi;
      cmul(ld<V>(ui), ld<V>(ui + W), ld<V>(x1), ld<V>(x1 + W), tr, ti);
      cmul(ld<V>(li), ld<V>(li + W), ld<V>(x2), ld<V>(x2 + W), sr, si);
      cdiv<P>((ld<V>(bi) - tr) - sr, (ld<V>(bi + W) - ti) - si, ld<V>(di), ld<V>(di + W), yr, yi);
      st(bi, yr);
      st(bi + W, yi);
     }
    }
  }
}

// One real system (W = 1): the same operations as real_kernel, with branches instead of selects,
// as dgtsv itself is written. A branch that is (almost) always taken the same way costs nothing,
// where a select computes both sides: for one long system this is what keeps pace with LAPACK.
template <typename R>
void real_kernel_one(int64_t n, int64_t k, R* __restrict__ d, R* __restrict__ du,
                     R* __restrict__ dl, R* __restrict__ b, R* __restrict__ flag) {
  bool bad = false;
  for (int64_t i = 0; i + 1 < n; ++i) {
    const R a = d[i], l = dl[i];
    R* b0 = b + i * k;
    R* b1 = b0 + k;
    if (std::abs(a) >= std::abs(l)) {  // no interchange (a NaN takes the other branch, as in dgtsv)
      bad |= a == R(0);
      const R f = l / a;
      d[i + 1] = d[i + 1] - f * du[i];
      dl[i] = R(0);
      for (int64_t j = 0; j < k; ++j) b1[j] = b1[j] - f * b0[j];
    } else {  // not checked for a zero pivot, as in dgtsv (see real_kernel)
      const R f = a / l, e = d[i + 1], c = du[i], g = du[i + 1];
      d[i] = l;
      du[i] = e;
      d[i + 1] = c - f * e;
      dl[i] = g;  // fill-in U[i, i+2]
      du[i + 1] = -(f * g);
      for (int64_t j = 0; j < k; ++j) {
        const R x0 = b0[j], x1 = b1[j];
        b0[j] = x1;
        b1[j] = x0 - f * x1;
      }
    }
  }
  flag[0] = (bad || d[n - 1] == R(0)) ? R(1) : R(0);
  for (int64_t j = 0; j < k; ++j) {
    R* bn = b + (n - 1) * k + j;
    *bn = *bn / d[n - 1];
    if (n > 1) {
      R* bm = bn - k;
      *bm = (*bm - du[n - 2] * *bn) / d[n - 2];
    }
    for (int64_t i = n - 3; i >= 0; --i) {
      R* bi = b + i * k + j;
      *bi = (*bi - du[i] * bi[k] - dl[i] * bi[2 * k]) / d[i];
    }
  }
}

template <typename R, bool Complex, int W>
inline void run_kernel(int64_t n, int64_t k, R* d, R* du, R* dl, R* b, R* flag) {
  if constexpr (Complex) {
    complex_kernel<R, W>(n, k, d, du, dl, b, flag);
  } else if constexpr (W == 1) {
    real_kernel_one<R>(n, k, d, du, dl, b, flag);
  } else {
    real_kernel<R, W>(n, k, d, du, dl, b, flag);
  }
}

// Lane w of an interleaved array <- count consecutive reals (and back).
template <typename R, int W>
inline void gather(R* __restrict__ dst, const R* __restrict__ src, int64_t count, int w) {
  for (int64_t q = 0; q < count; ++q) dst[q * W + w] = src[q];
}

template <typename R, int W>
inline void scatter(R* __restrict__ dst, const R* __restrict__ src, int64_t count, int w) {
  for (int64_t q = 0; q < count; ++q) dst[q] = src[q * W + w];
}

// The first zero pivot of lane w (d is final after the elimination), or -1: for a system the
// kernel flagged, the row where ?gtsv stops (INFO - 1). d[i] holds the pivot of step i, and a
// zero there is either a flagged stop or (real only) an unchecked zero pivot in the interchange
// branch, which needs d[i] = NaN: from then on every multiplier is NaN, every later step takes
// the interchange branch (no check) and d[n-1] is NaN, so such a system is not flagged at all.
// In a flagged system the first zero of d is therefore the first stop, and so is ?gtsv's INFO.
template <typename R, bool Complex, int W>
int64_t first_zero_pivot(const R* d, int64_t n, int w) {
  constexpr int C = Complex ? 2 : 1;
  for (int64_t i = 0; i < n; ++i) {
    const R* e = d + i * C * W;
    if (e[w] == R(0) && (!Complex || e[(C - 1) * W + w] == R(0))) return i;
  }
  return -1;
}

}  // namespace
