// The C++ half of the package's operators, built at install time (setup.py) as the extension
// module tridiag_tutorial._C, on PyTorch's stable ABI (torch/csrc/stable: STABLE_TORCH_LIBRARY,
// TORCH_BOX, torch::stable::Tensor), so one build loads in later torch releases too.
//
// It defines the schemas of the ops that compiled and exported graphs hold:
//
//   tridiag_tutorial::solve(lower, diag, upper, rhs, lu?, pivots?, trans, driver) -> x
//   tridiag_tutorial::solve_kernel(... the same ...) -> x
//   tridiag_tutorial::lu_factor(lower, diag, upper, driver) -> (lu, pivots)
//   tridiag_tutorial::cpp_solve(lower, diag, upper, rhs) -> (x, info)
//   tridiag_tutorial::cpp_solve_ex(lower, diag, upper, rhs, speculative_min_n) -> (x, info, fallbacks)
//   tridiag_tutorial::cpp_solve_backward(lower, diag, upper, x, grad_x)
//       -> (grad_lower, grad_diag, grad_upper, grad_rhs, info)
//
// The Python package (tridiag_tutorial/ops.py) registers their fake kernels, the Autograd kernel
// of solve, the vmap rules and the kernels of each device (LAPACK through SciPy, this file's
// kernel, kernels in torch ops), as pytorch/extension-cpp's ops.py does. What this file
// registers runs without Python: cpp_solve's CPU kernel, and a CompositeExplicitAutograd kernel
// for solve and solve_kernel, which is what a process that loads only this library (with
// torch.ops.load_library, an AOTInductor package say) runs. There every solve without factors
// runs on this file's kernel, which makes LAPACK ?gtsv's decisions bit for bit (the same
// systems raise, a NaN stays in its own system); a solve from factors (lu given) and lu_factor
// need the Python package and say so. In a process that imports tridiag_tutorial, the Python
// kernels, registered for the CPU and GPU dispatch keys, take precedence over that composite one.
//
// cpp_solve(lower, diag, upper, rhs) -> (x, info) solves A x = rhs for a batch of tridiagonal
// matrices A with lower[..., i] = A[i+1, i] (n-1), diag[..., i] = A[i, i] (n), upper[..., i] =
// A[i, i+1] (n-1) and rhs (*B, n, k), or (*B, n) for one right-hand side per system, all four
// with one batch shape *B (no broadcasting). It checks every tensor (defined, strided, on the CPU,
// one supported dtype, these shapes) before it reads one, so the Python package may call it on
// unvalidated tensors (its fast path does) and validate only where it refuses them. x is a new
// C-contiguous tensor of rhs's shape; the inputs are never modified.
// info is a 0-dim int64 tensor: -1, or s * n + p where s is the first singular system (flat C
// order over *B) and p the zero pivot ?gtsv reports there (INFO - 1). The Python caller turns it
// into tridiag_tutorial.SingularMatrixError (a torch.linalg.LinAlgError with the pivot and the
// batch index as attributes); the stable ABI cannot raise LinAlgError itself.
//
// The arithmetic is ?gtsv's, operation for operation: Gaussian elimination with partial pivoting
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
// where one system's elimination is a single chain that waits for each division. Blocks are
// distributed over threads with torch::stable::parallel_for (at::parallel_for underneath); the
// last block is padded with identity systems. Fewer than W systems (one large system, say) use
// the same code with W = 1, each system solved in place in the output, up to kSpeculativeMinN
// unknowns; from there on a real system goes to the speculative kernel below, which cuts it into
// pieces and eliminates the pieces side by side, with the same operations and so the same bits
// (cpp_solve_ex takes that size as an argument).
//
// A system is reported exactly where ?gtsv returns INFO > 0: dgtsv/sgtsv check for a zero pivot
// only in the step without interchange (d[i] = 0 with |d[i]| >= |lower[i]|) and at d[n-1]; the
// interchange step is never checked (a NaN d[i] above a zero lower[i] gives NaN, not an error).
// zgtsv/cgtsv check only where lower[i] is zero. Systems never mix, so a NaN or infinity stays in
// its own system.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <Python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// 32-byte vector types (the speculative kernel's AVX2 lanes) pass through the inline helpers
// below in code compiled for plain x86-64 too; GCC warns that their calling convention would
// differ there, which matters only for functions called across translation units (none are).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

