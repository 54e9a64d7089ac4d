"""The autograd Functions of the op, and the derivative plumbing they share.

- :class:`_TridiagonalSolve`: the eager path, an ``autograd.Function`` with ``setup_context``,
  ``backward``, ``jvp`` and ``vmap``, so that every ``torch.func`` transform and forward-mode AD
  work;
- :class:`_CompiledSolve`: the Autograd kernel of ``tridiag_tutorial::solve`` under
  ``torch.compile``, a single-level Function (one autograd node at the current transform level);
- :class:`_CppSolve`: the C++ kernel with reverse mode only, for a call that no transform, mode or
  compiler can observe.

All three take their derivatives from :mod:`tridiag_tutorial.rules`, written once with the solve
as a parameter.
"""

from __future__ import annotations

import sys

import torch

from . import _compat, _routes, kernels, rules
from ._schemas import solve_kernel_op as _kernel_op
from ._schemas import solve_op as _compiled_op
from .kernels import compiled

# The kernels (tridiag_tutorial.kernels), called directly: no autograd, no checks, one batch
# shape, rhs (*B, n, k). ``driver`` names the kernel.
_kernel = kernels.solve

def _adjoint(lu, pivots, trans: str):
    """``(lu, pivots, trans)`` that solve with ``M^H``, where ``(lu, pivots, trans)`` solve with
    ``M``. Without factors the rules pass ``M^H``'s bands, and nothing changes."""
    if lu is None:
        return None, None, "N"
    if trans == "N":
        return lu, pivots, "C"
    if trans == "C":
        return lu, pivots, "N"
    # M = A^T, so M^H = conj(A) = conj(L) conj(U): the conjugate factors, with the same pivots
    # (LAPACK's pivoting magnitude |re| + |im| does not change under conjugation).
    return lu.conj().resolve_conj(), pivots, "N"


#: The types the direct routes take: a plain tensor, or a Parameter (learnable bands), whose
#: ``__torch_function__`` is disabled, so no override can see a call on one. Any other subclass
#: (a DTensor needs the general path's sharding rules) takes the general path.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct(*tensors) -> bool:
    """True when the kernels may be called on these tensors directly, skipping the dispatcher:
    no ``torch.func`` transform is active, no dispatch or function mode is installed, and they
    are plain tensors or Parameters with data (no other subclass, no FakeTensor or meta tensor,
    no functorch wrapper).
    Dispatching a custom op from Python costs more than LAPACK needs for a small system (chapter
    12 measures both). ``None`` entries (absent factors) are skipped."""
    if not _routes.ON.direct_kernel or torch.compiler.is_compiling():  # Dynamo traces the ops
        return False
    if _compat.mode_active() or _compat.transform_active():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.is_meta or _compat.is_functorch_tensor(t):
            return False
    return True


def _register_sharding_for(tensors) -> None:
    """Register DTensor's sharding rules for the ops (:mod:`tridiag_tutorial.distributed.sharding`) the first
    time a DTensor reaches one, so that a caller need not know to import that module. Importing it
    registers them, so they are registered exactly when it is in ``sys.modules``. Where
    ``torch.distributed.tensor`` is not imported, no tensor can be a DTensor, and the package
    does not import it: the check is two dictionary lookups. Not while compiling: import
    :mod:`tridiag_tutorial.distributed.sharding` before compiling a function of DTensors."""
    if torch.compiler.is_compiling() or "tridiag_tutorial.distributed.sharding" in sys.modules:
        return
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in tensors):
        from .distributed import sharding  # noqa: F401  (importing it registers the rules)


def _unobserved(args) -> bool:
    """True when nothing but the result of this call matters: no gradient will be asked for, no
    ``torch.func`` transform or forward-AD level is active, and :func:`_direct` holds. Then the
    public functions call the kernel without ``autograd.Function`` or the op."""
    if _compat.forward_ad_active():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return False
    return _direct(*args)


