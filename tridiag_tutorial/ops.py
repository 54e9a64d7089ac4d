r"""The public op, :func:`tridiagonal_solve`: the result of the whole tutorial.

Design (chapter 7 explains it; chapter 5 shows the traps it gets around)::

    tridiagonal_solve(lower, diag, upper, rhs)      validate + broadcast (one place)
        |-- eager:     _TridiagonalSolve.apply      autograd.Function: backward, jvp, vmap
        |-- compiling: torch.ops.tridiag_tutorial.tridiagonal_solve
        |                                           custom op: fake kernel, autograd, vmap
        `-- both run the same kernel: LAPACK ?gtsv on CPU, the batched torch kernel elsewhere

Why two paths? On torch 2.13 (measured in chapter 5):

- a ``custom_op`` with ``register_autograd`` raises under ``torch.func.grad`` and silently returns
  zero tangents under ``torch.func.jvp`` / ``jacfwd``;
- an ``autograd.Function`` with a ``jvp`` staticmethod cannot be traced by Dynamo with
  ``fullgraph=True``.

So eager code (including every ``torch.func`` transform and forward-mode AD) goes through the
``autograd.Function``, which defines ``setup_context``, ``backward``, ``jvp`` and ``vmap``; code
being compiled (``torch.compiler.is_compiling()``) goes through the custom op, which Dynamo treats
as one opaque node with a fake kernel and a registered backward. Both use the rules of
:mod:`tridiag_tutorial.rules`, and both backward passes call the differentiable solve again on
``A^H``, so derivatives of any order work.
"""

from __future__ import annotations

import torch

from . import rules
from ._validation import validate
from .custom_op import _vmap_rule
from .custom_op import tridiagonal_solve_op as _solve_op

__all__ = ["tridiagonal_solve"]


# --------------------------------------------------------------------------------------------
# The eager path: an autograd.Function that torch.func and forward-mode AD understand.
# --------------------------------------------------------------------------------------------
class _TridiagonalSolve(torch.autograd.Function):
    @staticmethod
    def forward(lower, diag, upper, rhs):
        return _solve_op(lower, diag, upper, rhs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _ = inputs
        ctx.save_for_backward(lower, diag, upper, output)
        ctx.save_for_forward(lower, diag, upper, output)

    @staticmethod
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_backward(_TridiagonalSolve.apply, lower, diag, upper, x, grad_x)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs):
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_jvp(_TridiagonalSolve.apply, lower, diag, upper, x,
                               d_lower, d_diag, d_upper, d_rhs)

    @staticmethod
    def vmap(info, in_dims, lower, diag, upper, rhs):
        return _vmap_rule(_TridiagonalSolve.apply, info, in_dims, lower, diag, upper, rhs)


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

    On CPU it calls LAPACK ``?gtsv`` (Gaussian elimination with partial pivoting). Gradients flow
    to all four inputs, to any order; ``torch.compile(fullgraph=True)`` traces it with no graph
    break. Inputs are never modified.

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
    if torch.compiler.is_compiling():
        x = _solve_op(p.lower, p.diag, p.upper, p.rhs)
    else:
        x = _TridiagonalSolve.apply(p.lower, p.diag, p.upper, p.rhs)
    return x.squeeze(-1) if p.vector_rhs else x
