"""The C++ kernel's pieces solve for one large real system (csrc/pieces.h,
``solve_pieces``): ``cpp_solve``, and so ``driver=None``, from ``compiled.PIECES_MIN_N``
unknowns; ``compiled.solve_ex`` from any size.

Its answers are not ?gtsv's bits. On the families it is meant for they must come from it (no
fallback) with a forward error within 10 times SciPy ?gtsv's (against ``accuracy.reference``);
below ``PIECES_MIN_N`` they are ?gtsv's bits. Where it hands a system back (Poisson's matrix from
8 tiles on, a singular matrix, NaN or infinity) the answer is ?gtsv's bits, or its pivot in
``SingularMatrixError``, and one fallback is counted. Also: inputs unchanged, non-contiguous
inputs, thread counts, small batches, gradients, the 16-byte lanes, memory given back.

Bitwise means the bits: values are compared as integers (so -0.0 differs from 0.0), and NaN
only in where it is (its payload is not compared)."""

import contextlib
import gc
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy.linalg import lapack as scipy_lapack

from tridiag_tutorial import SingularMatrixError, tridiagonal_solve
from tridiag_tutorial.bench import accuracy
from tridiag_tutorial.kernels import compiled

from conftest import REAL_DTYPES, assert_grads_match_dense, make_system, require_cpp

T = torch.ops.tridiag_tutorial
GTSV = {torch.float32: scipy_lapack.sgtsv, torch.float64: scipy_lapack.dgtsv}
NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
LANES = {torch.float32: 16, torch.float64: 8}  # W: pieces side by side; a batch of W: a block
SEQUENTIAL = 2**62  # pieces_min_n that keeps every system on the sequential kernel
MIN_N = compiled.PIECES_MIN_N
SIZES = [MIN_N - 1, MIN_N, 4099, 10_007, 100_003]
# families that the pieces kernel must solve alone (no fallback), within 10 times ?gtsv's error
FAMILIES = ["dominant", "pivoting", "heat_1", "heat_1e2", "heat_1e4", "near_toeplitz",
            "scaled_rows", "nearly_singular_block"]
# families it may hand back (then: ?gtsv's bits)
HARD_FAMILIES = ["zero_diagonal", "normal", "near_singular_join", "slowly_forgetting_1e-2",
                 "slowly_forgetting_1e-4", "slowly_forgetting_0"]
SCALE_EXPONENT = {torch.float32: 30, torch.float64: 100}  # scaled_rows: 10^(-e..e)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _cpp():
    require_cpp()


