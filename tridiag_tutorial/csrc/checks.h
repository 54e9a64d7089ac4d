// The input checks of the ops, on the stable ABI, and the few tensor helpers they share. Part of
// tridiag.cpp's translation unit (see lanes.h).
//
// Entry point: check_inputs(lower, diag, upper, rhs, op, rhs_name) -> Sizes {n, k, nsys}.
// What cpp_solve checks before it reads a tensor (Python callers may rely on it instead of their
// own checks: the fast path of tridiagonal_solve calls the op on unvalidated tensors and, on an
// error, validates in Python for a typed message): every tensor defined, strided, on the CPU, of
// one supported dtype; lower, upper (*B, n-1), diag (*B, n) with n >= 1, and rhs (*B, n) (one
// right-hand side) or (*B, n, k), all with one batch shape.
// Where an input fails, it raises (STD_TORCH_CHECK: a RuntimeError in Python, which names `op`, the
// input and this file's line); else it returns n, k (1 for rhs (*B, n)) and nsys, the number of
// systems. It reads no values. op and rhs_name name the op and its right-hand side in the messages
// (cpp_solve_backward checks its grad_x so).

#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

namespace {

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

}  // namespace
