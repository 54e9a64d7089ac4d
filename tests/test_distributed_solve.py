"""The split solve of :mod:`tridiag_tutorial.distributed.solve` on 2 and 4 gloo processes.

Every multi-process check runs inside ONE spawned job per world size (a module-scoped fixture):
each rank runs the checks of ``CHECKS`` in order and writes, for each check it finished, whether
it passed; each test function below then asserts one check on every rank. The first failure on a
rank (an assertion or any other exception) is recorded with its traceback and ends that worker,
since a rank that left a check early would no longer make the same collectives as the others;
``spawn(join=True)`` then re-raises the worker's error (the others fail in their next collective,
or spawn ends them), the tests of the checks that finished on every rank still pass, and the
others fail with the recorded tracebacks and the job's error. Nothing waits longer than the
collectives' 60 s timeout.

The references are computed on every rank from the whole system, which every rank builds from the
same seed: LAPACK's ``?gtsv`` (``tridiag_tutorial.kernels.lapack``) and the longdouble-refined reference of
``tridiag_tutorial.bench.accuracy``, and for gradients the dense reference (``dense_solve``) and
``torch.autograd.gradcheck`` of a replicated wrapper.
"""

import datetime
import json
import math
import os
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tridiag_tutorial import SingularMatrixError
from tridiag_tutorial import distributed as ds
from tridiag_tutorial.bench import accuracy
from tridiag_tutorial.book.multiprocess import free_port
from tridiag_tutorial.kernels import lapack
from tridiag_tutorial.reference import dense_solve

from conftest import make_system, one_rank_group

WORLD_SIZES = [2, 4]
TIMEOUT = datetime.timedelta(seconds=60)


# ----------------------------------------------------------------------------------------------
# Helpers used inside the workers
# ----------------------------------------------------------------------------------------------
def unequal_sizes(n, world_size):
    """Pieces of clearly different sizes, one of them of the minimum 2 rows on 4 ranks."""
    weights = (1, 2) if world_size == 2 else (1, 4, 0, 2)
    free = n - ds.MIN_ROWS * world_size
    sizes = [ds.MIN_ROWS + free * w // sum(weights) for w in weights]
    sizes[-1] += n - sum(sizes)
    return sizes


def gather_rows(piece, sizes):
    """The whole ``(*B, n, k)`` from every rank's ``(*B, m_r, k)`` (padded to one size); a vector
    ``(m_r,)`` gives ``(n,)``."""
    if piece.ndim == 1:
        return gather_rows(piece[:, None], sizes)[:, 0]
    rows = max(sizes)
    padded = torch.nn.functional.pad(piece, (0, 0, 0, rows - piece.shape[-2]))
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded.contiguous())
    return torch.cat([t[..., :m, :] for t, m in zip(out, sizes)], dim=-2)


def rank_rows(full, sizes, rank):
    """This rank's rows ``(..., m, k)`` of a whole ``(..., n, k)``; of ``(n,)``: ``(m,)``."""
    if full.ndim == 1:
        return rank_rows(full[:, None], sizes, rank)[:, 0]
    s = sum(sizes[:rank])
    return full[..., s:s + sizes[rank], :]


def lapack_error_bound(system, x, what):
    """``x`` (the whole solution) within 10x LAPACK's forward error where LAPACK's is < 1e-2."""
    x_ref = accuracy.reference(*system)
    error = accuracy.forward_error(x, x_ref)
    lapack_error = accuracy.forward_error(lapack.gtsv(*system), x_ref)
    if lapack_error < 1e-2:
        assert error <= 10 * lapack_error, (what, error, lapack_error)
    return error, lapack_error


def with_columns(system, k, seed):
    """``system`` with ``k`` right-hand-side columns (the first one its own)."""
    lower, diag, upper, rhs = system
    if k > 1:
        # the first column times N(0, 1) factors: the rows keep their scale (badly scaled rows)
        extra = np.random.default_rng(seed + 1000).standard_normal((rhs.shape[0], k - 1))
        rhs = np.concatenate([rhs, (rhs * extra).astype(rhs.dtype)], axis=1)
    return lower, diag, upper, rhs


def nearly_singular_piece(system, sizes, rank, seed):
    """``system`` with the block of ``rank``'s piece made singular (its continuant set to zero
    through its last diagonal entry) and then perturbed by a relative ``10^U(-15, -3)``: ``A``
    stays regular, the piece's block nearly is not."""
    lower, diag, upper, rhs = (t.copy() for t in system)
    g = np.random.default_rng(seed)
    s, m = sum(sizes[:rank]), sizes[rank]
    q = float(diag[s])  # ratio of consecutive leading minors of the block
    for j in range(s + 1, s + m - 1):
        q = float(diag[j]) - float(lower[j - 1]) * float(upper[j - 1]) / q
    last = s + m - 1
    diag[last] = float(lower[last - 1]) * float(upper[last - 1]) / q
    diag[last] *= 1 + 10.0 ** g.uniform(-15, -3) * (1 if g.random() < 0.5 else -1)
    return lower, diag, upper, rhs


