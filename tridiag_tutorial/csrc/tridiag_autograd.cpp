// tridiag_tutorial_cpp::solve_autograd: the solve of tridiag.cpp with its backward in C++.
//
// solve_autograd(lower, diag, upper, rhs) -> x takes the same validated, broadcast inputs as
// tridiag_tutorial_cpp::solve (bands (*B, n-1), (*B, n), (*B, n-1), rhs (*B, n, k)), or rhs
// (*B, n) for one vector per system, and returns x of rhs's shape. Its Autograd kernel is a torch::autograd::Function, so the autograd engine runs its
// backward without entering Python:
//
//     v = A^{-H} g                        (tridiag_tutorial_cpp::solve on the bands of A^H)
//     grad_rhs = v,  grad_A = -v x^H      on the three bands, summed over the k columns
//
// the rules of tridiag_tutorial/rules.py. Without create_graph (a plain loss.backward()) it calls
// the kernel directly and forms the three band gradients in one fused loop; with create_graph
// it solves through solve_autograd itself and writes the band products as ATen operations, which
// autograd records, so second derivatives work.
//
// When v or x is a batched tensor (autograd.grad(is_grads_batched=True),
// jacobian(vectorize=True), gradcheck(check_batched_grad=True), torch.func.vmap over a
// backward), which holds no storage, the backward takes the ATen branch too: the solve goes
// through the op's vmap rule (registered from Python by tridiag_tutorial.compiled.load) and the
// band products are batched by vmap.
//
// The Python package sends a call here only in eager reverse mode (no torch.func transform, no
// forward-mode AD, no dispatch mode, plain CPU tensors): this Function has no jvp, and a
// torch::autograd::Function cannot run under torch.func.grad (torch refuses it), which the
// Python autograd.Function of tridiag_tutorial.ops provides for those cases.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <complex>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// tridiag_tutorial_cpp::solve (tridiag.cpp), through the dispatcher: its CPU kernel.
at::Tensor kernel(const at::Tensor& lower, const at::Tensor& diag, const at::Tensor& upper,
                  const at::Tensor& rhs) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tridiag_tutorial_cpp::solve", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&)>();
  return op.call(lower, diag, upper, rhs);
}

at::Tensor solve_autograd(const at::Tensor& lower, const at::Tensor& diag,
                          const at::Tensor& upper, const at::Tensor& rhs);

template <typename T>
T conj_of(const T& a) {
  if constexpr (c10::is_complex<T>::value) {
    return std::conj(a);
  } else {
    return a;
  }
}

// The three bands of -v x^H summed over the k columns, in one pass over v and x (contiguous
// (*B, n, k)): what the ATen expression in backward computes, without its dozen operations.
void band_gradients(const at::Tensor& v, const at::Tensor& x, at::Tensor& grad_lower,
                    at::Tensor& grad_diag, at::Tensor& grad_upper) {
  const int64_t n = x.size(-2), k = x.size(-1), systems = x.numel() / std::max<int64_t>(n * k, 1);
  auto batch = x.sizes().slice(0, x.dim() - 2).vec();
  auto band = batch;
  band.push_back(n - 1);
  batch.push_back(n);
  grad_diag = at::empty(batch, x.options());
  grad_lower = at::empty(band, x.options());
  grad_upper = at::empty(band, x.options());
  AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES(x.scalar_type(), "band_gradients", [&] {
    const scalar_t* V = v.const_data_ptr<scalar_t>();
    const scalar_t* X = x.const_data_ptr<scalar_t>();
    scalar_t* GL = grad_lower.mutable_data_ptr<scalar_t>();
    scalar_t* GD = grad_diag.mutable_data_ptr<scalar_t>();
    scalar_t* GU = grad_upper.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, systems, std::max<int64_t>(1, 32768 / std::max<int64_t>(n * k, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const scalar_t* vs = V + s * n * k;
        const scalar_t* xs = X + s * n * k;
        for (int64_t i = 0; i < n; ++i) {
          scalar_t d(0), l(0), u(0);
          for (int64_t c = 0; c < k; ++c) {
            const scalar_t vi = vs[i * k + c];
            d += vi * conj_of(xs[i * k + c]);
            if (i + 1 < n) {
              l += vs[(i + 1) * k + c] * conj_of(xs[i * k + c]);  // entry (i+1, i)
              u += vi * conj_of(xs[(i + 1) * k + c]);             // entry (i, i+1)
            }
          }
          GD[s * n + i] = -d;
          if (i + 1 < n) {
            GL[s * (n - 1) + i] = -l;
            GU[s * (n - 1) + i] = -u;
          }
        }
      }
    });
  });
}

// Whether the fused loop may read t's memory: a dense CPU tensor with storage of its own, not a
// wrapper that holds none (a vmap-batched tensor of torch.func.vmap, is_grads_batched or
// check_batched_grad; a functorch, functional or Python-subclass tensor).
bool plain(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers({c10::DispatchKey::FuncTorchBatched,
                                             c10::DispatchKey::BatchedNestedTensor,
                                             c10::DispatchKey::FuncTorchGradWrapper,
                                             c10::DispatchKey::Functionalize,
                                             c10::DispatchKey::Python});
  return t.defined() && t.has_storage() && t.layout() == at::kStrided && !t.is_nested() &&
         t.device().is_cpu() && !t.key_set().has_any(wrappers);
}

