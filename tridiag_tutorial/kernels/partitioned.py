r"""A partitioned solver in torch ops: O(log n) dispatched operations for one large system.

The pivoting kernel of :mod:`tridiag_tutorial.kernels.sequential` eliminates one row after another, so
one system of ``n`` unknowns costs about ``30 n`` torch operations; on a GPU each is a kernel
launch. This kernel cuts the system into blocks and solves **all blocks at once** with that same
pivoting kernel (the blocks become a batch), so the sequential part is one block long:

1. **Partition.** The rows are grouped as ``[block 0 (m rows)] [separator 0] [block 1] [separator 1]
   ...``: ``p`` blocks of ``m = block`` rows, each followed by one separator row (the system is
   padded with identity rows to ``p (m + 1)`` rows; they do not couple to the real ones).
2. **Blocks.** Each block ``A_j`` couples to the rest only through its first row (to separator
   ``j - 1``) and its last row (to separator ``j``). One batched factorization of the ``p``
   blocks, with partial pivoting inside each, and one batched solve with ``k + 4`` right-hand
   sides (the caller's ``k``, the two probes below, two spikes) give ``A_j^{-1} b_j`` and the
   two "spikes" ``A_j^{-1} (a e_1)`` and ``A_j^{-1} (c e_m)``.
3. **Reduced system.** Substituting the blocks into the separator rows leaves a tridiagonal system
   in the ``p`` separator unknowns (the Schur complement of the blocks), about ``n / (m + 1)``
   unknowns: solved by the same method, recursively, until it is small enough for the pivoting
   kernel.
4. **Recovery.** Every block's unknowns follow from its two separators, all blocks at once.

Each level costs a fixed number of operations, independent of ``n``, and divides the size by
``m + 1``, so the count grows like ``log n``. The first solve keeps every level's factors and
spikes, so that a later right-hand side costs only the blocks' solves, the reduced systems' and
the recoveries (:func:`_solve_phase`): the refinement below uses that.

**Accuracy: refinement, a check, a fallback.** Pivoting happens inside each block only. If a
block (of ``A`` or of a reduced system) is singular or nearly so while ``A`` is not, because
LAPACK's row swaps would reach across the block boundary, the spikes grow and the answer loses
digits (or the method divides by zero); and for a singular ``A`` the reduced system can get a
pivot made of round-off where LAPACK finds an exact zero. So the kernel

1. solves two fixed *probe* right-hand sides ``D z`` beside the caller's (``z`` with entries in
   ``[-1, 1]``, no random state; ``D`` the rows' largest magnitudes, so that scaling rows changes
   nothing);
2. refines every column ``REFINEMENT_STEPS`` (2) times, ``x <- x + A^{-1} (b - A x)``, with the
   residual in more than the working precision (float32 in float64; float64 as an unevaluated
   sum of two float64s, by error-free products and sums), so that ``x`` converges to
   ``A^{-1} b`` rounded, not merely to a small residual;
3. checks, for every column whose system's bands and whose own entries are finite (a non-finite
   entry in one column or one system does not switch off the check of another), that ``x`` is
   finite and the last correction is at most ``CONVERGENCE_TOL`` (2) eps ``max|x|``, and for
   every system with finite bands that ``eps max|(D^{-1} A)^{-1} z| <= 1 / SINGULAR_MARGIN``
   (1/100: otherwise ``A`` is singular, or so nearly that LAPACK may meet an exact zero pivot)
   and that eps times the largest spike entry is at most ``GROWTH_TOL`` (1e-3: above it a
   correction no longer measures the error, and refinement can stall at a wrong answer).

If any check fails, the whole call is solved again by the sequential pivoting kernel, which
makes LAPACK's pivot decisions: it returns LAPACK's answer or raises
:class:`torch.linalg.LinAlgError` where LAPACK does. The check reads one boolean back from the
device. The accuracy harness (``python -m tridiag_tutorial.bench.accuracy``; chapter 16 shows
its committed rows) compares the forward error with LAPACK's on five families of systems, and
the tests hold it within 10 times LAPACK's where LAPACK's is below 1e-2, and every singular
construction raises where LAPACK does. Systems with a nearly singular block mostly fall back, as
do float32 systems with a large ``cond(A)``. A system whose bands are not finite gives non-finite results in its own system only
and is not checked, so it does not raise where LAPACK would meet a zero pivot before its first
non-finite entry.

**Cost.** Dispatched operations (``benchmarks.CountOperations``, one system, one column, float64)
and the median time on the CPU (one thread, Intel Xeon, 15 runs; 7 at n = 1e6), against this
kernel without refinement (one probe, a backward-error check) in the same process:

========  ==============  ===================  ==================
n         operations      time (ms)            time ratio
========  ==============  ===================  ==================
1e3       1,020 -> 1,989  2.7 -> 5.2           1.9
1e5       1,558 -> 2,986  39 -> 185            4.8
1e6       1,818 -> 3,472  403 -> 2,470         6.1
========  ==============  ===================  ==================

The count still grows like ``log n``; on the CPU the time grows with the extra arithmetic
(three solve phases and two residuals in double-double, on three columns more than the caller's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import sequential

__all__ = ["BLOCK", "REFINEMENT_STEPS", "CONVERGENCE_TOL", "SINGULAR_MARGIN", "GROWTH_TOL", "solve",
           "solve_ex", "solve_unchecked", "levels"]

# Rows per block. Of 4, 8, 16 and 32, blocks of 4 dispatched the fewest operations (1,020,
# 1,260, 1,519 and 2,462 for n = 1000; 1,558 to 3,906 for n = 1e5, before refinement was added)
# and were the fastest or within about 6% of it on the CPU at n = 1e3, 1e5 and 1e6 (one thread,
# float64).
BLOCK = 4
REFINEMENT_STEPS = 2  # steps of iterative refinement after the first solve
CONVERGENCE_TOL = 2.0  # the last correction may be at most this many eps times max|x|, per column
SINGULAR_MARGIN = 100.0  # fall back where eps max|(D^{-1} A)^{-1} z| > max|z| / SINGULAR_MARGIN
GROWTH_TOL = 1e-3  # fall back where eps times the largest spike entry exceeds this


def solve_ex(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
             block: int = BLOCK) -> tuple[torch.Tensor, bool]:
    """``x = A^{-1} rhs`` for bands ``(*B, n-1)``, ``(*B, n)``, ``(*B, n-1)`` and ``rhs``
    ``(*B, n, k)`` of one batch shape, and whether the answer came from the fallback (the
    sequential kernel, where the check of the answer failed); ``x`` is a new tensor, the inputs
    are not modified.

    Raises:
        torch.linalg.LinAlgError: ``A`` is singular (raised by the sequential kernel that the
            fallback runs; the message names the pivot and the batch element), also when ``rhs``
            has no column (``k = 0``): the probes are solved all the same.
    """
    if block < 2:
        raise ValueError(f"partitioned.solve: block must be at least 2, got {block}")
    if diag.numel() == 0:  # no system: nothing to solve
        return rhs.new_zeros(rhs.shape), False
    # k = 0 columns still runs: the probes (and the fallback) raise for a singular A, as the
    # other kernels do
    # [book: partitioned-check]
    k = rhs.shape[-1]
    row = _row_max(lower, diag, upper)  # (*B, n)
    probe = _probe(rhs) * torch.where(row > 0, row, torch.ones_like(row))[..., None]
    b = torch.cat([rhs, probe], dim=-1)
    x, levels_ = _factor_solve(lower, diag, upper, b, block)
    residual = _Residual(lower, diag, upper, b)
    correction = x
    for _ in range(REFINEMENT_STEPS):
        correction = _solve_phase(levels_, residual(x), block)
        x = x + correction
    if bool(_answer_is_suspect(lower, diag, upper, rhs, x, correction, k, _growth(levels_))):  # one device read
        return sequential.solve(lower, diag, upper, rhs), True
    return x[..., :k].contiguous(), False
    # [/book: partitioned-check]


def solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
          block: int = BLOCK) -> torch.Tensor:
    """:func:`solve_ex`'s ``x`` alone: the kernel that ``driver="partitioned"`` runs."""
    return solve_ex(lower, diag, upper, rhs, block)[0]