def _vmap_rule(solve, info, in_dims, *args, out_dims=0):
    """The general batch rule: put the vmapped dimension first on every input.

    The kernels need all inputs to have the same batch shape, so unbatched inputs are expanded
    along the new dimension (a view, no copy) rather than left alone; ``None`` arguments (absent
    optional inputs) stay ``None``.
    """
    args = [
        None if a is None else a.movedim(d, 0) if d is not None
        else a.expand(info.batch_size, *a.shape)
        for a, d in zip(args, in_dims)
    ]
    return solve(*args), out_dims


def _batch_rule(solve, info, in_dims, lower, diag, upper, rhs, lu, pivots):
    """The vmap rule of both paths' solve (``solve`` takes the six tensors).

    When only ``rhs`` is batched (one matrix, many right-hand sides), the vmapped dimension
    becomes more columns of ``rhs``: one solve with ``k * batch`` columns, as JAX's batching rule
    does, instead of copying the matrix to every batch element. Otherwise the vmapped dimension
    goes first on every input, and unbatched inputs are expanded along it (a view)."""
    if in_dims[3] is not None and all(d is None for i, d in enumerate(in_dims) if i != 3):
        b = rhs.movedim(in_dims[3], -1)  # (*B, n, k, batch)
        x = solve(lower, diag, upper, b.reshape(*b.shape[:-2], -1), lu, pivots)
        return x.reshape(b.shape).movedim(-1, 0), 0
    return _vmap_rule(solve, info, in_dims, lower, diag, upper, rhs, lu, pivots)


def _band_grads_and_rhs(solve, needs, lower, diag, upper, x, grad_x):
    """:func:`rules.solve_backward`, computing only the band gradients that ``needs`` asks for
    (``ctx.needs_input_grad`` of the bands); ``v = A^{-H} g`` is the gradient of ``rhs``."""
    if any(needs):
        return rules.solve_backward(solve, lower, diag, upper, x, grad_x)
    v = solve(upper.conj(), diag.conj(), lower.conj(), grad_x)
    return None, None, None, v


def _backward(solve, ctx, saved, grad_x):
    """Both paths' backward: ``solve(lower, diag, upper, rhs, lu, pivots, trans)`` solves with
    ``M^H`` from the saved factors (or from ``M^H``'s bands when there are none); ``saved`` is
    ``ctx.saved_tensors``."""
    lower, diag, upper, x, lu, pivots = saved
    lu, pivots, trans = _adjoint(lu, pivots, ctx.trans)
    grads = _band_grads_and_rhs(lambda l, d, u, r: solve(l, d, u, r, lu, pivots, trans),
                                ctx.needs_input_grad[:3], lower, diag, upper, x, grad_x)
    return (*grads, None, None, None, None)


def _jvp(solve, ctx, tangents):
    """Both paths' ``jvp``: ``dx = M^{-1} (d_rhs - dM x)``, solving with the saved factors."""
    _check_not_forward_over_forward()
    lower, diag, upper, x, lu, pivots = ctx.saved_tensors
    return rules.solve_jvp(lambda l, d, u, r: solve(l, d, u, r, lu, pivots, ctx.trans),
                           lower, diag, upper, x, *tangents)