# ----------------------------------------------------------------------------------------------
# Helpers: piece sizes, the families of matrices, SciPy's ?gtsv, errors, bitwise comparison.
# ----------------------------------------------------------------------------------------------
def ceil_div(a, b):
    return -(-a // b)


def piece_rows(n, dtype):
    """Rows per piece m (the rule of solve_pieces, only to place test rows at piece boundaries):
    P = W pieces or n / 512, rounded up to a multiple of W, m = n / P rounded up to a multiple of
    8, more pieces while m is close to a multiple of 4 KiB."""
    width, size = LANES[dtype], torch.finfo(dtype).bits // 8
    pieces = ceil_div(max(width, ceil_div(n, 512)), width) * width
    m = ceil_div(ceil_div(n, pieces), 8) * 8
    while m * size > 4096 - 512 and not 512 <= (m * size) % 4096 <= 4096 - 512:
        pieces += width
        m = ceil_div(ceil_div(n, pieces), 8) * 8
    return m


def middle_boundary(n, dtype):
    """The first row of the piece nearest the middle."""
    m = piece_rows(n, dtype)
    return max(m, round(n / 2 / m) * m)


@contextlib.contextmanager
def num_threads(threads):
    """torch's thread count set to ``threads`` inside the block, restored after it."""
    original = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(original)


def make_family(family, n, dtype, k=None, seed=0):
    """``(lower, diag, upper, rhs)`` of one system (torch tensors of ``dtype``); ``rhs`` ``(n,)``
    if k is None, else ``(n, k)``, N(0, 1) (row-scaled with the rows for scaled_rows).

    - dominant, pivoting (accuracy.make's "random"), nearly_singular_block, zero_diagonal:
      :func:`tridiag_tutorial.bench.accuracy.make`;
    - heat_R: I + R tridiag(-1, 2, -1), an implicit heat step;
    - near_toeplitz: tridiag(-1, 2.001, -1); poisson: tridiag(-1, 2, -1);
    - scaled_rows: pivoting with row i and its right-hand side times 10^(t_i + U(-1, 1)), t_i
      going evenly from -e to e (e = 100 in float64, 30 in float32);
    - normal: every entry N(0, 1) (many interchanges, tiny pivots);
    - near_singular_join: pivoting with a block of 4 rows across the middle piece boundary (rows
      b - 2 to b + 1), cut off below in the lower band, whose determinant is zero up to a relative
      10^U(-15, -3): a tiny pivot where two pieces meet;
    - slowly_forgetting_M: diagonal 2 + M, off-diagonals -(1 + 0.01 N): elimination forgets its
      start slowly (M = 0: close to Poisson's matrix).
    """
    g = np.random.default_rng([seed, 7])
    rhs = g.standard_normal((n, 1 if k is None else k))
    row = 0 if n < 6 else None  # (make draws a row in [2, n - 3) unless given one)
    if family in ("dominant", "nearly_singular_block", "zero_diagonal"):
        lower, diag, upper, _ = accuracy.make(family, n, np.float64, seed, row)
    elif family in ("pivoting", "scaled_rows", "near_singular_join"):
        lower, diag, upper, _ = accuracy.make("random", n, np.float64, seed, row)
    elif family.startswith("heat_"):
        r = float(family[5:])
        lower, upper, diag = np.full(n - 1, -r), np.full(n - 1, -r), np.full(n, 1 + 2 * r)
    elif family == "near_toeplitz":
        lower, upper, diag = np.full(n - 1, -1.0), np.full(n - 1, -1.0), np.full(n, 2.001)
    elif family == "poisson":
        lower, upper, diag = np.full(n - 1, -1.0), np.full(n - 1, -1.0), np.full(n, 2.0)
    elif family == "normal":
        lower, diag, upper = (g.standard_normal(size) for size in (n - 1, n, n - 1))
    elif family.startswith("slowly_forgetting_"):
        lower, upper = (-(1 + 0.01 * g.standard_normal(n - 1)) for _ in range(2))
        diag = np.full(n, 2.0 + float(family.rsplit("_", 1)[1]))
    else:
        raise ValueError(family)
    if family == "scaled_rows":
        e = SCALE_EXPONENT[dtype]
        scale = 10.0 ** np.clip(np.linspace(-e, e, n) + g.uniform(-1, 1, n), -e, e)
        lower, diag, upper = lower * scale[1:], diag * scale, upper * scale[:-1]
        rhs = rhs * scale[:, None]
    elif family == "near_singular_join":
        a = middle_boundary(n, dtype) - 2  # the block's first row; lower[a - 1] = A[a, a - 1]
        lower[a - 1], lower[a + 3] = 0.0, 0.0  # block upper triangular: det = product of pivots
        f_prev, f = 1.0, diag[a]  # continuants: the leading minors of the block
        for r in range(a + 1, a + 3):
            f_prev, f = f, diag[r] * f - lower[r - 1] * upper[r - 1] * f_prev
        last = a + 3
        diag[last] = (lower[last - 1] * upper[last - 1] * f_prev / f
                      * (1 + (1 if g.random() < 0.5 else -1) * 10.0 ** g.uniform(-15, -3)))
    out = [torch.from_numpy(np.ascontiguousarray(t, dtype=NUMPY[dtype]))
           for t in (lower, diag, upper, rhs)]
    if k is None:
        out[3] = out[3][:, 0].contiguous()
    return out


def gtsv(lower, diag, upper, rhs):
    """SciPy's ?gtsv on one system: ``(x, info)``, x None where info > 0 (a zero pivot)."""
    *_, x, info = GTSV[diag.dtype](*(t.detach().numpy() for t in (lower, diag, upper, rhs)))
    assert info >= 0
    return (None if info > 0 else torch.from_numpy(np.ascontiguousarray(x))), int(info)


def assert_within_ten_times_lapack(args, x, what=""):
    """``max|x - x_ref| / max|x_ref|`` at most 10 times ?gtsv's on the same input (or 10 times
    4 eps, where ?gtsv's is smaller), x_ref from accuracy.reference (refined in longdouble)."""
    lower, diag, upper, rhs = (t.detach().numpy() for t in args)
    n = diag.shape[0]
    columns = rhs.reshape(n, -1)
    x_ref = accuracy.reference(lower, diag, upper, columns)
    expected, info = gtsv(*args)
    assert info == 0, f"{what}: ?gtsv reports a zero pivot at {info - 1}"
    lapack_error = accuracy.forward_error(expected.numpy().reshape(n, -1), x_ref)
    error = accuracy.forward_error(x.detach().numpy().reshape(n, -1), x_ref)
    eps = float(np.finfo(NUMPY[args[1].dtype]).eps)
    assert x.shape == expected.shape and x.dtype == expected.dtype, what
    assert error <= 10 * max(lapack_error, 4 * eps), (
        f"{what}: forward error {error:.3e}, ?gtsv's {lapack_error:.3e} "
        f"({error / max(lapack_error, 4 * eps):.1f} times the larger of it and 4 eps)")


def assert_same_bits(actual, expected, what=""):
    """Equal bits, NaN where NaN (any payload); the message names the first differing index."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.detach().contiguous(), expected.detach().contiguous()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    differ = (nan_a != nan_e) | (~nan_e & (a.view(BITS[a.dtype]) != e.view(BITS[e.dtype])))
    if differ.any():
        first = tuple(int(i) for i in differ.nonzero()[0])
        pytest.fail(f"{what}: {int(differ.sum())} values differ, the first at {first}: "
                    f"{a[first].item()!r} != {e[first].item()!r}", pytrace=False)


def assert_every_entry_gives(args, expected, fallbacks):
    """solve_ex counts ``fallbacks`` hand-backs, and solve_ex, cpp_solve and tridiagonal_solve
    (driver=None) all give ``expected``'s bits."""
    x, counted = compiled.solve_ex(*args)
    assert counted == fallbacks
    assert_same_bits(x, expected, "solve_ex")
    assert_same_bits(T.cpp_solve(*args)[0], expected, "cpp_solve")
    assert_same_bits(tridiagonal_solve(*args), expected, "tridiagonal_solve")


def differs_somewhere(a, b):
    """Whether two tensors differ in at least one value's bits."""
    return bool((a.contiguous().view(BITS[a.dtype]) != b.contiguous().view(BITS[b.dtype])).any())


def assert_raises_lapack_pivot(args, info, what=""):
    """The op at the default threshold counts one fallback and reports ?gtsv's pivot INFO - 1;
    every way to the C++ kernel raises SingularMatrixError there."""
    n = args[1].shape[-1]
    for min_n in ([0, MIN_N] if n >= MIN_N else [0]):
        _, code, fallbacks = T.cpp_solve_ex(*args, min_n)
        assert (int(code), int(fallbacks)) == (info - 1, 1), (what, min_n)
    for min_n in (0, MIN_N, SEQUENTIAL):
        with pytest.raises(SingularMatrixError) as err:
            compiled.solve_ex(*args, pieces_min_n=min_n)
        assert (err.value.pivot, err.value.batch_index) == (info - 1, ()), (what, min_n)
    _, code = T.cpp_solve(*args)
    assert int(code) == info - 1, what
    for driver in (None, "cpp"):
        with pytest.raises(SingularMatrixError) as err:
            tridiagonal_solve(*args, driver=driver)
        assert err.value.pivot == info - 1, (what, driver)


def vector_id(k):
    return "vector" if k is None else f"k{k}"


# ----------------------------------------------------------------------------------------------
# 1. Within 10 times ?gtsv's error, on the pieces kernel; ?gtsv's bits below the threshold.
# ----------------------------------------------------------------------------------------------
CASES = [(family, n) for family in FAMILIES for n in SIZES]


@pytest.mark.parametrize("k", [None, 1, 3], ids=vector_id)
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("family, n", CASES)
def test_within_ten_times_lapack(family, n, dtype, k):
    """No fallback on any of these families. Below PIECES_MIN_N the sequential kernel runs: ?gtsv's
    bits; from PIECES_MIN_N the pieces kernel: a forward error within 10 times ?gtsv's. cpp_solve
    (the op at its own threshold) returns the same bits as solve_ex's default."""
    args = make_family(family, n, dtype, k, seed=n + FAMILIES.index(family))
    what = f"{family}, n={n}, {dtype}, k={k}"
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0, what
    if n < MIN_N:
        assert_same_bits(x, gtsv(*args)[0], what)
    else:
        assert_within_ten_times_lapack(args, x, what)
    x_op, code = T.cpp_solve(*args)
    assert int(code) == -1
    assert_same_bits(x_op, x, f"cpp_solve, {what}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [4099, 10_007])
@pytest.mark.parametrize("family", HARD_FAMILIES)
def test_hard_families_handed_back_or_within_ten_times(family, n, dtype):
    """Families that the pieces kernel may hand back (interchanges at every step, tiny pivots,
    a near-singular block where two pieces meet, slow decay): one system, at most one fallback;
    with it the answer is ?gtsv's bits, without it within 10 times ?gtsv's error."""
    args = make_family(family, n, dtype, 2, seed=n + HARD_FAMILIES.index(family))
    what = f"{family}, n={n}, {dtype}"
    expected, info = gtsv(*args)
    if info > 0:
        assert_raises_lapack_pivot(args, info, what)
        return
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks in (0, 1), what
    if fallbacks:
        assert_same_bits(x, expected, f"handed back, {what}")
    else:
        assert_within_ten_times_lapack(args, x, what)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("k", [None, 1, 3], ids=vector_id)
def test_poisson_handed_back_after_the_first_tile(dtype, k):
    """tridiag(-1, 2, -1) with 8 tiles or more (n = 40000 in float64, 80000 in float32): the first
    tile's reduced system amplifies ones by more than 1e3, and the system goes to the sequential
    kernel: one fallback, ?gtsv's bits (also from cpp_solve and driver=None)."""
    n = 40_000 if dtype == torch.float64 else 80_000
    assert n // (piece_rows(n, dtype) * LANES[dtype]) >= 8, "at least 8 tiles"
    args = make_family("poisson", n, dtype, k, seed=n)
    expected, info = gtsv(*args)
    assert info == 0
    assert_every_entry_gives(args, expected, fallbacks=1)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("k", [None, 1, 3], ids=vector_id)
@pytest.mark.parametrize("n", [4096, 20_000])
def test_poisson_below_eight_tiles_stays_on_the_pieces(dtype, k, n):
    """tridiag(-1, 2, -1) at n = 4096 and 20,000 (fewer than 8 tiles: no early decision, although
    its joining system grows ill-conditioned with n): solved by the pieces kernel, within 10 times
    ?gtsv's error."""
    assert ceil_div(n, piece_rows(n, dtype) * LANES[dtype]) < 8, "fewer than 8 tiles"
    args = make_family("poisson", n, dtype, k, seed=n)
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0
    assert_within_ten_times_lapack(args, x, f"Poisson, n={n}, {dtype}, k={k}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_threshold_is_pieces_min_n(dtype):
    """cpp_solve (driver=None's C++ kernel) sends one system to the pieces kernel from the size
    that compiled.PIECES_MIN_N states. On pivoting systems whose pieces answer (forced with
    pieces_min_n=0) differs from ?gtsv's bits: at PIECES_MIN_N - 1 cpp_solve and driver=None give
    ?gtsv's bits, at PIECES_MIN_N the pieces kernel's (within 10 times ?gtsv's error)."""
    for n, on_pieces in ((MIN_N - 1, False), (MIN_N, True)):
        args = make_family("pivoting", n, dtype, 1, seed=5)
        expected, info = gtsv(*args)
        assert info == 0
        pieces, fallbacks = compiled.solve_ex(*args, pieces_min_n=0)
        assert fallbacks == 0
        assert differs_somewhere(pieces, expected), f"n={n}: the pieces kernel rounds as ?gtsv"
        assert_within_ten_times_lapack(args, pieces, f"forced, n={n}")
        want = pieces if on_pieces else expected
        assert_same_bits(T.cpp_solve(*args)[0], want, f"cpp_solve, n={n}")
        assert_same_bits(tridiagonal_solve(*args), want, f"driver=None, n={n}")
        assert_same_bits(compiled.solve_ex(*args)[0], want, f"solve_ex's default, n={n}")
        assert_same_bits(compiled.solve_ex(*args, pieces_min_n=SEQUENTIAL)[0], expected,
                         f"sequential, n={n}")


# ----------------------------------------------------------------------------------------------
# 2. Forced onto small systems; zero right-hand sides.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("family", ["dominant", "pivoting"])
@pytest.mark.parametrize("n", [2, 3, 17, 56, 57, 112, 113, 300])
def test_forced_on_small_systems(n, family, dtype):
    """pieces_min_n=0 at small n (W pieces of about n / W rows, the rest padding): where the
    pieces kernel solves the system, within 10 times ?gtsv's error; where it hands it back (it
    may, for pieces shorter than 8 rows: n <= 56 in float64, 112 in float32), one fallback and
    ?gtsv's bits. Pieces of 8 rows or more are not handed back."""
    args = make_family(family, n, dtype, 2, seed=n)
    expected, info = gtsv(*args)
    assert info == 0
    x, fallbacks = compiled.solve_ex(*args, pieces_min_n=0)
    what = f"{family}, n={n}, {dtype}"
    assert fallbacks in (0, 1), what
    if ceil_div(n, LANES[dtype]) >= 8:
        assert fallbacks == 0, what
    if fallbacks:
        assert_same_bits(x, expected, what)
    else:
        assert_within_ten_times_lapack(args, x, what)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("zeros", ["random_signs", "negative", "one_column"])
def test_zero_right_hand_sides_give_zeros(dtype, zeros):
    """A right-hand side of signed zeros (or one zero column of three): its x is exactly zero
    (any sign), on the pieces kernel (no fallback: nothing cancels in a zero)."""
    n = 5000
    lower, diag, upper, _ = make_family("pivoting", n, dtype, seed=0)
    g = torch.Generator().manual_seed(1)
    if zeros == "negative":
        rhs = torch.full((n,), -0.0, dtype=dtype)
    elif zeros == "random_signs":
        rhs = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0).to(dtype)
    else:
        rhs = torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype)
        rhs[:, 1] = 0.0
    x, fallbacks = compiled.solve_ex(lower, diag, upper, rhs)
    assert fallbacks == 0
    zero = x if zeros != "one_column" else x[:, 1]
    assert torch.equal(zero, torch.zeros_like(zero))
    if zeros == "one_column":
        assert (x[:, [0, 2]] != 0).any()
        assert_within_ten_times_lapack((lower, diag, upper, rhs[:, [0, 2]].contiguous()),
                                       x[:, [0, 2]].contiguous(), "the other columns")


# ----------------------------------------------------------------------------------------------
# 3. Singular matrices: ?gtsv's pivot, one fallback.
# ----------------------------------------------------------------------------------------------
def singular_edit(args, construction, i):
    """Make the system singular at row/column ``i``: ``zero_row`` (row i zero), ``half_row``
    (row i + 1 = row i / 2, both only in columns i, i + 1: exact), ``zero_column`` (column i
    zero: an exact zero pivot at i, with nothing below it to interchange)."""
    lower, diag, upper, _ = args
    n = diag.shape[-1]
    if construction == "zero_row":
        if i > 0:
            lower[i - 1] = 0.0
        if i < n - 1:
            upper[i] = 0.0
        diag[i] = 0.0
    elif construction == "half_row":
        if i > 0:
            lower[i - 1] = 0.0
        if i + 1 < n - 1:
            upper[i + 1] = 0.0
        lower[i], diag[i + 1] = diag[i] / 2, upper[i] / 2
    elif construction == "zero_column":
        if i > 0:
            upper[i - 1] = 0.0
        if i < n - 1:
            lower[i] = 0.0
        diag[i] = 0.0
    else:
        raise ValueError(construction)


def singular_positions(n, dtype, construction):
    """Rows 0, 511, 512, 513, 1023, 1024, the first piece boundary, the middle one (both sides),
    the middle of a piece and the last rows (n - 1 but for half_row, which needs i + 1 < n)."""
    m, b = piece_rows(n, dtype), middle_boundary(n, dtype)
    rows = {0, 511, 512, 513, 1023, 1024, m - 1, m, m + 1, b - 1, b, b + 1, b + m // 2, n - 2,
            n - 1}
    last = n - 2 if construction == "half_row" else n - 1
    return sorted(r for r in rows if 0 <= r <= last)


SINGULAR = [(dtype, construction, n, i) for dtype in REAL_DTYPES
            for construction in ("zero_column", "zero_row", "half_row")
            for n in (4099, 10_007) for i in singular_positions(n, dtype, construction)]


@pytest.mark.parametrize("dtype, construction, n, i", SINGULAR,
                         ids=[f"{str(d)[6:]}-{c}-{n}-{i}" for d, c, n, i in SINGULAR])
def test_singular_raises_at_lapack_pivot(dtype, construction, n, i):
    """A singular system (at a piece boundary, inside a piece, in the last row) counts one
    fallback and raises at ?gtsv's pivot INFO - 1 from compiled.solve_ex (pieces from any size,
    from PIECES_MIN_N, sequential only), cpp_solve and tridiagonal_solve (driver None and
    "cpp")."""
    args = make_family("pivoting", n, dtype, 2, seed=i)
    singular_edit(args, construction, i)
    _, info = gtsv(*args)
    assert info > 0
    if i == n - 1:
        assert info == n  # the last pivot
    assert_raises_lapack_pivot(args, info, f"{construction} at {i}, n={n}, {dtype}")


@pytest.mark.parametrize("n", [4099, 10_007])
def test_float32_rows_scaled_past_its_range_raise_where_lapack_does(n):
    """Rows (and right-hand sides) scaled by 10^U(-30, 30) each in float32: products underflow,
    and ?gtsv's last pivot comes out exactly zero. The pieces kernel hands the system back, and
    it raises at ?gtsv's pivot."""
    g = np.random.default_rng(n)
    lower, diag, upper, _ = accuracy.make("random", n, np.float64, n)
    scale = 10.0 ** g.uniform(-30, 30, n)
    rhs = g.standard_normal((n, 2)) * scale[:, None]
    args = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32))
            for t in (lower * scale[1:], diag * scale, upper * scale[:-1], rhs)]
    _, info = gtsv(*args)
    assert info > 0, "?gtsv met no zero pivot: the construction no longer tests this"
    assert_raises_lapack_pivot(args, info, f"n={n}")


