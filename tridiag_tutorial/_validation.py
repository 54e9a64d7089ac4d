"""One place that checks and broadcasts the inputs of every entry point.

Convention (the same as LAPACK's ``?gtsv`` and SciPy's wrappers), for an ``n x n`` matrix ``A``::

    lower[..., i] = A[i+1, i]    shape (..., n-1)
    diag[..., i]  = A[i, i]      shape (..., n)
    upper[..., i] = A[i, i+1]    shape (..., n-1)

JAX's ``jax.lax.linalg.tridiagonal_solve(dl, d, du, b)`` differs: its three bands all have length
``n``, ``dl[..., i] = A[i, i-1]`` with ``dl[..., 0] = 0``, and ``du[..., i] = A[i, i+1]`` with
``du[..., n-1] = 0``. So ``lower = dl[..., 1:]`` and ``upper = du[..., :-1]``; the other way,
``dl = pad(lower, (1, 0))`` and ``du = pad(upper, (0, 1))``. Its ``b`` is always ``(..., n, k)``.

``rhs`` is one vector per system, shape ``(..., n)``, when ``rhs.ndim == diag.ndim``, and ``k``
columns per system, shape ``(..., n, k)``, when ``rhs.ndim == diag.ndim + 1``. The batch
dimensions ``...`` of the four inputs broadcast against each other.

The public functions check their inputs here once; the kernels then receive four tensors of one
dtype, on one device, with the same batch shape and a matrix right-hand side ``(*batch, n, k)``.
The registered ops (``tridiag_tutorial::solve``, ``::solve_kernel``, ``::lu_factor``), which a
compiled or exported graph calls and which anyone can call directly, check the same contract on
metadata alone (:func:`validate_kernel_args`, :func:`validate_factor_args`), in their real and
their fake kernels alike, and the kernels that solve from factors check the pivot values
(:func:`check_pivot_values`) before anything indexes with them: LAPACK's ``?gttrs`` trusts
``ipiv``, and a value outside ``{i+1, i+2}`` makes it read and write outside its arrays.

Every check derives from the same few: :func:`check_tensors` (dense tensors of one supported
dtype on one device), :func:`rhs_layout` and :func:`broadcast_batch`; the distributed solve's
per-rank check (:mod:`tridiag_tutorial.distributed.solve`) builds on them too, with its own band
layout. The C++ kernel checks its inputs again before it reads one: the last guard, for a direct
call of its op. Where it refuses the inputs of the public function's fast path, the path through
:func:`validate` runs and raises the error that names the problem.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["SUPPORTED_DTYPES", "SingularMatrixError", "Problem", "validate", "validate_bands",
           "validate_factors", "validate_kernel_args", "validate_factor_args", "check_pivot_values",
           "check_tensors", "rhs_layout", "broadcast_batch"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)
_NAMES = ("lower", "diag", "upper", "rhs")


class SingularMatrixError(torch.linalg.LinAlgError):
    """A tridiagonal matrix is singular: LU with partial pivoting met an exactly zero pivot.

    Every kernel raises this one error, built here and only here. Its attributes say where:
    ``pivot``, the 0-based index ``i`` of the zero pivot ``U[i, i]`` (LAPACK's ``INFO - 1``), and
    ``batch_index``, the index of the first such system in the batch (``()`` for one system).
    It is a :class:`torch.linalg.LinAlgError`, so ``except torch.linalg.LinAlgError`` catches it.
    ``detail`` (optional) is appended to the message in parentheses.
    """

    def __init__(self, pivot: int, batch_index: tuple = (), detail: str | None = None):
        self.pivot = int(pivot)
        self.batch_index = tuple(int(i) for i in batch_index)
        self.detail = detail
        message = f"the tridiagonal matrix is singular: pivot U[{self.pivot}, {self.pivot}] is exactly zero"
        if self.batch_index:
            message += f", in batch element {self.batch_index}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    @classmethod
    def at(cls, pivot: int, flat_index: int, batch_shape) -> SingularMatrixError:
        """The error of system ``flat_index`` (C order) of a batch of shape ``batch_shape``."""
        batch_shape = tuple(batch_shape)
        where = tuple(np.unravel_index(flat_index, batch_shape)) if batch_shape else ()
        return cls(pivot, where)

    def __reduce__(self):  # pickles (multiprocessing) with its attributes
        return (type(self), (self.pivot, self.batch_index, self.detail))


class Problem(NamedTuple):
    """Validated inputs, broadcast to one batch shape (views: nothing is copied)."""

    lower: torch.Tensor  # (*batch, n-1)
    diag: torch.Tensor  # (*batch, n)
    upper: torch.Tensor  # (*batch, n-1)
    rhs: torch.Tensor  # (*batch, n, k): always a matrix
    vector_rhs: bool  # True when the caller gave (..., n): the result drops the k axis again


def _describe(tensors) -> str:
    return ", ".join(f"{name}{tuple(t.shape)}" for name, t in zip(_NAMES, tensors))


def validate(lower, diag, upper, rhs, *, name: str = "tridiagonal_solve") -> Problem:
    """Check ``(lower, diag, upper, rhs)`` and broadcast their batch dimensions.

    Raises:
        TypeError: an argument is not a tensor or not a dense (strided) one, such as a sparse or
            nested tensor; dtypes differ; a dtype is not float32, float64,
            complex64 or complex128 (integers, bool and half precision are refused rather than
            silently promoted).
        ValueError: devices differ; the band lengths do not fit ``n = diag.shape[-1]``; ``rhs``
            has neither ``diag.ndim`` nor ``diag.ndim + 1`` dimensions; batch shapes do not
            broadcast.
    """
    tensors = (lower, diag, upper, rhs)
    n = _check(tensors, name)
    shapes = lambda: _describe(tensors)  # noqa: E731
    vector_rhs, rhs_batch = rhs_layout(rhs, diag, n, name, shapes)
    batches = (lower.shape[:-1], diag.shape[:-1], upper.shape[:-1], rhs_batch)
    if not batches[0] == batches[1] == batches[2] == batches[3]:  # else: the common case, fast
        batch = broadcast_batch(batches, name, shapes)
        lower, diag, upper = (t.expand(*batch, t.shape[-1]) for t in (lower, diag, upper))
        rhs = rhs.expand(*batch, *rhs.shape[len(rhs_batch):])
    return Problem(lower, diag, upper, rhs.unsqueeze(-1) if vector_rhs else rhs, vector_rhs)


def validate_bands(lower, diag, upper, *, name: str):
    """:func:`validate` for a matrix alone: the same checks, and the three bands broadcast to one
    batch shape (views)."""
    tensors = (lower, diag, upper)
    _check(tensors, name)
    batches = (lower.shape[:-1], diag.shape[:-1], upper.shape[:-1])
    batch = broadcast_batch(batches, name, lambda: _describe(tensors))
    if all(b == batch for b in batches):
        return tensors
    return tuple(t.expand(*batch, t.shape[-1]) for t in tensors)


def check_tensors(tensors, name: str, names=_NAMES) -> None:
    """The checks every entry point makes first, the distributed one included: each argument a
    dense tensor, all of one supported dtype, all on one device."""
    for arg, t in zip(names, tensors):
        _check_dense(arg, t, name)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listed = ", ".join(f"{arg}={t.dtype}" for arg, t in zip(names, tensors))
        raise TypeError(f"{name}: all inputs must have the same dtype, got {listed}")
    dtype = tensors[1].dtype
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: dtype {dtype} is not supported; use one of {supported}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listed = ", ".join(f"{arg} on {t.device}" for arg, t in zip(names, tensors))
        raise ValueError(f"{name}: all inputs must be on the same device, got {listed}")


def rhs_layout(rhs, diag, rows: int, name: str, shapes, rows_name: str = "n"):
    """``(vector, batch)`` of ``rhs`` against ``diag``: ``(..., rows)`` (one vector per system)
    or ``(..., rows, k)``; raises ``ValueError`` naming ``shapes()`` (called only then: the
    message is not built, nor traced by Dynamo, for valid inputs) otherwise."""
    if rhs.ndim == diag.ndim:
        vector, batch, rhs_rows = True, rhs.shape[:-1], rhs.shape[-1]
    elif rhs.ndim == diag.ndim + 1:
        vector, batch, rhs_rows = False, rhs.shape[:-2], rhs.shape[-2]
    else:
        raise ValueError(
            f"{name}: rhs must have diag.ndim = {diag.ndim} dimensions (one vector per system) or "
            f"diag.ndim + 1 = {diag.ndim + 1} (a matrix ({rows_name}, k) per system); got {shapes()}")
    if rhs_rows != rows:
        where = "last" if vector else "second-to-last"
        raise ValueError(f"{name}: rhs must have {rows_name} = {rows} rows (its {where} dimension); "
                         f"got {shapes()}")
    return vector, batch


def broadcast_batch(batches, name: str, shapes):
    """The batch shape that ``batches`` broadcast to; ``ValueError`` naming ``shapes()`` if none."""
    if all(b == batches[0] for b in batches[1:]):  # the common case, and fast
        return batches[0]
    try:
        return torch.broadcast_shapes(*batches)
    except RuntimeError:
        raise ValueError(f"{name}: the batch dimensions do not broadcast: {shapes()}") from None


def _check(tensors, name: str) -> int:
    """The checks that do not involve ``rhs``'s shape; returns ``n``."""
    lower, diag, upper = tensors[:3]
    check_tensors(tensors, name)
    for arg, t in zip(_NAMES[:3], tensors[:3]):
        if t.ndim == 0:
            raise ValueError(f"{name}: {arg} must have at least one dimension, got a scalar")
    n = diag.shape[-1]
    if n == 0:
        raise ValueError(f"{name}: the matrix must be at least 1 x 1, got diag{tuple(diag.shape)}")
    if lower.shape[-1] != n - 1 or upper.shape[-1] != n - 1:
        raise ValueError(
            f"{name}: with n = diag.shape[-1] = {n}, lower and upper must have n-1 = {n - 1} "
            f"entries in their last dimension; got {_describe(tensors)}"
        )
    return n


def _check_dense(arg: str, t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        layout = f"{t.layout} (nested)" if t.is_nested else t.layout
        raise TypeError(
            f"{name}: {arg} must be a dense (torch.strided) tensor, got layout {layout}; "
            f"convert it with .to_dense() (sparse) or .unbind() / .to_padded_tensor() (nested)")


def validate_factors(lu, pivots, diag, *, name: str) -> None:
    """Check the factors ``(lu, pivots)`` against the matrix whose diagonal is ``diag``
    ``(*batch, n)``, on metadata alone (no data is read; :func:`check_pivot_values` reads the
    pivot values where a kernel is about to use them).

    Raises:
        TypeError: ``lu`` or ``pivots`` is not a dense tensor; ``diag``'s dtype is not one of
            ``SUPPORTED_DTYPES`` (the message names the bands); ``lu``'s dtype is not ``diag``'s (a
            float32 ``lu`` beside float64 bands, or a complex one beside real bands, would change
            the result's dtype); ``pivots`` is not int32.
        ValueError: they are not on ``diag``'s device (a meta tensor beside CPU tensors included);
            their shapes are not ``lu`` ``(*batch, 4, n)`` and ``pivots`` ``(*batch, n)``.
    """
    _check_dense("lu", lu, name)
    _check_dense("pivots", pivots, name)
    if diag.dtype not in SUPPORTED_DTYPES:  # the bands are at fault, not the factors
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: lower, diag and upper must be floating point or complex "
                        f"({supported}), got {diag.dtype}")
    if lu.dtype != diag.dtype:
        raise TypeError(f"{name}: lu must have the bands' dtype {diag.dtype}, got {lu.dtype}; make "
                        "the factors with tridiagonal_lu_factor from these bands")
    if pivots.dtype != torch.int32:
        raise TypeError(f"{name}: pivots must be torch.int32 (LAPACK's ipiv), got {pivots.dtype}; "
                        "make the factors with tridiagonal_lu_factor")
    if lu.device != diag.device or pivots.device != diag.device:
        raise ValueError(f"{name}: all inputs must be on the same device, got the bands on "
                         f"{diag.device}, lu on {lu.device}, pivots on {pivots.device}")
    batch, n = diag.shape[:-1], diag.shape[-1]
    if lu.shape != (*batch, 4, n) or pivots.shape != (*batch, n):
        raise ValueError(
            f"{name}: the factors do not fit their bands: expected lu {(*batch, 4, n)} and int32 "
            f"pivots {(*batch, n)}, got lu {tuple(lu.shape)} and pivots {tuple(pivots.shape)}; "
            "make them with tridiagonal_lu_factor")


def validate_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, *, name: str) -> None:
    """The contract of the kernels (:func:`tridiag_tutorial.kernels.solve`), checked on metadata
    alone, so that the real and the fake kernel of a registered op check exactly the same thing:
    four dense tensors of one supported dtype on one device, the bands ``(*B, n-1)``, ``(*B, n)``,
    ``(*B, n-1)`` and ``rhs`` ``(*B, n, k)`` with one batch shape ``B`` (no broadcasting: the
    public functions broadcast), ``trans`` one of ``'N'``, ``'T'``, ``'C'`` (``'N'`` without
    factors), and ``lu`` and ``pivots`` both given (checked by :func:`validate_factors`) or both
    ``None``.

    Raises:
        TypeError, ValueError: naming the argument and the shapes, dtypes or devices.
    """
    n = _check((lower, diag, upper, rhs), name)
    batch = diag.shape[:-1]
    if rhs.ndim != diag.ndim + 1 or rhs.shape[-2] != n:
        raise ValueError(f"{name}: rhs must be (*batch, n, k) with n = {n}; got "
                         f"{_describe((lower, diag, upper, rhs))}")
    if lower.shape[:-1] != batch or upper.shape[:-1] != batch or rhs.shape[:-2] != batch:
        raise ValueError(f"{name}: the inputs must have one batch shape (this op does not "
                         f"broadcast); got {_describe((lower, diag, upper, rhs))}")
    if not isinstance(trans, str) or trans not in ("N", "T", "C"):
        raise ValueError(f"{name}: trans must be 'N', 'T' or 'C', got {trans!r}")
    if (lu is None) != (pivots is None):
        raise ValueError(f"{name}: lu and pivots must be given together or both be None; got "
                         f"lu={'None' if lu is None else 'a tensor'}, "
                         f"pivots={'None' if pivots is None else 'a tensor'}")
    if lu is None:
        if trans != "N":
            raise ValueError(f"{name}: trans={trans!r} needs the factors (lu, pivots); without "
                             "them pass the bands of the transposed matrix and trans='N'")
        return
    validate_factors(lu, pivots, diag, name=name)