# [book: eager-function]
class _TridiagonalSolve(torch.autograd.Function):
    """``x = solve(lower, diag, upper, rhs, lu, pivots, trans, driver)`` (see
    :func:`tridiag_tutorial.kernels.solve`). ``driver`` names the kernel; the backward and
    ``jvp`` reuse it, and the factors, when there are any."""

    @staticmethod
    def forward(lower, diag, upper, rhs, lu, pivots, trans, driver):
        if _direct(lower, diag, upper, rhs, lu, pivots):
            return _kernel(lower, diag, upper, rhs, lu, pivots, trans, driver)
        _register_sharding_for((lower, diag, upper, rhs))  # DTensors: the rules, once
        return _kernel_op(lower, diag, upper, rhs, lu, pivots, trans, driver)  # modes, fakes

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, lu, pivots, ctx.trans, ctx.driver = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(lower, diag, upper, output, lu, pivots)
        ctx.save_for_forward(lower, diag, upper, output, lu, pivots)

    @staticmethod
    def backward(ctx, grad_x):
        if grad_x is None:  # grads are not materialised: x was not used by the loss
            return (None,) * 8
        saved = ctx.saved_tensors  # each read unpacks them again: read once
        plain = not torch.is_grad_enabled() and not _compat.forward_ad_active()
        if plain and _direct(grad_x, *saved):
            # First-order backward, not itself differentiated: call the kernels directly.
            return _backward(lambda *a: _kernel(*a, ctx.driver), ctx, saved, grad_x)
        # Solve through the differentiable Function, so higher derivatives work.
        return _backward(lambda *a: _apply(*a, ctx.driver), ctx, saved, grad_x)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, *_):
        return _jvp(lambda *a: _apply(*a, ctx.driver), ctx, (d_lower, d_diag, d_upper, d_rhs))

    @staticmethod
    def vmap(info, in_dims, lower, diag, upper, rhs, lu, pivots, trans, driver):
        def solve(*tensors):
            return _TridiagonalSolve.apply(*tensors, trans, driver)
        return _batch_rule(solve, info, in_dims[:6], lower, diag, upper, rhs, lu, pivots)


# [book: apply]
def _apply(*args):
    """``_TridiagonalSolve.apply(*args)``. Without a ``torch.func`` transform, through
    :func:`_compat.function_apply`, which skips the :mod:`inspect` binding of the arguments that
    ``Function.apply`` does on every call for a Function with ``setup_context`` (chapter 13
    measures that cost: several times LAPACK's own time at n = 100)."""
    if not _routes.ON.function_apply:
        return _TridiagonalSolve.apply(*args)
    return _compat.function_apply(_TridiagonalSolve, *args)


def _differentiable_solve(lower, diag, upper, rhs, driver: str | None = None):
    """The differentiable solve of validated inputs through :class:`_TridiagonalSolve` (the
    Function that ``torch.func`` needs)."""
    return _TridiagonalSolve.apply(lower, diag, upper, rhs, None, None, "N",
                                   kernels.resolve_driver(driver, rhs))


_FORWARD_OVER_FORWARD = (
    "tridiagonal_solve: forward-mode AD nested in forward-mode AD (torch.func.jvp of jvp, "
    "jacfwd(jacfwd(f))) is not supported: torch does not differentiate an autograd.Function's "
    "jvp rule at an outer forward-mode level, so the second derivative would be silently wrong. "
    "Use torch.func.hessian or jacfwd(jacrev(f)) (forward-over-reverse), or jacrev(jacrev(f)), "
    "which work.")


def _check_not_forward_over_forward() -> None:
    if _compat.forward_transform_depth() > 1:
        raise NotImplementedError(_FORWARD_OVER_FORWARD)


