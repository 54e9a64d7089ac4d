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

Nothing below this module checks its inputs again: the kernels receive four tensors of one dtype,
on one device, with the same batch shape and a matrix right-hand side ``(*batch, n, k)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SUPPORTED_DTYPES", "Problem", "validate", "validate_bands"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)
_NAMES = ("lower", "diag", "upper", "rhs")


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
    if rhs.ndim == diag.ndim:
        vector_rhs = True
        rhs_batch, rhs_n = rhs.shape[:-1], rhs.shape[-1]
    elif rhs.ndim == diag.ndim + 1:
        vector_rhs = False
        rhs_batch, rhs_n = rhs.shape[:-2], rhs.shape[-2]
    else:
        raise ValueError(
            f"{name}: rhs must have diag.ndim = {diag.ndim} dimensions (one vector per system) or "
            f"diag.ndim + 1 = {diag.ndim + 1} (a matrix (n, k) per system); got {_describe(tensors)}"
        )
    if rhs_n != n:
        where = "last" if vector_rhs else "second-to-last"
        raise ValueError(
            f"{name}: rhs must have n = {n} rows (its {where} dimension); got {_describe(tensors)}"
        )

    batches = (lower.shape[:-1], diag.shape[:-1], upper.shape[:-1], rhs_batch)
    if batches[0] == batches[1] == batches[2] == batches[3]:  # the common case, and fast
        batch = batches[0]
    else:
        try:
            batch = torch.broadcast_shapes(*batches)
        except RuntimeError:
            raise ValueError(
                f"{name}: the batch dimensions do not broadcast: {_describe(tensors)}"
            ) from None
        lower, diag, upper = (t.expand(*batch, t.shape[-1]) for t in (lower, diag, upper))
        rhs = rhs.expand(*batch, *rhs.shape[len(rhs_batch):])

    return Problem(lower, diag, upper, rhs.unsqueeze(-1) if vector_rhs else rhs, vector_rhs)


def validate_bands(lower, diag, upper, *, name: str):
    """:func:`validate` for a matrix alone: the same checks, and the three bands broadcast to one
    batch shape (views)."""
    tensors = (lower, diag, upper)
    _check(tensors, name)
    batches = (lower.shape[:-1], diag.shape[:-1], upper.shape[:-1])
    if batches[0] == batches[1] == batches[2]:
        return tensors
    try:
        batch = torch.broadcast_shapes(*batches)
    except RuntimeError:
        raise ValueError(f"{name}: the batch dimensions do not broadcast: {_describe(tensors)}"
                         ) from None
    return tuple(t.expand(*batch, t.shape[-1]) for t in tensors)


def _check(tensors, name: str) -> int:
    """The checks that do not involve ``rhs``'s shape; returns ``n``."""
    lower, diag, upper = tensors[:3]
    for arg, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            layout = f"{t.layout} (nested)" if t.is_nested else t.layout
            raise TypeError(
                f"{name}: {arg} must be a dense (torch.strided) tensor, got layout {layout}; "
                f"convert it with .to_dense() (sparse) or .unbind() / .to_padded_tensor() (nested)")

    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listed = ", ".join(f"{arg}={t.dtype}" for arg, t in zip(_NAMES, tensors))
        raise TypeError(f"{name}: all inputs must have the same dtype, got {listed}")
    dtype = diag.dtype
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: dtype {dtype} is not supported; use one of {supported}")

    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listed = ", ".join(f"{arg} on {t.device}" for arg, t in zip(_NAMES, tensors))
        raise ValueError(f"{name}: all inputs must be on the same device, got {listed}")

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