def validate_factor_args(lower, diag, upper, *, name: str) -> None:
    """The contract of :func:`tridiag_tutorial.kernels.factor`, on metadata alone (for the real
    and the fake kernel of ``tridiag_tutorial::lu_factor``): three dense bands of one supported
    dtype, on one device, of one batch shape.

    Raises:
        TypeError, ValueError: as :func:`validate_bands`, and when the batch shapes differ.
    """
    _check((lower, diag, upper), name)
    batch = diag.shape[:-1]
    if lower.shape[:-1] != batch or upper.shape[:-1] != batch:
        raise ValueError(f"{name}: the bands must have one batch shape (this op does not "
                         f"broadcast); got {_describe((lower, diag, upper))}")


@functools.lru_cache(maxsize=8)
def _pivot_rows(n: int):
    """``(rows, limit)`` for :func:`check_pivot_values` on the CPU: the 1-based row numbers
    (int32) and the largest allowed step (uint32: 1, and 0 in the last row)."""
    rows = np.arange(1, n + 1, dtype=np.int32)
    limit = (rows < n).astype(np.uint32)
    rows.flags.writeable = limit.flags.writeable = False
    return rows, limit


def _bad_pivots_in_torch(pivots: torch.Tensor) -> torch.Tensor:
    """:func:`check_pivot_values`'s mask of bad entries in torch ops, on the pivots' device."""
    n = pivots.shape[-1]
    rows = torch.arange(1, n + 1, dtype=torch.int32, device=pivots.device)
    step = pivots - rows
    return (step < 0) | (step > (rows < n))


