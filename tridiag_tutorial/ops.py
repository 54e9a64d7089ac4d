r"""The public op, :func:`tridiagonal_solve`: the result of the whole tutorial.

Design (chapter 7 explains it; chapter 5 shows the traps it gets around)::

    tridiagonal_solve(lower, diag, upper, rhs)      validate + broadcast (one place)
        |-- nothing observes the call (no grad, no transform, no mode): the kernel, directly
        |-- eager:     _TridiagonalSolve.apply      autograd.Function: backward, jvp, vmap
        |-- compiling: torch.ops.tridiag_tutorial.solve
        |                                           library op: fake kernel (via solve_kernel),
        |                                           an Autograd kernel that works under
        |                                           torch.func, and a vmap rule
        `-- all run the same kernels: LAPACK on CPU, the batched torch kernel elsewhere

Why two paths? On torch 2.13 (measured in chapter 5):

- a ``custom_op`` with ``register_autograd`` raises under ``torch.func.grad`` and silently returns
  zero tangents under ``torch.func.jvp`` / ``jacfwd``;
- an ``autograd.Function`` with a ``jvp`` staticmethod cannot be traced by Dynamo with
  ``fullgraph=True``.

So eager code (including every ``torch.func`` transform and forward-mode AD) goes through the
``autograd.Function``, which defines ``setup_context``, ``backward``, ``jvp`` and ``vmap``; code
being compiled (``torch.compiler.is_compiling()``) goes through the op ``tridiag_tutorial::solve``,
which Dynamo treats as one opaque node. That op is defined with ``torch.library.Library`` rather
than ``custom_op`` so that its Autograd kernel can be ours: a single-level autograd.Function with
``backward`` and ``jvp`` (the way functorch attaches an autograd.Function to one transform level),
so ``torch.func.grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``, ``vmap`` and forward-mode dual
numbers all work inside a compiled function. Both paths use the rules of
:mod:`tridiag_tutorial.rules`.

What does not compose, and raises instead of answering wrongly (chapter 7's support table):

- nested differentiation (``hessian``, ``jacfwd(jacrev(f))``, ``grad(grad(f))``) *inside*
  ``torch.compile``: a single-level Function differentiates at one level only. The error says so
  and what to do (run that transform eagerly; compiled single-level transforms work);
- forward-over-forward (``jvp`` of ``jvp``, ``jacfwd(jacfwd(f))``), eager or compiled: torch does
  not differentiate an ``autograd.Function``'s ``jvp`` staticmethod at an outer forward level (it
  returns a silently wrong second derivative, for ``torch.linalg.solve`` as well; pytorch
  issue 197867), so the op raises
  and points to ``hessian`` / ``jacfwd(jacrev(f))``, which work eagerly;
- double backward (``create_graph=True``) through a compiled function: torch's AOTAutograd
  raises its own error ("does not currently support double backward").

The kernel that a CPU tensor goes to (LAPACK, or the pure-torch kernel under
:func:`~tridiag_tutorial.custom_op.torch_kernel_on_cpu`) is context-local state; each path saves
the choice its forward made and its backward and ``jvp`` run on the same kernel.

Factor reuse (eager path), where it is faster (:func:`_keeps_factors`): when a backward pass will
follow, the forward factors ``A = LU`` once and keeps the factors; a plain first-order backward then
solves ``A^H v = g`` from them (``trans='T'``/``'C'``) instead of factoring again. That pays on the
pure-torch kernel (CUDA). With LAPACK it pays only for one large complex system: ``?gtsv`` factors
and solves in a single sweep, so ``?gttrf`` + two ``?gttrs`` cost about as much as two ``?gtsv``
or more (chapters 7 and 9 measure it); otherwise a plain backward calls ``?gtsv`` with ``A^H``
directly. A backward that is itself being differentiated (``create_graph=True``, ``torch.func``)
calls the differentiable solve on ``A^H`` instead, so derivatives of any order work.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _compat, lapack, rules, torch_kernel
from ._validation import validate
from .custom_op import (_kernel_choice, _numpy, _solve_kernel, _torch_kernel_on_cpu, _use_lapack,
                        _vmap_rule)
from .custom_op import tridiagonal_solve_op as _solve_op

__all__ = ["tridiagonal_solve"]


# --------------------------------------------------------------------------------------------
# Factor reuse: the forward keeps LU factors, the first backward solves with A^H from them.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tridiag_tutorial::factor_solve", mutates_args=())
def _factor_solve_op(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                     rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, lu)``: the solution and the packed LU factors ``(*B, 5, n)`` (``?gttrf`` + ``?gttrs``)."""
    return _factor_solve_kernel(lower, diag, upper, rhs)