extern "C" {
// An empty module tridiag_tutorial._C: importing it loads this library, whose static
// initialisers register the ops below (pytorch/extension-cpp's way). Py_LIMITED_API (CPython 3.10's
// limited API, set by torch's BuildExtension): one build serves every CPython from 3.10 on.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace {

// --------------------------------------------------------------------------------------------
// Lanes. Pack<R, W>::V is what one element of the W systems of a block is: a GCC/Clang vector
// of W reals (the compiler lowers it to the widest SIMD the target flags allow: SSE2 on plain
// x86-64), or the scalar R when W = 1. The kernels are written once on V: arithmetic is
// elementwise, comparisons give masks (bool for a scalar), and `m ? a : b` is a select (a blend
// for vectors), so there is no branch on data and no control flow to stop vectorisation.
// --------------------------------------------------------------------------------------------
// Lanes per block: one 64-byte cache line of reals per element (8 doubles, 16 floats).
template <typename R>
constexpr int kLanes = static_cast<int>(64 / sizeof(R));

#define TT_INLINE inline __attribute__((always_inline))

// 16-byte vectors: SSE2 (plain x86-64) and NEON have every operation used here on them, so GCC
// emits vector instructions (wider generic vectors would be expanded piecewise without -mavx).
// A block of W lanes is W / VL such vectors, handled side by side (independent division chains).
typedef double v2d __attribute__((vector_size(16)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v2l __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

template <typename R, int W>
struct Pack;
template <>
struct Pack<double, 8> {
  using V = v2d;
  using I = v2l;
  static constexpr int VL = 2;
  static TT_INLINE V abs(V x) { return (V)((I)x & (I{} + INT64_MAX)); }  // clear the sign bit
};
template <>
struct Pack<float, 16> {
  using V = v4f;
  using I = v4i;
  static constexpr int VL = 4;
  static TT_INLINE V abs(V x) { return (V)((I)x & (I{} + INT32_MAX)); }
};
template <typename R>
struct Pack<R, 1> {
  using V = R;
  static constexpr int VL = 1;
  static TT_INLINE V abs(V x) { return std::abs(x); }
};

template <typename V, typename R>
TT_INLINE V ld(const R* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename R>
TT_INLINE void st(R* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// A mask's negation that works for both a vector mask and a bool.
template <typename M>
TT_INLINE M lnot(const M& m) {
  return m == 0;
}

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

void record_singular(std::atomic<int64_t>& first, int64_t code) {
  int64_t seen = first.load();
  while (code < seen && !first.compare_exchange_weak(seen, code)) {
  }
}

// --------------------------------------------------------------------------------------------
// One large real system: many elimination chains in flight, LAPACK's answer bit for bit.
//
// ?gtsv (and real_kernel_one) is one chain of dependent divisions: each step needs the pivot the
// step before produced, so the CPU waits for every division and does little else. This kernel
// cuts the rows into P pieces of m rows and eliminates W pieces side by side in SIMD registers
// (their rows copied side by side, element i of the W pieces contiguous), each piece starting
// from a guess: that the rows above it changed nothing (its first row as given). The guess is
// wrong, but Gaussian elimination forgets its start: the state carried from row to row (the
// row's diagonal, superdiagonal and right-hand side as modified by the steps above) depends on
// the rows far above less and less, and after some tens of rows a chain started from the true
// state computes the very same numbers, to the last bit, as the chain started from the guess.
// So a repair runs the true chain from the end of the piece above (?gtsv's operations, scalar)
// until its state equals the speculative one at a checkpoint (every kCheckpoint rows); from
// there on, the speculative results are exact. The back substitution is done the same way,
// upward: each piece from a guess of zero below it, then repaired from the true values below
// until two consecutive values agree. Where a repair reaches the end of its piece without
// agreeing, the next piece's repair starts again from the repaired state, so the worst case is
// the sequential elimination itself (counted as a fallback).
//
// Every number is the result of the same operations on the same operands as in ?gtsv (the
// arithmetic of real_kernel, which matches it bit for bit), so the answer is ?gtsv's: the same
// accuracy, the same pivots. A zero pivot anywhere (a singular matrix, or a spurious one in a
// speculative row) and any non-finite answer hand the system to real_kernel_one, which reports
// ?gtsv's INFO and produces its NaNs.
// --------------------------------------------------------------------------------------------
typedef double v4d __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

template <typename V>
struct Lane;
template <>
struct Lane<v2d> {
  using R = double;
  using I = v2l;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v4f> {
  using R = float;
  using I = v4i;
  static constexpr int32_t kMag = INT32_MAX;
};
template <>
struct Lane<v4d> {
  using R = double;
  using I = v4l;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v8f> {
  using R = float;
  using I = v8i;
  static constexpr int32_t kMag = INT32_MAX;
};

// cpp_solve sends a real system of kSpeculativeMinN unknowns or more (one, or each of fewer than
// W) to the speculative kernel: from there on it measured faster than the sequential kernel
// (compiled.SPECULATIVE_MIN_N is the same number). cpp_solve_ex takes the size as an argument.
constexpr int64_t kSpeculativeMinN = 1024;
constexpr int64_t kPieceRows = 2048;
        // the target m (measured, one thread, AMD EPYC: 2048 rows took 0.89 to 0.94 of the time
        // of 1024 in float64 at n = 3e4 to 1e6, 0.91 to 0.96 in float32; 4096 no better but at
        // n = 1e6 in float32, with twice the tile scratch)
constexpr int64_t kMinPieceRows = 256;     // the least m when pieces are cut smaller for threads
constexpr int64_t kRepairGrain = 32;
        // pieces a thread repairs at least: a repair takes tens of rows, well under a
        // microsecond, and waking a second thread several (measured: grain 8 made two threads
        // slower than one below n = 1e4)
constexpr int64_t kCheckpoint = 8;
        // rows between two checkpoints of the forward state
constexpr int64_t kEdge = 64;
        // rows kept of each end of a piece (the repairs' reach) when pieces have 4 kEdge or more

// One system (n rows, k right-hand sides; L, U n-1 and D n reals, B and X n x k row-major) and
// the workspace of its pieces, in the side-by-side layout: piece q's row i at
// ((q / W * kept + row(i)) * W + q % W) (times k, plus column j, for b and x).
// The workspace keeps every row of each piece (edge = kept = m), or only its first and last
// `edge` rows (kept = 2 edge): the repairs work near the ends of the pieces, and the rows between
// go from a tile-sized scratch, in cache, straight to X.
template <typename R>
struct Spec {
  const R *L, *D, *U, *B;
  R* X;
  int64_t n, k, m, P, W;
  int64_t edge = 0, kept = 0;
  R *d = nullptr, *du = nullptr, *dl = nullptr, *b = nullptr, *x = nullptr;
  R* ck = nullptr;    // checkpoints [P / W][m / kCheckpoint + 1][2 + k][W]
  R* ends = nullptr;  // [P][2 + k]: each piece's state at its last row, speculative

  bool compact() const { return kept < m; }
  int64_t row(int64_t i) const { return i < edge ? i : i - (m - kept); }
  int64_t at(int64_t q, int64_t i) const { return (q / W * kept + row(i)) * W + q % W; }
  int64_t atb(int64_t q, int64_t i, int64_t j) const {
    return ((q / W * kept + row(i)) * k + j) * W + q % W;
  }
  int64_t checkpoints() const { return m / kCheckpoint + 1; }
  // Row r of A (identity rows past n): its diagonal, its entry right of the diagonal, the entry
  // below its diagonal (A[r+1, r]) and its right-hand side.
  R Dr(int64_t r) const { return r < n ? D[r] : R(1); }
  R Ur(int64_t r) const { return r + 1 < n ? U[r] : R(0); }
  R Lr(int64_t r) const { return r + 1 < n ? L[r] : R(0); }
  R Br(int64_t r, int64_t j) const { return r < n ? B[r * k + j] : R(0); }
};

// The rows of one tile (W pieces side by side) while it is eliminated: in the workspace itself,
// or in a scratch that the next tile of the same thread reuses.
template <typename R>
struct TileRows {
  R *d, *du, *dl, *b, *x;
};
constexpr int kZeroPivot = 1, kNotFinite = 2;

// A compact workspace: the first and last `edge` rows of tile t's pieces, from its scratch.
template <typename R>
void keep_edges(const Spec<R>& s, int64_t t, const TileRows<R>& rows) {
  R* const to[5] = {s.d, s.du, s.dl, s.b, s.x};
  const R* const from[5] = {rows.d, rows.du, rows.dl, rows.b, rows.x};
  for (int a = 0; a < 5; ++a) {
    const int64_t row = (a < 3 ? 1 : s.k) * s.W;  // reals per row of the tile
    R* base = to[a] + t * s.kept * row;
    std::memcpy(base, from[a], sizeof(R) * s.edge * row);
    std::memcpy(base + s.edge * row, from[a] + (s.m - s.edge) * row, sizeof(R) * s.edge * row);
  }
}

// GCC's __builtin_shuffle, for the transposes of the gather (elsewhere: element by element).
#if defined(__GNUC__) && !defined(__clang__)
#define TT_HAVE_SHUFFLE 1
#else
#define TT_HAVE_SHUFFLE 0
#endif

template <typename V, int NV>
struct SpecTile {
  using R = typename Lane<V>::R;
  using I = typename Lane<V>::I;
  static constexpr int VL = static_cast<int>(sizeof(V) / sizeof(R));
  static constexpr int W = NV * VL;

  static TT_INLINE V vabs(V x) { return (V)((I)x & (I{} + Lane<V>::kMag)); }

#if TT_HAVE_SHUFFLE
  // One round of a VL x VL transpose: rows a and a + H exchange their blocks of H elements.
  template <int H>
  static TT_INLINE void transpose_round(V* r) {
    I lo, hi;
    for (int p = 0; p < VL; ++p) {
      lo[p] = (p & H) == 0 ? p : VL + p - H;
      hi[p] = (p & H) == 0 ? p + H : VL + p;
    }
    for (int a = 0; a < VL; ++a) {
      if (a & H) continue;
      const V x = r[a], y = r[a + H];
      r[a] = __builtin_shuffle(x, y, lo);
      r[a + H] = __builtin_shuffle(x, y, hi);
    }
  }

  // Rows i .. i + VL - 1 of VL pieces (src[c]: piece c's first row) to dst, side by side (row
  // i + j at dst + j W): loaded a vector a piece, transposed in registers, stored a vector a
  // row, where a copy element by element takes a store for each.
  static TT_INLINE void transpose_in(const R* const* src, int64_t i, R* dst) {
    V r[VL];
    for (int c = 0; c < VL; ++c) r[c] = ld<V>(src[c] + i);
    if constexpr (VL >= 2) transpose_round<1>(r);
    if constexpr (VL >= 4) transpose_round<2>(r);
    if constexpr (VL >= 8) transpose_round<4>(r);
    for (int j = 0; j < VL; ++j) st(dst + j * W, r[j]);
  }

  // The way back: rows i .. i + VL - 1 of VL pieces side by side (src: row i, the first of the
  // VL lanes) to each piece's own rows (dst[c] + i), by the same transposes.
  static TT_INLINE void transpose_out(const R* src, int64_t i, R* const* dst) {
    V r[VL];
    for (int j = 0; j < VL; ++j) r[j] = ld<V>(src + j * W);
    if constexpr (VL >= 2) transpose_round<1>(r);
    if constexpr (VL >= 4) transpose_round<2>(r);
    if constexpr (VL >= 8) transpose_round<4>(r);
    for (int c = 0; c < VL; ++c) st(dst[c] + i, r[c]);
  }
#endif

  // Rows of the W pieces of tile t side by side, then each piece eliminated from its own first
  // row (?gtsv's forward steps, a select for the interchange), with checkpoints of the state.
  // Returns whether a step met a zero pivot.
  static TT_INLINE bool forward(const Spec<R>& s, int64_t t, const TileRows<R>& rows) {
    const int64_t m = s.m, k = s.k, first = t * W * m, C = s.checkpoints();
    R* d = rows.d;
    R* du = rows.du;
    R* dl = rows.dl;
    R* b = rows.b;
    R* ck = s.ck + t * C * (2 + k) * W;
    // Row i of the W pieces side by side. The copy goes a block of rows at a time, one piece
    // after another: W pieces read row by row at once are 4 W streams of memory, more than the
    // hardware prefetchers follow (measured: 3 times slower at n = 1e6).
    constexpr int64_t kBlock = 64;
    const V zero{};
    const V one = zero + R(1);
    V bad[NV], sa[NV], sc[NV], sb[NV];  // sa, sc, sb: the state carried down (k = 1: sb)
    for (int o = 0; o < NV; ++o) bad[o] = sa[o] = sc[o] = sb[o] = zero;
    for (int64_t i0 = 0; i0 < m; i0 += kBlock) {
      const int64_t i1 = std::min(m, i0 + kBlock);
      // Rows [i0, i1) of piece w and the row after them lie inside A when first + w m + i1 < n:
      // those are read as they are; the rows of the last piece near the end of A through
      // s.Dr and its kind (identity rows past n). The pieces of a group of VL whose rows all
      // lie inside are copied by transposes, rows [i0, iv).
      const int64_t iv = i0 + (i1 - i0) / VL * VL;
      bool transposed[NV];
      for (int g = 0; g < NV; ++g) transposed[g] = false;
#if TT_HAVE_SHUFFLE
      for (int g = 0; g < NV; ++g) {
        if (first + (g * VL + VL - 1) * m + i1 >= s.n) continue;
        transposed[g] = true;
        const R *Dp[VL], *Up[VL], *Lp[VL], *Bp[VL];
        for (int c = 0; c < VL; ++c) {
          const int64_t r0 = first + (g * VL + c) * m;
          Dp[c] = s.D + r0;
          Up[c] = s.U + r0;
          Lp[c] = s.L + r0;
          Bp[c] = s.B + r0;
        }
        for (int64_t i = i0; i < iv; i += VL) {
          transpose_in(Dp, i, d + i * W + g * VL);
          transpose_in(Up, i, du + i * W + g * VL);
          transpose_in(Lp, i, dl + i * W + g * VL);
          if (k == 1) transpose_in(Bp, i, b + i * W + g * VL);
        }
      }
#endif
      for (int w = 0; w < W; ++w) {
        const int64_t r0 = first + w * m;
        if (r0 + i1 < s.n) {
          const R* D = s.D + r0;
          const R* U = s.U + r0;
          const R* L = s.L + r0;
          // The block after next of this piece, while this one is copied (measured at n = 1e6:
          // two blocks ahead 0.55 of ?gtsv's time, one block 0.58, three 0.6 to 0.7).
          const int64_t ahead = std::min(m, i1 + 2 * kBlock);
          for (int64_t i = i1 + kBlock; i < ahead; i += 64 / static_cast<int64_t>(sizeof(R))) {
            __builtin_prefetch(D + i);
            __builtin_prefetch(U + i);
            __builtin_prefetch(L + i);
            __builtin_prefetch(s.B + r0 * k + i * k);
          }
          const int64_t from = transposed[w / VL] ? iv : i0;
          for (int64_t i = from; i < i1; ++i) d[i * W + w] = D[i];
          for (int64_t i = from; i < i1; ++i) du[i * W + w] = U[i];
          for (int64_t i = from; i < i1; ++i) dl[i * W + w] = L[i];
          if (k == 1) {
            const R* Bp = s.B + r0;
            for (int64_t i = from; i < i1; ++i) b[i * W + w] = Bp[i];
            continue;
          }
        } else {
          for (int64_t i = i0; i < i1; ++i) {
            d[i * W + w] = s.Dr(r0 + i);
            du[i * W + w] = s.Ur(r0 + i);
            dl[i * W + w] = s.Lr(r0 + i);
          }
        }
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t j = 0; j < k; ++j) b[(i * k + j) * W + w] = s.Br(r0 + i, j);
        }
      }
      // The steps whose two rows are in: (i, i + 1) for i + 1 < i1, while the block is in cache.
      // The state carried down (row i's diagonal and superdiagonal) stays in registers.
      for (int64_t i = std::max<int64_t>(0, i0 - 1); i + 1 < i1; ++i) {
        if (i == 0) {
          for (int o = 0; o < NV; ++o) {
            sa[o] = ld<V>(d + o * VL);
            sc[o] = ld<V>(du + o * VL);
            sb[o] = ld<V>(b + o * VL);
          }
        }
        if (i % kCheckpoint == 0) {
          R* c = ck + (i / kCheckpoint) * (2 + k) * W;
          for (int o = 0; o < NV; ++o) {
            st(c + o * VL, sa[o]);
            st(c + W + o * VL, sc[o]);
            if (k == 1) st(c + 2 * W + o * VL, sb[o]);
          }
          if (k != 1) std::memcpy(c + 2 * W, b + i * k * W, sizeof(R) * k * W);
        }
        for (int o = 0; o < NV; ++o) {
          R* d0 = d + i * W + o * VL;
          R* u0 = du + i * W + o * VL;
          R* l0 = dl + i * W + o * VL;
          const V a = sa[o], c = sc[o], l = ld<V>(l0), e = ld<V>(d0 + W), g = ld<V>(u0 + W);
          const auto sw = (vabs(a) >= vabs(l)) == 0;  // interchange (also on NaN, as in dgtsv)
          const V p = sw ? l : a;
          const V f = (sw ? a : l) / p;
          st(d0, p);
          st(u0, sw ? e : c);
          st(l0, sw ? g : zero);
          sa[o] = (sw ? c : e) - f * (sw ? e : c);
          sc[o] = sw ? -(f * g) : g;
          bad[o] = ((sw == 0) & (a == zero)) ? one : bad[o];
          if (k == 1) {  // one right-hand side: its state in a register too
            const V x0 = sb[o], x1 = ld<V>(b + (i + 1) * W + o * VL);
            const V q = sw ? x1 : x0;
            st(b + i * W + o * VL, q);
            sb[o] = (sw ? x0 : x1) - f * q;
            continue;
          }
          for (int64_t j = 0; j < k; ++j) {
            R* b0 = b + (i * k + j) * W + o * VL;
            R* b1 = b0 + k * W;
            const V x0 = ld<V>(b0), x1 = ld<V>(b1);
            const V q = sw ? x1 : x0;
            st(b0, q);
            st(b1, (sw ? x0 : x1) - f * q);
          }
        }
      }
    }
    for (int o = 0; o < NV; ++o) {  // the last row's state: its pivot row
      st(d + (m - 1) * W + o * VL, sa[o]);
      st(du + (m - 1) * W + o * VL, sc[o]);
      if (k == 1) st(b + (m - 1) * W + o * VL, sb[o]);
    }
    for (int w = 0; w < W; ++w) {  // each piece's state at its last row
      R* e = s.ends + (t * W + w) * (2 + k);
      e[0] = d[(m - 1) * W + w];
      e[1] = du[(m - 1) * W + w];
      for (int64_t j = 0; j < k; ++j) e[2 + j] = b[((m - 1) * k + j) * W + w];
    }
    bool any = false;
    for (int o = 0; o < NV; ++o) {
      for (int v = 0; v < VL; ++v) any |= bad[o][v] != R(0);
    }
    return any;
  }

  // Back substitution of the W pieces of tile t, each from a guess of zero below it, into x.
  static TT_INLINE void backward(const Spec<R>& s, const TileRows<R>& rows) {
    const int64_t m = s.m, k = s.k;
    const R* d = rows.d;
    const R* du = rows.du;
    const R* dl = rows.dl;
    const R* b = rows.b;
    R* x = rows.x;
    constexpr int kCols = 2;
    for (int64_t j0 = 0; j0 < k; j0 += kCols) {
      const int nc = static_cast<int>(std::min<int64_t>(kCols, k - j0));
      V xa[kCols][NV], xb[kCols][NV];  // x[i+1], x[i+2]
      for (int c = 0; c < nc; ++c) {
        for (int o = 0; o < NV; ++o) xa[c][o] = xb[c][o] = V{};
      }
      for (int64_t i = m - 1; i >= 0; --i) {
        for (int o = 0; o < NV; ++o) {
          const int64_t e = i * W + o * VL;
          const V dd = ld<V>(d + e), uu = ld<V>(du + e), ll = ld<V>(dl + e);
          for (int c = 0; c < nc; ++c) {
            const int64_t eb = (i * k + j0 + c) * W + o * VL;
            const V v = ((ld<V>(b + eb) - uu * xa[c][o]) - ll * xb[c][o]) / dd;
            st(x + eb, v);
            xb[c][o] = xa[c][o];
            xa[c][o] = v;
          }
        }
      }
    }
  }

  // Rows [from, to) of the W pieces of tile t into X, from x, which holds the pieces' rows
  // side by side from row x0 on (x0 <= from); false where one of their values is not finite.
  static TT_INLINE bool scatter(const Spec<R>& s, int64_t t, const R* x, int64_t x0,
                                int64_t from, int64_t to) {
    const int64_t m = s.m, k = s.k, first = t * W * m;
    V finite[NV];  // stay 0 where every value is finite (inf - inf and NaN are NaN)
    for (int o = 0; o < NV; ++o) finite[o] = V{};
    for (int64_t e = (from - x0) * k * W; e < (to - x0) * k * W; e += W) {
      for (int o = 0; o < NV; ++o) {
        const V v = ld<V>(x + e + o * VL);
        finite[o] += v - v;
      }
    }
    int hi = W;  // lanes whose piece lies inside A
    while (hi > 0 && first + hi * m > s.n) --hi;
    constexpr int64_t kBlock = 64;  // a block of rows at a time, as in forward
    for (int64_t i0 = from; i0 < to; i0 += kBlock) {
      const int64_t i1 = std::min(to, i0 + kBlock);
      const int64_t iv = i0 + (i1 - i0) / VL * VL;  // rows [i0, iv): by transposes, k = 1
      bool transposed[NV];
      for (int g = 0; g < NV; ++g) transposed[g] = false;
#if TT_HAVE_SHUFFLE
      for (int g = 0; g < NV && k == 1; ++g) {
        if ((g + 1) * VL > hi) break;
        transposed[g] = true;
        R* Xp[VL];
        for (int c = 0; c < VL; ++c) Xp[c] = s.X + first + (g * VL + c) * m;
        for (int64_t i = i0; i < iv; i += VL) transpose_out(x + (i - x0) * W + g * VL, i, Xp);
      }
#endif
      for (int w = 0; w < W; ++w) {
        const int64_t r0 = first + w * m;
        if (w < hi && k == 1) {
          R* Xp = s.X + r0;
          for (int64_t i = transposed[w / VL] ? iv : i0; i < i1; ++i) Xp[i] = x[(i - x0) * W + w];
          continue;
        }
        for (int64_t i = i0; i < i1 && r0 + i < s.n; ++i) {
          for (int64_t j = 0; j < k; ++j) {
            s.X[(r0 + i) * k + j] = x[((i - x0) * k + j) * W + w];
          }
        }
      }
    }
    bool ok = true;
    for (int o = 0; o < NV; ++o) {
      for (int v = 0; v < VL; ++v) ok &= finite[o][v] == R(0);
    }
    return ok;
  }

  // Tile t: the speculative elimination, then at once (its rows still in cache) the speculative
  // back substitution; with a compact workspace, then its edges kept and the rows between them
  // written to X. Returns kZeroPivot and kNotFinite bits.
  static TT_INLINE int tile(const Spec<R>& s, int64_t t, const TileRows<R>& rows) {
    int flags = forward(s, t, rows) ? kZeroPivot : 0;
    backward(s, rows);
    if (s.compact()) {
      keep_edges(s, t, rows);
      if (!scatter(s, t, rows.x, 0, s.edge, s.m - s.edge)) flags |= kNotFinite;
    }
    return flags;
  }
};

// kFar: the repair needs rows that a compact workspace does not keep (the system is then solved
// again with every row kept).
enum class Repair { kMerged, kThrough, kBad, kFar };

// Whether two reals have the same bits: == would take -0.0 for +0.0, whose sign a later
// division can turn into an infinity of the other sign (and ?gtsv's answer keeps it).
template <typename R>
TT_INLINE bool same_bits(R a, R b) {
  return std::memcmp(&a, &b, sizeof(R)) == 0;
}

// The forward repair of piece q >= 1: ?gtsv's steps from the state `state` ([2 + k]: diagonal,
// superdiagonal, right-hand side) of the last row of piece q - 1, through the first rows of
// piece q, until the state equals a checkpoint of the speculative chain. The steps' pivot rows
// are written over the speculative ones. kThrough: no agreement in the piece; `state` is then
// the state of piece q's last row. kBad: a zero pivot. kFar: see Repair.
// A repair that runs again (its state above has changed) does not stop before `reach`, the row
// where the earlier one stopped: the rows before it hold the earlier run's values. On return,
// reach is the row where this one stopped.
template <typename R>
Repair repair_forward(const Spec<R>& s, int64_t q, R* state, int64_t& reach) {
  const int64_t m = s.m, k = s.k, C = s.checkpoints();
  const int64_t W = s.W;
  const R* ck = s.ck + (q / W * C) * (2 + k) * W + q % W;
  const int64_t min_stop = reach;
  for (int64_t i = -1; i + 1 < m; ++i) {  // the step of rows (i, i + 1) of piece q
    reach = i;
    if (i >= min_stop && i % kCheckpoint == 0) {
      const R* c = ck + (i / kCheckpoint) * (2 + k) * W;
      bool same = same_bits(c[0], state[0]) && same_bits(c[W], state[1]);
      for (int64_t j = 0; j < k && same; ++j) same = same_bits(c[(2 + j) * W], state[2 + j]);
      if (same) return Repair::kMerged;
    }
    // Row i, and the two rows the back substitution starts again from, among the kept ones.
    if (s.compact() && i + 2 >= s.edge) return Repair::kFar;
    const int64_t r = q * m + i;  // the global row of the pivot row
    const int64_t at = i >= 0 ? s.at(q, i) : s.at(q - 1, m - 1);
    const R a = state[0], c = state[1];
    const R l = s.Lr(r), e = s.Dr(r + 1), g = s.Ur(r + 1);
    const bool sw = !(std::abs(a) >= std::abs(l));
    if (!sw && a == R(0)) return Repair::kBad;
    const R p = sw ? l : a;
    const R f = (sw ? a : l) / p;
    s.d[at] = p;
    s.du[at] = sw ? e : c;
    s.dl[at] = sw ? g : R(0);
    state[0] = (sw ? c : e) - f * (sw ? e : c);
    state[1] = sw ? -(f * g) : g;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t atb = i >= 0 ? s.atb(q, i, j) : s.atb(q - 1, m - 1, j);
      const R x0 = state[2 + j], x1 = s.Br(r + 1, j);
      const R qv = sw ? x1 : x0;
      s.b[atb] = qv;
      state[2 + j] = (sw ? x0 : x1) - f * qv;
    }
  }
  reach = m;
  return Repair::kThrough;
}

// The backward repair of piece q <= P - 2, column j: the back substitution from the true values
// of piece q + 1's first two rows, until two consecutive values equal the speculative ones
// (kMerged), or through the piece (kThrough), or to a row a compact workspace does not keep.
template <typename R>
Repair repair_backward(const Spec<R>& s, int64_t q, int64_t j, R xa, R xb) {
  bool same_below = false;
  for (int64_t i = s.m - 1; i >= 0; --i) {
    if (s.compact() && i < s.m - s.edge) return Repair::kFar;
    const int64_t e = s.at(q, i), eb = s.atb(q, i, j);
    const R v = ((s.b[eb] - s.du[e] * xa) - s.dl[e] * xb) / s.d[e];
    const bool same = same_bits(v, s.x[eb]);
    if (same && same_below) return Repair::kMerged;
    if (!same) s.x[eb] = v;
    same_below = same;
    xb = xa;
    xa = v;
  }
  return Repair::kThrough;
}


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TT_HAVE_AVX2 1
#define TT_AVX2 __attribute__((target("avx2")))
TT_AVX2 int tile_avx2(const Spec<double>& s, int64_t t, const TileRows<double>& rows) {
  return SpecTile<v4d, 2>::tile(s, t, rows);
}
TT_AVX2 int tile_avx2(const Spec<float>& s, int64_t t, const TileRows<float>& rows) {
  return SpecTile<v8f, 2>::tile(s, t, rows);
}
TT_AVX2 bool scatter_avx2(const Spec<double>& s, int64_t t, const double* x, int64_t x0,
                          int64_t from, int64_t to) {
  return SpecTile<v4d, 2>::scatter(s, t, x, x0, from, to);
}
TT_AVX2 bool scatter_avx2(const Spec<float>& s, int64_t t, const float* x, int64_t x0,
                          int64_t from, int64_t to) {
  return SpecTile<v8f, 2>::scatter(s, t, x, x0, from, to);
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
  using T = SpecTile<v2d, 4>;
};
template <>
struct Narrow<float> {
  using T = SpecTile<v4f, 4>;
};
template <typename R>
struct Wide;  // 32-byte vectors (AVX2), chosen at run time
template <>
struct Wide<double> {
  using T = SpecTile<v4d, 2>;
};
template <>
struct Wide<float> {
  using T = SpecTile<v8f, 2>;
};

// The workspace of the speculative kernel: kept by each thread between calls and grown to the
// largest it needed (Tag: the calling thread's workspace, 0, or a thread's tile scratch, 1).
// Fresh memory costs a page fault per 4 KiB on its first use, as much as the solve itself at
// n = 1e6 (measured: 2.6x the time of a solve with the workspace kept).
template <typename R, int Tag>
R* workspace(int64_t count) {
  thread_local std::unique_ptr<R[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < count) {
    buffer.reset();
    buffer.reset(new R[count]);
    capacity = count;
  }
  return buffer.get();
}

// The back substitution of piece q's rows [0, top) again (a forward repair rewrote their pivot
// rows), upward from the values of rows top and top + 1 (past the piece: the guess of zero).
template <typename R>
void redo_top(const Spec<R>& s, int64_t q, int64_t top) {
  const int64_t m = s.m;
  for (int64_t j = 0; j < s.k; ++j) {
    R xa = top < m ? s.x[s.atb(q, top, j)] : R(0);
    R xb = top + 1 < m ? s.x[s.atb(q, top + 1, j)] : R(0);
    for (int64_t i = top - 1; i >= 0; --i) {
      const int64_t e = s.at(q, i), eb = s.atb(q, i, j);
      const R v = ((s.b[eb] - s.du[e] * xa) - s.dl[e] * xb) / s.d[e];
      s.x[eb] = v;
      xb = xa;
      xa = v;
    }
  }
}

// The repairs of the join between piece q - 1 and piece q, for a compact workspace: the forward
// repair of q from q - 1's speculative last state, the back substitution of q's first rows again,
// and the backward repair of q - 1 from q's first two values (kept in tops). With a compact
// workspace a forward repair only touches the first `edge` rows of a piece (and the last row of
// the piece above) and a backward repair only the last `edge`, so the joins can be repaired in
// any order, each by itself; the answer is that of run_speculative's phases, one after another,
// wherever every repair merges. Returns false where one did not (the caller then runs those
// phases).
template <typename R>
bool repair_join(const Spec<R>& s, int64_t q, R* state, int64_t& reach, R* tops) {
  const int64_t k = s.k;
  std::copy(s.ends + (q - 1) * (2 + k), s.ends + q * (2 + k), state);
  reach = -1;
  if (repair_forward(s, q, state, reach) != Repair::kMerged) return false;
  redo_top(s, q, reach);
  for (int64_t j = 0; j < k; ++j) {
    const R xa = s.x[s.atb(q, 0, j)], xb = s.x[s.atb(q, 1, j)];
    tops[(q * k + j) * 2] = xa;
    tops[(q * k + j) * 2 + 1] = xb;
    if (repair_backward(s, q - 1, j, xa, xb) != Repair::kMerged) return false;
  }
  return true;
}

// One run of the speculative kernel on the pieces that s describes, its workspace kept whole
// (s.kept = s.m) or compact. Returns 0 where it solved the system, 1 where a repair went through
// a whole piece (the answer is still ?gtsv's), -1 where it could not (a zero pivot or a value
// that is not finite) and -2 where a repair needed a row that a compact workspace lacks.
// joined (a compact workspace only): each thread repairs the joins inside the tiles it has just
// eliminated, while their rows are still in its core's cache, and the joins between tiles are
// repaired after (repair_join), instead of the phases below, each over all the pieces, one
// after another; where a repair does not merge, it returns -3 and the caller runs those phases.
template <typename R>
int run_speculative(Spec<R>& s, bool wide, bool joined = false) {
  const int64_t k = s.k, m = s.m, P = s.P, W = s.W;
  const int64_t tiles = P / W, C = s.checkpoints(), rows = P * s.kept;
  s.d = workspace<R, 0>(rows * (3 + 2 * k) + tiles * C * (2 + k) * W + P * (2 + k));
  s.du = s.d + rows;
  s.dl = s.du + rows;
  s.b = s.dl + rows;
  s.x = s.b + rows * k;
  s.ck = s.x + rows * k;
  s.ends = s.ck + tiles * C * (2 + k) * W;
  // Every tile: eliminated, substituted back and (compact) written out, in the workspace itself
  // or in a scratch of its thread's.
  std::atomic<int> flags{0};
  joined = joined && s.compact();
  std::vector<R> tops(P * k * 2);  // the first two values of each piece a backward repair used
  std::unique_ptr<int64_t[]> reach(new int64_t[P]);
  std::atomic<bool> merged{true};
  torch::stable::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    R* scratch = s.compact() ? workspace<R, 1>(m * W * (3 + 2 * k)) : nullptr;
    std::vector<R> state(joined ? 2 + k : 0);
    for (int64_t t = begin; t < end; ++t) {
      TileRows<R> rows{s.d + t * m * W, s.du + t * m * W, s.dl + t * m * W,
                       s.b + t * m * k * W, s.x + t * m * k * W};
      if (s.compact()) {
        rows = {scratch, scratch + m * W, scratch + 2 * m * W, scratch + 3 * m * W,
                scratch + (3 + k) * m * W};
      }
      int f;
#if TT_HAVE_AVX2
      if (wide) {
        f = tile_avx2(s, t, rows);
      } else
#endif
      {
        f = Narrow<R>::T::tile(s, t, rows);
      }
      flags.fetch_or(f);
      // The joins inside the tile, by the thread that eliminated it.
      for (int64_t q = t * W + 1; joined && !(f & kZeroPivot) && q < (t + 1) * W; ++q) {
        if (!repair_join(s, q, state.data(), reach[q], tops.data())) {
          merged.store(false);
          break;
        }
      }
    }
  });
  if (flags.load() & kZeroPivot) return -1;
  if (joined) {
    if (flags.load() & kNotFinite) return -1;  // (as the phases below would, at their end)
    if (!merged.load()) return -3;
    // The joins between tiles (their rows are in other cores' caches: few, spread as repairs).
    const int64_t grain = std::max<int64_t>(1, kRepairGrain / W);
    torch::stable::parallel_for(1, tiles, grain, [&](int64_t begin, int64_t end) {
      std::vector<R> state(2 + k);
      for (int64_t t = begin; t < end; ++t) {
        if (!repair_join(s, t * W, state.data(), reach[t * W], tops.data())) merged.store(false);
      }
    });
    if (!merged.load()) return -3;
    if (s.d[s.at(P - 1, m - 1)] == R(0)) return -1;  // ?gtsv's check of the last pivot
    // (Every piece's first two values are still those its upper neighbour's repair used: a
    // repair that merged did not reach them. Checked all the same, as below.)
    for (int64_t q = 1; q < P; ++q) {
      for (int64_t j = 0; j < k; ++j) {
        if (!same_bits(s.x[s.atb(q, 0, j)], tops[(q * k + j) * 2]) ||
            !same_bits(s.x[s.atb(q, 1, j)], tops[(q * k + j) * 2 + 1])) {
          return -3;
        }
      }
    }
  }
  int result = 0;
  if (!joined) {
    // Forward repairs: all at once, each from the speculative state above it (ends); then, in
    // order, again below each piece that a repair went through (its last row's state changed).
    std::unique_ptr<Repair[]> how(new Repair[P]);
    std::vector<R> states(P * (2 + k));
    torch::stable::parallel_for(1, P, kRepairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        R* state = &states[q * (2 + k)];
        std::copy(s.ends + (q - 1) * (2 + k), s.ends + q * (2 + k), state);
        reach[q] = -1;
        how[q] = repair_forward(s, q, state, reach[q]);
      }
    });
    for (int64_t q = 1; q < P; ++q) {
      if (how[q] == Repair::kFar) return -2;
    }
    for (int64_t q = 1; q < P; ++q) {
      if (how[q] == Repair::kBad) return -1;
      if (how[q] != Repair::kThrough) continue;
      result = 1;
      if (q + 1 == P) {  // the last row of all: its state is its final pivot
        const int64_t e = s.at(q, m - 1);
        s.d[e] = states[q * (2 + k)];
        s.du[e] = states[q * (2 + k) + 1];
        for (int64_t j = 0; j < k; ++j) s.b[s.atb(q, m - 1, j)] = states[q * (2 + k) + 2 + j];
        break;
      }
      R* next = &states[(q + 1) * (2 + k)];
      std::copy(&states[q * (2 + k)], &states[(q + 1) * (2 + k)], next);
      how[q + 1] = repair_forward(s, q + 1, next, reach[q + 1]);
    }
    if (s.d[s.at(P - 1, m - 1)] == R(0)) return -1;  // ?gtsv's check of the last pivot
    // The repairs rewrote the pivot rows of the first reach[q] rows of each piece q (all of them
    // where one went through): their speculative back substitution used the old ones. Run it
    // again there, upward from the first row the repair left alone (below the piece: the same
    // guess of zero). The last row of the piece above also changed: its backward repair, which
    // starts there, takes care of it.
    torch::stable::parallel_for(1, P, kRepairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) redo_top(s, q, std::min(reach[q], m));
    });
    // Backward repairs: all at once from the speculative values of the first two rows below
    // (tops), then upward again above each piece that a repair went through.
    for (int64_t q = 1; q < P; ++q) {
      for (int64_t j = 0; j < k; ++j) {
        tops[(q * k + j) * 2] = s.x[s.atb(q, 0, j)];
        tops[(q * k + j) * 2 + 1] = s.x[s.atb(q, 1, j)];
      }
    }
    std::atomic<int> through{0};  // bit 1: a repair went through a piece; bit 2: one went far
    torch::stable::parallel_for(0, P - 1, kRepairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        for (int64_t j = 0; j < k; ++j) {
          const Repair r = repair_backward(s, q, j, tops[((q + 1) * k + j) * 2],
                                           tops[((q + 1) * k + j) * 2 + 1]);
          if (r != Repair::kMerged) through.fetch_or(r == Repair::kFar ? 2 : 1);
        }
      }
    });
    if (through.load() & 2) return -2;
    if (through.load() & 1) result = 1;
    // From the bottom up: where a piece's first two values are not those its upper neighbour's
    // repair started from, that repair runs again from the values now there.
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t q = P - 2; q >= 0; --q) {
        const R xa = s.x[s.atb(q + 1, 0, j)], xb = s.x[s.atb(q + 1, 1, j)];
        if (same_bits(xa, tops[((q + 1) * k + j) * 2]) &&
            same_bits(xb, tops[((q + 1) * k + j) * 2 + 1])) {
          continue;
        }
        result = 1;
        if (repair_backward(s, q, j, xa, xb) == Repair::kFar) return -2;
      }
    }
  }
  if (flags.load() & kNotFinite) return -1;
  // Into X: with a compact workspace the kept rows (the first and last `edge` of each piece; the
  // tiles wrote the others), else every row; each tile by the thread that eliminated it, by the
  // same transposes as the tiles' own scatter.
  std::atomic<bool> finite{true};
  torch::stable::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const R* x = s.x + t * s.kept * k * W;
      const int64_t bottom = m - s.edge, rest = s.compact() ? s.edge : m;
      bool ok;
