"""LAPACK's tridiagonal solvers through SciPy: NumPy arrays in, NumPy arrays out.

Three routines, chosen by dtype (``s``, ``d``, ``c``, ``z``) with ``scipy.linalg.get_lapack_funcs``:

- ``?gtsv``: factor and solve in one pass (Gaussian elimination with partial pivoting);
- ``?gttrf``: factor ``A = L U`` once, keeping the pivots;
- ``?gttrs``: solve with those factors, for ``A`` (``trans='N'``), ``A^T`` (``'T'``) or ``A^H`` (``'C'``).

What this module adds to the raw wrappers:

- inputs are never modified (the wrappers are called without ``overwrite_*``);
- ``n = 1`` and ``n = 2`` work: SciPy's f2py wrappers assume ``n >= 2`` for ``?gtsv`` and
  ``n >= 3`` for ``?gttrf``/``?gttrs``, so small systems are padded with identity rows;
- ``info > 0`` (an exactly zero pivot) raises :class:`~tridiag_tutorial.SingularMatrixError` naming the pivot
  and the batch element, ``info < 0`` raises :class:`ValueError`;
- :func:`solve`, :func:`factor` and :func:`factor_solve` take any number of batch dimensions: a
  batch is joined into block-diagonal systems of at most :data:`_CHUNK_ROWS` rows (never more than
  LAPACK's 32-bit indices address), one LAPACK call each, with results bit for bit those of each
  system alone (a system whose zeros the joined call could give another sign is solved again
  alone; solves with ``A^T`` and ``A^H`` from factors give the same values, but a zero may differ
  in sign); a chunk with a non-finite or overflowing system is settled by splitting it, so one
  such system costs about one chunk more, not one call per system.

Arrays follow the package's convention: ``lower[..., i] = A[i+1, i]``, ``diag[..., i] = A[i, i]``,
``upper[..., i] = A[i, i+1]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._validation import SingularMatrixError

__all__ = ["LUFactors", "gtsv", "gttrf", "gttrs", "join", "solve", "factor", "factor_solve"]


def get_lapack_funcs(names, arrays):
    """``scipy.linalg.get_lapack_funcs``, imported on first use: importing SciPy's linear algebra
    is a cost that ``import tridiag_tutorial`` should not pay before a solve needs it."""
    from scipy.linalg import get_lapack_funcs as funcs  # after the first call, a dict lookup

    return funcs(names, arrays)


class LUFactors(NamedTuple):
    """The output of ``?gttrf`` for one system and the true ``n``; when ``n < 3``, that of the system
    padded to 3 x 3 with identity rows first (see :func:`_pad`)."""

    dl: np.ndarray
    d: np.ndarray
    du: np.ndarray
    du2: np.ndarray
    ipiv: np.ndarray
    n: int


def _check_info(info: int, routine: str) -> None:
    if info > 0:
        raise SingularMatrixError(info - 1, detail=f"LAPACK {routine} info = {info}")
    if info < 0:
        raise ValueError(f"LAPACK {routine}: argument {-info} had an illegal value")


def _pad(lower, diag, upper, rhs, size: int):
    """Embed an ``n x n`` system (``n < size``) in a ``size x size`` one with identity rows above.

    The padded matrix is block diagonal, ``[[I, 0], [0, A]]``, so its solution is ``[0, x]`` for any
    ``trans``. The identity rows come first so that LAPACK eliminates them before ``A`` (multiplier
    exactly 0, no interchange) and then does on ``A``'s rows what it does on ``A`` alone: padded
    below, a NaN last pivot of ``A`` would lose the pivot comparison (``|NaN| >= 0`` is false) and be
    interchanged with an identity row, and ``?gttrf`` would then report a zero pivot.
    """
    n = diag.shape[0]
    extra = size - n
    z = np.zeros(extra, dtype=diag.dtype)
    lower = np.concatenate([z, lower])
    upper = np.concatenate([z, upper])
    diag = np.concatenate([np.ones(extra, dtype=diag.dtype), diag])
    if rhs is not None:
        rhs = np.concatenate([np.zeros((extra,) + rhs.shape[1:], dtype=rhs.dtype), rhs])
    return lower, diag, upper, rhs


def gtsv(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve one tridiagonal system with ``?gtsv``; ``rhs`` is ``(n,)`` or ``(n, k)``.

    Returns a new C-contiguous array of ``rhs``'s shape; the inputs are left unchanged.
    """
    n = diag.shape[0]
    vector = rhs.ndim == 1
    b = rhs[:, None] if vector else rhs
    extra = max(2 - n, 0)
    if extra:
        lower, diag, upper, b = _pad(lower, diag, upper, b, 2)
    (routine,) = get_lapack_funcs(("gtsv",), (diag,))
    *_, x, info = routine(lower, diag, upper, b)
    _check_info(info - extra if info > 0 else info, routine.typecode + "gtsv")
    x = np.ascontiguousarray(x[extra:])
    return x[:, 0] if vector else x