# the exponents of rows (or columns) scaled close to the smallest normal number, and of one
# inside the range the pieces keep; each with its expected fallbacks
NEAR_MIN = {torch.float64: [((-307, -300), 1), ((-300, -293), 1), ((-290, -280), 0)],
            torch.float32: [((-37, -35), 1), ((-33, -31), 1), ((-29, -25), 0)]}


@pytest.mark.parametrize("scaled", ["rows", "columns"])
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_scaled_near_the_smallest_normal_number(dtype, scaled):
    """Rows (with their right-hand sides), or columns, scaled by 10^U(lo, hi) close to the
    smallest normal number: the cut of the spikes' subnormal entries would drop terms that matter
    (forward errors thousands to millions of times ?gtsv's before a piece with a pivot below
    min / eps was handed back). Handed back, ?gtsv's bits; a little higher, kept, within 10 times
    ?gtsv's error."""
    n = 4099
    for (lo, hi), fallbacks in NEAR_MIN[dtype]:
        g = np.random.default_rng(abs(lo))
        lower, diag, upper, _ = accuracy.make("random", n, np.float64, abs(lo))
        scale = 10.0 ** g.uniform(lo, hi, n)
        truth = g.standard_normal((n, 2))
        if scaled == "rows":
            bands = (lower * scale[1:], diag * scale, upper * scale[:-1])
        else:  # A D: x = D^-1 truth solves A D x = A truth
            bands = (lower * scale[:-1], diag * scale, upper * scale[1:])
            truth = truth / scale[:, None]
        rhs = bands[1][:, None] * truth
        rhs[1:] += bands[0][:, None] * truth[:-1]
        rhs[:-1] += bands[2][:, None] * truth[1:]
        args = [torch.from_numpy(np.ascontiguousarray(t, dtype=NUMPY[dtype])) for t in (*bands, rhs)]
        what = f"{scaled} scaled by 10^U({lo}, {hi}), {dtype}"
        expected, info = gtsv(*args)
        assert info == 0, what
        x, counted = compiled.solve_ex(*args)
        assert counted == fallbacks, what
        if fallbacks:
            assert_every_entry_gives(args, expected, fallbacks=1)
        else:
            assert_within_ten_times_lapack(args, x, what)


