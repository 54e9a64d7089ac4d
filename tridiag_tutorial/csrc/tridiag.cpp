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
//   tridiag_tutorial::cpp_solve_ex(lower, diag, upper, rhs, pieces_min_n) -> (x, info, fallbacks)
//   tridiag_tutorial::cpp_solve_backward(lower, diag, upper, x, grad_x)
//       -> (grad_lower, grad_diag, grad_upper, grad_rhs, info)
//
// The Python package (tridiag_tutorial/ops.py) registers their fake kernels, the Autograd kernel
// of solve, the vmap rules and the kernels of each device (LAPACK through SciPy, this file's
// kernel, kernels in torch ops), as pytorch/extension-cpp's ops.py does. What this file
// registers runs without Python: cpp_solve's CPU kernel, and a CompositeExplicitAutograd kernel
// for solve and solve_kernel, which is what a process that loads only this library (with
// torch.ops.load_library, an AOTInductor package say) runs. There every solve without factors
// runs on this file's kernel, which raises for the systems ?gtsv reports singular, at its pivot
// (a NaN stays in its own system); a solve from factors (lu given) and lu_factor
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
// where one system's elimination is a single chain that waits for each division. Blocks go to
// torch's threads in one parallel region (torch::stable::parallel_for), claimed in chunks from a
// shared counter and with a thread budget that leaves the pool while its threads stall
// (claim_chunks); the last block is padded with identity systems. Fewer than W systems use
// the same code with W = 1, each system solved in place in the output, up to kPiecesMinN
// unknowns; from there on a real system goes to the pieces kernel below, which cuts it into
// pieces, eliminates them side by side and joins them through a small reduced system: its
// rounding differs from ?gtsv's, and wherever it cannot vouch for its answer it hands the system
// back to the W = 1 elimination (cpp_solve_ex takes that size as an argument).
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
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// 32-byte vector types (the pieces kernel's AVX2 lanes) pass through the inline helpers
// below in code compiled for plain x86-64 too; GCC warns that their calling convention would
// differ there, which matters only for functions called across translation units (none are).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

