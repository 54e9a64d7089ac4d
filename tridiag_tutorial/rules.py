r"""The differentiation rules of ``x = A^{-1} b`` for a tridiagonal ``A``, written once.

Every version of the solver in this package (the chapter versions and the final op) calls these
functions; chapter 3 derives them. With ``g = dL/dx`` (PyTorch's convention for complex numbers:
the gradient is the conjugate Wirtinger derivative, so ``A^T`` becomes ``A^H``):

.. math::

    v = A^{-H} g, \qquad \bar b = v, \qquad \bar A = -v\, x^H
    \quad\text{restricted to the three bands, summed over the columns of } x,

and in forward mode, from ``A x = b``: ``dA x + A dx = db``, so

.. math::

    dx = A^{-1} (db - dA\, x).

The transpose of a tridiagonal matrix is tridiagonal with ``lower`` and ``upper`` swapped, so
``A^{-H} g`` is the same solve with ``(upper.conj(), diag.conj(), lower.conj())``. Both rules take
that solve as an argument: called with a differentiable solve, they are differentiable themselves,
which gives second and higher derivatives for free.

All tensors here have one batch shape (broadcast by :mod:`tridiag_tutorial._validation`) and a
matrix right-hand side: ``lower``, ``upper`` ``(*batch, n-1)``, ``diag`` ``(*batch, n)``, ``x``,
``g`` ``(*batch, n, k)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["tridiag_matmul", "band_gradients", "solve_backward", "solve_jvp"]

Solve = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tridiag_matmul(lower, diag, upper, x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` in O(n) for ``x`` of shape ``(*batch, n, k)``; ``None`` bands count as zero."""
    out = torch.zeros_like(x) if diag is None else diag.unsqueeze(-1) * x
    if x.shape[-2] > 1:
        pad = x.new_zeros(x.shape[:-2] + (1, x.shape[-1]))
        if lower is not None:  # (A x)[i] += A[i, i-1] x[i-1] = lower[i-1] x[i-1]
            out = out + torch.cat([pad, lower.unsqueeze(-1) * x[..., :-1, :]], dim=-2)
        if upper is not None:  # (A x)[i] += A[i, i+1] x[i+1] = upper[i] x[i+1]
            out = out + torch.cat([upper.unsqueeze(-1) * x[..., 1:, :], pad], dim=-2)
    return out


# [book: band-gradients]
def band_gradients(v: torch.Tensor, x: torch.Tensor):
    """The three bands of ``-v x^H``, summed over columns: ``(grad_lower, grad_diag, grad_upper)``.

    ``grad_lower[i] = -sum_k v[i+1, k] conj(x[i, k])`` (entry ``(i+1, i)``),
    ``grad_diag[i] = -sum_k v[i, k] conj(x[i, k])``,
    ``grad_upper[i] = -sum_k v[i, k] conj(x[i+1, k])`` (entry ``(i, i+1)``).
    """
    minus_v, xc = -v, x.conj()  # negate once, not three times: these are O(n) memory passes
    if v.shape[-1] == 1:  # one column: nothing to sum, and four passes over memory instead of nine
        minus_v, xc = minus_v.squeeze(-1), xc.squeeze(-1)
        return minus_v[..., 1:] * xc[..., :-1], minus_v * xc, minus_v[..., :-1] * xc[..., 1:]
    grad_diag = (minus_v * xc).sum(-1)
    grad_lower = (minus_v[..., 1:, :] * xc[..., :-1, :]).sum(-1)
    grad_upper = (minus_v[..., :-1, :] * xc[..., 1:, :]).sum(-1)
    return grad_lower, grad_diag, grad_upper


# [book: solve-backward]
def solve_backward(solve: Solve, lower, diag, upper, x, grad_x):
    """Reverse mode: ``(grad_lower, grad_diag, grad_upper, grad_rhs)`` from ``grad_x = dL/dx``."""
    v = solve(upper.conj(), diag.conj(), lower.conj(), grad_x)  # v = A^{-H} g
    grad_lower, grad_diag, grad_upper = band_gradients(v, x)
    return grad_lower, grad_diag, grad_upper, v


# [book: solve-jvp]
def solve_jvp(solve: Solve, lower, diag, upper, x,
              d_lower: torch.Tensor | None, d_diag: torch.Tensor | None,
              d_upper: torch.Tensor | None, d_rhs: torch.Tensor | None) -> torch.Tensor:
    """Forward mode: ``dx = A^{-1} (d_rhs - dA x)``; a ``None`` tangent counts as zero."""
    residual = -tridiag_matmul(d_lower, d_diag, d_upper, x)
    if d_rhs is not None:
        residual = residual + d_rhs
    return solve(lower, diag, upper, residual)
