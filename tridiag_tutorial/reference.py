"""Dense references: assemble ``A`` and solve with ``torch.linalg.solve``, in O(n^3).

These are the independent references of the tests and chapters. They are differentiable by
ordinary autograd, so they also give reference gradients, Jacobians and Hessians.
"""

from __future__ import annotations

import torch

from ._validation import validate

__all__ = ["to_dense", "dense_solve"]


def to_dense(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Assemble the dense ``(*batch, n, n)`` matrix with ``A[i+1, i] = lower[..., i]``,
    ``A[i, i] = diag[..., i]`` and ``A[i, i+1] = upper[..., i]``.

    >>> import torch
    >>> to_dense(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 5.0, 6.0]), torch.tensor([7.0, 8.0]))
    tensor([[4., 7., 0.],
            [1., 5., 8.],
            [0., 2., 6.]])
    """
    batch = torch.broadcast_shapes(lower.shape[:-1], diag.shape[:-1], upper.shape[:-1])
    n = diag.shape[-1]
    return (
        torch.diag_embed(diag.expand(*batch, n))
        + torch.diag_embed(lower.expand(*batch, n - 1), offset=-1)
        + torch.diag_embed(upper.expand(*batch, n - 1), offset=1)
    )


def dense_solve(lower, diag, upper, rhs) -> torch.Tensor:
    """Solve the same problem as :func:`tridiag_tutorial.tridiagonal_solve`, densely.

    Accepts the same shapes (broadcast batches, vector or matrix ``rhs``) and returns the same
    shape; O(n^3) time and O(n^2) memory, so use it only as a reference.
    """
    p = validate(lower, diag, upper, rhs, name="dense_solve")
    x = torch.linalg.solve(to_dense(p.lower, p.diag, p.upper), p.rhs)
    return x.squeeze(-1) if p.vector_rhs else x