#if TT_HAVE_AVX2
      if (wide) {
        ok = scatter_avx2(s, t, x, 0, 0, rest) &&
             (!s.compact() || scatter_avx2(s, t, x + s.edge * k * W, bottom, bottom, m));
      } else
#endif
      {
        ok = Narrow<R>::T::scatter(s, t, x, 0, 0, rest) &&
             (!s.compact() || Narrow<R>::T::scatter(s, t, x + s.edge * k * W, bottom, bottom, m));
      }
      if (!ok) finite.store(false);
    }
  });
  return finite.load() ? result : -1;
}

// Solve one real system on the speculative kernel. Returns 0 where it solved it, 1 where a
// repair went through a whole piece (the answer is still ?gtsv's), and -1 where it could not
// (a zero pivot or a value that is not finite; X is then undefined and the caller solves the
// system with real_kernel_one).
template <typename R>
int solve_speculative(const R* L, const R* D, const R* U, const R* B, R* X, int64_t n,
                      int64_t k) {
#if TT_HAVE_AVX2
  const bool wide = cpu_has_avx2();
#else
  const bool wide = false;
#endif
  const int64_t W = wide ? Wide<R>::T::W : Narrow<R>::T::W;
  // About kPieceRows rows a piece, but at least one tile of W pieces per thread where pieces of
  // kMinPieceRows rows allow it (the tiles are what the threads share).
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  int64_t P = std::max<int64_t>(W, (n + kPieceRows - 1) / kPieceRows);
  P = std::max<int64_t>(P, W * std::min<int64_t>(threads, n / (W * kMinPieceRows)));
  P = (P + W - 1) / W * W;
  int64_t m = (n + P - 1) / P;
  // W pieces are read side by side, m rows apart: a distance close to a multiple of 4 KiB puts
  // them in one set of the L1 cache, which then misses on every row. Move away from it.
  while (m * static_cast<int64_t>(sizeof(R)) > 4096 - 512) {
    const int64_t off = (m * static_cast<int64_t>(sizeof(R))) % 4096;
    if (off >= 512 && off <= 4096 - 512) break;
    P += W;
    m = (n + P - 1) / P;
  }
  if (m < 2 * kCheckpoint) return -1;
  Spec<R> s{L, D, U, B, X, n, k, m, P, W};
  // First with the compact workspace (long enough pieces), then, where a repair reached past
  // its rows, with every row kept.
  if (m >= 4 * kEdge) {
    s.edge = kEdge;
    s.kept = 2 * kEdge;
    int how = run_speculative(s, wide, true);
    if (how == -3) how = run_speculative(s, wide);
    if (how != -2) return how;
  }
  s.edge = s.kept = m;
  return run_speculative(s, wide);
}