def gttrf(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray) -> LUFactors:
    """Factor one tridiagonal matrix with ``?gttrf`` (partial pivoting); inputs are unchanged."""
    factors, info, name = _gttrf_raw(lower, diag, upper)
    _check_info(info, name)
    return factors


def gttrs(factors: LUFactors, rhs: np.ndarray, trans: str = "N") -> np.ndarray:
    """Solve ``A x = rhs`` (``trans='N'``), ``A^T x = rhs`` (``'T'``) or ``A^H x = rhs`` (``'C'``).

    ``factors`` comes from :func:`gttrf`; ``rhs`` is ``(n,)`` or ``(n, k)`` and is left unchanged.
    """
    if trans not in ("N", "T", "C"):
        raise ValueError(f"gttrs: trans must be 'N', 'T' or 'C', got {trans!r}")
    n = factors.n
    vector = rhs.ndim == 1
    b = rhs[:, None] if vector else rhs
    extra = factors.d.shape[0] - n  # identity rows first (see _pad)
    if extra:
        b = np.concatenate([np.zeros((extra, b.shape[1]), dtype=b.dtype), b])
    (routine,) = get_lapack_funcs(("gttrs",), (factors.d,))
    x, info = routine(factors.dl, factors.d, factors.du, factors.du2, factors.ipiv, b, trans=trans)
    _check_info(info, routine.typecode + "gttrs")
    x = np.ascontiguousarray(x[extra:])
    return x[:, 0] if vector else x


def _batch_error(err: SingularMatrixError, n: int, batch, first: int = 0) -> SingularMatrixError:
    """Turn a zero pivot of a joined system (see :func:`join`) into its batch element's own.

    ``first`` is the flat batch index of the joined system's first block; the pivot of the joined
    system is ``element * n + pivot``."""
    element, pivot = divmod(err.pivot, n)
    return SingularMatrixError.at(pivot, first + element, batch)


def join(lower, diag, upper, rhs=None):
    """Join a batch of ``n x n`` systems into one block-diagonal system of ``size * n`` rows.

    The couplings between consecutive blocks are exact zeros, so partial pivoting never swaps
    rows across blocks (the candidate pivot from the next block is 0) and every elimination step
    at a block boundary multiplies by exactly 0: LAPACK performs the same operations, in the same
    order, as it would on each system alone, in one call instead of ``size`` calls. The
    exceptions are non-finite values: ``0 * inf`` is NaN, and a NaN pivot candidate loses every
    comparison, so ``?gttrf`` swaps it with the next block's first row (see :func:`factor`).
    The systems ``c`` to ``e - 1`` of the joined system are the slices ``[c * n : e * n - 1]`` of
    its off-diagonals and ``[c * n : e * n]`` of the rest: joined on their own.
    """
    n = diag.shape[-1]
    size = diag.size // n
    if size == 1:  # one system: nothing to join, no copy
        b = None if rhs is None else rhs.reshape(n, -1)
        return lower.reshape(n - 1), diag.reshape(n), upper.reshape(n - 1), b
    zero = np.zeros((size, 1), dtype=diag.dtype)
    dl = np.concatenate([lower.reshape(size, n - 1), zero], axis=1).reshape(-1)[:-1]
    du = np.concatenate([upper.reshape(size, n - 1), zero], axis=1).reshape(-1)[:-1]
    b = None if rhs is None else rhs.reshape(size * n, rhs.shape[-1])
    return dl, diag.reshape(-1), du, b


# --- Chunks, offsets and the systems that must be solved again ------------------------------------