def _with_primal_layout(dx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The tangent ``dx`` of the solution ``x``, laid out as ``x`` is.

    Forward-mode AD gives an output's tangent its primal's layout: where the strides differ it
    copies the tangent through ``aten::_new_zeros_with_same_feature_meta``, which reads the
    primal's ``storage_offset()`` and so raises "Cannot call storage_offset() on tensor with
    symbolic sizes/strides" under ``torch.compile(..., dynamic=True)`` (torch 2.13). They differ
    when a ``vmap`` batches the tangent's right-hand side but not the primal's (``jacfwd`` is
    such a ``vmap`` of ``jvp``): :func:`_batch_rule` solves that as more columns, so the vmapped
    dimension comes back innermost in memory, while ``x`` is C-contiguous. Where the primal is
    vmapped in the same way, the strides agree and nothing is copied."""
    if dx.stride() == x.stride():
        return dx
    return dx.contiguous()  # the copy that torch would make, here without storage_offset()


# [book: compiled-function]
class _CompiledSolve(_compat.SingleLevelFunction):
    """The Autograd kernel of ``tridiag_tutorial::solve``: one autograd node at the current level."""

    @staticmethod
    def forward(lower, diag, upper, rhs, lu, pivots, trans, driver):
        return _kernel_op(lower, diag, upper, rhs, lu, pivots, trans, driver)

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, lu, pivots, ctx.trans, ctx.driver = inputs
        ctx.save_for_backward(lower, diag, upper, output, lu, pivots)
        ctx.save_for_forward(lower, diag, upper, output, lu, pivots)

    @staticmethod
    def backward(ctx, grad_x):
        return _backward(lambda *a: _compiled_op(*a, ctx.driver), ctx, ctx.saved_tensors, grad_x)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, *_):
        dx = _jvp(lambda *a: _compiled_op(*a, ctx.driver), ctx, (d_lower, d_diag, d_upper, d_rhs))
        return _with_primal_layout(dx, ctx.saved_tensors[3])


def _unfused_backward(lower, diag, upper, x, grad_x):
    """What :func:`compiled.solve_backward` computes in one C++ call, as a solve with ``A^H`` on
    the C++ kernel and the band products of :func:`rules.solve_backward` in torch ops: the
    simpler route, where ``fused_backward`` is off."""
    column = (lambda t: t.unsqueeze(-1)) if x.dim() == diag.dim() else (lambda t: t)
    *bands, v = rules.solve_backward(compiled.solve, lower, diag, upper, column(x), column(grad_x))
    return (*bands, v.reshape(x.shape))


# [book: cpp-function]
class _CppSolve(torch.autograd.Function):
    """The C++ kernel with reverse-mode autograd and nothing else, for :func:`_solve_on_cpp`: a
    gradient is asked for, but no transform, forward-AD level or mode can see the call, so the
    ``jvp`` and ``vmap`` rules of :class:`_TridiagonalSolve` are not needed, nor its factors,
    ``trans`` or driver argument, nor the reshaping of a vector ``rhs`` (the op takes it as it
    is). The backward is one call of the C++ op ``cpp_solve_backward``
    (:func:`compiled.solve_backward`: the solve with ``A^H`` on the same kernel, and the band
    gradients formed in C++ in one pass, not four torch ops), or the solve alone where only
    ``rhs`` needs a gradient; where it is itself differentiated (``create_graph=True``) or runs
    under a transform (``torch.autograd.functional.jacobian(..., vectorize=True)`` vmaps it), it
    takes the general path's differentiable rules instead."""

    @staticmethod
    def forward(ctx, lower, diag, upper, rhs):
        x = compiled.solve(lower, diag, upper, rhs)
        ctx.save_for_backward(lower, diag, upper, x)
        return x

    @staticmethod
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        need_lower, need_diag, need_upper, _ = ctx.needs_input_grad
        if not (torch.is_grad_enabled() or _compat.forward_ad_active() or not _direct(grad_x)):
            # (Written flat on purpose: every first-order backward runs this branch, so each
            # Python step here is paid on every call.)
            if not (need_lower or need_diag or need_upper):  # rhs alone: the solve with A^H
                return None, None, None, compiled.solve(upper.conj(), diag.conj(), lower.conj(),
                                                        grad_x)
            grad_lower, grad_diag, grad_upper, grad_rhs = (
                compiled.solve_backward if _routes.ON.fused_backward else _unfused_backward)(
                lower, diag, upper, x, grad_x)  # one call, in C++
            return (grad_lower if need_lower else None, grad_diag if need_diag else None,
                    grad_upper if need_upper else None, grad_rhs)
        needs = (need_lower, need_diag, need_upper)

        def solve(lower, diag, upper, rhs):  # differentiable, and it knows transforms
            return _apply(lower, diag, upper, rhs, None, None, "N", "cpp")

        column = (lambda t: t.unsqueeze(-1)) if x.dim() == diag.dim() else (lambda t: t)
        grads = _band_grads_and_rhs(solve, needs, lower, diag, upper, column(x), column(grad_x))
        return (*grads[:3], grads[3].reshape(x.shape))


_CPP_SOLVE_APPLY = _compat.base_apply(_CppSolve)  # _CppSolve.apply without its Python layer
