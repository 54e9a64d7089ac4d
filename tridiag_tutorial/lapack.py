"""LAPACK's tridiagonal solvers through SciPy: NumPy arrays in, NumPy arrays out.

Three routines, chosen by dtype (``s``, ``d``, ``c``, ``z``) with ``scipy.linalg.get_lapack_funcs``:

- ``?gtsv``: factor and solve in one pass (Gaussian elimination with partial pivoting);
- ``?gttrf``: factor ``A = L U`` once, keeping the pivots;
- ``?gttrs``: solve with those factors, for ``A`` (``trans='N'``), ``A^T`` (``'T'``) or ``A^H`` (``'C'``).

What this module adds to the raw wrappers:

- inputs are never modified (the wrappers are called without ``overwrite_*``);
- ``n = 1`` and ``n = 2`` work: SciPy's f2py wrappers assume ``n >= 2`` for ``?gtsv`` and
  ``n >= 3`` for ``?gttrf``/``?gttrs``, so small systems are padded with identity rows;
- ``info > 0`` (an exactly zero pivot) raises :class:`torch.linalg.LinAlgError` naming the pivot
  and the batch element, ``info < 0`` raises :class:`ValueError`;
- :func:`solve` loops over any number of batch dimensions.

Arrays follow the package's convention: ``lower[..., i] = A[i+1, i]``, ``diag[..., i] = A[i, i]``,
``upper[..., i] = A[i, i+1]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs

__all__ = ["LUFactors", "gtsv", "gttrf", "gttrs", "solve"]


class LUFactors(NamedTuple):
    """The output of ``?gttrf`` for one system (padded to at least 3 x 3), and the true ``n``."""

    dl: np.ndarray
    d: np.ndarray
    du: np.ndarray
    du2: np.ndarray
    ipiv: np.ndarray
    n: int


def _check_info(info: int, routine: str) -> None:
    if info > 0:
        raise torch.linalg.LinAlgError(
            f"the tridiagonal matrix is singular: pivot U[{info - 1}, {info - 1}] is exactly zero "
            f"(LAPACK {routine} info = {info})"
        )
    if info < 0:
        raise ValueError(f"LAPACK {routine}: argument {-info} had an illegal value")


def _pad(lower, diag, upper, rhs, size: int):
    """Embed an ``n x n`` system (``n < size``) in a ``size x size`` one with identity rows below.

    The padded matrix is block diagonal, ``[[A, 0], [0, I]]``, so its solution is ``[x, 0]`` for any
    ``trans``, and pivoting never picks a padded row (their entries in ``A``'s columns are zero).
    """
    n = diag.shape[0]
    extra = size - n
    z = np.zeros(extra, dtype=diag.dtype)
    lower = np.concatenate([lower, z])
    upper = np.concatenate([upper, z])
    diag = np.concatenate([diag, np.ones(extra, dtype=diag.dtype)])
    if rhs is not None:
        rhs = np.concatenate([rhs, np.zeros((extra,) + rhs.shape[1:], dtype=rhs.dtype)])
    return lower, diag, upper, rhs


def gtsv(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve one tridiagonal system with ``?gtsv``; ``rhs`` is ``(n,)`` or ``(n, k)``.

    Returns a new C-contiguous array of ``rhs``'s shape; the inputs are left unchanged.
    """
    n = diag.shape[0]
    vector = rhs.ndim == 1
    b = rhs[:, None] if vector else rhs
    if n < 2:
        lower, diag, upper, b = _pad(lower, diag, upper, b, 2)
    (routine,) = get_lapack_funcs(("gtsv",), (diag,))
    *_, x, info = routine(lower, diag, upper, b)
    _check_info(info, routine.typecode + "gtsv")
    x = np.ascontiguousarray(x[:n])
    return x[:, 0] if vector else x


def gttrf(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray) -> LUFactors:
    """Factor one tridiagonal matrix with ``?gttrf`` (partial pivoting); inputs are unchanged."""
    n = diag.shape[0]
    if n < 3:
        lower, diag, upper, _ = _pad(lower, diag, upper, None, 3)
    (routine,) = get_lapack_funcs(("gttrf",), (diag,))
    dl, d, du, du2, ipiv, info = routine(lower, diag, upper)
    _check_info(info, routine.typecode + "gttrf")
    return LUFactors(dl, d, du, du2, ipiv, n)


def gttrs(factors: LUFactors, rhs: np.ndarray, trans: str = "N") -> np.ndarray:
    """Solve ``A x = rhs`` (``trans='N'``), ``A^T x = rhs`` (``'T'``) or ``A^H x = rhs`` (``'C'``).

    ``factors`` comes from :func:`gttrf`; ``rhs`` is ``(n,)`` or ``(n, k)`` and is left unchanged.
    """
    if trans not in ("N", "T", "C"):
        raise ValueError(f"gttrs: trans must be 'N', 'T' or 'C', got {trans!r}")
    n = factors.n
    vector = rhs.ndim == 1
    b = rhs[:, None] if vector else rhs
    size = factors.d.shape[0]
    if n < size:
        b = np.concatenate([b, np.zeros((size - n, b.shape[1]), dtype=b.dtype)])
    (routine,) = get_lapack_funcs(("gttrs",), (factors.d,))
    x, info = routine(factors.dl, factors.d, factors.du, factors.du2, factors.ipiv, b, trans=trans)
    _check_info(info, routine.typecode + "gttrs")
    x = np.ascontiguousarray(x[:n])
    return x[:, 0] if vector else x


def solve(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve a batch of systems with one ``?gtsv`` call each.

    Shapes: ``lower``, ``upper`` ``(*batch, n-1)``, ``diag`` ``(*batch, n)``, ``rhs``
    ``(*batch, n, k)``, all with the same ``batch`` (broadcast beforehand). Returns a new
    C-contiguous array ``(*batch, n, k)``. A singular system raises
    :class:`torch.linalg.LinAlgError` that names its batch index.
    """
    batch = diag.shape[:-1]
    n = diag.shape[-1]
    size = int(np.prod(batch))
    out = np.empty(rhs.shape, dtype=rhs.dtype)
    out_flat = out.reshape(size, n, rhs.shape[-1])  # a view: out is C-contiguous
    flat = (a.reshape(size, *a.shape[len(batch):]) for a in (lower, diag, upper, rhs))
    for index, (dl, d, du, b) in enumerate(zip(*flat)):
        try:
            out_flat[index] = gtsv(dl, d, du, b)
        except torch.linalg.LinAlgError as err:
            if batch:
                where = tuple(int(i) for i in np.unravel_index(index, batch))
                raise torch.linalg.LinAlgError(f"{err}, in batch element {where}") from None
            raise
    return out