#: LAPACK, through the LP64 interface that SciPy uses, indexes rows with 32-bit integers (``ipiv``
#: is int32): no joined call may hold more rows than this.
_LAPACK_MAX_ROWS = 2**31 - 1
#: The most rows joined into one LAPACK call (a larger system is a call of its own). A chunk with a
#: non-finite or overflowing system is solved again in parts, so this bounds the cost of one such
#: system to about two chunks' worth of work; for a clean batch the chunks cost nothing measurable
#: (the ``cliffs`` rows of ``notebooks/data/benchmark_results.json``).
_CHUNK_ROWS = 2**16
#: A joined run of systems whose result must be checked again is split into this many parts.
_SPLIT = 8


def _chunk_bounds(size: int, n: int, max_rows: int | None = None) -> list[tuple[int, int]]:
    """The ranges ``[start, stop)`` of consecutive systems that each joined LAPACK call takes.

    ``size`` systems of ``n`` rows; each range holds at most ``max_rows`` rows (default
    :data:`_CHUNK_ROWS`, capped at :data:`_LAPACK_MAX_ROWS`), or one system when ``n`` is larger.
    Python integers throughout, so any ``size * n`` is exact (no int32 overflow).
    """
    if n > _LAPACK_MAX_ROWS:
        raise ValueError(f"a system of n = {n} rows is more than LAPACK's 32-bit row indices can "
                         f"address ({_LAPACK_MAX_ROWS})")
    max_rows = min(_CHUNK_ROWS if max_rows is None else int(max_rows), _LAPACK_MAX_ROWS)
    per_call = max(1, max_rows // max(n, 1))
    return [(start, min(start + per_call, size)) for start in range(0, size, per_call)]


def _block_offsets(count: int, n: int) -> np.ndarray:
    """The first row of each of ``count`` joined ``n``-row blocks: ``(count,)`` int64 (no overflow)."""
    return np.arange(count, dtype=np.int64) * np.int64(n)


def _joined_pivots(pivots: np.ndarray) -> np.ndarray:
    """Per-system 1-based pivots ``(count, n)`` as the joined system's ``ipiv`` (int32, ``count * n``)."""
    count, n = pivots.shape
    if count * n > _LAPACK_MAX_ROWS:
        raise ValueError(f"{count} x {n} rows do not fit LAPACK's 32-bit ipiv: join fewer systems")
    return (pivots + _block_offsets(count, n)[:, None]).astype(np.int32).reshape(-1)


def _local_pivots(ipiv: np.ndarray, count: int, n: int) -> np.ndarray:
    """The first ``count`` blocks of a joined ``ipiv`` as per-system pivots ``(count, n)`` int32."""
    joined = ipiv[: count * n].astype(np.int64).reshape(count, n)
    return (joined - _block_offsets(count, n)[:, None]).astype(np.int32)


def _split(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into at most ``parts`` non-empty consecutive ranges of near-equal size."""
    cuts = sorted({start + (stop - start) * i // parts for i in range(parts + 1)})
    return list(zip(cuts[:-1], cuts[1:]))


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """The maximal runs ``(start, stop, value)`` of equal values in a 1-D boolean array."""
    edges = (np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist()
    return [(a, b, bool(mask[a])) for a, b in zip([0, *edges], [*edges, mask.size])]


def _finite_systems(arrays, count: int) -> np.ndarray:
    """``(count,)``: whether every value of each system (the leading axis) of ``arrays`` is finite."""
    return np.logical_and.reduce([np.isfinite(a).reshape(count, -1).all(axis=1) for a in arrays])


def _settle(solve_range, count: int, inputs_finite) -> np.ndarray:
    """Solve ``count`` consecutive systems, joined where that is exact: ``(count, n, k)``.

    ``solve_range(c, e)`` solves systems ``c`` to ``e - 1`` in one joined call; ``inputs_finite()``
    tells which systems have only finite inputs. A joined result that is all finite is every
    system's own result (the blocks met only through products with exact zeros, and a leak would
    have put a NaN in another block). Otherwise the systems with a non-finite input are solved
    alone, and each run of the others is solved again in :data:`_SPLIT` parts, a part that is
    still not finite split again, down to single systems (which are then alone): one overflowing
    system costs about ``_SPLIT / (_SPLIT - 1)`` times the rows of the run more, in ``_SPLIT``
    calls per level. Systems are settled in order, so a ``LinAlgError`` names the first system
    that is singular on its own.
    """
    x = solve_range(0, count)
    if np.isfinite(x).all():
        return x
    out = np.empty_like(x)
    for c, e, finite in _runs(inputs_finite()):
        if finite:
            _bisect(solve_range, out, c, e, x if (c, e) == (0, count) else None)
        else:
            for i in range(c, e):
                out[i] = solve_range(i, i + 1)[0]
    return out


def _real_view(a: np.ndarray) -> np.ndarray:
    """``a`` as real numbers (a complex array's parts side by side), a view where ``a`` is
    contiguous."""
    if not np.iscomplexobj(a):
        return a
    return a.view(a.real.dtype) if a.flags.c_contiguous else np.stack([a.real, a.imag], -1)


def _negative_zeros(arrays, count: int) -> np.ndarray:
    """``(count,)``: whether any value (or part of one) of each system of ``arrays`` (systems on
    the leading axis) is ``-0.0``; an array without a zero costs one comparison."""
    found = np.zeros(count, dtype=bool)
    for a in arrays:
        for part in ((a.real, a.imag) if np.iscomplexobj(a) else (a,)):
            zero = part == 0
            if np.count_nonzero(zero):  # (faster than .any() on small arrays)
                found |= (zero & np.signbit(part)).reshape(count, -1).any(axis=1)
    return found


def _keep_zero_signs(x: np.ndarray, solve_range, inputs_with_negative_zero) -> np.ndarray:
    """``x`` (``(count, n, k)``, joined results) with the systems whose zeros may have another
    sign than alone solved again alone, so that every system's result is its own, sign of zero
    included.

    A joined call does a few more operations than the systems alone, at each block boundary: an
    exact zero times the neighbouring block's value, subtracted. That changes no value, but turns
    ``-0.0 - (-0.0)`` into ``+0.0`` where the system alone keeps ``-0.0``. In ``?gtsv`` and in
    ``?gttrs`` with ``A`` the value subtracted from is ``-0.0`` only where a ``-0.0`` among the
    system's inputs started it (a difference or sum is ``-0.0`` only where its first operand is),
    and a changed zero ends only in entries of ``x`` that are zero. So the systems solved again
    are those with an exact zero in ``x`` and a ``-0.0`` in their inputs
    (``inputs_with_negative_zero()``, ``(count,)``, asked only where ``x`` has a zero): none in
    most batches, and the check is one comparison of ``x``."""
    count = x.shape[0]
    if count < 2:
        return x
    zero = _real_view(x) == 0
    if not np.count_nonzero(zero):
        return x
    redo = zero.reshape(count, -1).any(axis=1) & inputs_with_negative_zero()
    for i in np.flatnonzero(redo).tolist():
        x[i] = solve_range(i, i + 1)[0]
    return x


def _bisect(solve_range, out: np.ndarray, c: int, e: int, x=None) -> None:
    """Fill ``out[c:e]`` from joined solves, splitting a part whose result is not finite."""
    x = solve_range(c, e) if x is None else x
    if e - c == 1 or np.isfinite(x).all():
        out[c:e] = x
        return
    for a, b in _split(c, e, _SPLIT):
        _bisect(solve_range, out, a, b)


# --- The batched routines -------------------------------------------------------------------------

def solve(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve a batch of systems with ``?gtsv`` calls on joined systems (:func:`join`).

    Shapes: ``lower``, ``upper`` ``(*batch, n-1)``, ``diag`` ``(*batch, n)``, ``rhs``
    ``(*batch, n, k)``, all with the same ``batch`` (broadcast beforehand). Returns a new
    C-contiguous array ``(*batch, n, k)``, equal to solving each system on its own (bit for bit).
    A singular system raises :class:`torch.linalg.LinAlgError` that names its pivot and batch
    index (the first singular system in batch order), also when there is no right-hand side
    (``k = 0``), as :func:`torch.linalg.solve` does.

    The batch is joined in chunks of at most :data:`_CHUNK_ROWS` rows, one call each. A chunk whose
    result is not finite (a non-finite input, or an overflow, leaks into the other blocks through
    ``0 * inf``) is settled by :func:`_settle`: its systems with non-finite inputs alone, the
    others joined again in parts. One NaN or overflowing system in a clean batch therefore costs
    about one chunk more, not one call per system.
    """
    batch, n = diag.shape[:-1], diag.shape[-1]
    if rhs.size == 0:
        if diag.size:  # nothing to solve for, but a singular matrix must still raise
            solve(lower, diag, upper, np.zeros(rhs.shape[:-1] + (1,), dtype=rhs.dtype))
        return np.empty(rhs.shape, dtype=rhs.dtype)
    size, k = int(np.prod(batch)), rhs.shape[-1]
    flat = (lower.reshape(size, n - 1), diag.reshape(size, n), upper.reshape(size, n - 1),
            rhs.reshape(size, n, k))
    parts = []
    for start, stop in _chunk_bounds(size, n):
        chunk = [a[start:stop] for a in flat]
        dl, d, du, b = join(*chunk)

        def solve_range(c, e, dl=dl, d=d, du=du, b=b, start=start):
            try:
                x = gtsv(dl[c * n: e * n - 1], d[c * n: e * n], du[c * n: e * n - 1], b[c * n: e * n])
            except SingularMatrixError as err:
                raise _batch_error(err, n, batch, first=start + c) from None
            return x.reshape(e - c, n, k)

        x = _settle(solve_range, stop - start,
                    lambda chunk=chunk: _finite_systems(chunk, len(chunk[1])))
        parts.append(_keep_zero_signs(x, solve_range,
                                      lambda chunk=chunk: _negative_zeros(chunk, len(chunk[1]))))
    x = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return x.reshape(rhs.shape)


def _gttrf_raw(lower, diag, upper):
    """:func:`gttrf` without raising: ``(factors, info, routine name)`` (padded when ``n < 3``)."""
    n = diag.shape[0]
    extra = max(3 - n, 0)
    if extra:
        lower, diag, upper, _ = _pad(lower, diag, upper, None, 3)
    (routine,) = get_lapack_funcs(("gttrf",), (diag,))
    dl, d, du, du2, ipiv, info = routine(lower, diag, upper)
    return LUFactors(dl, d, du, du2, ipiv, n), info - extra if info > 0 else info, \
        routine.typecode + "gttrf"


def _unpadded(f: LUFactors) -> LUFactors:
    """``f`` without the identity rows that :func:`_pad` put first: arrays of ``n``, ``n - 1``, ... rows."""
    extra = f.d.shape[0] - f.n
    if not extra:
        return f
    return LUFactors(f.dl[extra:], f.d[extra:], f.du[extra:], f.du2[extra:], f.ipiv[extra:] - extra, f.n)


def factor(lower: np.ndarray, diag: np.ndarray, upper: np.ndarray):
    """Factor a batch with ``?gttrf``: bands ``(*batch, n-1)``, ``(*batch, n)``, ``(*batch, n-1)``.

    Returns ``(lu, pivots)``: ``lu`` ``(*batch, 4, n)`` holds ``?gttrf``'s ``dl``, ``d``, ``du`` and
    ``du2`` in its rows (zero-padded to ``n``), ``pivots`` ``(*batch, n)`` its 1-based ``ipiv`` (row
    ``i`` was interchanged with row ``pivots[i] - 1``, which is ``i`` or ``i + 1``), each relative to
    its own system, and bit for bit what factoring each system alone gives. A singular matrix
    raises :class:`torch.linalg.LinAlgError` naming the pivot and the batch element (the first
    singular system in batch order).

    The batch is factored in joined calls (:func:`join`) of at most :data:`_CHUNK_ROWS` rows. A
    block whose last pivot is NaN is interchanged with the next block's first row (``|NaN| >= 0``
    is false), which corrupts both blocks and, through the NaN, every later one, and can report a
    zero pivot that the block alone does not have. So the joined factors are kept up to the first
    block boundary with an interchange; that block is factored alone, and the rest again (its
    systems with non-finite inputs alone, the others joined in :data:`_SPLIT` parts, each checked
    the same way). One NaN system costs about one chunk more.
    """
    batch, n = diag.shape[:-1], diag.shape[-1]
    size = int(np.prod(batch))
    lu = np.zeros((size, 4, n), dtype=diag.dtype)
    pivots = np.empty((size, n), dtype=np.int32)
    flat = [a.reshape(size, a.shape[-1]) for a in (lower, diag, upper)]
    for start, stop in _chunk_bounds(size, n) if n else []:
        _factor_chunk([a[start:stop] for a in flat], lu[start:stop], pivots[start:stop], start, batch)
    if size > 1 and n:
        # At a block boundary a joined call computes d[i+1] - (0 / d[i]) * 0, which turns a -0.0
        # first diagonal entry into +0.0 (and the signs of zeros that follow from it); a system
        # alone keeps it. It is the only operation more: those systems are factored alone.
        for i in (np.flatnonzero(_negative_zeros([flat[1][1:, :1]], size - 1)) + 1).tolist():
            f, info, name = _gttrf_raw(*(a[i] for a in flat))
            if info == 0:  # (a singular system raised above)
                _store_factors(_unpadded(f), 1, n, lu[i:i + 1], pivots[i:i + 1])
    return lu.reshape(batch + (4, n)), pivots.reshape(batch + (n,))


def _factor_chunk(chunk, lu: np.ndarray, pivots: np.ndarray, first: int, batch) -> None:
    """:func:`factor` of the systems ``chunk`` (bands ``(count, .)``) into ``lu`` and ``pivots``."""
    count, n = chunk[1].shape
    dl, d, du, _ = join(*chunk)

    def factor_range(c, e):
        """Factor systems ``c`` to ``e - 1`` joined; store those that got their own factors (all
        up to the first block boundary with an interchange) and return the first one not stored."""
        f, info, name = _gttrf_raw(dl[c * n: e * n - 1], d[c * n: e * n], du[c * n: e * n - 1])
        f = _unpadded(f)
        ends = np.arange(n - 1, (e - c) * n - 1, n)  # each block's last row, but the last block's
        crossed = np.flatnonzero(f.ipiv[ends] == ends + 2)  # 1-based: row r swapped with r + 1
        good = int(crossed[0]) if crossed.size else e - c
        if info > 0 and (info - 1) // n < good:  # a zero pivot in a block that is its own
            try:
                _check_info(info, name)
            except SingularMatrixError as err:
                raise _batch_error(err, n, batch, first=first + c) from None
        _store_factors(f, good, n, lu[c: c + good], pivots[c: c + good])
        return c + good

    def factor_run(c, e):
        """Factor systems ``c`` to ``e - 1`` (finite inputs): joined, then what is left in parts."""
        stop = factor_range(c, e)
        if stop < e:
            factor_range(stop, stop + 1)  # alone
            for a, b in _split(stop + 1, e, _SPLIT):
                factor_run(a, b)

    stop = factor_range(0, count)
    if stop == count:
        return
    finite = _finite_systems([a[stop:] for a in chunk], count - stop)
    for c, e, ok in _runs(finite):
        if ok:
            factor_run(stop + c, stop + e)
        else:
            for i in range(stop + c, stop + e):
                factor_range(i, i + 1)


def _store_factors(f: LUFactors, count: int, n: int, lu: np.ndarray, pivots: np.ndarray) -> None:
    """Copy the first ``count`` blocks of joined factors ``f`` into ``lu`` ``(count, 4, n)`` and
    ``pivots`` ``(count, n)``, with each system's padding (the joined couplings) exactly zero."""
    if count == 0:
        return
    m = count * n
    rows = np.zeros((4, m), dtype=lu.dtype)
    rows[0, : m - 1], rows[1], rows[2, : m - 1] = f.dl[: m - 1], f.d[:m], f.du[: m - 1]
    rows[3, : max(m - 2, 0)] = f.du2[: max(m - 2, 0)]
    lu[:] = rows.reshape(4, count, n).transpose(1, 0, 2)
    lu[:, 0, n - 1] = lu[:, 2, n - 1] = 0
    lu[:, 3, max(n - 2, 0):] = 0
    pivots[:] = _local_pivots(f.ipiv, count, n)


def factor_solve(lu: np.ndarray, pivots: np.ndarray, rhs: np.ndarray, trans: str = "N") -> np.ndarray:
    """Solve with factors from :func:`factor` (``?gttrs``): ``A x = rhs`` (``trans='N'``),
    ``A^T x = rhs`` (``'T'``) or ``A^H x = rhs`` (``'C'``), for ``rhs`` ``(*batch, n, k)``.

    A batch is solved in joined calls of at most :data:`_CHUNK_ROWS` rows; the factors of a
    block-diagonal matrix are the blocks' factors (their padding is ignored: the couplings are set
    to exact zeros), so this equals solving each system alone, bit for bit with ``trans='N'``; with
    ``'T'`` and ``'C'`` the same values, but a zero may have the other sign (the joined call
    subtracts an exact zero where the system alone does not, so ``-0.0`` can come back ``+0.0``;
    keeping the sign would mean solving again alone every system with a zero in its result, a
    zero right-hand side included). A chunk whose result is
    not finite is settled as in :func:`solve` (:func:`_settle`). Returns a new C-contiguous array;
    the inputs are left unchanged. ``pivots`` must hold values that ``?gttrf`` can produce
    (:func:`tridiag_tutorial._validation.check_pivot_values`): ``?gttrs`` trusts them.
    """
    batch, n = lu.shape[:-2], lu.shape[-1]
    if rhs.size == 0:
        return np.empty(rhs.shape, dtype=rhs.dtype)
    if not batch and n >= 3:  # one system: ?gttrs straight on views of the factors' rows
        return gttrs(LUFactors(lu[0, : n - 1], lu[1], lu[2, : n - 1], lu[3, : n - 2], pivots, n),
                     rhs, trans)
    size, k = int(np.prod(batch)), rhs.shape[-1]
    flat_lu, flat_piv = lu.reshape(size, 4, n), pivots.reshape(size, n)
    flat_rhs = rhs.reshape(size, n, k)
    parts = []
    for start, stop in _chunk_bounds(size, n):
        count = stop - start
        blocks = flat_lu[start:stop].transpose(1, 0, 2).copy()  # (4, count, n), ours to edit
        blocks[0, :, n - 1] = blocks[2, :, n - 1] = 0  # the couplings of the joined system
        blocks[3, :, max(n - 2, 0):] = 0
        rows = blocks.reshape(4, count * n)
        ipiv = _joined_pivots(flat_piv[start:stop])
        b = flat_rhs[start:stop].reshape(count * n, k)

        def solve_range(c, e, rows=rows, ipiv=ipiv, b=b):
            lo, hi = c * n, e * n
            f = LUFactors(rows[0, lo: hi - 1], rows[1, lo:hi], rows[2, lo: hi - 1],
                          rows[3, lo: max(hi - 2, lo)], ipiv[lo:hi] - np.int32(lo), hi - lo)
            if hi - lo < 3:  # SciPy's ?gttrs wrapper needs 3 rows: embed in identity rows
                f = _pad_factors(f)
            return gttrs(f, b[lo:hi], trans).reshape(e - c, n, k)

        def inputs_finite(blocks=blocks, start=start, stop=stop, count=count):
            return _finite_systems([blocks.transpose(1, 0, 2), flat_rhs[start:stop]], count)

        def rhs_negative_zeros(start=start, stop=stop, count=count):  # the factors' do not count
            return _negative_zeros([flat_rhs[start:stop]], count)

        x = _settle(solve_range, count, inputs_finite)
        parts.append(_keep_zero_signs(x, solve_range, rhs_negative_zeros) if trans == "N" else x)
    x = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return x.reshape(rhs.shape)


def _pad_factors(f: LUFactors) -> LUFactors:
    """The factors of ``[[I, 0], [0, A]]`` (3 x 3, see :func:`_pad`) from those of a 1 x 1 or 2 x 2
    ``A``: what :func:`gttrf` returns for ``A``."""
    m, extra = f.n, 3 - f.n
    dl, d, du, du2 = np.zeros(2, f.d.dtype), np.ones(3, f.d.dtype), np.zeros(2, f.d.dtype), \
        np.zeros(1, f.d.dtype)
    dl[extra:], d[extra:], du[extra:] = f.dl[: m - 1], f.d[:m], f.du[: m - 1]
    ipiv = np.arange(1, 4, dtype=np.int32)
    ipiv[extra:] = f.ipiv[:m] + extra
    return LUFactors(dl, d, du, du2, ipiv, m)
