"""The pure-torch kernel: LAPACK's ``?gttrf`` / ``?gttrs`` in torch ops, vectorised over the batch.

This is the kernel for every device but the CPU (where :mod:`tridiag_tutorial.kernels.lapack` is used),
and it runs on the CPU too, so the tests check it there against the dense reference and against
LAPACK's own factors.

It is Gaussian elimination **with partial pivoting**, written as LAPACK writes it (row ``i`` is
swapped with row ``i + 1`` when ``|lower[i]| > |diag[i]|``; for complex numbers LAPACK's
``|re| + |im|`` is used, as in ``zgttrf``), so it is as stable as LAPACK: no diagonal dominance is
needed. Each elimination step is a handful of elementwise torch ops on all systems of the batch at
once, and the steps run one after another, so the cost is O(n) *kernel launches*: the kernel is
fast for batches of small systems, and slow for one large system. Larger systems go to
:mod:`tridiag_tutorial.kernels.partitioned`, which solves blocks of this kernel's systems all at once and
needs O(log n) operations (see :func:`tridiag_tutorial.kernels.choose_driver`). The factors have the
layout of :func:`tridiag_tutorial.kernels.lapack.factor`: ``lu`` ``(*batch, 4, n)`` with rows
``dl, d, du, du2`` and ``pivots`` ``(*batch, n)``, LAPACK's 1-based ``ipiv`` of each system.

A singular matrix (an exactly zero pivot) raises :class:`torch.linalg.LinAlgError` naming the pivot
and the batch element, like the LAPACK path; this check reads one boolean back from the device.
Non-finite inputs give non-finite results in their own system only.
"""

from __future__ import annotations

import torch

from .._validation import SingularMatrixError

__all__ = ["factor", "factor_unchecked", "lu_solve", "solve"]


# [book: magnitude]
def _magnitude(t: torch.Tensor) -> torch.Tensor:
    """LAPACK's pivoting magnitude: ``|t|`` for real, ``|re| + |im|`` (``CABS1``) for complex."""
    return t.real.abs() + t.imag.abs() if t.is_complex() else t.abs()


# [book: divide]
def _divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b``; for complex numbers by Smith's algorithm, as Fortran (and so LAPACK) divides:
    exact when ``b`` is real, where torch's own complex division is not always (``0.5 d / d`` can
    miss ``0.5`` by an ulp, and an exactly singular matrix would then get a round-off pivot
    instead of LAPACK's exact zero). ``b`` must not be zero."""
    if not a.is_complex():
        return a / b
    br, bi, ar, ai = b.real, b.imag, a.real, a.imag
    real_larger = br.abs() >= bi.abs()
    ratio = torch.where(real_larger, bi / br, br / bi)  # the unused branch may divide by zero
    den = torch.where(real_larger, br + bi * ratio, bi + br * ratio)
    re = torch.where(real_larger, ar + ai * ratio, ar * ratio + ai) / den
    im = torch.where(real_larger, ai - ar * ratio, ai * ratio - ar) / den
    return torch.complex(re, im)