def check_pivot_values(pivots, *, name: str = "tridiagonal_lu_solve") -> None:
    """Check that ``pivots`` ``(*batch, n)`` holds values that ``?gttrf`` can produce: 1-based,
    ``pivots[..., i]`` is ``i + 1`` or ``i + 2`` for ``i < n - 1`` and ``pivots[..., n - 1]`` is
    ``n``. Anything else would make ``?gttrs`` index outside its arrays (a crash or a silently
    wrong answer; the pure-torch kernel would answer wrongly). Vectorised: a few elementwise
    operations and one read back from the device; on the CPU on a NumPy view of the data.

    Raises:
        ValueError: a value is out of range; the message gives the first such entry, its batch
            element and what it may be.
    """
    n = pivots.shape[-1]
    if pivots.numel() == 0:
        return
    # step = pivots - (i + 1) must be 0 (no interchange) or 1 (rows i, i+1 swapped), and 0 in the
    # last row. int32 differences wrap, but never onto 0 or 1 (|i + 1| < 2^31 - 1).
    if pivots.device.type == "cpu":  # on a NumPy view: a NumPy operation costs a fraction of torch's
        rows, limit = _pivot_rows(n)
        bad = (pivots.numpy() - rows).view(np.uint32) > limit  # a negative step is a huge uint32
    else:
        bad = _bad_pivots_in_torch(pivots)
    if not bool(bad.any()):  # one read back from the device
        return
    flat = np.asarray(bad.cpu() if isinstance(bad, torch.Tensor) else bad).reshape(-1, n)
    values = (pivots.cpu().numpy() if isinstance(pivots, torch.Tensor) else pivots).reshape(-1, n)
    element, i = (int(j[0]) for j in np.nonzero(flat))
    allowed = f"{i + 1} or {i + 2}" if i < n - 1 else f"{n} (the last row)"
    where = ""
    if pivots.ndim > 1:
        where = f" in batch element {tuple(int(j) for j in np.unravel_index(element, pivots.shape[:-1]))}"
    raise ValueError(
        f"{name}: pivots[..., {i}] = {int(values[element, i])}{where} is not a pivot that LU with "
        f"partial pivoting produces (1-based: {allowed}); pass the pivots that "
        "tridiagonal_lu_factor returned, unmodified")
