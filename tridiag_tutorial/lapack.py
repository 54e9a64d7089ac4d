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
- :func:`solve`, :func:`factor` and :func:`factor_solve` take any number of batch dimensions.

Arrays follow the package's convention: ``lower[..., i] = A[i+1, i]``, ``diag[..., i] = A[i, i]``,
``upper[..., i] = A[i, i+1]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs

__all__ = ["LUFactors", "gtsv", "gttrf", "gttrs", "solve", "factor", "factor_solve"]


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


def _batch_error(err: torch.linalg.LinAlgError, n: int, batch, systems=None) -> torch.linalg.LinAlgError:
    """Turn a zero pivot of a joined system (see :func:`_join`) into its batch element's own.

    ``systems`` maps the joined system's blocks to flat batch indices when only some systems of
    the batch were joined (all of them, in order, when ``None``). The message has one format
    whichever path found the pivot: the routine's ``info`` is left out.
    """
    global_pivot = int(str(err).split("U[", 1)[1].split(",", 1)[0])
    element, pivot = divmod(global_pivot, n)
    if systems is not None:
        element = int(systems[element])
    local = str(err).replace(f"U[{global_pivot}, {global_pivot}]", f"U[{pivot}, {pivot}]")
    return _element_error(local, element, batch)


def _element_error(err, index: int, batch) -> torch.linalg.LinAlgError:
    """A zero pivot of batch element ``index`` (flat), in the one message format (no ``info``)."""
    message = str(err).split(" (LAPACK")[0]
    if batch:
        message += f", in batch element {tuple(int(i) for i in np.unravel_index(index, batch))}"
    return torch.linalg.LinAlgError(message)


def _join(lower, diag, upper, rhs):
    """Join a batch of ``n x n`` systems into one block-diagonal system of ``size * n`` rows.

    The couplings between consecutive blocks are exact zeros, so partial pivoting never swaps
    rows across blocks (the candidate pivot from the next block is 0) and every elimination step
    at a block boundary multiplies by exactly 0: LAPACK performs the same operations, in the same
    order, as it would on each system alone, in one call instead of ``size`` calls. The one
    exception is a non-finite value (``0 * inf`` is NaN), which callers check for.
    """
    n = diag.shape[-1]
    size = diag.size // n
    if size == 1:  # one system: nothing to join, no copy
        return lower.reshape(n - 1), diag.reshape(n), upper.reshape(n - 1), rhs.reshape(n, -1)
    zero = np.zeros((size, 1), dtype=diag.dtype)
    dl = np.concatenate([lower.reshape(size, n - 1), zero], axis=1).reshape(-1)[:-1]
    du = np.concatenate([upper.reshape(size, n - 1), zero], axis=1).reshape(-1)[:-1]
    return dl, diag.reshape(-1), du, rhs.reshape(size * n, rhs.shape[-1])