// Solve nsys systems of size n with k right-hand sides. L, D, U, Bm, X are the contiguous
// inputs and output as reals (complex: interleaved parts). first: min over singular systems of
// system * n + pivot.
template <typename R, bool Complex>
void solve_all(const R* L, const R* D, const R* U, const R* Bm, R* X, int64_t nsys, int64_t n,
               int64_t k, std::atomic<int64_t>& first, int64_t speculative_min_n,
               int64_t& fallbacks) {
  constexpr int C = Complex ? 2 : 1;
  constexpr int W = kLanes<R>;
  const int64_t band = (n - 1) * C, dsize = n * C, bsize = n * k * C;
  const int64_t work = std::max<int64_t>(1, n * (k + 3));  // per system, roughly
  std::vector<int64_t> sequential;  // the systems that the elimination below solves
  bool speculative = false;
  if constexpr (!Complex) {
    speculative = nsys < W && n >= speculative_min_n && k >= 1;
    if (speculative) {
      // A few large systems: one after another, each on the speculative kernel (its pieces
      // spread over the threads); a system it hands back is solved below, sequentially.
      for (int64_t s = 0; s < nsys; ++s) {
        const int how = solve_speculative<R>(L + s * band, D + s * dsize, U + s * band,
                                             Bm + s * bsize, X + s * bsize, n, k);
        if (how != 0) ++fallbacks;
        if (how < 0) sequential.push_back(s);
      }
      if (sequential.empty()) return;
    }
  }
  if (nsys < W) {
    if (!speculative) {
      for (int64_t s = 0; s < nsys; ++s) sequential.push_back(s);
    }
    // Few systems (one large system, say): W = 1, each system solved in place in the output.
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / work);
    const int64_t count = static_cast<int64_t>(sequential.size());
    torch::stable::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      std::unique_ptr<R[]> ws(new R[3 * dsize]);  // uninitialised: every element is written below
      R* d = ws.get();
      R* du = d + dsize;
      R* dl = du + dsize;
      for (int64_t t = begin; t < end; ++t) {
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
  torch::stable::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<R[]> ws(new R[(3 * dsize + bsize) * W]);  // uninitialised, filled below
    R* d = ws.get();
    R* du = d + dsize * W;
    R* dl = du + dsize * W;
    R* b = dl + dsize * W;
    for (int64_t blk = begin; blk < end; ++blk) {
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

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// aten::<name>(self) through the dispatcher, by name: the stable ABI's way to any ATen op.
Tensor call_unary(const char* name, const Tensor& self) {
  std::array<StableIValue, 1> stack{torch::stable::detail::from(self)};
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher(name, "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// The values of t in C order: lazily conjugated or negated views resolved, then contiguous.
// Each call below goes through the dispatcher by name (about 0.2 us), more than the solve of a
// small system, so only the ones that can change something are made: a real tensor never has
// the conjugate bit (torch asserts it), and a contiguous one needs no copy.
Tensor dense_values(const Tensor& t, bool complex) {
  Tensor r = call_unary("aten::resolve_neg", complex ? call_unary("aten::resolve_conj", t) : t);
  return r.is_contiguous() ? r : torch::stable::contiguous(r);
}

bool same_sizes(const Tensor& t, const std::vector<int64_t>& shape) {
  if (t.dim() != static_cast<int64_t>(shape.size())) return false;
  for (int64_t a = 0; a < t.dim(); ++a) {
    if (t.size(a) != shape[a]) return false;
  }
  return true;
}

// What cpp_solve checks before it reads a tensor (Python callers may rely on it instead of their
// own checks: the fast path of tridiagonal_solve calls the op on unvalidated tensors and, on an
// error, validates in Python for a typed message): every tensor defined, strided, on the CPU, of
// one supported dtype; lower, upper (*B, n-1), diag (*B, n) with n >= 1, and rhs (*B, n) (one
// right-hand side) or (*B, n, k), all with one batch shape.
struct Sizes {
  int64_t n, k, nsys;
};

Sizes check_inputs(const Tensor& lower, const Tensor& diag, const Tensor& upper,
                   const Tensor& rhs, const char* op = "tridiag_tutorial::cpp_solve",
                   const char* rhs_name = "rhs") {
  const std::pair<const char*, const Tensor*> all[] = {
      {"lower", &lower}, {"diag", &diag}, {"upper", &upper}, {rhs_name, &rhs}};
  for (const auto& [name, t] : all) {
    STD_TORCH_CHECK(t->defined(), op, ": ", name, " is undefined");
    STD_TORCH_CHECK(t->layout() == torch::headeronly::Layout::Strided, op, ": ", name,
                    " must be a dense (strided) tensor");
    STD_TORCH_CHECK(t->is_cpu(), op, ": CPU tensors only (", name, " is not on the CPU)");
  }
  STD_TORCH_CHECK(diag.dim() >= 1, op, ": diag must have a last dimension n");
  const bool vector = rhs.dim() == diag.dim();
  STD_TORCH_CHECK(vector || rhs.dim() == diag.dim() + 1, op, ": ", rhs_name, " must be (*B, n) "
                  "or (*B, n, k) for diag (*B, n); got ", rhs_name, " with ", rhs.dim(),
                  " dimensions and diag with ", diag.dim());
  const int64_t n = diag.size(-1);
  const int64_t k = vector ? 1 : rhs.size(-1);
  STD_TORCH_CHECK(n >= 1, op, ": n must be at least 1");
  std::vector<int64_t> band_shape, rhs_shape;
  for (int64_t a = 0; a + 1 < diag.dim(); ++a) band_shape.push_back(diag.size(a));
  rhs_shape = band_shape;
  band_shape.push_back(n - 1);
  rhs_shape.push_back(n);
  if (!vector) rhs_shape.push_back(k);
  STD_TORCH_CHECK(same_sizes(lower, band_shape) && same_sizes(upper, band_shape) &&
                      same_sizes(rhs, rhs_shape),
                  op, ": shapes must be lower, upper (*B, n-1), diag (*B, n) and ", rhs_name,
                  " (*B, n) or (*B, n, k), with one batch shape");
  const ScalarType dtype = diag.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double ||
                      dtype == ScalarType::ComplexFloat || dtype == ScalarType::ComplexDouble,
                  op, ": dtype must be float32, float64, complex64 or complex128");
  for (const auto& [name, t] : all) {
    STD_TORCH_CHECK(t->scalar_type() == dtype, op, ": all inputs must have one dtype");
  }
  return {n, k, diag.numel() / n};
}

bool is_complex(ScalarType dtype) {
  return dtype == ScalarType::ComplexFloat || dtype == ScalarType::ComplexDouble;
}

// x = M^{-1} b for nsys systems, dispatched on dtype. L, D, U are M's bands (contiguous).
void solve_dtype(ScalarType dtype, const void* L, const void* D, const void* U, const void* B,
                 void* X, int64_t nsys, int64_t n, int64_t k, std::atomic<int64_t>& first,
                 int64_t speculative_min_n, int64_t& fallbacks) {
  switch (dtype) {
    case ScalarType::Float:
      solve_all<float, false>(static_cast<const float*>(L), static_cast<const float*>(D),
                              static_cast<const float*>(U), static_cast<const float*>(B),
                              static_cast<float*>(X), nsys, n, k, first, speculative_min_n,
                              fallbacks);
      break;
    case ScalarType::Double:
      solve_all<double, false>(static_cast<const double*>(L), static_cast<const double*>(D),
                               static_cast<const double*>(U), static_cast<const double*>(B),
                               static_cast<double*>(X), nsys, n, k, first, speculative_min_n,
                              fallbacks);
      break;
    case ScalarType::ComplexFloat:  // interleaved (re, im) pairs, read as reals
      solve_all<float, true>(static_cast<const float*>(L), static_cast<const float*>(D),
                             static_cast<const float*>(U), static_cast<const float*>(B),
                             static_cast<float*>(X), nsys, n, k, first, speculative_min_n,
                              fallbacks);
      break;
    default:
      solve_all<double, true>(static_cast<const double*>(L), static_cast<const double*>(D),
                              static_cast<const double*>(U), static_cast<const double*>(B),
                              static_cast<double*>(X), nsys, n, k, first, speculative_min_n,
                              fallbacks);
  }
}

Tensor info_tensor(const Tensor& like, const std::atomic<int64_t>& first) {
  Tensor info = torch::stable::new_empty(like, {}, ScalarType::Long);
  const int64_t code = first.load();
  *info.mutable_data_ptr<int64_t>() = code == std::numeric_limits<int64_t>::max() ? -1 : code;
  return info;
}

std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> shape(t.dim());
  for (int64_t a = 0; a < t.dim(); ++a) shape[a] = t.size(a);
  return shape;
}

// cpp_solve_ex without its third output: x and info, and the count of fallbacks in `fallbacks`.
std::tuple<Tensor, Tensor> solve_counted(const Tensor& lower, const Tensor& diag,
                                         const Tensor& upper, const Tensor& rhs,
                                         int64_t speculative_min_n, int64_t& fallbacks) {
  const Sizes z = check_inputs(lower, diag, upper, rhs);
  const ScalarType dtype = diag.scalar_type();
  const bool c = is_complex(dtype);
  const Tensor l = dense_values(lower, c), d = dense_values(diag, c), u = dense_values(upper, c),
               b = dense_values(rhs, c);
  Tensor x = torch::stable::new_empty(b, sizes_of(rhs));  // C-contiguous, rhs's dtype and device
  std::atomic<int64_t> first{std::numeric_limits<int64_t>::max()};
  if (z.nsys > 0) {
    solve_dtype(dtype, l.const_data_ptr(), d.const_data_ptr(), u.const_data_ptr(),
                b.const_data_ptr(), x.mutable_data_ptr(), z.nsys, z.n, z.k, first,
                speculative_min_n, fallbacks);
  }
  return {x, info_tensor(b, first)};
}

// cpp_solve_ex(lower, diag, upper, rhs, speculative_min_n) -> (x, info, fallbacks): cpp_solve
// with the size from which one real system (or each of fewer than W) goes to the speculative
// kernel (cpp_solve: kSpeculativeMinN), and how many such systems were not solved by it alone (a
// repair went through a whole piece, or the system went to the sequential elimination), as a
// 0-dim int64 tensor.
std::tuple<Tensor, Tensor, Tensor> cpp_solve_ex(const Tensor& lower, const Tensor& diag,
                                                const Tensor& upper, const Tensor& rhs,
                                                int64_t speculative_min_n) {
  int64_t fallbacks = 0;
  auto [x, info] = solve_counted(lower, diag, upper, rhs, speculative_min_n, fallbacks);
  Tensor count = torch::stable::new_empty(info, {}, ScalarType::Long);
  *count.mutable_data_ptr<int64_t>() = fallbacks;
  return {x, info, count};
}

// (Without the count: one tensor fewer to allocate, on every call of the final op.)
std::tuple<Tensor, Tensor> cpp_solve(const Tensor& lower, const Tensor& diag, const Tensor& upper,
                                     const Tensor& rhs) {
  int64_t fallbacks = 0;
  return solve_counted(lower, diag, upper, rhs, kSpeculativeMinN, fallbacks);
}

// The bands of -v x^H summed over the k columns (rules.band_gradients), for nsys systems of n
// rows, v and x (nsys, n, k) C-contiguous (complex: interleaved parts):
//   grad_lower[i] = -sum_j v[i+1, j] conj(x[i, j]), grad_diag[i] = -sum_j v[i, j] conj(x[i, j]),
//   grad_upper[i] = -sum_j v[i, j] conj(x[i+1, j]).
// One pass over v and x in chunks of rows (spread over the threads), three short loops a chunk.
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
  torch::stable::parallel_for(0, nsys * n, 16384, [&](int64_t begin, int64_t end) {
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

// band_products on tensors: v and x C-contiguous of rhs's shape, grads = (grad_lower, grad_diag,
// grad_upper) new and C-contiguous; complex values read as interleaved reals, as in solve_dtype.
template <typename R, bool Complex>
void band_products_of(const Tensor& v, const Tensor& x, const Tensor (&grads)[3], const Sizes& z) {
  band_products<R, Complex>(static_cast<const R*>(v.const_data_ptr()),
                            static_cast<const R*>(x.const_data_ptr()),
                            static_cast<R*>(grads[0].mutable_data_ptr()),
                            static_cast<R*>(grads[1].mutable_data_ptr()),
                            static_cast<R*>(grads[2].mutable_data_ptr()), z.nsys, z.n, z.k);
}

// The values of A^H's band that t is (conj(upper) is A^H's lower band, conj(diag) its diagonal,
// conj(lower) its upper band), in C order: for a real t, t itself.
Tensor adjoint_band(const Tensor& t, bool complex) {
  return complex ? dense_values(call_unary("aten::conj", t), true) : dense_values(t, false);
}

// cpp_solve_backward(lower, diag, upper, x, grad_x) -> (grad_lower, grad_diag, grad_upper,
// grad_rhs, info): the reverse mode of x = A^{-1} rhs on this kernel, in one call. grad_rhs is
// v = A^{-H} grad_x, one solve with A^H's bands (the speculative kernel for one large real
// system, as cpp_solve), and the band gradients are the bands of -v x^H summed over the columns
// (band_products). x and grad_x have rhs's shape, (*B, n) or (*B, n, k); everything is checked
// before it is read, as in cpp_solve, and info is cpp_solve's, for A^H.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cpp_solve_backward(
    const Tensor& lower, const Tensor& diag, const Tensor& upper, const Tensor& x,
    const Tensor& grad_x) {
  const char* op = "tridiag_tutorial::cpp_solve_backward";
  const Sizes z = check_inputs(lower, diag, upper, grad_x, op, "grad_x");
  STD_TORCH_CHECK(x.defined(), op, ": x is undefined");
  STD_TORCH_CHECK(x.layout() == torch::headeronly::Layout::Strided, op,
                  ": x must be a dense (strided) tensor");
  STD_TORCH_CHECK(x.is_cpu(), op, ": CPU tensors only (x is not on the CPU)");
  STD_TORCH_CHECK(x.scalar_type() == diag.scalar_type(), op, ": all inputs must have one dtype");
  STD_TORCH_CHECK(same_sizes(x, sizes_of(grad_x)), op, ": x and grad_x must have one shape");
  const ScalarType dtype = diag.scalar_type();
  const bool c = is_complex(dtype);
  const Tensor l = adjoint_band(upper, c), d = adjoint_band(diag, c), u = adjoint_band(lower, c),
               g = dense_values(grad_x, c), xs = dense_values(x, c);
  Tensor v = torch::stable::new_empty(g, sizes_of(grad_x));
  Tensor grad_lower = torch::stable::new_empty(d, sizes_of(lower));
  Tensor grad_diag = torch::stable::new_empty(d, sizes_of(diag));
  Tensor grad_upper = torch::stable::new_empty(d, sizes_of(upper));
  const Tensor g3[3] = {grad_lower, grad_diag, grad_upper};
  std::atomic<int64_t> first{std::numeric_limits<int64_t>::max()};
  int64_t fallbacks = 0;
  if (z.nsys > 0) {
    solve_dtype(dtype, l.const_data_ptr(), d.const_data_ptr(), u.const_data_ptr(),
                g.const_data_ptr(), v.mutable_data_ptr(), z.nsys, z.n, z.k, first,
                kSpeculativeMinN, fallbacks);
    switch (dtype) {
      case ScalarType::Float: band_products_of<float, false>(v, xs, g3, z); break;
      case ScalarType::Double: band_products_of<double, false>(v, xs, g3, z); break;
      case ScalarType::ComplexFloat: band_products_of<float, true>(v, xs, g3, z); break;
      default: band_products_of<double, true>(v, xs, g3, z);
    }
  }
  return {grad_lower, grad_diag, grad_upper, v, info_tensor(g, first)};
}

// What a process without the Python package runs for solve and solve_kernel: the kernel above,
// for solves without factors; an exactly zero pivot raises RuntimeError with the system's flat
// index (the Python kernels raise tridiag_tutorial.SingularMatrixError instead).
Tensor solve_without_python(const Tensor& lower, const Tensor& diag, const Tensor& upper,
                            const Tensor& rhs, std::optional<Tensor> lu,
                            std::optional<Tensor> pivots, std::string trans,
                            std::string driver) {
  STD_TORCH_CHECK(!lu.has_value() && !pivots.has_value(),
                  "tridiag_tutorial::solve: a solve from LU factors needs the Python package "
                  "(import tridiag_tutorial); this library alone solves from the bands");
  STD_TORCH_CHECK(trans == "N", "tridiag_tutorial::solve: trans must be 'N' without factors");
  STD_TORCH_CHECK(rhs.dim() == diag.dim() + 1, "tridiag_tutorial::solve: rhs must be (*B, n, k) "
                  "for diag (*B, n); got rhs with ", rhs.dim(), " dimensions and diag ",
                  diag.dim());
  STD_TORCH_CHECK(driver == "lapack" || driver == "cpp" || driver == "sequential" ||
                      driver == "partitioned",
                  "tridiag_tutorial::solve: unknown driver '", driver, "'");
  auto [x, info] = cpp_solve(lower, diag, upper, rhs);
  const int64_t code = *info.const_data_ptr<int64_t>();
  if (code >= 0) {
    const int64_t n = diag.size(-1), pivot = code % n;
    STD_TORCH_CHECK(false, "the tridiagonal matrix is singular: pivot U[", pivot, ", ", pivot,
                    "] is exactly zero, in system ", code / n, " (flat index over the batch)");
  }
  return x;
}

std::tuple<Tensor, Tensor> lu_factor_without_python(const Tensor& lower, const Tensor& diag,
                                                   const Tensor& upper, std::string driver) {
  STD_TORCH_CHECK(false, "tridiag_tutorial::lu_factor: factoring needs the Python package "
                  "(import tridiag_tutorial); this library alone solves from the bands");
  return {lower, diag};
}

}  // namespace

// The schemas: one place, here. tridiag_tutorial/ops.py defines the same ones (SCHEMAS) when this
// library is absent (no compiler at install), and tests/test_install.py checks they agree.
STABLE_TORCH_LIBRARY(tridiag_tutorial, m) {
  m.def("solve(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, Tensor? lu, Tensor? pivots, "
        "str trans, str driver) -> Tensor");
  m.def("solve_kernel(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, Tensor? lu, "
        "Tensor? pivots, str trans, str driver) -> Tensor");
  m.def("lu_factor(Tensor lower, Tensor diag, Tensor upper, str driver) -> (Tensor, Tensor)");
  m.def("cpp_solve(Tensor lower, Tensor diag, Tensor upper, Tensor rhs) -> (Tensor, Tensor)");
  m.def("cpp_solve_ex(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, int speculative_min_n) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("cpp_solve_backward(Tensor lower, Tensor diag, Tensor upper, Tensor x, Tensor grad_x) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(tridiag_tutorial, CPU, m) {
  m.impl("cpp_solve", TORCH_BOX(&cpp_solve));
  m.impl("cpp_solve_ex", TORCH_BOX(&cpp_solve_ex));
  m.impl("cpp_solve_backward", TORCH_BOX(&cpp_solve_backward));
}

STABLE_TORCH_LIBRARY_IMPL(tridiag_tutorial, CompositeExplicitAutograd, m) {
  m.impl("solve", TORCH_BOX(&solve_without_python));
  m.impl("solve_kernel", TORCH_BOX(&solve_without_python));
  m.impl("lu_factor", TORCH_BOX(&lu_factor_without_python));
}