def _factor_solve_kernel(lower, diag, upper, rhs):
    if _use_lapack(rhs):
        x, lu = lapack.factor_solve(*_numpy(lower, diag, upper, rhs))
        return torch.from_numpy(x), torch.from_numpy(lu)
    lu = torch_kernel.factor(lower, diag, upper)
    return torch_kernel.lu_solve(lu, rhs), lu


@_factor_solve_op.register_fake
def _factor_solve_fake(lower, diag, upper, rhs):
    return rhs.new_empty(rhs.shape), diag.new_empty(diag.shape[:-1] + (5, diag.shape[-1]))


# None: decide by measurement (_keeps_factors). Context-local, like the kernel choice.
_FACTOR_REUSE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "tridiag_tutorial_factor_reuse", default=None)


@contextlib.contextmanager
def _factor_reuse(enabled: bool | None):
    """Force factor reuse on (``True``) or off (``False``) within the block, in this thread or
    task; ``None`` restores the measured policy. For the tests and the benchmarks, which compare
    both strategies. The choice is made in the forward: a backward that runs after the block still
    uses the factors kept (or not) by its forward."""
    token = _FACTOR_REUSE.set(enabled)
    try:
        yield
    finally:
        _FACTOR_REUSE.reset(token)


_LAPACK_REUSE_MIN_N = 10**5  # see _keeps_factors


def _keeps_factors(rhs: torch.Tensor) -> bool:
    """Whether a forward that a backward will follow should keep the LU factors for it.

    Decided by measurement: forward + backward with reuse against solving twice, in the benchmark
    suite's factor-reuse experiment (chapter 9 renders it). The pure-torch kernel factorises at
    about twice the cost of a solve with the factors, and reuse took 0.57-0.72 of the time of
    solving twice in every case measured. LAPACK's ``?gtsv`` factors and solves in one sweep,
    which ``?gttrf`` + ``?gttrs`` need three for. With LAPACK, reuse was slower for systems of
    n < 1e5 (by up to 25%), for several right-hand sides (14-27%) and in 14 of 16 batch
    measurements (up to 42%; the factors also travel between the joined and the per-system
    layout), and within 5% either way for one large real system. It was faster, by 2-10%, in
    every measurement of one complex system of ``n >= 10**5`` with one right-hand side, so that
    is the one LAPACK case that keeps factors; elsewhere the backward solves again and no
    ``(*B, 5, n)`` factors are held in memory until it runs. ``rhs`` is the validated
    ``(*B, n, k)`` right-hand side.
    """
    forced = _FACTOR_REUSE.get()
    if forced is not None:
        return forced
    if not _use_lapack(rhs):
        return True
    one_system = rhs.shape[:-2].numel() == 1 and rhs.shape[-1] == 1
    return rhs.is_complex() and one_system and rhs.shape[-2] >= _LAPACK_REUSE_MIN_N


def _lu_solve_kernel(lu, rhs, trans):
    """Solve with ``A`` (``'N'``), ``A^T`` (``'T'``) or ``A^H`` (``'C'``) from packed factors.

    Not differentiable on purpose, and called directly (never dispatched): it serves only a
    first-order backward that nothing observes (see :meth:`_TridiagonalSolve.backward`).
    """
    if _use_lapack(rhs):
        return torch.from_numpy(lapack.lu_solve(*_numpy(lu, rhs), trans))
    return torch_kernel.lu_solve(lu, rhs, trans)