struct TridiagonalSolve : public torch::autograd::Function<TridiagonalSolve> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& lower, const at::Tensor& diag,
                            const at::Tensor& upper, const at::Tensor& rhs) {
    // rhs (*B, n) is one vector per system: solved as (*B, n, 1) here, inside the Function, so
    // that autograd records no unsqueeze and squeeze around it.
    const bool vector = rhs.dim() == diag.dim();
    at::Tensor x = kernel(lower, diag, upper, vector ? rhs.unsqueeze(-1) : rhs);
    if (vector) x.squeeze_(-1);  // in place: the output is not a view (autograd forbids
                                 // modifying a custom Function's view output in place)
    ctx->set_materialize_grads(false);
    ctx->saved_data["vector"] = vector;
    // x is saved as the output it is (not a tensor it views), so that a backward with
    // create_graph differentiates through it.
    ctx->save_for_backward({lower, diag, upper, x});
    return x;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const bool vector = ctx->saved_data["vector"].toBool();
    const at::Tensor g = vector ? grads[0].unsqueeze(-1) : grads[0];
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &lower = saved[0], &diag = saved[1], &upper = saved[2];
    const at::Tensor x = vector ? saved[3].unsqueeze(-1) : saved[3];
    // A^H has the bands (conj(upper), conj(diag), conj(lower)). With create_graph (grad mode on
    // in the backward) the solve is recorded, so the backward can be differentiated again.
    const bool bands = ctx->needs_input_grad(0) || ctx->needs_input_grad(1) ||
                       ctx->needs_input_grad(2);
    at::Tensor grad_lower, grad_diag, grad_upper;
    const bool record = at::GradMode::is_enabled();
    const at::Tensor v = record ? solve_autograd(upper.conj(), diag.conj(), lower.conj(), g)
                                : kernel(upper.conj(), diag.conj(), lower.conj(), g);
    if (!record && plain(v) && plain(x)) {  // a first-order backward: one fused pass
      if (bands) band_gradients(v, x.contiguous(), grad_lower, grad_diag, grad_upper);
      return {ctx->needs_input_grad(0) ? grad_lower : at::Tensor(),
              ctx->needs_input_grad(1) ? grad_diag : at::Tensor(),
              ctx->needs_input_grad(2) ? grad_upper : at::Tensor(),
              ctx->needs_input_grad(3) ? (vector ? v.squeeze(-1) : v) : at::Tensor()};
    }
    // With create_graph, or when v is a batched tensor (is_grads_batched, check_batched_grad,
    // vmap: the op's vmap rule in tridiag_tutorial/compiled.py solved it), ATen operations,
    // which autograd records and vmap batches.
    if (bands) {
      const int64_t n = x.size(-2);
      const at::Tensor minus_v = v.neg();
      const at::Tensor xc = x.conj();
      if (ctx->needs_input_grad(1)) grad_diag = (minus_v * xc).sum(-1);
      if (ctx->needs_input_grad(0))  // entry (i+1, i): -sum_k v[i+1, k] conj(x[i, k])
        grad_lower = (minus_v.narrow(-2, 1, n - 1) * xc.narrow(-2, 0, n - 1)).sum(-1);
      if (ctx->needs_input_grad(2))  // entry (i, i+1): -sum_k v[i, k] conj(x[i+1, k])
        grad_upper = (minus_v.narrow(-2, 0, n - 1) * xc.narrow(-2, 1, n - 1)).sum(-1);
    }
    return {ctx->needs_input_grad(0) ? grad_lower : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_diag : at::Tensor(),
            ctx->needs_input_grad(2) ? grad_upper : at::Tensor(),
            ctx->needs_input_grad(3) ? (vector ? v.squeeze(-1) : v) : at::Tensor()};
  }
};

at::Tensor solve_autograd(const at::Tensor& lower, const at::Tensor& diag,
                          const at::Tensor& upper, const at::Tensor& rhs) {
  // What autograd needs before the kernel's own checks run (it reads the inputs' sizes).
  const char* names[] = {"lower", "diag", "upper", "rhs"};
  const at::Tensor* inputs[] = {&lower, &diag, &upper, &rhs};
  for (int a = 0; a < 4; ++a) {
    const at::Tensor& t = *inputs[a];
    TORCH_CHECK(t.defined(), "tridiag_tutorial_cpp::solve_autograd: ", names[a], " is undefined");
    TORCH_CHECK(!t.is_nested() && t.layout() == at::kStrided,
                "tridiag_tutorial_cpp::solve_autograd: ", names[a],
                " must be a dense (strided) tensor, got ",
                t.is_nested() ? "a nested tensor" : c10::str(t.layout()));
  }
  TORCH_CHECK(rhs.dim() == diag.dim() || rhs.dim() == diag.dim() + 1,
              "tridiag_tutorial_cpp::solve_autograd: rhs must be (*B, n) or (*B, n, k) for diag "
              "(*B, n); got rhs ", rhs.sizes(), " and diag ", diag.sizes());
  return TridiagonalSolve::apply(lower, diag, upper, rhs);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tridiag_tutorial_cpp, m) {
  m.def("solve_autograd(Tensor lower, Tensor diag, Tensor upper, Tensor rhs) -> Tensor");
}

// Autograd: the Function above. CPU (below autograd, when no input requires grad): the kernel.
TORCH_LIBRARY_IMPL(tridiag_tutorial_cpp, Autograd, m) {
  m.impl("solve_autograd", &solve_autograd);
}

TORCH_LIBRARY_IMPL(tridiag_tutorial_cpp, CPU, m) {
  m.impl("solve_autograd", &kernel);
}