def solve_pieces(system, sizes, rank, **kwargs):
    """This rank's ``split_solve`` of a NumPy ``system`` ``(n,)`` bands and ``(n, k)`` rhs, and
    the whole solution gathered; ``(x_whole, record)``."""
    tensors = [torch.from_numpy(np.ascontiguousarray(t)) for t in system]
    pieces = ds.split_bands(*tensors, rank, len(sizes), sizes=sizes)
    before = [p.clone() for p in pieces]
    with ds.record() as rec:
        x = ds.split_solve(*pieces, **kwargs)
    for p, b in zip(pieces, before):  # inputs are never modified
        assert torch.equal(p, b) or (p.isnan() == b.isnan()).all()
    assert x.shape == pieces[3].shape
    return gather_rows(x, sizes).numpy(), rec


# ----------------------------------------------------------------------------------------------
# The checks (each runs on every rank, in the same order)
# ----------------------------------------------------------------------------------------------
def check_forward_accuracy(rank, world_size):
    """The families of ``accuracy.py``, float32 and float64, n = 64 and 1000: within 10x LAPACK's
    forward error; equal and unequal pieces and k = 1 and 3 alternate over the cases (each
    family and dtype meets both); the random and dominant families do not fall back (so this
    tests the split method itself, not its fallback)."""
    case = 0
    for n in (64, 1000):
        for family in accuracy.FAMILIES:
            for dtype in (np.float32, np.float64):
                case += 1
                split = ("equal", "unequal")[case % 2]
                sizes = (ds.split_sizes(n, world_size) if split == "equal"
                         else unequal_sizes(n, world_size))
                k = (1, 3)[(case // 2) % 2]
                seed = n + case
                system = with_columns(accuracy.make(family, n, dtype, seed), k, seed)
                x, rec = solve_pieces(system, sizes, rank)
                assert x.dtype == dtype
                lapack_error_bound(system, x, (family, n, dtype, split, k))
                if family in ("random", "dominant"):
                    assert rec.fallbacks == 0, (family, n, dtype, split, k)


def solve_like_lapack(system, sizes, rank, what):
    """Where LAPACK on the whole system raises, the split solve raises on this rank too (a
    LinAlgError with LAPACK's pivot); where LAPACK answers, the split solve answers within 10x its
    error. Returns True where LAPACK raised."""
    try:
        lapack.gtsv(*system)
        expected = None
    except SingularMatrixError as e:
        expected = e
    try:
        x, _ = solve_pieces(system, sizes, rank)
    except torch.linalg.LinAlgError as e:
        assert expected is not None, (what, "raised where LAPACK answers", e)
        assert isinstance(e, SingularMatrixError) and e.pivot == expected.pivot, (what, e)
        return True
    assert expected is None, (what, "answered where LAPACK raises")
    lapack_error_bound(system, x, what)
    return False


def check_nearly_singular_piece(rank, world_size):
    """A piece's block nearly singular (up to a relative 1e-15 to 1e-3): within 10x LAPACK's
    error (or raising where LAPACK raises: rounded to float32 such a matrix can become singular),
    every piece and a 2-row piece included."""
    compared = 0
    for dtype in (np.float32, np.float64):
        for split in ("equal", "unequal"):
            n = 64
            sizes = ds.split_sizes(n, world_size) if split == "equal" else unequal_sizes(n, world_size)
            for seed in range(6):
                bad = seed % world_size
                system = nearly_singular_piece(accuracy.make("random", n, dtype, seed), sizes, bad,
                                               seed)
                compared += not solve_like_lapack(system, sizes, rank, (dtype, split, seed, bad))
    assert compared >= 18


def check_complex(rank, world_size):
    """complex128 and complex64 systems (k = 1 and 3), equal and unequal pieces: the split solve
    agrees with LAPACK on the whole system."""
    for dtype, tol in ((torch.complex128, 1e-12), (torch.complex64, 1e-5)):
        for k, sizes in ((None, ds.split_sizes(30, world_size)), (3, unequal_sizes(30, world_size))):
            lower, diag, upper, rhs = make_system(30, k=k, dtype=dtype, seed=7)
            pieces = ds.split_bands(lower, diag, upper, rhs, rank, world_size, sizes=sizes)
            x = ds.split_solve(*pieces)
            bands = [t.numpy() for t in (lower, diag, upper)]
            expected = torch.from_numpy(lapack.gtsv(*bands, (rhs if k else rhs[:, None]).numpy()))
            mine = rank_rows(expected, sizes, rank)
            got = x if k else x[:, None]
            assert x.dtype == dtype
            assert float((got - mine).abs().max() / expected.abs().max()) < tol


def check_batch(rank, world_size):
    """A batch of 3 systems split alike, with broadcasting (one upper for all), k = 2."""
    lower, diag, upper, rhs = make_system(20, batch=(3,), k=2, seed=3)
    upper = upper[0]
    sizes = unequal_sizes(20, world_size)
    x = ds.split_solve(*ds.split_bands(lower, diag, upper, rhs, rank, world_size, sizes=sizes))
    expected = dense_solve(lower, diag, upper, rhs)
    torch.testing.assert_close(x, rank_rows(expected, sizes, rank), rtol=1e-10, atol=1e-12)


def _zero_first_column(system, sizes, rank):
    """The block of ``rank``'s piece gets a zero first column (so its LU meets an exact zero
    pivot) while ``A`` keeps the coupling ``A[s-1, s]`` in that column: ``A`` is regular."""
    lower, diag, upper, rhs = (t.copy() for t in system)
    s = sum(sizes[:rank])
    diag[s], lower[s] = 0.0, 0.0  # A[s, s] and A[s+1, s]
    upper[s - 1] = 1.5  # A[s-1, s]: the only entry of column s
    return lower, diag, upper, rhs


def check_fallback_on_singular_block(rank, world_size):
    """A piece's block exactly singular, A regular: the call falls back (counted) and returns
    LAPACK's answer on the whole system; in a batch, one such system makes the call fall back and
    both systems are right; a regular system does not fall back."""
    n = 24
    sizes = ds.split_sizes(n, world_size)
    for dtype in (np.float32, np.float64):
        system = _zero_first_column(accuracy.make("random", n, dtype, 5), sizes, 1)
        x, rec = solve_pieces(system, sizes, rank)
        assert rec.fallbacks == 1 and rec.solves == 1
        np.testing.assert_array_equal(x, lapack.gtsv(*system))  # LAPACK's answer, exactly
        x, rec = solve_pieces(accuracy.make("random", n, dtype, 5), sizes, rank)
        assert rec.fallbacks == 0
    good = accuracy.make("random", n, np.float64, 6)
    bad = _zero_first_column(accuracy.make("random", n, np.float64, 7), sizes, world_size - 1)
    batch = [torch.from_numpy(np.stack(parts)) for parts in zip(good, bad)]
    with ds.record() as rec:
        x = ds.split_solve(*ds.split_bands(*batch, rank, world_size))
    assert rec.fallbacks == 1
    for i, system in enumerate((good, bad)):
        lapack_error_bound(system, gather_rows(x[i], sizes).numpy(), i)


def check_singular_raises(rank, world_size):
    """Singular constructions (a zero row, a row half the next, a decoupled rank-1 2 x 2 block)
    at and around every piece boundary and inside a piece: where LAPACK on the whole system
    raises, every rank raises a LinAlgError with LAPACK's pivot; where it answers, so does the
    split solve, within 10x its error."""
    n = 24
    sizes = ds.split_sizes(n, world_size)
    starts = [sum(sizes[:r]) for r in range(1, world_size)]
    # the last two rows of piece 0 and its first row after it, the two rows at every other
    # boundary, and a row inside the first piece
    rows = sorted({starts[0] - 2, 2} | {i for s in starts for i in (s - 1, s)})
    raised = 0
    for family in accuracy.SINGULAR_FAMILIES:
        for dtype in (np.float32, np.float64):
            for row in rows:
                system = accuracy.make(family, n, dtype, seed=row, row=row)
                raised += solve_like_lapack(system, sizes, rank, (family, dtype, row))
    assert raised >= len(rows)  # the exact constructions do raise


def check_non_finite(rank, world_size):
    """NaN in, NaN out, in its own system of a batch: a NaN band entry on the last rank makes its
    system NaN on every rank, an inf in one rhs column on rank 0 makes that column NaN, a NaN in a
    coupling entry its system; the other systems and columns are right, and nothing hangs."""
    n = 16
    sizes = ds.split_sizes(n, world_size)
    lower, diag, upper, rhs = make_system(n, batch=(4,), k=2, seed=11)
    diag[1, n - 3] = math.nan  # system 1: on the last rank
    rhs[2, 1, 1] = math.inf  # system 2, column 1: on rank 0
    upper[3, sizes[0] - 1] = math.nan  # system 3: the coupling of rank 0 to rank 1
    pieces = ds.split_bands(lower, diag, upper, rhs, rank, world_size)
    with ds.record() as rec:
        x = ds.split_solve(*pieces)
    assert rec.fallbacks == 0
    assert x[1].isnan().all() and x[3].isnan().all() and x[2, :, 1].isnan().all()
    expected = dense_solve(lower[0], diag[0], upper[0], rhs[0])
    torch.testing.assert_close(x[0], rank_rows(expected, sizes, rank), rtol=1e-10, atol=1e-12)
    expected = dense_solve(lower[2], diag[2], upper[2], rhs[2, :, :1])
    torch.testing.assert_close(x[2, :, :1], rank_rows(expected, sizes, rank), rtol=1e-10,
                               atol=1e-12)
    # one system, a NaN right-hand side entry on rank 1: all NaN there, and the same with grad
    l1, d1, u1, b1 = make_system(n, seed=12)
    b1[sizes[0]] = math.nan
    x = ds.split_solve(*ds.split_bands(l1, d1, u1, b1, rank, world_size))
    assert x.isnan().all()
    pieces = [p.detach().requires_grad_() for p in ds.split_bands(l1, d1, u1, b1, rank, world_size)]
    ds.split_solve(*pieces).sum().backward()
    assert pieces[0].grad is not None  # the backward ran on every rank (NaN gradients)


def _refused(rank, world_size, bad_rank, change, error, local_words, what):
    """Every rank calls split_solve with good pieces, except that ``bad_rank`` applies
    ``change``; every rank must raise ``error``: the bad rank with its own message (containing
    ``local_words``), the others naming ``bad_rank`` (or, for a disagreement, all the same)."""
    lower, diag, upper, rhs = make_system(4 * world_size, seed=2)
    pieces = list(ds.split_bands(lower, diag, upper, rhs, rank, world_size))
    if rank == bad_rank:
        pieces = change(pieces)
    with pytest.raises(error) as info:
        ds.split_solve(*pieces)
    message = str(info.value)
    if rank == bad_rank or "every rank must" in message:
        assert local_words in message, (what, message)
    else:
        assert f"rank {bad_rank}" in message and local_words in message, (what, message)


def check_bad_input(rank, world_size):
    """Bad input on one rank raises on every rank, with the same kind of error and a message that
    says which rank and what; the group still works afterwards."""
    last = world_size - 1
    nonzero = 1.0

    def set_entry(index, position, value):
        def change(p):
            p = [t.clone() for t in p]
            p[index][position] = value
            return p
        return change

    cases = [
        (0, set_entry(0, 0, nonzero), ValueError, "lower[..., 0] must be 0", "rank 0 coupling"),
        (last, set_entry(2, -1, nonzero), ValueError, "upper[..., -1] must be 0", "last coupling"),
        (1, lambda p: [t[:1] for t in p], ValueError, "at least 2 rows", "one row"),
        (1, lambda p: [t.float() for t in p], TypeError, "same dtype", "dtype across ranks"),
        (1, lambda p: [t.long() for t in p], TypeError, "not supported", "integer dtype"),
        (1, lambda p: [p[0], p[1].float(), p[2], p[3]], TypeError, "same dtype", "mixed dtype"),
        (1, lambda p: p[:3] + [torch.stack([p[3], p[3]], -1)], ValueError, "same kind",
         "k across ranks"),
        (1, lambda p: [t.expand(2, -1) for t in p], ValueError, "batch shape", "batch across ranks"),
        (1, lambda p: [p[0][1:]] + p[1:], ValueError, "rows", "band length"),
        (1, lambda p: [p[0], p[1].tolist(), p[2], p[3]], TypeError, "torch.Tensor", "a list"),
        (1, lambda p: p[:3] + [p[3].clone().requires_grad_()], ValueError, "require grad",
         "requires_grad on one rank"),
        (1, lambda p: p[:3] + [p[3][:-1]], ValueError, "rows", "rhs length"),
    ]
    for bad_rank, change, error, words, what in cases:
        _refused(rank, world_size, bad_rank, change, error, words, what)
    with pytest.raises(ValueError, match="refinement_steps"):
        ds.split_solve(*make_system(8, seed=0)[:4], refinement_steps=-1)
    # the group is still in step: a good solve works
    lower, diag, upper, rhs = make_system(4 * world_size, seed=2)
    x = ds.split_solve(*ds.split_bands(lower, diag, upper, rhs, rank, world_size))
    expected = dense_solve(lower, diag, upper, rhs)[:, None]
    torch.testing.assert_close(x[:, None], rank_rows(expected, ds.split_sizes(len(diag), world_size),
                                                     rank))


def _local_loss_grads(full, weight, sizes, rank, solve=ds.split_solve):
    """Gradients of this rank's piece of ``sum(weight * x)`` w.r.t. its four pieces."""
    pieces = [p.detach().clone().requires_grad_()
              for p in ds.split_bands(*full, rank, len(sizes), sizes=sizes)]
    x = solve(*pieces)
    w = ds.split_bands(*full[:3], weight, rank, len(sizes), sizes=sizes)[3]
    loss = (w.conj() * x).real.sum()
    return torch.autograd.grad(loss, pieces)


def check_gradients_match_dense(rank, world_size):
    """The four local gradients equal the pieces of the single-process (dense reference)
    gradients of the same loss (its pieces summed over the ranks): float64 and complex128,
    vector and k = 3, equal and unequal pieces, a batch, and through the fallback."""
    cases = [(torch.float64, None, (), "equal"), (torch.float64, 3, (), "unequal"),
             (torch.complex128, 2, (), "unequal"), (torch.float64, 2, (2,), "equal"),
             (torch.float64, None, (), "fallback")]
    n = 4 * world_size + 3
    for dtype, k, batch, split in cases:
        sizes = unequal_sizes(n, world_size) if split == "unequal" else ds.split_sizes(n, world_size)
        full = make_system(n, batch=batch, k=k, dtype=dtype, seed=21)
        if split == "fallback":
            system = _zero_first_column(tuple(t.numpy() for t in full), sizes, 1)
            full = [torch.from_numpy(t) for t in system]
        weight = make_system(n, batch=batch, k=k, dtype=dtype, seed=22)[3]
        with ds.record() as rec:
            grads = _local_loss_grads(full, weight, sizes, rank)
        assert rec.solves == 2 and rec.fallbacks == (2 if split == "fallback" else 0), split
        leaves = [t.clone().requires_grad_() for t in full]
        loss = (weight.conj() * dense_solve(*leaves)).real.sum()
        expected = ds.split_bands(*torch.autograd.grad(loss, leaves), rank, world_size,
                                  sizes=sizes)
        for name, g, e in zip(("lower", "diag", "upper", "rhs"), grads, expected):
            assert g.shape == e.shape, name
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")
        if rank == 0:
            assert (grads[0][..., 0] == 0).all()  # not an entry of A
    # double backward is refused, with an error
    full = make_system(n, seed=23)
    pieces = [p.detach().clone().requires_grad_() for p in ds.split_bands(*full, rank, world_size)]
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(ds.split_solve(*pieces).sum(), pieces, create_graph=True)


class _SumGrad(torch.autograd.Function):
    """Identity on the replicated whole inputs; the backward sums every rank's gradient (each rank
    fills only the entries of its own piece), which is the gradient of the replicated function."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g in grads:
            g = g.contiguous().clone()
            dist.all_reduce(g)
            out.append(g)
        return tuple(out)


class _GatherRows(torch.autograd.Function):
    """This rank's rows -> the whole solution on every rank; the backward keeps this rank's rows
    of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, piece, sizes, rank):
        ctx.sizes, ctx.rank = sizes, rank
        return gather_rows(piece, sizes)

    @staticmethod
    def backward(ctx, grad):
        return rank_rows(grad, ctx.sizes, ctx.rank).contiguous(), None, None


def check_gradcheck(rank, world_size):
    """gradcheck of the replicated function whole inputs -> whole x: every rank perturbs the same
    entries in the same order, so the collectives stay in step, and _SumGrad / _GatherRows make the
    replicated function's backward out of the split one. float64 in full on 2 ranks (one forward
    per perturbed entry: about 10 collectives each), its fast mode (a random projection of the
    Jacobian) on 4 ranks, where a collective costs about 10 times more on a 2-core machine, and for
    complex128 (whose full check runs several times as many)."""
    n = 2 * world_size + 1
    sizes = unequal_sizes(n, world_size)

    def f(lower, diag, upper, rhs):
        pieces = ds.split_bands(*_SumGrad.apply(lower, diag, upper, rhs), rank, world_size,
                                sizes=sizes)
        return _GatherRows.apply(ds.split_solve(*pieces), sizes, rank)

    for dtype, k in ((torch.float64, None), (torch.complex128, 2)):
        inputs = make_system(n, k=k, dtype=dtype, seed=31, requires_grad=True)
        fast = world_size > 2 or dtype.is_complex
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, fast_mode=fast)