# ----------------------------------------------------------------------------------------------
# 4. NaN and infinity: handed back, ?gtsv's bits.
# ----------------------------------------------------------------------------------------------
def non_finite_cases():
    n = 4099
    cases = []
    for dtype in REAL_DTYPES:
        m, b = piece_rows(n, dtype), middle_boundary(n, dtype)
        for band in ("lower", "diag", "upper", "rhs"):
            last = n - 1 if band in ("diag", "rhs") else n - 2
            for row in sorted({0, m - 1, n // 3, b - 1, b, last}):
                for value in (NAN, INF, -INF):
                    cases.append((dtype, n, band, row, value))
    return cases


NON_FINITE = non_finite_cases()


@pytest.mark.parametrize("dtype, n, band, row, value", NON_FINITE,
                         ids=[f"{str(d)[6:]}-{b}[{r}]={v}" for d, _, b, r, v in NON_FINITE])
def test_non_finite_matches_lapack(dtype, n, band, row, value):
    """One NaN or infinity in a band or the rhs (column 0 of 2): the system is handed back (one
    fallback) and the answer is ?gtsv's bits, NaN where NaN; or its pivot where it reports one."""
    args = make_family("pivoting", n, dtype, 2, seed=row)
    index = (row, 0) if band == "rhs" else row
    args[("lower", "diag", "upper", "rhs").index(band)][index] = value
    what = f"{band}[{row}] = {value}, n={n}, {dtype}"
    expected, info = gtsv(*args)
    if info > 0:
        assert_raises_lapack_pivot(args, info, what)
        return
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 1, what
    assert torch.equal(torch.isnan(x), torch.isnan(expected)), what
    assert_same_bits(x, expected, what)
    assert_same_bits(T.cpp_solve(*args)[0], expected, f"cpp_solve, {what}")


# ----------------------------------------------------------------------------------------------
# 5. Inputs: not modified; strided.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["pivoting", "poisson", "nan", "singular"])
def test_inputs_not_modified(dtype, case):
    """Neither the pieces kernel nor its hand-back (after the first tile, on a NaN, on a zero
    pivot) writes the inputs."""
    n = 10_006 if case != "poisson" else (40_000 if dtype == torch.float64 else 80_000)
    args = make_family("poisson" if case == "poisson" else "pivoting", n, dtype, 3, seed=9)
    if case == "nan":
        args[1][n // 2] = NAN
    elif case == "singular":
        singular_edit(args, "zero_column", n // 2)
    before = [t.clone() for t in args]
    if case == "singular":
        with pytest.raises(SingularMatrixError):
            compiled.solve_ex(*args)
    else:
        _, fallbacks = compiled.solve_ex(*args)
        assert fallbacks == (0 if case == "pivoting" else 1)
    for t, b in zip(args, before):
        assert_same_bits(t, b, case)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("k", [None, 3], ids=vector_id)
def test_non_contiguous_inputs(dtype, k):
    """Bands that are every other element of a longer tensor, and a strided (or transposed)
    rhs, give the bits of the contiguous inputs, on the pieces kernel."""
    n = 4099
    args = make_family("pivoting", n, dtype, k, seed=10)
    strided = []
    for t in args[:3]:
        longer = torch.full((2 * t.shape[0],), NAN, dtype=dtype)
        longer[::2] = t
        strided.append(longer[::2])
    rhs = args[3]
    if k is None:
        longer = torch.full((2 * n,), NAN, dtype=dtype)
        longer[1::2] = rhs
        strided.append(longer[1::2])
    else:
        strided.append(rhs.T.contiguous().T)
    assert not any(t.is_contiguous() for t in strided)
    expected, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0
    assert_within_ten_times_lapack(args, expected, "contiguous")
    assert_every_entry_gives(strided, expected, fallbacks=0)


# ----------------------------------------------------------------------------------------------
# 6. Threads.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_same_bits_on_any_thread_count(dtype):
    """One system on 1, 2 or 3 threads, and a batch of 3 (one system a thread): the same bits
    every time (the kernel is deterministic), each system's as when solved alone, within 10
    times ?gtsv's error, no fallback."""
    systems = [make_family("pivoting", 100_003, dtype, 1, seed=11),
               make_family("dominant", 20_001, dtype, 3, seed=13)]
    batch_parts = [make_family("pivoting", 5000, dtype, 2, seed=20 + s) for s in range(3)]
    batch = [torch.stack(parts) for parts in zip(*batch_parts)]
    answers = {}
    for threads in (1, 2, 3):
        with num_threads(threads):
            got = [compiled.solve_ex(*args) for args in systems]
            got.append(compiled.solve_ex(*batch))
            got += [compiled.solve_ex(*args) for args in batch_parts]
        assert all(fallbacks == 0 for _, fallbacks in got), threads
        answers[threads] = [x for x, _ in got]
    for threads in (2, 3):
        for i, (x, first) in enumerate(zip(answers[threads], answers[1])):
            assert_same_bits(x, first, f"answer {i} on {threads} threads against 1")
    for args, x in zip(systems, answers[1]):
        assert_within_ten_times_lapack(args, x, "one system")
    for s, args in enumerate(batch_parts):
        assert_same_bits(answers[1][2][s], answers[1][3 + s], f"batch system {s} against alone")
        assert_within_ten_times_lapack(args, answers[1][2][s], f"batch system {s}")


# ----------------------------------------------------------------------------------------------
# 7. Small batches.
# ----------------------------------------------------------------------------------------------
def batch_of(size, n, dtype, k, family="pivoting"):
    systems = [make_family(family, n, dtype, k, seed=100 + s) for s in range(size)]
    return systems, [torch.stack(parts) for parts in zip(*systems)]


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("size", ["2", "3", "W-1"])
@pytest.mark.parametrize("k", [None, 2], ids=vector_id)
def test_small_batches_on_the_pieces_kernel(dtype, size, k):
    """Batches smaller than W (8 doubles, 16 floats): each system on the pieces kernel (no
    fallback), its x within 10 times its ?gtsv's error and the bits of it solved alone."""
    count = LANES[dtype] - 1 if size == "W-1" else int(size)
    systems, args = batch_of(count, 5000, dtype, k)
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0
    for s, system in enumerate(systems):
        what = f"system {s} of {count}"
        assert_within_ten_times_lapack(system, x[s], what)
        assert_same_bits(x[s], compiled.solve_ex(*system)[0], what)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("size", ["3", "W-1"])
@pytest.mark.parametrize("bad", ["nan", "poisson"])
def test_small_batch_hands_back_only_the_bad_system(dtype, size, bad):
    """One bad system in a small batch (a NaN; Poisson's matrix with 8 tiles or more): that
    system alone is handed back (one fallback), its x ?gtsv's bits; the others keep the pieces
    kernel's answer (their bits alone, within 10 times ?gtsv's error)."""
    count = LANES[dtype] - 1 if size == "W-1" else int(size)
    n = 5000 if bad == "nan" else (40_000 if dtype == torch.float64 else 80_000)
    systems, _ = batch_of(count, n, dtype, 1, family="dominant")
    if bad == "nan":
        systems[1][1][n // 2] = NAN
    else:
        systems[1] = make_family("poisson", n, dtype, 1, seed=1)
    args = [torch.stack(parts) for parts in zip(*systems)]
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 1
    assert_same_bits(x[1], gtsv(*systems[1])[0], "the bad system")
    for s, system in enumerate(systems):
        if s != 1:
            alone, none = compiled.solve_ex(*system)
            assert none == 0
            assert_same_bits(x[s], alone, f"system {s} of {count}")
            assert_within_ten_times_lapack(system, x[s], f"system {s} of {count}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_small_batch_with_a_singular_system(dtype):
    """A batch of 3 whose system 2 is singular: the op counts one fallback and reports that
    system's ?gtsv pivot (info = system * n + pivot); solve_ex raises with its batch index."""
    n = 4099
    systems, _ = batch_of(3, n, dtype, 2)
    singular_edit(systems[2], "zero_row", 1500)
    _, info = gtsv(*systems[2])
    assert info > 0
    args = [torch.stack(parts) for parts in zip(*systems)]
    _, code, fallbacks = T.cpp_solve_ex(*args, MIN_N)
    assert (int(code), int(fallbacks)) == (2 * n + info - 1, 1)
    with pytest.raises(SingularMatrixError) as err:
        compiled.solve_ex(*args)
    assert (err.value.pivot, err.value.batch_index) == (info - 1, (2,))


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_batch_of_w_systems_is_the_block_kernel(dtype):
    """W systems (a block) go to the block kernel, not to the pieces kernel: no fallback even
    with a NaN in one, and every system's x is ?gtsv's bits."""
    count = LANES[dtype]
    systems, args = batch_of(count, 5000, dtype, 1, family="dominant")
    args[1][1, 2500] = NAN
    systems[1][1][2500] = NAN
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0
    for s, system in enumerate(systems):
        assert_same_bits(x[s], gtsv(*system)[0], f"system {s} of {count}")


# ----------------------------------------------------------------------------------------------
# 8. Gradients through tridiagonal_solve (forward and backward on the pieces kernel).
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 2], ids=vector_id)
def test_gradients_match_dense(k):
    """tridiagonal_solve (driver=None) at n = 3000, float64: x is the pieces kernel's
    (compiled.solve_ex's bits), and the four gradients of (x * w).sum() (the backward solves
    with A^T on the same kernel) are the dense reference's."""
    n = 3000
    args = make_system(n, (), k, seed=16, requires_grad=True)
    w = torch.randn(args[3].shape, generator=torch.Generator().manual_seed(17),
                    dtype=torch.float64)
    x = tridiagonal_solve(*args)
    pieces, fallbacks = compiled.solve_ex(*(a.detach() for a in args))
    assert fallbacks == 0
    assert_same_bits(x, pieces, "forward")
    grads = torch.autograd.grad((x * w).sum(), args)
    assert_grads_match_dense(grads, args, lambda x: (x * w).sum())


def test_gradcheck_above_the_threshold():
    """torch.autograd.gradcheck (fast mode) of tridiagonal_solve on one float64 system of
    n = 2100 > PIECES_MIN_N, with respect to the diagonal and the right-hand side."""
    n = 2100
    lower, diag, upper, rhs = make_system(n, (), 1, seed=18, dominant=True)
    diag.requires_grad_()
    rhs.requires_grad_()
    assert n >= MIN_N
    assert torch.autograd.gradcheck(lambda d, b: tridiagonal_solve(lower, d, upper, b),
                                    (diag, rhs), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# 9. The 16-byte lanes (plain x86-64, aarch64), on this CPU too.
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(bool(os.environ.get("TRIDIAG_TUTORIAL_NO_AVX2")), reason="already in it")
def test_sixteen_byte_lanes_pass_the_same_tests():
    """With TRIDIAG_TUTORIAL_NO_AVX2=1 the kernel uses the lanes of CPUs without AVX2: the
    accuracy, hand-back, singular, non-finite and batch tests pass there as well (run in a
    process of their own, since the choice is made when the library loads)."""
    env = dict(os.environ, TRIDIAG_TUTORIAL_NO_AVX2="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "within_ten_times or poisson or threshold or forced or singular or non_finite "
         "or small_batch or thread_count"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


# ----------------------------------------------------------------------------------------------
# 9b. The spikes stop before subnormal numbers.
# ----------------------------------------------------------------------------------------------
# A spike decays geometrically across a piece where it is diagonally dominant; computed to the end
# of its piece it passes through subnormal numbers, on which some CPUs take a slow path (measured
# on an Intel Xeon: up to 1.3 times ?sgtsv's time on these families at n = 4096). The kernel cuts a
# spike to zero before that (cut_spike). bench.spikes.probe builds csrc/spike_probe.cpp, which
# counts every spike entry the kernel computes, before the cut, and can build the kernel without
# the cut: there 2 to 6 in 100 entries are subnormal on these families (float32, n = 4096), 3 in
# 100 for dominant float64 at n = 1e5; with the cut, fewer than 1 in 400 (1 in 100 with scaled
# rows): where a spike crosses the threshold, and a neighbour.
SPIKE_CASES = [("dominant", 4096, torch.float32), ("pivoting", 4096, torch.float32),
               ("heat_1", 4096, torch.float32), ("nearly_singular_block", 4096, torch.float32),
               ("scaled_rows", 4096, torch.float32), ("dominant", 100_000, torch.float64),
               ("poisson", 4096, torch.float32)]


def spike_bound(family):
    """How many spike entries per subnormal one the cut must keep at least: with scaled rows an
    eliminated entry carries its row's scale (down to 1e-30), so a few more are subnormal before
    their ratio is negligible, and they are not cut (that would cost accuracy)."""
    return 100 if family == "scaled_rows" else 400


@pytest.mark.parametrize("lanes", ["widest", "16-byte"])
@pytest.mark.parametrize("family, n, dtype", SPIKE_CASES, ids=str)
def test_spikes_stop_before_subnormal_numbers(family, n, dtype, lanes):
    if shutil.which("g++") is None:
        pytest.skip("the spike probe needs g++")
    from tridiag_tutorial.bench import spikes

    system = make_family(family, n, dtype)
    cut = spikes.probe(system, lanes=lanes)
    # solved by the pieces (poisson at n = 4096 has fewer than 8 tiles: it stays on them), and
    # three spike columns' worth of entries counted: v and w in the substitution, v in elimination
    assert cut.code == 0 and cut.entries >= 3 * n - 3 * 64
    assert cut.subnormal * spike_bound(family) < cut.entries, cut
    kept = spikes.probe(system, cut=False, lanes=lanes)  # the same kernel without the cut
    assert kept.entries == cut.entries
    if family == "poisson":  # its spikes do not decay: none is subnormal either way
        assert cut.subnormal == kept.subnormal == 0
    else:  # without the cut, the bound fails
        assert kept.subnormal * spike_bound(family) > kept.entries, kept


def test_spike_probe_rejects_what_it_cannot_solve():
    from tridiag_tutorial.bench import spikes

    lower, diag, upper, rhs = make_family("dominant", 2048, torch.float64)
    with pytest.raises(TypeError, match="float32 or float64"):
        spikes.probe((lower.to(torch.float16), diag.to(torch.float16), upper.to(torch.float16),
                      rhs.to(torch.float16)))
    with pytest.raises(ValueError, match="one system"):
        spikes.probe((lower, diag, upper[:-1], rhs))


# ----------------------------------------------------------------------------------------------
# 10. Memory given back.
# ----------------------------------------------------------------------------------------------
def resident_mb():
    """This process's resident memory (VmRSS), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no VmRSS in /proc/self/status")


def large_dominant_system(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    lower = torch.rand(n - 1, generator=g, dtype=torch.float64) - 0.5
    upper = torch.rand(n - 1, generator=g, dtype=torch.float64) - 0.5
    diag = 2 + torch.rand(n, generator=g, dtype=torch.float64)
    return lower, diag, upper, torch.randn(n, k, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("entry", ["solve_ex", "tridiagonal_solve"])
def test_memory_given_back_after_a_large_solve(entry):
    """One float64 system of n = 4e6 with 8 columns (x: 256 MB): once x is deleted, the
    resident memory is back within 50 MB of what it was before the call."""
    n, k = 4_000_000, 8
    args = large_dominant_system(n, k, seed=30)
    compiled.solve_ex(*make_family("dominant", MIN_N, torch.float64, 1))  # a first, small solve
    gc.collect()
    before = resident_mb()
    if entry == "solve_ex":
        x, fallbacks = compiled.solve_ex(*args)
        assert fallbacks == 0
    else:
        x = tridiagonal_solve(*args)
    # (finite: through the sum, which allocates nothing; an elementwise mask of x would be 32 MB
    # of the test's own that the C library may keep on its heap after it is freed)
    assert x.shape == (n, k) and bool(torch.isfinite(x.sum()))
    del x
    gc.collect()
    kept = resident_mb() - before
    assert kept <= 50, f"{kept:.0f} MB kept after the solve"


def test_memory_given_back_by_threads():
    """Three threads of a ThreadPoolExecutor, each solving one n = 1e6 system with 8 columns at
    the same time: with the results dropped and the threads still alive, they keep no more
    than 50 MB each."""
    n, k = 1_000_000, 8
    systems = [large_dominant_system(n, k, seed=31 + s) for s in range(3)]
    compiled.solve_ex(*make_family("dominant", MIN_N, torch.float64, 1))
    barrier = threading.Barrier(3)

    def solve(args):
        barrier.wait(timeout=60)  # three threads at once
        x, fallbacks = compiled.solve_ex(*args)
        return threading.get_ident(), fallbacks, x

    gc.collect()
    before = resident_mb()
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(solve, systems))
        assert len({ident for ident, _, _ in results}) == 3
        assert [fallbacks for _, fallbacks, _ in results] == [0, 0, 0]
        del results
        gc.collect()
        kept = resident_mb() - before
    assert kept <= 3 * 50, f"{kept:.0f} MB kept by three threads"