def _direct(*tensors) -> bool:
    """True when the kernels may be called on these tensors directly, skipping the dispatcher:
    no ``torch.func`` transform is active, no dispatch or function mode is installed, and they are
    plain tensors with data (no subclass, no FakeTensor or meta tensor, no functorch wrapper). Dispatching a
    custom op costs tens of microseconds in Python, more than LAPACK needs for n = 100."""
    if torch.compiler.is_compiling():  # Dynamo traces the custom ops, never the NumPy kernels
        return False
    if _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:  # inside a torch.func transform
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type == "meta":
            return False
        functorch = torch._C._functorch
        if (functorch.is_functorch_wrapped_tensor(t) or functorch.is_batchedtensor(t)
                or functorch.is_legacy_batchedtensor(t)):  # the last: gradcheck's batched checks
            return False
    return True


def _unobserved(args) -> bool:
    """True when nothing but the result of this call matters: no gradient will be asked for, no
    ``torch.func`` transform or forward-AD level is active, and :func:`_direct` holds. Then the
    public function calls the kernel without ``autograd.Function`` or the custom op."""
    if forward_ad._current_level >= 0:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in args):
        return False
    return _direct(*args)


# --------------------------------------------------------------------------------------------
# The eager path: an autograd.Function that torch.func and forward-mode AD understand.
# --------------------------------------------------------------------------------------------
class _TridiagonalSolve(torch.autograd.Function):
    """``(x, lu) = solve(lower, diag, upper, rhs, keep_lu, torch_kernel)``; ``lu`` is empty unless
    ``keep_lu``. ``torch_kernel`` is the kernel choice made by the caller (see
    :func:`~tridiag_tutorial.custom_op.torch_kernel_on_cpu`); the backward and ``jvp`` reuse it."""

    @staticmethod
    def forward(lower, diag, upper, rhs, keep_lu, torch_kernel):
        direct = _direct(lower, diag, upper, rhs)  # else the custom ops (fake kernels, modes)
        with _kernel_choice(torch_kernel):
            if keep_lu:
                return (_factor_solve_kernel if direct else _factor_solve_op)(lower, diag, upper,
                                                                              rhs)
            x = (_solve_kernel if direct else _solve_op)(lower, diag, upper, rhs)
        return x, diag.new_empty(diag.shape[:-1] + (0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, _, ctx.torch_kernel = inputs
        x, lu = output
        ctx.mark_non_differentiable(lu)
        ctx.set_materialize_grads(False)  # no zero-filled (..., 5, n) gradient for lu, ever
        ctx.save_for_backward(lower, diag, upper, x, lu)
        ctx.save_for_forward(lower, diag, upper, x)

    @staticmethod
    def backward(ctx, grad_x, _grad_lu):
        lower, diag, upper, x, lu = ctx.saved_tensors
        if grad_x is None:  # grads are not materialised: x was not used by the loss
            return None, None, None, None, None, None
        plain = not torch.is_grad_enabled() and forward_ad._current_level < 0  # no AD watching
        with _kernel_choice(ctx.torch_kernel):  # the forward's kernel, whatever the caller's now
            if plain and _direct(grad_x, x, lu, lower, diag, upper):
                # First-order backward, not itself differentiated: call the kernels directly.
                if lu.numel():  # the forward kept its factors: solve with A^T / A^H from them
                    v = _lu_solve_kernel(lu, grad_x, "C" if x.is_complex() else "T")
                    return (*rules.band_gradients(v, x), v, None, None)
                grads = rules.solve_backward(_solve_kernel, lower, diag, upper, x, grad_x)
            else:  # solve again through the differentiable op, so higher derivatives work
                grads = rules.solve_backward(_differentiable_solve, lower, diag, upper, x, grad_x)
        return (*grads, None, None)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, _d_keep_lu, _d_torch_kernel):
        _check_not_forward_over_forward()
        lower, diag, upper, x = ctx.saved_tensors
        with _kernel_choice(ctx.torch_kernel):
            dx = rules.solve_jvp(_differentiable_solve, lower, diag, upper, x,
                                 d_lower, d_diag, d_upper, d_rhs)
        return dx, None

    @staticmethod
    def vmap(info, in_dims, lower, diag, upper, rhs, keep_lu, torch_kernel):
        return _vmap_rule(lambda *a: _TridiagonalSolve.apply(*a, keep_lu, torch_kernel), info,
                          in_dims[:4], lower, diag, upper, rhs, out_dims=(0, 0))


def _differentiable_solve(lower, diag, upper, rhs):
    """The differentiable solve that backward and jvp rules call, on the current kernel choice."""
    x, _ = _TridiagonalSolve.apply(lower, diag, upper, rhs, False, _torch_kernel_on_cpu())
    return x


_FORWARD_OVER_FORWARD = (
    "tridiagonal_solve: forward-mode AD nested in forward-mode AD (torch.func.jvp of jvp, "
    "jacfwd(jacfwd(f))) is not supported: torch does not differentiate an autograd.Function's "
    "jvp rule at an outer forward-mode level, so the second derivative would be silently wrong. "
    "Use torch.func.hessian or jacfwd(jacrev(f)) (forward-over-reverse), or jacrev(jacrev(f)), "
    "which work.")


def _check_not_forward_over_forward() -> None:
    if _compat.forward_transform_depth() > 1:
        raise NotImplementedError(_FORWARD_OVER_FORWARD)


# --------------------------------------------------------------------------------------------
# The compiled path: tridiag_tutorial::solve, an op with an Autograd kernel of our own.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("tridiag_tutorial::solve_kernel", mutates_args=())
def _kernel_op(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
               torch_kernel: bool) -> torch.Tensor:
    """The kernel alone (no autograd): what the compiled graph calls, forward and backward."""
    with _kernel_choice(torch_kernel):
        return _solve_kernel(lower, diag, upper, rhs)


@_kernel_op.register_fake
def _kernel_fake(lower, diag, upper, rhs, torch_kernel):
    return rhs.new_empty(rhs.shape)  # the real kernels return a new C-contiguous tensor


def _on_kernel(op, torch_kernel: bool):
    """``op`` as a solve of four tensors, with the kernel choice bound."""
    return lambda lower, diag, upper, rhs: op(lower, diag, upper, rhs, torch_kernel)


def _vmap_with_kernel(op):
    """The batch rule of an op whose last argument is the kernel choice."""
    def rule(info, in_dims, lower, diag, upper, rhs, torch_kernel):
        return _vmap_rule(_on_kernel(op, torch_kernel), info, in_dims[:4], lower, diag, upper, rhs)
    return rule


_kernel_op.register_vmap(_vmap_with_kernel(_kernel_op))


_LIB = torch.library.Library("tridiag_tutorial", "FRAGMENT")
_LIB.define("solve(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, bool torch_kernel) -> Tensor")
_LIB.impl("solve", _kernel_op, "CompositeExplicitAutograd")  # every backend, meta and fake too


class _CompiledSolve(_compat.SingleLevelFunction):
    """The Autograd kernel of ``tridiag_tutorial::solve``: one autograd node at the current level."""

    @staticmethod
    def forward(lower, diag, upper, rhs, torch_kernel):
        return _kernel_op(lower, diag, upper, rhs, torch_kernel)

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, ctx.torch_kernel = inputs
        ctx.save_for_backward(lower, diag, upper, output)
        ctx.save_for_forward(lower, diag, upper, output)

    @staticmethod
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        solve = _on_kernel(_compiled_op, ctx.torch_kernel)
        return (*rules.solve_backward(solve, lower, diag, upper, x, grad_x), None)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, _d_torch_kernel):
        _check_not_forward_over_forward()
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_jvp(_on_kernel(_compiled_op, ctx.torch_kernel), lower, diag, upper, x,
                               d_lower, d_diag, d_upper, d_rhs)


