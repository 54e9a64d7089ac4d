r"""A partitioned solver in torch ops: O(log n) dispatched operations for one large system.

The pivoting kernel of :mod:`tridiag_tutorial.torch_kernel` eliminates one row after another, so
one system of ``n`` unknowns costs about ``30 n`` torch operations; on a GPU each is a kernel
launch. This kernel cuts the system into blocks and solves **all blocks at once** with that same
pivoting kernel (the blocks become a batch), so the sequential part is one block long:

1. **Partition.** The rows are grouped as ``[block 0 (m rows)] [separator 0] [block 1] [separator 1]
   ...``: ``p`` blocks of ``m = block`` rows, each followed by one separator row (the system is
   padded with identity rows to ``p (m + 1)`` rows; they do not couple to the real ones).
2. **Blocks.** Each block ``A_j`` couples to the rest only through its first row (to separator
   ``j - 1``) and its last row (to separator ``j``). One batched factorization of the ``p``
   blocks, with partial pivoting inside each, and one batched solve with ``k + 2`` right-hand
   sides give ``A_j^{-1} b_j`` and the two "spikes" ``A_j^{-1} (a e_1)`` and ``A_j^{-1} (c e_m)``.
3. **Reduced system.** Substituting the blocks into the separator rows leaves a tridiagonal system
   in the ``p`` separator unknowns (the Schur complement of the blocks), about ``n / (m + 1)``
   unknowns: solved by the same method, recursively, until it is small enough for the pivoting
   kernel.
4. **Recovery.** Every block's unknowns follow from its two separators, all blocks at once.

Each level costs a fixed number of operations, independent of ``n`` (a few hundred: 1,818 in all
for the nine systems solved at n = 1e6), and divides the size by ``m + 1``, so the count grows
like ``log n``. Each block is solved with ``k + 3`` right-hand sides instead of ``k`` (the two
spikes, and the probe of the check below), so the arithmetic is more than elimination's. The same code runs on every device.

**When it can fail where LAPACK does not.** Pivoting happens inside each block only. If a block
(of ``A`` or of a reduced system) is singular while ``A`` is not, because LAPACK's row swaps
would reach across the block boundary, the method divides by zero; if a block is nearly singular,
its answer can be far less accurate than LAPACK's; and for a singular ``A`` the reduced system can
get a pivot made of round-off where LAPACK finds an exact zero. So the kernel solves a fixed
*probe* right-hand side ``z`` (entries in ``[-1, 1]``, no random state) beside the caller's, and
checks, for every system whose inputs are finite:

- the row-wise backward error of every column, the caller's and the probe's,
  ``max_i |(A x - b)_i| / (max_j |A_ij| max|x| + |b_i|)``, must be at most
  ``BACKWARD_ERROR_TOL`` (1000) times the dtype's epsilon, and
- ``eps max|A| max|A^{-1} z| <= max|z|`` (otherwise ``cond(A) > 1 / eps``: ``A`` is singular in
  this precision), whatever the caller's right-hand side is.

If either fails for any system of the call (or ``x`` is not finite), the whole call is solved again
by the sequential pivoting kernel, which returns LAPACK's answer or raises
:class:`torch.linalg.LinAlgError` for a singular ``A``. The check reads one boolean back from the
device; the probe adds one column to every solve (no extra operations, more data). It guarantees
a small backward error, not LAPACK's forward error: measured on random systems that need pivoting
(float32, n = 1000, 200 systems), the error against a float64 solve was LAPACK's at the median
and up to 33 times LAPACK's; for nearly singular matrices whose singular part LAPACK's
elimination happens to cancel exactly, it can be far larger (up to about ``cond(A) eps``). A
system whose inputs are not finite gives non-finite results in its own system only, as on the
other kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import torch_kernel

__all__ = ["BLOCK", "BACKWARD_ERROR_TOL", "solve", "levels"]

# Rows per block. Of 4, 8, 16 and 32, blocks of 4 dispatched the fewest operations (1,020,
# 1,260, 1,519 and 2,462 for n = 1000; 1,558 to 3,906 for n = 1e5) and were the fastest or within
# about 6% of it on the CPU at n = 1e3, 1e5 and 1e6 (one thread, float64).
BLOCK = 4
BACKWARD_ERROR_TOL = 1000.0  # row-wise backward error, in units of the dtype's epsilon


def solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
          block: int = BLOCK) -> torch.Tensor:
    """``x = A^{-1} rhs`` for bands ``(*B, n-1)``, ``(*B, n)``, ``(*B, n-1)`` and ``rhs``
    ``(*B, n, k)`` of one batch shape; returns a new tensor, the inputs are not modified.

    Raises:
        torch.linalg.LinAlgError: ``A`` is singular (raised by the sequential kernel that the
            fallback runs; the message names the pivot and the batch element).
    """
    if block < 2:
        raise ValueError(f"partitioned.solve: block must be at least 2, got {block}")
    if rhs.numel() == 0:  # no right-hand side, or no system: nothing to solve
        return rhs.new_zeros(rhs.shape)
    k = rhs.shape[-1]
    probe = _probe(rhs)
    both = _solve(lower, diag, upper, torch.cat([rhs, probe], dim=-1), block)
    x, x_probe = both[..., :k], both[..., k:]
    if bool(_answer_is_suspect(lower, diag, upper, rhs, x, probe, x_probe)):  # one device read
        return torch_kernel.solve(lower, diag, upper, rhs)
    return x.contiguous()


def _probe(rhs: torch.Tensor) -> torch.Tensor:
    """``(*B, n, 1)``: a fixed right-hand side with entries in ``[-1, 1]`` that look random (the
    fractional parts of ``i`` times the golden ratio, no random state), solved beside the
    caller's. Its solution tells whether ``A`` is singular in the working precision whatever the
    caller's right-hand side is (zero, or in the range of a singular ``A``, or with one entry far
    larger than the rest)."""
    n = rhs.shape[-2]
    i = torch.arange(1, n + 1, device=rhs.device, dtype=torch.float64)
    z = 2 * torch.frac(i * 0.6180339887498949) - 1
    return z.to(rhs.dtype)[:, None].expand(*rhs.shape[:-1], 1)


def levels(n: int, block: int = BLOCK) -> list[int]:
    """The sizes of the systems the recursion solves: ``n``, then each reduced system's, down to
    the one the sequential kernel solves."""
    sizes = [n]
    while _partitions(sizes[-1], block):
        sizes.append(-(-(sizes[-1] + 1) // (block + 1)))
    return sizes


def _partitions(n: int, block: int) -> bool:
    return n > 2 * (block + 1)  # below this the reduced system would not be much smaller


def _solve(lower, diag, upper, rhs, m):
    n, k = rhs.shape[-2], rhs.shape[-1]
    if not _partitions(n, m):
        return torch_kernel.lu_solve(*torch_kernel.factor_unchecked(lower, diag, upper), rhs)
    p = -(-(n + 1) // (m + 1))  # blocks; the last separator row is always padding
    pad = p * (m + 1) - n
    batch = diag.shape[:-1]
    # full-length bands: lo[i] = A[i, i-1], up[i] = A[i, i+1], zero where there is no entry
    lo = F.pad(lower, (1, pad)).reshape(*batch, p, m + 1)
    up = F.pad(upper, (0, pad + 1)).reshape(*batch, p, m + 1)
    d = F.pad(diag, (0, pad), value=1.0).reshape(*batch, p, m + 1)
    b = F.pad(rhs, (0, 0, 0, pad)).reshape(*batch, p, m + 1, k)

    # 2. every block at once: A_j [y, v, w] = [b_j, lo_j[0] e_1, up_j[m-1] e_m]
    lu, pivots = torch_kernel.factor_unchecked(lo[..., 1:m], d[..., :m], up[..., :m - 1])
    spike_left = F.pad(lo[..., :1], (0, m - 1))  # (*B, p, m): lo_j[0] in the first row
    spike_right = F.pad(up[..., m - 1:m], (m - 1, 0))  # up_j[m-1] in the last row
    solved = torch_kernel.lu_solve(
        lu, pivots, torch.cat([b[..., :m, :], spike_left[..., None], spike_right[..., None]], -1))
    y, v, w = solved[..., :k], solved[..., k:k + 1], solved[..., k + 1:]

    # 3. separator j: lo_s x_j[m-1] + d_s s_j + up_s x_{j+1}[0] = b_s, with x_j = y - v s_{j-1} - w s_j
    lo_s, d_s, up_s, b_s = lo[..., m], d[..., m], up[..., m], b[..., m, :]
    y_next = F.pad(y[..., 1:, 0, :], (0, 0, 0, 1))  # (*B, p, k): y of block j + 1's first row
    v_next = F.pad(v[..., 1:, 0, 0], (0, 1))
    w_next = F.pad(w[..., 1:, 0, 0], (0, 1))
    reduced_diag = d_s - lo_s * w[..., m - 1, 0] - up_s * v_next
    reduced_lower = (-lo_s * v[..., m - 1, 0])[..., 1:]
    reduced_upper = (-up_s * w_next)[..., :-1]
    reduced_rhs = b_s - lo_s[..., None] * y[..., m - 1, :] - up_s[..., None] * y_next
    s = _solve(reduced_lower, reduced_diag, reduced_upper, reduced_rhs, m)

    # 4. recovery, all blocks at once
    s_prev = F.pad(s[..., :-1, :], (0, 0, 1, 0))
    inner = y - v * s_prev[..., None, :] - w * s[..., None, :]
    x = torch.cat([inner, s[..., None, :]], dim=-2).reshape(*batch, p * (m + 1), k)
    return x[..., :n, :].contiguous()  # the strides the op's fake kernel promises


def _row_max(lower, diag, upper) -> torch.Tensor:
    """``(*B, n)``: the largest magnitude in each row of ``A`` (a maximum cannot overflow)."""
    return torch.maximum(diag.abs(), torch.maximum(F.pad(lower.abs(), (1, 0)),
                                                   F.pad(upper.abs(), (0, 1))))


def _answer_is_suspect(lower, diag, upper, rhs, x, probe, x_probe) -> torch.Tensor:
    """True (a 0-dim bool tensor) when a system with finite inputs fails the module's check: a
    row-wise backward error above the tolerance (or not finite) in some column, the caller's or
    the probe's, or ``eps max|A| max|x_probe| > max|probe|``."""
    eps = torch.finfo(x.dtype).eps
    row = _row_max(lower, diag, upper)  # (*B, n)
    b, xs = torch.cat([rhs, probe], dim=-1), torch.cat([x, x_probe], dim=-1)
    residual = diag[..., None] * xs - b
    residual = residual + F.pad(lower[..., None] * xs[..., :-1, :], (0, 0, 1, 0))
    residual = residual + F.pad(upper[..., None] * xs[..., 1:, :], (0, 0, 0, 1))
    # column by column: |r_ik| / (row_i max_j |x_jk| + |b_ik|), divided through by max_j |x_jk|
    # so that nothing overflows
    x_max = xs.abs().amax(-2, keepdim=True)  # (*B, 1, k + 1)
    safe = torch.where(x_max > 0, x_max, torch.ones_like(x_max))
    r = residual.abs()
    error = (r / safe) / (row[..., None] + b.abs() / safe)
    error = torch.where(r == 0, torch.zeros_like(error), error).flatten(-2).amax(-1)
    # eps max|A| max|x_probe| > max|probe| means cond(A) > 1 / eps: A is singular in this
    # precision (a singular A can give a reduced system a pivot of round-off where LAPACK finds
    # an exact zero; the probe's solution then is enormous)
    singular = eps * row.amax(-1) * x_probe.abs().flatten(-2).amax(-1) > probe.abs().amax((-2, -1))
    finite_input = (torch.isfinite(lower).all(-1) & torch.isfinite(diag).all(-1)
                    & torch.isfinite(upper).all(-1) & torch.isfinite(rhs).flatten(-2).all(-1))
    # "not (error <= tol)" is also True for a NaN error: a breakdown (0/0) in a finite system
    return (finite_input & (~(error <= BACKWARD_ERROR_TOL * eps) | singular)).any()