def check_communication(rank, world_size):
    """The bytes each rank contributes and sends, measured by record(), equal communication()'s
    formula: with and without refinement, float32, float64 and complex128, k = 1 and 3, and the
    whole-system gather; a backward is the same split solve (with A^H, not validated again) and
    one gather of the neighbours' couplings and boundary rows."""
    n = 40
    for dtype in (torch.float32, torch.float64, torch.complex128):
        for k in (1, 3):
            full = make_system(n, k=k, dtype=dtype, seed=41, dominant=True)
            pieces = ds.split_bands(*full, rank, world_size)
            for route, solve in (("split_solve", lambda: ds.split_solve(*pieces)),
                                 ("split_solve_no_refinement",
                                  lambda: ds.split_solve(*pieces, refinement_steps=0)),
                                 ("gather_solve", lambda: ds.gather_solve(*pieces))):
                with ds.record() as rec:
                    solve()
                expected = ds.communication(n, world_size, k=k, dtype=dtype)[route]
                assert rec.fallbacks == 0
                assert (rec.bytes_contributed, rec.bytes_sent, len(rec.collectives)) == (
                    expected["contributed"], expected["sent"], expected["collectives"]), route
            leaves = [p.detach().clone().requires_grad_() for p in pieces]
            x = ds.split_solve(*leaves)
            with ds.record() as rec:
                x.real.sum().backward()
            values = 2 if dtype.is_complex else 1
            real = torch.empty((), dtype=dtype).real.element_size()
            neighbours = (2 + 2 * k) * values * real  # lower[0], upper[-1] and two rows of x
            formula = ds.communication(n, world_size, k=k, dtype=dtype)
            backward = (formula["split_solve"]["contributed"]
                        - formula["validation"]["contributed"] + neighbours)  # A^H: not validated
            assert rec.bytes_contributed == backward
            assert rec.bytes_sent == backward * (world_size - 1)
            assert len(rec.collectives) == formula["split_solve"]["collectives"]
    # the gather route's bytes at n = 1e6, float64, k = 1: four columns of 1e6 / P rows of 8 bytes
    big = ds.communication(10**6, world_size)["gather_system"]
    assert big["contributed"] == 4 * (10**6 // world_size) * 8
    assert big["sent"] == 4 * (10**6 // world_size) * 8 * (world_size - 1)


SPLIT_PHASES = ["split: probes and finiteness", "split: 1. block factor and solve",
                "split: 2. all_gather of the ends", "split: 3. reduced system and recovery"]
REFINEMENT_PHASES = ["split: 4. refinement: all_gathers",
                     "split: 4. refinement: residual in double-double",
                     "split: 4. refinement: block solve",
                     "split: 4. refinement: reduced system and recovery"]
GATHER_PHASES = ["gather: pack", "gather: all_gather of the whole system",
                 "gather: assemble on the host", "gather: LAPACK on the whole system",
                 "gather: keep the rank's rows"]


def check_phase_times(rank, world_size):
    """record() times each route's phases, in the order they run, inside the call: the split
    solve with and without refinement, the gather, a fallback (the split phases up to the failed
    check, then the gather's); the phases are disjoint, so they sum to at most the call; nested
    records both see a call; the residual in double-double is built only when refining, once;
    a solve outside record() leaves no trace."""
    pieces = ds.split_bands(*make_system(4000, dtype=torch.float64, seed=43, dominant=True),
                            rank, world_size)
    routes = {"split": (lambda: ds.split_solve(*pieces),
                        SPLIT_PHASES + REFINEMENT_PHASES + ["split: 5. checks"]),
              "no refinement": (lambda: ds.split_solve(*pieces, refinement_steps=0),
                                SPLIT_PHASES + ["split: 5. checks"]),
              "gather": (lambda: ds.gather_solve(*pieces), GATHER_PHASES)}
    for route, (solve, phases) in routes.items():
        with ds.record() as outer:
            with ds.record() as rec:
                solve()
            solve()
        assert list(rec.seconds) == ["call", "validate", *phases], (route, list(rec.seconds))
        assert all(t > 0 for t in rec.seconds.values()), (route, rec.seconds)
        inside = sum(t for name, t in rec.seconds.items() if name != "call")
        assert inside <= rec.seconds["call"], (route, rec.seconds)
        assert outer.seconds["call"] > rec.seconds["call"]  # two calls against one
    # the double-double residual is built only where it is used: once per refined solve
    built = []
    original = ds.solve.partitioned._Residual

    class Counting(original):
        def __init__(self, *args):
            built.append(1)
            super().__init__(*args)

    ds.solve.partitioned._Residual = Counting
    try:
        ds.split_solve(*pieces, refinement_steps=0)
        assert built == [], "refinement_steps=0 built the residual"
        ds.split_solve(*pieces, refinement_steps=3)
        assert built == [1], built
    finally:
        ds.solve.partitioned._Residual = original
    before = len(ds.solve._RECORDS)
    ds.split_solve(*pieces)
    assert len(ds.solve._RECORDS) == before == 0
    sizes = ds.split_sizes(24, world_size)
    system = _zero_first_column(accuracy.make("random", 24, np.float64, 5), sizes, 1)
    _, rec = solve_pieces(system, sizes, rank)
    assert rec.fallbacks == 1
    assert list(rec.seconds) == ["call", "validate", *SPLIT_PHASES[:3], *GATHER_PHASES], list(
        rec.seconds)


CHECKS = [check_forward_accuracy, check_nearly_singular_piece, check_complex, check_batch,
          check_fallback_on_singular_block, check_singular_raises, check_non_finite,
          check_bad_input, check_gradients_match_dense, check_gradcheck, check_communication,
          check_phase_times]


def _worker(rank, world_size, port, folder):
    """Run every check in order on this rank. The first failure (an assertion or any other
    exception) is recorded with its traceback and ends the worker: a rank that left a check early
    would make different collectives from the others, so no later check could be trusted (the
    others then fail in their next collective, or are ended by spawn)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    results, seconds = {}, {}
    try:
        for check in CHECKS:
            start = time.perf_counter()
            try:
                check(rank, world_size)
            except BaseException:
                results[check.__name__] = traceback.format_exc()
                raise
            results[check.__name__] = None
            seconds[check.__name__] = round(time.perf_counter() - start, 2)
    finally:
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(dict(results=results, seconds=seconds), f)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"{p}ranks")
def job(request, tmp_path_factory):
    """One spawned job per world size: ``(results, crash, world_size)``, ``results`` every rank's
    ``{check: None (passed) | traceback}`` for the checks it ran, ``crash`` the error spawn
    re-raised (with the failing worker's traceback) or None."""
    world_size = request.param
    folder = str(tmp_path_factory.mktemp(f"split{world_size}"))
    crash = None
    try:
        mp.spawn(_worker, args=(world_size, free_port(), folder), nprocs=world_size, join=True)
    except Exception as e:  # spawn's ProcessRaisedException / ProcessExitedException
        crash = e
    results = {}
    for rank in range(world_size):
        path = os.path.join(folder, f"rank{rank}.json")
        if os.path.exists(path):  # a rank ended by spawn after another failed writes nothing
            with open(path) as f:
                results[rank] = json.load(f)
    if 0 in results:
        print(f"seconds per check on rank 0 of {world_size}: {results[0]['seconds']}")
    return {rank: r["results"] for rank, r in results.items()}, crash, world_size


def _assert_passed(job, check):
    """``check`` passed on every rank; otherwise fail with the tracebacks of the ranks where it
    failed, or, where it did not run to its end, with the error of the job."""
    results, crash, world_size = job
    name = check.__name__
    failures = {rank: r[name] for rank, r in results.items() if r.get(name)}
    assert not failures, "\n".join(f"rank {rank}:\n{tb}" for rank, tb in failures.items())
    passed = [rank for rank, r in results.items() if name in r]
    if len(passed) < world_size:
        first = {rank: next((c for c, tb in r.items() if tb), None) for rank, r in results.items()}
        pytest.fail(f"{name} did not run to its end on every rank (ranks that passed it: "
                    f"{passed}; the first failed check of each rank: {first}); the job's error:\n"
                    f"{crash}", pytrace=False)


def test_forward_within_ten_times_lapack(job):
    _assert_passed(job, check_forward_accuracy)


def test_nearly_singular_piece_within_ten_times_lapack(job):
    _assert_passed(job, check_nearly_singular_piece)


def test_complex_matches_lapack(job):
    _assert_passed(job, check_complex)


def test_batch_with_broadcasting(job):
    _assert_passed(job, check_batch)


def test_fallback_where_a_piece_is_singular(job):
    _assert_passed(job, check_fallback_on_singular_block)


def test_singular_matrix_raises_on_every_rank(job):
    _assert_passed(job, check_singular_raises)


def test_non_finite_in_its_own_system(job):
    _assert_passed(job, check_non_finite)


def test_bad_input_raises_on_every_rank(job):
    _assert_passed(job, check_bad_input)


def test_gradients_match_dense(job):
    _assert_passed(job, check_gradients_match_dense)


def test_gradcheck_of_replicated_wrapper(job):
    _assert_passed(job, check_gradcheck)


def test_bytes_match_the_formula(job):
    _assert_passed(job, check_communication)


# ----------------------------------------------------------------------------------------------
# Single-process tests: the layout helpers and the errors that need no group
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [None, [2, 7, 3]])
def test_split_bands_cuts_the_whole_system(sizes):
    """The pieces hold the whole system's entries in the documented layout (couplings at the
    ends, zero at the ends of the system), and the rows split as torch.tensor_split does."""
    n, world_size = 12, 3
    lower, diag, upper, rhs = make_system(n, k=2, seed=1)
    A = torch.diag(diag) + torch.diag(lower, -1) + torch.diag(upper, 1)
    expected_sizes = [len(t) for t in torch.tensor_split(torch.arange(n), world_size)]
    assert ds.split_sizes(n, world_size) == expected_sizes
    sizes_used = sizes or expected_sizes
    s = 0
    for rank, m in enumerate(sizes_used):
        lo, d, up, b = ds.split_bands(lower, diag, upper, rhs, rank, world_size, sizes=sizes)
        for j in range(m):
            i = s + j
            assert lo[j] == (A[i, i - 1] if i > 0 else 0)
            assert d[j] == A[i, i]
            assert up[j] == (A[i, i + 1] if i < n - 1 else 0)
        torch.testing.assert_close(b, rhs[s:s + m])
        s += m


def test_split_bands_refuses_bad_pieces():
    lower, diag, upper, rhs = make_system(5, seed=1)
    with pytest.raises(ValueError, match="at least 2 rows"):
        ds.split_bands(lower, diag, upper, rhs, 0, 3)
    with pytest.raises(ValueError, match="summing to n = 5"):
        ds.split_bands(lower, diag, upper, rhs, 0, 2, sizes=[2, 2])
    with pytest.raises(ValueError, match="rank must be"):
        ds.split_bands(lower, diag, upper, rhs, 2, 2)


def test_split_solve_needs_an_initialized_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ds.split_solve(*make_system(4, seed=0))


def test_communication_formula_scales():
    """The split solve's bytes do not depend on n; the whole-system gather's grow with n / P."""
    small, large = ds.communication(1000, 4), ds.communication(10**6, 4)
    assert small["split_solve"] == large["split_solve"]
    assert small["split_solve"]["contributed"] > small["split_solve_no_refinement"]["contributed"]
    assert large["gather_system"]["contributed"] == 1000 * small["gather_system"]["contributed"]


def test_gradients_of_broadcast_bands_are_summed_over_the_batch():
    """Bands ``(1, m)`` beside a right-hand side ``(3, m)`` broadcast inside the split solve, so
    their gradients are sums over the batch, as ``tridiagonal_solve``'s are: checked in a group of
    one rank in this process (the split solve with P = 1 is the reduced system of one piece)."""
    with one_rank_group():
        g = torch.Generator().manual_seed(5)
        n = 9
        lower, upper = (torch.randn(1, n - 1, generator=g, dtype=torch.float64) for _ in "lu")
        diag = 4 + torch.rand(1, n, generator=g, dtype=torch.float64)
        rhs = torch.randn(3, n, generator=g, dtype=torch.float64)
        pieces = ds.split_bands(lower, diag, upper, rhs, 0, 1)  # expands the bands to (3, n)
        local = [p[:1].clone().requires_grad_() for p in pieces[:3]]
        local.append(pieces[3].clone().requires_grad_())
        whole = [t.clone().requires_grad_() for t in (lower, diag, upper, rhs)]
        x, expected = ds.split_solve(*local), dense_solve(*whole)
        weights = torch.randn(x.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad((x * weights).sum(), local)
        want = torch.autograd.grad((expected * weights).sum(), whole)
        torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
        assert [t.shape for t in grads] == [(1, n)] * 3 + [(3, n)]
        # the local layout's lower[0] and upper[-1] are the (absent) couplings: gradient zero
        assert grads[0][..., 0].abs().max() == 0 and grads[2][..., -1].abs().max() == 0
        for got, ref in ((grads[0][..., 1:], want[0]), (grads[1], want[1]),
                         (grads[2][..., :-1], want[2]), (grads[3], want[3])):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_the_communication_harness_measures_the_formula(capsys):
    """python -m tridiag_tutorial.bench.communication: the bytes each route sent on two gloo
    processes are the formula's, and its answers agree with the gathered LAPACK solve."""
    from tridiag_tutorial.bench import communication

    rows = communication.main(["--n", "2000", "--world-sizes", "2"])
    assert {r["route"] for r in rows} == {"gather_solve", "split_solve", "split_solve_no_refinement"}
    assert all(r["matches"] and r["sent"] == r["formula_sent"] for r in rows)
    assert all(r["max_difference_from_lapack"] < 1e-10 for r in rows)
    assert len(capsys.readouterr().out.splitlines()) == len(rows)


@pytest.mark.slow  # reads the spawned jobs, as the tests SLOW_TESTS names in tests/conftest.py
def test_record_times_each_phase(job):
    _assert_passed(job, check_phase_times)


def test_torch_func_transforms_and_tangents_are_refused_with_the_remedy():
    """split_solve and gather_solve are Functions for ordinary reverse mode: under a torch.func
    transform or with a tangent on an input they raise, naming the call and what to use instead
    (torch's own error names neither), before any collective; in a dual level without tangents,
    and with ordinary autograd, they still solve (against the dense solve)."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

    with one_rank_group():
        g = torch.Generator().manual_seed(7)
        n = 8
        lower, upper = (torch.randn(n - 1, generator=g, dtype=torch.float64) for _ in "lu")
        diag = 4 + torch.rand(n, generator=g, dtype=torch.float64)
        rhs = torch.randn(n, generator=g, dtype=torch.float64)
        lo, d, up, b = ds.split_bands(lower, diag, upper, rhs, 0, 1)
        expected = dense_solve(lower, diag, upper, rhs)
        ones = torch.ones_like(d)
        for solve, name in ((ds.split_solve, "split_solve"), (ds.gather_solve, "gather_solve")):
            of_d = lambda x: solve(lo, x, up, b)  # noqa: E731
            cases = {
                "grad": lambda: grad(lambda x: of_d(x).pow(2).sum())(d),
                "vmap": lambda: vmap(lambda r: solve(lo, d, up, r))(b.expand(3, -1).clone()),
                "jvp": lambda: jvp(of_d, (d,), (ones,)),
                "jacrev": lambda: jacrev(of_d)(d),
                "jacfwd": lambda: jacfwd(of_d)(d),
                "hessian": lambda: hessian(lambda x: of_d(x).pow(2).sum())(d),
            }
            for case, call in cases.items():
                with pytest.raises(NotImplementedError, match=f"^{name}: torch.func transforms"):
                    call()
            with fwAD.dual_level():
                with pytest.raises(NotImplementedError, match=f"^{name}: torch.func transforms"):
                    solve(lo, fwAD.make_dual(d, ones), up, b)
                torch.testing.assert_close(solve(lo, d, up, b), expected, rtol=1e-12, atol=1e-12)
            x = d.clone().requires_grad_()
            (solve(lo, x, up, b) * expected).sum().backward()
            dense_x = diag.clone().requires_grad_()
            (dense_solve(lower, dense_x, upper, rhs) * expected).sum().backward()
            torch.testing.assert_close(x.grad, dense_x.grad, rtol=1e-10, atol=1e-12)


def compiled_split_solve_worker(rank, world_size, system):
    """The split solve of one rank's rows eagerly and under torch.compile (aot_eager), without and
    with fullgraph, and the gradient of a loss through the compiled call."""
    pieces = ds.split_bands(*system, rank, world_size)
    out = {"eager": ds.split_solve(*pieces)}
    torch.compiler.reset()
    diag = pieces[1].clone().requires_grad_()  # one compilation serves the solution and the gradient
    x = torch.compile(ds.split_solve, backend="aot_eager")(pieces[0], diag, pieces[2], pieces[3])
    x.pow(2).sum().backward()
    out["compiled"], out["compiled grad"] = x.detach(), diag.grad
    torch.compiler.reset()
    try:
        torch.compile(ds.split_solve, backend="aot_eager", fullgraph=True)(*pieces)
        out["fullgraph"] = "ran"
    except Exception as error:  # noqa: BLE001  (what each rank saw is compared below)
        out["fullgraph"] = type(error).__name__ + ": " + str(error).splitlines()[0]
    torch.compiler.reset()
    return out


@pytest.mark.slow
def test_the_split_solve_under_torch_compile_is_right_on_two_ranks_or_refused_on_both():
    """torch.compile of split_solve breaks its graph at the data-dependent checks and runs the
    collectives as in eager code: the solution and the gradient match the dense solve's; under
    fullgraph=True every rank raises (a data-dependent guard), none hangs or answers."""
    from tridiag_tutorial.book.multiprocess import run_on_ranks

    g = torch.Generator().manual_seed(3)
    n = 40
    lower, upper = (torch.randn(n - 1, generator=g, dtype=torch.float64) for _ in "lu")
    diag = 4 + torch.rand(n, generator=g, dtype=torch.float64)
    rhs = torch.randn(n, generator=g, dtype=torch.float64)
    expected = dense_solve(lower, diag, upper, rhs)
    whole = diag.clone().requires_grad_()
    dense_solve(lower, whole, upper, rhs).pow(2).sum().backward()
    ranks = run_on_ranks(compiled_split_solve_worker, 2, (lower, diag, upper, rhs), timeout=300)
    for key, want in (("eager", expected), ("compiled", expected), ("compiled grad", whole.grad)):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), want, rtol=1e-10, atol=1e-12)
    assert all(r["fullgraph"] != "ran" and "data-dependent" in r["fullgraph"] for r in ranks), \
        [r["fullgraph"] for r in ranks]