_NESTED_UNDER_COMPILE = (
    "tridiagonal_solve: nested differentiation inside torch.compile (torch.func.hessian, "
    "jacfwd(jacrev(f)), grad(grad(f)), a transform of a transform that both differentiate) is not "
    "supported: the compiled op attaches its derivative to one transform level only. Run the "
    "nested transform eagerly (without torch.compile), where it works; inside torch.compile, one "
    "level of grad, vjp, jacrev, jvp or jacfwd (optionally under vmap) works.")


def _solve_autograd(lower, diag, upper, rhs, torch_kernel):
    if _compat.differentiation_depth() > 1:
        raise NotImplementedError(_NESTED_UNDER_COMPILE)
    with _compat.enable_single_level_autograd_function():
        return _CompiledSolve.apply(lower, diag, upper, rhs, torch_kernel)


_LIB.impl("solve", _solve_autograd, "Autograd")
_compiled_op = torch.ops.tridiag_tutorial.solve.default
torch.library.register_vmap("tridiag_tutorial::solve", _vmap_with_kernel(_compiled_op), lib=_LIB)


# --------------------------------------------------------------------------------------------
# The public face.
# --------------------------------------------------------------------------------------------
def tridiagonal_solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                      rhs: torch.Tensor) -> torch.Tensor:
    r"""Solve ``A x = rhs`` for a tridiagonal ``A``, differentiably, in O(n).

    Args:
        lower: ``(..., n-1)``, the subdiagonal: ``lower[..., i] = A[i+1, i]``.
        diag: ``(..., n)``, the diagonal: ``diag[..., i] = A[i, i]``.
        upper: ``(..., n-1)``, the superdiagonal: ``upper[..., i] = A[i, i+1]``.
        rhs: ``(..., n)`` for one right-hand side per system (``rhs.ndim == diag.ndim``), or
            ``(..., n, k)`` for ``k`` of them (``rhs.ndim == diag.ndim + 1``).

    The batch dimensions ``...`` of the four arguments broadcast. All four must have the same
    dtype (float32, float64, complex64 or complex128) and device.

    Returns:
        ``x`` with ``rhs``'s broadcast shape, ``(*batch, n)`` or ``(*batch, n, k)``, and dtype.

    Raises:
        TypeError: mixed or unsupported dtypes, or an argument that is not a tensor.
        ValueError: mixed devices, band lengths that do not fit ``n``, or batch shapes that do not
            broadcast.
        torch.linalg.LinAlgError: ``A`` is singular (an exactly zero pivot in LU with partial
            pivoting); the message names the pivot and the batch element.

    On CPU it calls LAPACK ``?gtsv`` (Gaussian elimination with partial pivoting), and a backward
    calls it again with ``A^H`` (except for one complex system of ``n >= 10**5``, whose factors
    are kept); on other devices the pure-torch kernel (the same pivoting) runs, and its forward
    keeps the LU factors for the backward. Gradients flow to all four inputs, to
    any order; ``torch.compile(fullgraph=True)`` traces it with no graph break. Inputs are never
    modified.

    Example:
        >>> import torch
        >>> from tridiag_tutorial import tridiagonal_solve
        >>> lower = torch.tensor([1.0, 1.0])            # A = [[2, 1, 0],
        >>> diag = torch.tensor([2.0, 2.0, 2.0])        #      [1, 2, 1],
        >>> upper = torch.tensor([1.0, 1.0])            #      [0, 1, 2]]
        >>> rhs = torch.tensor([4.0, 8.0, 8.0], requires_grad=True)
        >>> x = tridiagonal_solve(lower, diag, upper, rhs)
        >>> x.detach().round(decimals=6)
        tensor([1., 2., 3.])
        >>> x.sum().backward()                          # rhs.grad = A^{-T} @ ones
        >>> rhs.grad.round(decimals=6)
        tensor([0.5000, 0.0000, 0.5000])
    """
    p = validate(lower, diag, upper, rhs)
    args = (p.lower, p.diag, p.upper, p.rhs)
    if torch.compiler.is_compiling():
        x = _compiled_op(*args, _torch_kernel_on_cpu())
    elif torch.jit.is_tracing():
        raise RuntimeError(
            "tridiagonal_solve: torch.jit.trace cannot record this op (it calls LAPACK through "
            "NumPy, so the trace would hold the solution as a constant). Use torch.compile, or "
            "torch.export.export for a graph to save.")
    elif _unobserved(args):
        x = _solve_kernel(*args)  # no autograd, transform or mode can see the call: skip dispatch
    else:
        # Keep the LU factors only when a backward pass will want them, and reuse pays.
        keep_lu = (torch.is_grad_enabled() and any(t.requires_grad for t in args)
                   and _keeps_factors(p.rhs))
        x, _ = _TridiagonalSolve.apply(*args, keep_lu, _torch_kernel_on_cpu())
    return x.squeeze(-1) if p.vector_rhs else x