extern "C" {
// An empty module tridiag_tutorial._C: importing it loads this library, whose static
// initialisers register the ops below (pytorch/extension-cpp's way). Py_LIMITED_API (CPython 3.10's
// limited API, set by torch's BuildExtension): one build serves every CPython from 3.10 on.
// Its one function, thread_budget(), reports the thread budget (see claim_chunks below).
PyObject* thread_budget(PyObject*, PyObject*);
PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"thread_budget", thread_budget, METH_NOARGS,
       "(stalled_regions, solo_ns_left): parallel regions in which a pool thread stalled, and "
       "how long regions still run on the calling thread alone."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
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
//    magnitude of each column.
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
// - a zero pivot in a piece (A singular, or a piece singular where A is not);
// - a zero pivot in the reduced system, or one below kTinyPivot eps times its row's largest
//   entry (a singular A whose zero pivot the reduced system meets as rounding);
// - a value that is not finite;
// - cancellation: a piece whose answer is more than kCancellation times smaller than the terms
//   it is made of (max|y| + max|v| |x[s-1]| + max|w| |x[s+m]|, each column), where a nearly
//   singular piece would have amplified its rounding errors.
// --------------------------------------------------------------------------------------------
// GCC's __builtin_shuffle, for the transposes of the loads and stores (elsewhere: element by
// element).
#if defined(__GNUC__) && !defined(__clang__)
#define TT_HAVE_SHUFFLE 1
#else
#define TT_HAVE_SHUFFLE 0
#endif

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
  using E = int64_t;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v4f> {
  using R = float;
  using I = v4i;
  using E = int32_t;
  static constexpr int32_t kMag = INT32_MAX;
};
template <>
struct Lane<v4d> {
  using R = double;
  using I = v4l;
  using E = int64_t;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v8f> {
  using R = float;
  using I = v8i;
  using E = int32_t;
  static constexpr int32_t kMag = INT32_MAX;
};

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
    if (first + W * m < A.n) {
      // Every row of the tile and its coupling below inside the system: VL rows of VL pieces
      // at a time, transposed into the lanes (m is a multiple of VL).
      for (int o = 0; o < NV; ++o) {
        const int64_t s0 = first + o * VL * m;
        for (int64_t i = 0; i < m; i += VL) {
          gather(A.D + s0, m, i, s.d + i * W + o * VL, W);
          gather(A.U + s0, m, i, s.du + i * W + o * VL, W);
          gather(A.L + s0, m, i, s.fl + i * W + o * VL, W);
        }
        if (k == 1) {
          for (int64_t i = 0; i < m; i += VL) {
            gather(A.B + s0, m, i, s.b + i * K * W + o * VL, K * W);
          }
          continue;
        }
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < k; ++j) {
            V b;
            for (int w = 0; w < VL; ++w) b[w] = A.B[(s0 + w * m + i) * k + j];
            st(s.b + (i * K + j) * W + o * VL, b);
          }
        }
      }
    } else {
      for (int w = 0; w < W; ++w) {
        const int64_t s0 = first + w * m;
        for (int64_t i = 0; i < m; ++i) {
          s.d[i * W + w] = A.Dr(s0 + i);
          s.du[i * W + w] = A.Ur(s0 + i);
          s.fl[i * W + w] = A.Lr(s0 + i);
          for (int64_t j = 0; j < k; ++j) s.b[(i * K + j) * W + w] = A.Br(s0 + i, j);
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
        bad = (p == zero) | ((p - p) != zero) | ((next != zero) & (vabs(next) <= tiny * (vabs(keep) + vabs(take))))
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
          st(b0 + (K + k) * W, (sw ? x0 : zero) - f * q);
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
      bad = (p == zero) | ((p - p) != zero) ? one : bad;
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
  static TT_INLINE void substitute(int64_t m, int64_t K, const TileRows<R>& s, R* mag) {
    const V zero{};
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
          const V x = t / p;
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
    Tile::substitute(m, K, s, mag);
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
    Tile::substitute(m, k, s, mag);
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


// Work on the indices [0, count) in one parallel region, in chunks of `chunk` indices. Each pool
// thread that torch::stable::parallel_for starts calls worker(next) once: it sets up its
// workspace, then takes indices while next(i) returns true. The chunks are claimed one at a time
// from a shared counter, so a thread that runs slower takes fewer of them instead of holding up
// the others with a fixed share, as a static split does.
class NextIndex {
 public:
  NextIndex(std::atomic<int64_t>& counter, int64_t count, int64_t chunk)
      : counter_(counter), count_(count), chunk_(chunk) {}
  bool operator()(int64_t& i) {
    if (at_ == end_) {
      at_ = counter_.fetch_add(chunk_);
      if (at_ >= count_) {
        at_ = end_;
        return false;
      }
      end_ = std::min(count_, at_ + chunk_);
    }
    i = at_++;
    return true;
  }

 private:
  std::atomic<int64_t>& counter_;
  const int64_t count_, chunk_;
  int64_t at_ = 0, end_ = 0;
};

// The thread budget. On a machine where another process keeps a core busy, a pool thread shares
// a core: it runs at a fraction of its speed and waits out the other process's time slices
// (milliseconds), and the region ends only when it does. Two threads then took up to twice one
// thread's time. So each region compares its wall time with the CPU time its threads spent in it,
// about what one thread would have needed: a region that took more than kStallShare of that (and
// more than kStallNs) stalled, its threads did not pay. After two stalled regions in a row (one
// alone can be a passing disturbance), regions run on the calling thread alone for a while, then
// one tries the pool again. While the tries stall, the while doubles, from kSoloMinNs to
// kSoloMaxNs; a try that does not stall brings the pool back and halves the while that the next
// stall starts (a lucky try under a lasting load does not start the doubling over). Under a
// lasting load that costs one stalled region in kSoloMaxNs; the threads come back at most
// kSoloMaxNs after the other process ends.
constexpr int64_t kStallNs = 300000;        // 0.3 ms: shorter regions are not judged
constexpr double kStallShare = 0.8;         // a region faster than 1 / 0.8 = 1.25 times one thread
constexpr int64_t kSoloMinNs = 50000000;    // 50 ms
constexpr int64_t kSoloMaxNs = 2000000000;  // 2 s
std::atomic<int64_t> g_solo_until{0};       // steady-clock ns: regions run alone until then
std::atomic<int64_t> g_solo_for{0};         // the while the next stall starts; 0: two stalls
std::atomic<int> g_stalled_in_a_row{0};
std::atomic<int64_t> g_stalled_regions{0};  // regions that saw a thread stall, for the tests

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

extern "C" PyObject* thread_budget(PyObject*, PyObject*) {
  const int64_t left = g_solo_until.load(std::memory_order_relaxed) - wall_ns();
  return Py_BuildValue("(LL)", static_cast<long long>(g_stalled_regions.load()),
                       static_cast<long long>(std::max<int64_t>(0, left)));
}

namespace {

// This thread's CPU time, or -1 where the platform cannot say (then nothing is measured).
int64_t thread_cpu_ns() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }
#endif
  return -1;
}

template <typename Worker>
void claim_chunks(int64_t count, int64_t chunk, const Worker& worker) {
  if (count <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  std::atomic<int64_t> counter{0};
  const int64_t chunks = (count + chunk - 1) / chunk;
  const bool solo = chunks == 1 || torch::stable::get_num_threads() <= 1 ||
                   wall_ns() < g_solo_until.load(std::memory_order_relaxed);
  if (solo) {
    NextIndex next(counter, count, chunk);
    worker(next);
    return;
  }
  // The region stalled where its threads did not pay: it took more than kStallShare of the CPU
  // time they spent in it, which one thread would have needed, give or take its caches (two
  // threads that share the work take about half; two of which one waits out another process's
  // time slice, or starts late, about all of it).
  std::atomic<int64_t> cpu_total{0};
  std::atomic<bool> measured{true};
  const int64_t start = wall_ns();
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t, int64_t) {
    const int64_t cpu0 = thread_cpu_ns();
    NextIndex next(counter, count, chunk);
    worker(next);
    const int64_t cpu1 = thread_cpu_ns();
    if (cpu0 < 0 || cpu1 < 0) measured.store(false, std::memory_order_relaxed);
    cpu_total.fetch_add(cpu1 - cpu0, std::memory_order_relaxed);
  });
  const int64_t wall = wall_ns() - start;
  const bool stalled = measured.load() && wall > kStallNs &&
                       static_cast<double>(wall) > kStallShare * static_cast<double>(cpu_total.load());
  if (!stalled) {
    g_stalled_in_a_row.store(0, std::memory_order_relaxed);
    const int64_t half = g_solo_for.load(std::memory_order_relaxed) / 2;
    g_solo_for.store(half < kSoloMinNs ? 0 : half, std::memory_order_relaxed);
    return;
  }
  g_stalled_regions.fetch_add(1, std::memory_order_relaxed);
  const int in_a_row = g_stalled_in_a_row.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t last = g_solo_for.load(std::memory_order_relaxed);
  if (last > 0 || in_a_row >= 2) {  // a stall soon after others, or two stalls in a row
    const int64_t next = last > 0 ? std::min(2 * last, kSoloMaxNs) : kSoloMinNs;
    g_solo_for.store(next, std::memory_order_relaxed);
    g_solo_until.store(wall_ns() + next, std::memory_order_relaxed);
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
                                         int64_t pieces_min_n, int64_t& fallbacks) {
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
                pieces_min_n, fallbacks);
  }
  return {x, info_tensor(b, first)};
}

// cpp_solve_ex(lower, diag, upper, rhs, pieces_min_n) -> (x, info, fallbacks): cpp_solve
// with the size from which one real system (or each of fewer than W) goes to the pieces kernel
// (cpp_solve: kPiecesMinN), and how many such systems it handed to the sequential elimination,
// as a 0-dim int64 tensor.
std::tuple<Tensor, Tensor, Tensor> cpp_solve_ex(const Tensor& lower, const Tensor& diag,
                                                const Tensor& upper, const Tensor& rhs,
                                                int64_t pieces_min_n) {
  int64_t fallbacks = 0;
  auto [x, info] = solve_counted(lower, diag, upper, rhs, pieces_min_n, fallbacks);
  Tensor count = torch::stable::new_empty(info, {}, ScalarType::Long);
  *count.mutable_data_ptr<int64_t>() = fallbacks;
  return {x, info, count};
}

// (Without the count: one tensor fewer to allocate, on every call of the final op.)
std::tuple<Tensor, Tensor> cpp_solve(const Tensor& lower, const Tensor& diag, const Tensor& upper,
                                     const Tensor& rhs) {
  int64_t fallbacks = 0;
  return solve_counted(lower, diag, upper, rhs, kPiecesMinN, fallbacks);
}

// The bands of -v x^H summed over the k columns (rules.band_gradients), for nsys systems of n
// rows, v and x (nsys, n, k) C-contiguous (complex: interleaved parts):
//   grad_lower[i] = -sum_j v[i+1, j] conj(x[i, j]), grad_diag[i] = -sum_j v[i, j] conj(x[i, j]),
//   grad_upper[i] = -sum_j v[i, j] conj(x[i+1, j]).
// One pass over v and x in chunks of rows, three short loops a chunk. The pass is a few
// nanoseconds a row, so threads share it only in chunks of kBandRowsPerThread rows: with a
// shorter share, a thread on a core that another process keeps busy stalls the whole pass (one
// system of 1e5 rows, forward + backward on two threads with one core busy: 3.5 times the time
// on one thread, when every 16384 rows went to a thread).
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
// v = A^{-H} grad_x, one solve with A^H's bands (the pieces kernel for one large real system,
// as cpp_solve), and the band gradients are the bands of -v x^H summed over the columns
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
                kPiecesMinN, fallbacks);
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
  m.def("cpp_solve_ex(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, int pieces_min_n) "
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