def solve(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve a batch of systems with a single ``?gtsv`` call on the joined system (:func:`_join`).

    Shapes: ``lower``, ``upper`` ``(*batch, n-1)``, ``diag`` ``(*batch, n)``, ``rhs``
    ``(*batch, n, k)``, all with the same ``batch`` (broadcast beforehand). Returns a new
    C-contiguous array ``(*batch, n, k)``, equal to solving each system on its own. A singular
    system raises :class:`torch.linalg.LinAlgError` that names its pivot and batch index, also
    when there is no right-hand side (``k = 0``), as :func:`torch.linalg.solve` does.
    """
    batch, n = diag.shape[:-1], diag.shape[-1]
    if rhs.size == 0:
        if diag.size:  # nothing to solve for, but a singular matrix must still raise
            solve(lower, diag, upper, np.zeros(rhs.shape[:-1] + (1,), dtype=rhs.dtype))
        return np.empty(rhs.shape, dtype=rhs.dtype)
    try:
        x = gtsv(*_join(lower, diag, upper, rhs)).reshape(rhs.shape)
    except torch.linalg.LinAlgError as err:
        raise _batch_error(err, n, batch) from None
    if batch and not np.isfinite(x).all():  # keep non-finite values inside their own system
        x = _solve_non_finite_apart(lower, diag, upper, rhs)
    return x


def _solve_non_finite_apart(lower, diag, upper, rhs) -> np.ndarray:
    """The joined solve when some system holds a non-finite value.

    In the joined system a NaN or infinity leaks into every later and earlier block (``0 * inf``
    is NaN at the exactly-zero couplings). So the systems whose inputs are all finite are joined
    and solved again in one call, and only those with a non-finite input are solved one by one;
    if a finite system still overflows, each system is solved alone.
    """
    batch, n = diag.shape[:-1], diag.shape[-1]
    size = int(np.prod(batch))
    flat = [a.reshape(size, *a.shape[len(batch):]) for a in (lower, diag, upper, rhs)]
    finite = np.logical_and.reduce([np.isfinite(a).reshape(size, -1).all(axis=1) for a in flat])
    good, alone = np.flatnonzero(finite), np.flatnonzero(~finite)
    x = np.empty(flat[3].shape, dtype=rhs.dtype)
    if good.size:
        try:
            x_good = gtsv(*_join(*(a[good] for a in flat)))
        except torch.linalg.LinAlgError as err:
            raise _batch_error(err, n, batch, systems=good) from None
        x_good = x_good.reshape((good.size,) + x.shape[1:])
        if np.isfinite(x_good).all():
            x[good] = x_good
        else:  # overflow in a finite system: no block can be trusted, solve each alone
            alone = np.arange(size)
    for index in alone:
        try:
            x[index] = gtsv(*(a[index] for a in flat))
        except torch.linalg.LinAlgError as err:
            raise _element_error(err, index, batch) from None
    return x.reshape(rhs.shape)


def factor(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray):
    """Factor a batch with ``?gttrf``: bands ``(*batch, n-1)``, ``(*batch, n)``, ``(*batch, n-1)``.

    Returns ``(lu, pivots)``: ``lu`` ``(*batch, 4, n)`` holds ``?gttrf``'s ``dl``, ``d``, ``du`` and
    ``du2`` in its rows (zero-padded to ``n``), ``pivots`` ``(*batch, n)`` its 1-based ``ipiv`` (row
    ``i`` was interchanged with row ``pivots[i] - 1``, which is ``i`` or ``i + 1``), each relative to
    its own system. A batch is factored in one call on the joined system (:func:`_join`; LAPACK
    then takes the same pivots as on each system alone), unless a value is not finite, when each
    system is factored alone. A singular matrix raises :class:`torch.linalg.LinAlgError` naming the
    pivot and the batch element.
    """
    batch, n = diag.shape[:-1], diag.shape[-1]
    size = int(np.prod(batch))
    lu = np.zeros((size, 4, n), dtype=diag.dtype)
    pivots = np.empty((size, n), dtype=np.int32)
    groups = [np.arange(size)]  # systems factored together
    if size > 1 and not all(np.isfinite(a).all() for a in (lower, diag, upper)):
        groups = [np.array([i]) for i in range(size)]
    flat = [a.reshape(size, a.shape[-1]) for a in (lower, diag, upper)]
    for systems in groups if size else []:
        m = systems.size * n
        dl, d, du, _ = _join(*(a[systems] for a in flat), np.zeros((systems.size, n, 1), diag.dtype))
        try:
            f = gttrf(dl, d, du)
        except torch.linalg.LinAlgError as err:
            raise _batch_error(err, n, batch, systems) from None
        rows = np.zeros((4, m), dtype=diag.dtype)  # the couplings of the joined system stay 0
        rows[0, : m - 1], rows[1], rows[2, : m - 1] = f.dl[: m - 1], f.d[:m], f.du[: m - 1]
        rows[3, : max(m - 2, 0)] = f.du2[: max(m - 2, 0)]
        lu[systems] = rows.reshape(4, systems.size, n).transpose(1, 0, 2)
        offsets = np.repeat(np.arange(systems.size, dtype=np.int32) * n, n)
        pivots[systems] = (f.ipiv[:m] - offsets).reshape(systems.size, n)
    return lu.reshape(batch + (4, n)), pivots.reshape(batch + (n,))


def factor_solve(lu: np.ndarray, pivots: np.ndarray, rhs: np.ndarray, trans: str = "N") -> np.ndarray:
    """Solve with factors from :func:`factor` (``?gttrs``): ``A x = rhs`` (``trans='N'``),
    ``A^T x = rhs`` (``'T'``) or ``A^H x = rhs`` (``'C'``), for ``rhs`` ``(*batch, n, k)``.

    A batch is solved in one call on the joined system; the factors of a block-diagonal matrix are
    the blocks' factors, so this equals solving each system alone (each system alone, when a value
    is not finite). Returns a new C-contiguous array; the inputs are left unchanged.
    """
    batch, n = lu.shape[:-2], lu.shape[-1]
    if rhs.size == 0:
        return np.empty(rhs.shape, dtype=rhs.dtype)
    if not batch and n >= 3:  # one system: ?gttrs straight on views of the factors' rows
        return gttrs(LUFactors(lu[0, : n - 1], lu[1], lu[2, : n - 1], lu[3, : n - 2], pivots, n),
                     rhs, trans)
    size = int(np.prod(batch))
    flat_lu, flat_piv = lu.reshape(size, 4, n), pivots.reshape(size, n)
    flat_rhs = rhs.reshape(size, n, rhs.shape[-1])
    x = _factor_solve_joined(flat_lu, flat_piv, flat_rhs, trans)
    if size > 1 and not np.isfinite(x).all():  # keep non-finite values inside their own system
        for i in range(size):
            x[i] = _factor_solve_joined(flat_lu[i:i + 1], flat_piv[i:i + 1], flat_rhs[i:i + 1],
                                        trans)[0]
    return x.reshape(rhs.shape)


def _factor_solve_joined(lu, pivots, rhs, trans):
    """:func:`factor_solve` of ``size`` systems (``lu`` ``(size, 4, n)``) in one ``?gttrs`` call."""
    size, _, n = lu.shape
    m = size * n
    rows = lu.transpose(1, 0, 2).reshape(4, m)
    ipiv = pivots.reshape(m) + np.repeat(np.arange(size, dtype=np.int32) * n, n)
    factors = LUFactors(rows[0, : m - 1], rows[1], rows[2, : m - 1], rows[3, : max(m - 2, 0)],
                        ipiv, m)
    if m < 3:  # SciPy's ?gttrs wrapper needs 3 rows: embed in identity rows, as gttrf did
        factors = _pad_factors(factors)
    return gttrs(factors, rhs.reshape(m, -1), trans).reshape(size, n, -1)


def _pad_factors(f: LUFactors) -> LUFactors:
    """The factors of ``[[A, 0], [0, I]]`` (3 x 3) from those of a 1 x 1 or 2 x 2 ``A``."""
    m = f.n
    dl, d, du, du2 = np.zeros(2, f.d.dtype), np.ones(3, f.d.dtype), np.zeros(2, f.d.dtype), \
        np.zeros(1, f.d.dtype)
    dl[: m - 1], d[:m], du[: m - 1] = f.dl, f.d, f.du
    ipiv = np.arange(1, 4, dtype=np.int32)
    ipiv[:m] = f.ipiv
    return LUFactors(dl, d, du, du2, ipiv, m)