_PROBE_STEPS = (0.6180339887498949, 0.4142135623730951)  # golden ratio and sqrt(2), mod 1


def _probe(rhs: torch.Tensor) -> torch.Tensor:
    """``(*B, n, 2)``: two fixed right-hand sides with entries in ``[-1, 1]`` that look random
    (the fractional parts of ``i`` times the golden ratio and times the square root of 2, no
    random state), solved beside the caller's. Their solutions tell whether ``A`` is singular in
    the working precision whatever the caller's right-hand side is (zero, or in the range of a
    singular ``A``, or with one entry far larger than the rest); two, so that neither's being
    nearly orthogonal to the null space of a nearly singular ``A`` can hide it."""
    n = rhs.shape[-2]
    i = torch.arange(1, n + 1, device=rhs.device, dtype=torch.float64)[:, None]
    # Python scalars, not a tensor built from them: on a GPU that would be a blocking host copy
    z = 2 * torch.frac(torch.cat([i * step for step in _PROBE_STEPS], dim=-1)) - 1
    return z.to(rhs.dtype).expand(*rhs.shape[:-1], len(_PROBE_STEPS))


def levels(n: int, block: int = BLOCK) -> list[int]:
    """The sizes of the systems the recursion solves: ``n``, then each reduced system's, down to
    the one the sequential kernel solves."""
    sizes = [n]
    while _partitions(sizes[-1], block):
        sizes.append(-(-(sizes[-1] + 1) // (block + 1)))
    return sizes


def _partitions(n: int, block: int) -> bool:
    return n > 2 * (block + 1)  # below this the reduced system would not be much smaller


class _Level(NamedTuple):
    """What one level of the recursion keeps for later solves: the blocks' factors (or, at the
    last level, the whole small system's) and, above the last level, the blocks' spikes and the
    separator rows' couplings."""
    lu: torch.Tensor  # (*B, p, 4, m), or (*B, 4, n) at the last level
    pivots: torch.Tensor
    v: torch.Tensor | None = None  # (*B, p, m, 1): A_j^{-1} (lo_j[0] e_1)
    w: torch.Tensor | None = None  # (*B, p, m, 1): A_j^{-1} (up_j[m-1] e_m)
    lo_s: torch.Tensor | None = None  # (*B, p): the separator rows' sub- and super-diagonals
    up_s: torch.Tensor | None = None


def _blocks(t: torch.Tensor, p: int, m: int, pad: int, value: float = 0.0) -> torch.Tensor:
    """``(*B, n)`` -> ``(*B, p, m + 1)``, padded with ``value``."""
    return F.pad(t, (0, pad), value=value).reshape(*t.shape[:-1], p, m + 1)


def _rhs_blocks(rhs: torch.Tensor, p: int, m: int, pad: int) -> torch.Tensor:
    """``(*B, n, k)`` -> ``(*B, p, m + 1, k)``, padded with zero rows."""
    return F.pad(rhs, (0, 0, 0, pad)).reshape(*rhs.shape[:-2], p, m + 1, rhs.shape[-1])


def _reduced_rhs(b, y, level: _Level, m: int) -> torch.Tensor:
    """Separator j: ``b_s - lo_s y_j[m-1] - up_s y_{j+1}[0]``, ``(*B, p, k)``."""
    y_next = F.pad(y[..., 1:, 0, :], (0, 0, 0, 1))  # (*B, p, k): y of block j + 1's first row
    return b[..., m, :] - level.lo_s[..., None] * y[..., m - 1, :] - level.up_s[..., None] * y_next


def _recover(y, s, level: _Level, n: int) -> torch.Tensor:
    """Every block's unknowns from its two separators, all blocks at once: ``(*B, n, k)``."""
    p, m = y.shape[-3], y.shape[-2]
    s_prev = F.pad(s[..., :-1, :], (0, 0, 1, 0))
    inner = y - level.v * s_prev[..., None, :] - level.w * s[..., None, :]
    x = torch.cat([inner, s[..., None, :]], dim=-2).reshape(*y.shape[:-3], p * (m + 1), -1)
    return x[..., :n, :]


def _factor_solve(lower, diag, upper, rhs, m):
    """The first solve: ``(x, levels)``, ``levels`` the list of :class:`_Level` that
    :func:`_solve_phase` reuses for further right-hand sides."""
    n, k = rhs.shape[-2], rhs.shape[-1]
    if not _partitions(n, m):
        lu, pivots = sequential.factor_unchecked(lower, diag, upper)
        return sequential.lu_solve(lu, pivots, rhs), [_Level(lu, pivots)]
    p = -(-(n + 1) // (m + 1))  # blocks; the last separator row is always padding
    pad = p * (m + 1) - n
    # full-length bands: lo[i] = A[i, i-1], up[i] = A[i, i+1], zero where there is no entry
    lo = _blocks(F.pad(lower, (1, 0)), p, m, pad)
    up = _blocks(F.pad(upper, (0, 1)), p, m, pad)
    d = _blocks(diag, p, m, pad, value=1.0)
    b = _rhs_blocks(rhs, p, m, pad)

    # 2. every block at once: A_j [y, v, w] = [b_j, lo_j[0] e_1, up_j[m-1] e_m]
    lu, pivots = sequential.factor_unchecked(lo[..., 1:m], d[..., :m], up[..., :m - 1])
    spike_left = F.pad(lo[..., :1], (0, m - 1))  # (*B, p, m): lo_j[0] in the first row
    spike_right = F.pad(up[..., m - 1:m], (m - 1, 0))  # up_j[m-1] in the last row
    solved = sequential.lu_solve(
        lu, pivots, torch.cat([b[..., :m, :], spike_left[..., None], spike_right[..., None]], -1))
    y, v, w = solved[..., :k], solved[..., k:k + 1], solved[..., k + 1:]
    level = _Level(lu, pivots, v, w, lo[..., m], up[..., m])

    # 3. separator j: lo_s x_j[m-1] + d_s s_j + up_s x_{j+1}[0] = b_s, with x_j = y - v s_{j-1} - w s_j
    v_next = F.pad(v[..., 1:, 0, 0], (0, 1))
    w_next = F.pad(w[..., 1:, 0, 0], (0, 1))
    reduced_diag = d[..., m] - level.lo_s * w[..., m - 1, 0] - level.up_s * v_next
    reduced_lower = (-level.lo_s * v[..., m - 1, 0])[..., 1:]
    reduced_upper = (-level.up_s * w_next)[..., :-1]
    s, below = _factor_solve(reduced_lower, reduced_diag, reduced_upper,
                             _reduced_rhs(b, y, level, m), m)

    # 4. recovery, all blocks at once
    return _recover(y, s, level, n), [level] + below


def _solve_phase(levels_: list, rhs: torch.Tensor, m: int) -> torch.Tensor:
    """``A^{-1} rhs`` with the factors that :func:`_factor_solve` kept: no factorization, no
    spikes, only the blocks' solves with ``rhs``, the reduced systems' and the recoveries."""
    level, n = levels_[0], rhs.shape[-2]
    if level.v is None:
        return sequential.lu_solve(level.lu, level.pivots, rhs)
    p = level.lu.shape[-3]
    b = _rhs_blocks(rhs, p, m, p * (m + 1) - n)
    y = sequential.lu_solve(level.lu, level.pivots, b[..., :m, :])
    s = _solve_phase(levels_[1:], _reduced_rhs(b, y, level, m), m)
    return _recover(y, s, level, n)


def _growth(levels_: list) -> torch.Tensor:
    """``(*B,)``: the largest magnitude of any spike entry, over every level. The recovery
    ``y - v s_{j-1} - w s_j`` loses about ``eps`` times this, relative to ``max|x|``, in every
    solve, so above ``1 / eps`` refinement can stall at a wrong answer with small corrections."""
    batch = levels_[-1].lu.shape[:-2]  # the last level's factors are (*B, 4, n)
    growth = torch.zeros(batch, dtype=levels_[0].lu.real.dtype, device=levels_[0].lu.device)
    for level in levels_[:-1]:
        below = level.lu.shape[:-3]  # the reduced systems keep the batch shape
        spikes = torch.cat([level.v, level.w], dim=-1).abs().flatten(len(below))
        growth = torch.maximum(growth, spikes.amax(-1))
    return growth


def solve_unchecked(lower, diag, upper, rhs, m=BLOCK):
    """The partitioned solve alone: no refinement, no check, no fallback."""
    return _factor_solve(lower, diag, upper, rhs, m)[0].contiguous()


# Splitting a float64 into two halves of 26 bits (Dekker): products of halves are exact.
_SPLIT_FACTOR = 2.0**27 + 1
_SPLIT_SAFE = 2.0**995  # above this, 2^27 a could overflow: split a / 2^28 and scale back


def _split(a: torch.Tensor):
    """``(a, hi, lo)`` with ``a = hi + lo`` exactly and ``hi``, ``lo`` of 26 bits each."""
    big = a.abs() > _SPLIT_SAFE
    scaled = torch.where(big, a * 2.0**-28, a)
    c = scaled * _SPLIT_FACTOR
    hi = c - (c - scaled)
    lo = scaled - hi
    return a, torch.where(big, hi * 2.0**28, hi), torch.where(big, lo * 2.0**28, lo)


def _shift(parts, direction: int):
    """Each of ``(a, hi, lo)`` (``(*B, n, k)``) moved one row down (``direction = 1``: row ``i``
    gets row ``i - 1``, a zero first row) or up (``-1``)."""
    pad = (0, 0, 1, 0) if direction == 1 else (0, 0, 0, 1)
    rows = slice(None, -1) if direction == 1 else slice(1, None)
    return tuple(F.pad(t[..., rows, :], pad) for t in parts)


def _accumulate(s, e, a, b):
    """Subtract the product of the split numbers ``a`` and ``b`` from the unevaluated sum
    ``s + e``: ``s`` takes the rounded sum (Knuth's two-sum), ``e`` every rounding error (the
    product's exactly, by Dekker's two-product; the sum's exactly)."""
    (a, a_hi, a_lo), (b, b_hi, b_lo) = a, b
    p = a * b
    p_error = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    total = s - p
    virtual = total - s
    s_error = (s - (total - virtual)) - (p + virtual)
    return total, e + (s_error - p_error)


class _Residual:
    """``b - A x`` for a given ``x``, in more than the working precision: float32 and complex64
    in float64 and complex128, float64 and complex128 as an unevaluated sum of two float64s
    (error-free products and sums), returned rounded to the working precision. The refinement
    then converges to ``A^{-1} b`` rounded, not to a solution with a small residual only."""

    def __init__(self, lower, diag, upper, b):
        self.dtype = b.dtype
        self.wide = {torch.float32: torch.float64, torch.complex64: torch.complex128}.get(b.dtype)
        lo = F.pad(lower, (1, 0))[..., None]  # (*B, n, 1): A[i, i-1], zero in row 0
        up = F.pad(upper, (0, 1))[..., None]
        bands = (lo, diag[..., None], up)
        if self.wide is not None:
            self.bands = tuple(t.to(self.wide) for t in bands)
            self.b = b.to(self.wide)
        elif b.is_complex():  # real and imaginary parts, each split once
            self.bands = tuple((_split(t.real), _split(t.imag)) for t in bands)
            self.b = b
        else:
            self.bands = tuple(_split(t) for t in bands)
            self.b = b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None:
            lo, d, up = self.bands
            xw = x.to(self.wide)
            r = (self.b - d * xw - lo * F.pad(xw[..., :-1, :], (0, 0, 1, 0))
                 - up * F.pad(xw[..., 1:, :], (0, 0, 0, 1)))
            return r.to(self.dtype)
        if not x.is_complex():
            return self._real(self.b, self.bands, _split(x))
        (lo_r, lo_i), (d_r, d_i), (up_r, up_i) = self.bands
        x_r, x_i = _split(x.real), _split(x.imag)
        neg = lambda parts: tuple(-t for t in parts)  # noqa: E731 (exact)
        # (a_r + i a_i)(x_r + i x_i) = (a_r x_r - a_i x_i) + i (a_r x_i + a_i x_r)
        real = self._real(self.b.real, (lo_r, d_r, up_r), x_r, (neg(lo_i), neg(d_i), neg(up_i)), x_i)
        imag = self._real(self.b.imag, (lo_r, d_r, up_r), x_i, (lo_i, d_i, up_i), x_r)
        return torch.complex(real, imag)

    @staticmethod
    def _real(b, bands, x, more_bands=None, more_x=None):
        """``b - sum over (lo, d, up) of lo x[i-1] + d x[i] + up x[i+1]`` (and the same with
        ``more_bands`` and ``more_x``), the sum carried in two float64s, rounded once at the end."""
        s, e = b, torch.zeros_like(b)
        for band_set, xs in ((bands, x), (more_bands, more_x)):
            if band_set is None:
                continue
            lo, d, up = band_set
            for band, shifted in ((d, xs), (lo, _shift(xs, 1)), (up, _shift(xs, -1))):
                s, e = _accumulate(s, e, band, shifted)
        return s + e


def _row_max(lower, diag, upper) -> torch.Tensor:
    """``(*B, n)``: the largest magnitude in each row of ``A`` (a maximum cannot overflow)."""
    return torch.maximum(diag.abs(), torch.maximum(F.pad(lower.abs(), (1, 0)),
                                                   F.pad(upper.abs(), (0, 1))))


def _answer_is_suspect(lower, diag, upper, rhs, x, correction, k, growth) -> torch.Tensor:
    """True (a 0-dim bool tensor) when a checked column fails the module's check. ``x`` and
    ``correction`` are ``(*B, n, k + 2)``: the caller's ``k`` columns, then the probe's two. A
    column is checked when its system's bands and the column itself are finite (the probe's, when
    the bands are); it fails if its ``x`` is not finite or its last correction exceeds
    ``CONVERGENCE_TOL`` eps max|x|. A system with finite bands also fails when the probes show
    ``eps max|(D^{-1} A)^{-1} z| > 1 / SINGULAR_MARGIN``, ``D`` the rows' largest magnitudes
    (``A`` singular, or so nearly that LAPACK may meet an exact zero pivot), or when
    ``eps growth > GROWTH_TOL`` (a block so nearly singular that the corrections cannot be
    trusted to measure the error)."""
    eps = torch.finfo(x.dtype).eps
    x_max = x.abs().amax(-2)  # (*B, k + 2)
    # "not (a <= b)" is also True for NaN: a breakdown (0/0) in a checked column
    converged = (correction.abs().amax(-2) <= CONVERGENCE_TOL * eps * x_max) & torch.isfinite(x).all(-2)
    bands_finite = (torch.isfinite(lower).all(-1) & torch.isfinite(diag).all(-1)
                    & torch.isfinite(upper).all(-1))  # (*B,)
    columns_finite = torch.cat([torch.isfinite(rhs).all(-2),
                                torch.ones_like(x_max[..., k:], dtype=torch.bool)], dim=-1)
    checked = bands_finite[..., None] & columns_finite
    # the probes are D z, D = diag(max_j |A_ij|): x_probe = (D^{-1} A)^{-1} z, whose rows have
    # largest entry 1 (scaling rows changes neither the solution nor LAPACK's exact zeros)
    singular = eps * x_max[..., k:].amax(-1) > 1 / SINGULAR_MARGIN  # max|z| is at most 1
    unstable = ~(eps * growth <= GROWTH_TOL)
    return (checked & ~converged).any() | (bands_finite & (singular | unstable)).any()
