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
// The Python package (tridiag_tutorial/registration.py) registers their fake kernels, the
// Autograd kernel of solve, the vmap rules and the kernels of each device (LAPACK through SciPy,
// this library's kernel, kernels in torch ops), as pytorch/extension-cpp's ops.py does. What this
// file registers runs without Python: cpp_solve's CPU kernel, and a CompositeExplicitAutograd
// kernel for solve and solve_kernel, which is what a process that loads only this library (with
// torch.ops.load_library, an AOTInductor package say) runs. There every solve without factors
// runs on this library's kernel, which raises for the systems ?gtsv reports singular, at its pivot
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
// This file is the library's one translation unit: the ops on tensors, the module
// tridiag_tutorial._C and the registration. The kernels are in the headers of this folder, which
// it includes and nothing else does (their code lies in an anonymous namespace, as when they were
// part of this file); each says at its top what its entry point computes:
//   lanes.h          the SIMD lanes: vector types and helpers
//   batched.h        the batched kernel (?gtsv's operations, its bits; blocks of W systems)
//   pieces.h         one large real system solved in pieces (kPiecesMinN unknowns or more)
//   threads.h        the parallel regions and their thread budget (claim_chunks)
//   checks.h         the input checks on the stable ABI (check_inputs)
//   dispatch.h       which kernel solves which systems, and the dtype switch (solve_dtype)
//   band_products.h  the band gradients of cpp_solve_backward

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// The parts, in the order their code had in the one file they were cut from: the compiler then
// emits the same code for them (the checks come before the dispatch for that reason alone).
#include "lanes.h"
#include "batched.h"
#include "pieces.h"
#include "threads.h"
#include "checks.h"
#include "dispatch.h"
#include "band_products.h"

extern "C" {
// An empty module tridiag_tutorial._C: importing it loads this library, whose static
// initialisers register the ops below (pytorch/extension-cpp's way). Py_LIMITED_API (CPython 3.10's
// limited API, set by torch's BuildExtension): one build serves every CPython from 3.10 on.
// Its one function, thread_budget(), reports the thread budget (claim_chunks, threads.h).
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

extern "C" PyObject* thread_budget(PyObject*, PyObject*) {
  const int64_t left = g_solo_until.load(std::memory_order_relaxed) - wall_ns();
  return Py_BuildValue("(LL)", static_cast<long long>(g_stalled_regions.load()),
                       static_cast<long long>(std::max<int64_t>(0, left)));
}

namespace {

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

// What a process without the Python package runs for solve and solve_kernel: cpp_solve above,
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

// The schemas: one place, here. tridiag_tutorial/_schemas.py defines the same ones (SCHEMAS)
// when this library is absent (no compiler at install), and tests/test_install.py checks they
// agree.
// [book: cpp-registration]
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
// [/book: cpp-registration]