def _multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b``; for complex numbers written out as Fortran (and so LAPACK) evaluates it,
    ``(ar br - ai bi) + i (ar bi + ai br)`` with every product and sum rounded on its own. Torch's
    own complex product fuses a product into the sum on some paths (on the CPU, one that small
    tensors take), which can leave a round-off pivot where LAPACK finds an exact zero."""
    if not a.is_complex():
        return a * b
    ar, ai, br, bi = a.real, a.imag, b.real, b.imag
    return torch.complex(ar * br - ai * bi, ar * bi + ai * br)


def factor(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor):
    """LU with partial pivoting of a batch: bands ``(*batch, n-1)``, ``(*batch, n)``,
    ``(*batch, n-1)`` -> ``(lu, pivots)``, ``(*batch, 4, n)`` and ``(*batch, n)`` int32 (the layout
    of :func:`tridiag_tutorial.kernels.lapack.factor`). Inputs are not modified.

    Raises:
        torch.linalg.LinAlgError: a pivot is exactly zero (the matrix is singular).
    """
    lu, pivots = factor_unchecked(lower, diag, upper)
    _check_pivots(lu[..., 1, :])
    return lu, pivots


def factor_unchecked(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor):
    """:func:`factor` without the check for a zero pivot (and so without reading anything back
    from the device): a zero pivot stays in ``lu[..., 1, :]`` for the caller to look at."""
    n = diag.shape[-1]
    d = list(diag.unbind(-1))
    du = list(upper.unbind(-1))
    multipliers, du2, swaps = [], [], []
    zero = torch.zeros_like(diag[..., 0])
    # [book: sequential-elimination]
    for i in range(n - 1):
        a, b, c = d[i], lower[..., i], du[i]  # rows i, i+1 in columns i, i+1: [[a, c], [b, d[i+1]]]
        swap = _magnitude(b) > _magnitude(a)
        pivot = torch.where(swap, b, a)
        other = torch.where(swap, a, b)
        safe = torch.where(pivot == 0, torch.ones_like(pivot), pivot)
        fact = torch.where(pivot == 0, zero, _divide(other, safe))  # a zero pivot: see factor
        next_d = d[i + 1]
        # no swap: row i+1 -= fact * row i;  swap: rows exchange first, then the same update
        d[i] = pivot
        du[i] = torch.where(swap, next_d, c)
        d[i + 1] = torch.where(swap, c - _multiply(fact, next_d), next_d - _multiply(fact, c))
        if i < n - 2:
            far = du[i + 1]  # A[i+1, i+2]: moves to row i (du2) after a swap
            du2.append(torch.where(swap, far, zero))
            du[i + 1] = torch.where(swap, -_multiply(fact, far), far)
        multipliers.append(fact)
        swaps.append(swap)
    # [/book: sequential-elimination]
    pad = [zero]
    rows = [multipliers + pad, d, du + pad, du2 + [zero] * (n - len(du2))]
    lu = torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)
    rows_1_based = torch.arange(1, n + 1, dtype=torch.int32, device=diag.device)
    swapped = torch.stack(swaps + [torch.zeros_like(diag[..., 0], dtype=torch.bool)], dim=-1)
    return lu, rows_1_based + swapped.to(torch.int32)


def _check_pivots(pivots: torch.Tensor) -> None:
    singular = pivots == 0
    if bool(singular.any()):  # one device-to-host read
        flat = singular.reshape(-1, pivots.shape[-1]).cpu()
        element = int(flat.any(dim=-1).nonzero()[0])
        pivot = int(flat[element].nonzero()[0])
        raise SingularMatrixError.at(pivot, element, pivots.shape[:-1])


def lu_solve(lu: torch.Tensor, pivots: torch.Tensor, rhs: torch.Tensor,
             trans: str = "N") -> torch.Tensor:
    """Solve with the factors of :func:`factor`: ``A x = rhs`` (``'N'``), ``A^T x = rhs`` (``'T'``)
    or ``A^H x = rhs`` (``'C'``); ``rhs`` ``(*batch, n, k)``; returns a new tensor."""
    if trans not in ("N", "T", "C"):
        raise ValueError(f"lu_solve: trans must be 'N', 'T' or 'C', got {trans!r}")
    if trans == "C":
        lu = lu.conj_physical()  # a new tensor: a lazily conjugated view misbehaved under AOTAutograd
    n = lu.shape[-1]
    dl, d, du, du2 = (lu[..., r, :].unsqueeze(-1) for r in range(4))  # (*batch, n, 1)
    rows_1_based = torch.arange(1, n + 1, dtype=pivots.dtype, device=pivots.device)
    swap = (pivots != rows_1_based).unsqueeze(-1)
    b = list(rhs.unbind(-2))
    if trans == "N":
        for i in range(n - 1):  # L: forward, with the row interchanges
            bi, bn = b[i], b[i + 1]
            b[i] = torch.where(swap[..., i, :], bn, bi)
            b[i + 1] = torch.where(swap[..., i, :], bi, bn) - dl[..., i, :] * b[i]
        for i in reversed(range(n)):  # U: backward
            s = b[i]
            if i + 1 < n:
                s = s - du[..., i, :] * b[i + 1]
            if i + 2 < n:
                s = s - du2[..., i, :] * b[i + 2]
            b[i] = s / d[..., i, :]
    else:
        for i in range(n):  # U^T: forward
            s = b[i]
            if i >= 1:
                s = s - du[..., i - 1, :] * b[i - 1]
            if i >= 2:
                s = s - du2[..., i - 2, :] * b[i - 2]
            b[i] = s / d[..., i, :]
        for i in reversed(range(n - 1)):  # L^T: backward, undoing the interchanges
            bi = b[i] - dl[..., i, :] * b[i + 1]
            bn = b[i + 1]
            b[i] = torch.where(swap[..., i, :], bn, bi)
            b[i + 1] = torch.where(swap[..., i, :], bi, bn)
    return torch.stack(b, dim=-2)


def solve(lower, diag, upper, rhs) -> torch.Tensor:
    """``x = A^{-1} rhs`` for a batch: :func:`factor`, then :func:`lu_solve`."""
    return lu_solve(*factor(lower, diag, upper), rhs)
