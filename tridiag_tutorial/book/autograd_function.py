"""Chapter 4: the solver as a ``torch.autograd.Function`` around LAPACK.

This is the source article's design, corrected: the forward calls SciPy's LAPACK wrapper on NumPy
arrays, saves ``(lower, diag, upper, x)`` and the backward applies
:func:`tridiag_tutorial.rules.solve_backward` with another LAPACK solve on ``A^T``. ``rhs`` is not
saved: the backward needs only ``A`` and the solution ``x``.

It works (``gradcheck`` passes) and it is where most people stop. Chapter 4 shows its limits, each
measured: NumPy inside ``forward`` makes Dynamo break the graph; no ``setup_context`` means no
``torch.func``; a backward that calls NumPy is ``once_differentiable`` (no second derivative); and
it runs on CPU only.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .. import rules
from .._validation import validate
from ..kernels import lapack

__all__ = ["LapackTridiagonalSolve", "tridiagonal_solve_function"]


# [book: lapack-numpy]
def _lapack_solve(lower, diag, upper, rhs) -> torch.Tensor:
    """Tensors in, tensor out, through NumPy: opaque to autograd, and Dynamo breaks the graph here."""
    arrays = (t.detach().resolve_conj().resolve_neg().numpy() for t in (lower, diag, upper, rhs))
    return torch.from_numpy(lapack.solve(*arrays))


# [book: lapack-function]
class LapackTridiagonalSolve(torch.autograd.Function):
    """``x = A^{-1} rhs`` with inputs already validated and broadcast; ``rhs`` is ``(*B, n, k)``."""

    @staticmethod
    def forward(ctx, lower, diag, upper, rhs):
        x = _lapack_solve(lower, diag, upper, rhs)
        ctx.save_for_backward(lower, diag, upper, x)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_backward(_lapack_solve, lower, diag, upper, x, grad_x)


def tridiagonal_solve_function(lower, diag, upper, rhs) -> torch.Tensor:
    """Chapter 4's version: :func:`tridiag_tutorial.tridiagonal_solve`'s arguments and result,
    through :class:`LapackTridiagonalSolve` (CPU only, first derivatives only)."""
    p = validate(lower, diag, upper, rhs, name="tridiagonal_solve_function")
    if p.diag.device.type != "cpu":
        raise ValueError(
            f"tridiagonal_solve_function: runs on CPU only (it calls LAPACK through NumPy); "
            f"got tensors on {p.diag.device}"
        )
    x = LapackTridiagonalSolve.apply(p.lower, p.diag, p.upper, p.rhs)
    return x.squeeze(-1) if p.vector_rhs else x
