"""The speculative C++ kernel for one large real system (csrc/tridiag.cpp, ``solve_speculative``;
``cpp_solve`` and so ``driver=None`` from ``SPECULATIVE_MIN_N`` unknowns, ``compiled.solve_ex``
and the op ``cpp_solve_ex`` from any size): its answer is SciPy's ?gtsv bit for bit, and the
sequential kernel's, on
matrices that pivot rarely, often and at every step, on badly scaled rows, near-singular blocks
across piece boundaries and signed zeros, on both sides of ``SPECULATIVE_MIN_N``; the fallback
count; singular matrices (?gtsv's pivot, at a piece boundary or the last row); NaN and infinity;
unchanged and non-contiguous inputs; thread counts; small batches; workspace reuse; the
gradients that the op's backward would compute with it.

Bitwise means the bits: values are compared as integers (so -0.0 differs from 0.0), and NaN
only in where it is (its payload is not compared)."""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.linalg import lapack as scipy_lapack

from tridiag_tutorial import SingularMatrixError, compiled, rules, tridiagonal_solve

from conftest import REAL_DTYPES, assert_grads_match_dense, make_system, require_cpp

T = torch.ops.tridiag_tutorial
GTSV = {torch.float32: scipy_lapack.sgtsv, torch.float64: scipy_lapack.dgtsv}
BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
BLOCK = {torch.float32: 16, torch.float64: 8}  # a batch this large goes to the block kernel
SEQUENTIAL = 2**62  # speculative_min_n that keeps every system on the sequential kernel
MIN_N = compiled.SPECULATIVE_MIN_N
SIZES = [MIN_N - 1, MIN_N, MIN_N + 1, 4099, 10_007]
FAMILIES = ["dominant", "pivoting", "random", "zero_diagonal", "scaled_rows",
            "mildly_scaled_rows", "near_singular_block"]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _cpp():
    require_cpp()


# ----------------------------------------------------------------------------------------------
# Helpers: where pieces start, the families of matrices, SciPy's ?gtsv, bitwise comparison.
# ----------------------------------------------------------------------------------------------
def piece_rows(n, dtype, width):
    """Rows per piece by the rule of solve_speculative with ``width`` pieces side by side (8
    doubles or 16 floats, with AVX2 or without): about 2048 rows, at least one tile of ``width``
    pieces per thread where pieces of 256 rows allow it, a multiple of ``width`` pieces, moved
    off a stride close to a multiple of 4 KiB."""
    size = torch.finfo(dtype).bits // 8
    pieces = -(-max(width, -(-n // 2048)) // width) * width
    pieces = max(pieces, width * min(torch.get_num_threads(), n // (width * 256)))
    m = -(-n // pieces)
    while m * size > 4096 - 512 and not 512 <= (m * size) % 4096 <= 4096 - 512:
        pieces += width
        m = -(-n // pieces)
    return m


@contextlib.contextmanager
def num_threads(threads):
    """torch's thread count set to ``threads`` inside the block, restored after it."""
    original = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(original)


def middle_boundaries(n, dtype):
    """The first row of the piece nearest the middle (whether the CPU has AVX2 or not, W pieces
    side by side: 8 doubles, 16 floats)."""
    m = piece_rows(n, dtype, BLOCK[dtype])
    return [max(m, round(n / 2 / m) * m)]


def make_family(family, n, dtype, k=None, seed=0):
    """``(lower, diag, upper, rhs)`` of one system of ``family``; ``rhs`` ``(n,)`` if k is None.

    - dominant, pivoting: conftest.make_system (diagonal ±(1.5 + |N|), +4 when dominant;
      off-diagonals N(0, 1));
    - random: every entry N(0, 1) (many interchanges);
    - zero_diagonal: off-diagonals ±(1 + 0.1 |N|), so that every step interchanges (for odd n the
      last diagonal entry is 1, as in accuracy.make: else the matrix is singular);
    - scaled_rows: pivoting with row i and its right-hand side times 10^U(-e, e), e = 30 in
      float32 and 150 in float64 (in float32 ?gtsv's last pivot then mostly cancels to exactly
      zero, and it reports a singular matrix: the raising path); mildly_scaled_rows: e halved;
    - near_singular_block: pivoting with a block of 4 rows across a piece boundary (rows b - 2 to
      b + 1), cut off from the rows above and below it in the lower band (so that A is block upper
      triangular), whose determinant is zero up to a relative 10^U(-15, -3): a tiny pivot.
    """
    g = torch.Generator().manual_seed(seed)
    rshape = (n,) if k is None else (n, k)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def signs(size):
        return torch.where(torch.rand(size, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)

    if family in ("dominant", "pivoting"):
        return make_system(n, (), k, dtype=dtype, seed=seed, dominant=family == "dominant")
    if family == "random":
        lower, diag, upper, rhs = randn(n - 1), randn(n), randn(n - 1), randn(*rshape)
    elif family == "zero_diagonal":
        lower = (1 + 0.1 * randn(n - 1).abs()) * signs(n - 1)
        upper = (1 + 0.1 * randn(n - 1).abs()) * signs(n - 1)
        diag, rhs = torch.zeros(n, dtype=torch.float64), randn(*rshape)
        if n % 2:  # a zero diagonal of odd length is singular: as accuracy.make, a last 1
            diag[-1] = 1.0
    elif family in ("scaled_rows", "mildly_scaled_rows"):
        lower, diag, upper, rhs = make_system(n, (), k, dtype=torch.float64, seed=seed)
        e = (30 if dtype == torch.float32 else 150) // (2 if family.startswith("mildly") else 1)
        scale = 10.0 ** ((2 * torch.rand(n, generator=g, dtype=torch.float64) - 1) * e)
        lower, diag, upper = lower * scale[1:], diag * scale, upper * scale[:-1]
        rhs = rhs * (scale if k is None else scale[:, None])
    elif family == "near_singular_block":
        lower, diag, upper, rhs = make_system(n, (), k, dtype=torch.float64, seed=seed)
        for b in middle_boundaries(n, dtype):
            a = b - 2  # the block's first row; lower[a - 1] = A[a, a - 1]
            lower[a - 1], lower[a + 3] = 0.0, 0.0  # A block upper triangular: the block's
            # determinant is the product of its pivots in U, so one of them is tiny
            f_prev, f = 1.0, float(diag[a])  # continuants: the leading minors of the block
            for r in range(a + 1, a + 3):
                f_prev, f = f, float(diag[r]) * f - float(lower[r - 1] * upper[r - 1]) * f_prev
            last = a + 3
            exponent = float(torch.rand((), generator=g, dtype=torch.float64)) * 12 - 15
            diag[last] = (float(lower[last - 1] * upper[last - 1]) * f_prev / f
                          * (1 + float(signs(1)) * 10.0 ** exponent))
    else:
        raise ValueError(family)
    return [t.to(dtype) for t in (lower, diag, upper, rhs)]


def gtsv(lower, diag, upper, rhs):
    """SciPy's ?gtsv on one system: ``(x, info)``, x None where info > 0 (a zero pivot)."""
    *_, x, info = GTSV[diag.dtype](*(t.detach().numpy() for t in (lower, diag, upper, rhs)))
    assert info >= 0
    return (None if info > 0 else torch.from_numpy(np.ascontiguousarray(x))), int(info)


def assert_same_bits(actual, expected, what=""):
    """Equal bits, NaN where NaN (any payload); the message names the first differing index."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.contiguous(), expected.contiguous()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    differ = (nan_a != nan_e) | (~nan_e & (a.view(BITS[a.dtype]) != e.view(BITS[e.dtype])))
    if differ.any():
        first = tuple(int(i) for i in differ.nonzero()[0])
        pytest.fail(f"{what}: {int(differ.sum())} values differ, the first at {first}: "
                    f"{a[first].item()!r} != {e[first].item()!r}", pytrace=False)


def assert_raises_lapack_pivot(args, info, what=""):
    """Every way to the C++ kernel raises SingularMatrixError at ?gtsv's pivot INFO - 1."""
    for min_n in (0, MIN_N, SEQUENTIAL):
        with pytest.raises(SingularMatrixError) as err:
            compiled.solve_ex(*args, speculative_min_n=min_n)
        assert (err.value.pivot, err.value.batch_index) == (info - 1, ()), (what, min_n)
    _, code = T.cpp_solve(*args)
    assert int(code) == info - 1, what
    with pytest.raises(SingularMatrixError) as err:
        tridiagonal_solve(*args, driver="cpp")
    assert err.value.pivot == info - 1, what


# ----------------------------------------------------------------------------------------------
# 1. ?gtsv's bits on every family, both sides of the threshold.
# ----------------------------------------------------------------------------------------------
CASES = [(family, n) for family in FAMILIES for n in SIZES] + [("dominant", 100_003)]


@pytest.mark.parametrize("k", [None, 1, 3], ids=lambda k: "vector" if k is None else f"k{k}")
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("family, n", CASES)
def test_matches_lapack_bit_for_bit(family, n, dtype, k):
    """The speculative kernel from SPECULATIVE_MIN_N (cpp_solve, solve_ex's default) and forced
    at every size, and the sequential kernel (solve_ex without the speculative kernel) all return
    ?gtsv's bits; where ?gtsv reports a zero pivot, each raises at its pivot."""
    args = make_family(family, n, dtype, k, seed=n + FAMILIES.index(family))
    expected, info = gtsv(*args)
    what = f"{family}, n={n}, {dtype}, k={k}"
    if info > 0:
        assert_raises_lapack_pivot(args, info, what)
        return
    x, code = T.cpp_solve(*args)
    assert int(code) == -1
    assert_same_bits(x, expected, f"cpp_solve, {what}")
    for min_n in (0, MIN_N, SEQUENTIAL):
        x, _ = compiled.solve_ex(*args, speculative_min_n=min_n)
        assert_same_bits(x, expected, f"speculative_min_n={min_n}, {what}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("zeros", ["random_signs", "negative"])
def test_signed_zeros_match_lapack(dtype, zeros):
    """A right-hand side of signed zeros: x is all zeros, and ?gtsv's signs of them are the
    answer's bits as much as any other value (a check that compares -0.0 == 0.0 must not let a
    wrong sign through)."""
    n = 5000
    lower, diag, upper, _ = make_family("random", n, dtype, seed=0)
    g = torch.Generator().manual_seed(1)
    if zeros == "negative":
        rhs = torch.full((n,), -0.0, dtype=dtype)
    else:
        rhs = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0).to(dtype)
    args = (lower, diag, upper, rhs)
    expected, info = gtsv(*args)
    assert info == 0
    assert_same_bits(compiled.solve_ex(*args, speculative_min_n=SEQUENTIAL)[0], expected,
                     f"sequential, {zeros}, n={n}, {dtype}")
    assert_same_bits(compiled.solve_ex(*args)[0], expected, f"speculative, {zeros}, n={n}, {dtype}")


# ----------------------------------------------------------------------------------------------
# 2. Forced onto small systems.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("family", ["pivoting", "random", "zero_diagonal"])
@pytest.mark.parametrize("n", [2, 3, 17, 64, 130, 256, 300])
def test_forced_on_small_systems_equals_sequential(n, family, dtype):
    """speculative_min_n=0 at small n (pieces too short are handed back, as a fallback) gives
    the sequential kernel's bits, which are ?gtsv's."""
    args = make_family(family, n, dtype, 2, seed=n)
    expected, info = gtsv(*args)
    if info > 0:
        assert_raises_lapack_pivot(args, info, f"{family}, n={n}")
        return
    x, fallbacks = compiled.solve_ex(*args, speculative_min_n=0)
    sequential, none = compiled.solve_ex(*args, speculative_min_n=SEQUENTIAL)
    assert none == 0
    assert fallbacks in (0, 1)
    if n <= 17:  # pieces of at most 3 rows: too short
        assert fallbacks == 1
    assert_same_bits(x, sequential, f"{family}, n={n}, {dtype}")
    assert_same_bits(sequential, expected, f"{family}, n={n}, {dtype}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [10_007, 100_003])
@pytest.mark.parametrize("margin", [1e-1, 1e-2, 1e-4, 0.0])
def test_slowly_forgetting_matrices_match_lapack(dtype, n, margin):
    """A matrix close to the 1-D Laplacian (diagonal 2 + margin, off-diagonals -1 times
    1 + 0.01 N): elimination forgets its start slowly, or not at all for margin 0, so the
    repairs run past the first and last 64 rows of a piece that the workspace keeps (the kernel
    then solves again with every row kept) or through whole pieces. ?gtsv's bits all the same,
    from cpp_solve (driver=None's kernel) and from tridiagonal_solve."""
    g = torch.Generator().manual_seed(n)
    off = [-(1 + 0.01 * torch.randn(n - 1, generator=g, dtype=torch.float64)) for _ in range(2)]
    diag = torch.full((n,), 2.0 + margin, dtype=torch.float64)
    rhs = torch.randn(n, generator=g, dtype=torch.float64)
    args = [t.to(dtype) for t in (off[0], diag, off[1], rhs)]
    expected, info = gtsv(*args)
    assert info == 0
    assert_same_bits(T.cpp_solve(*args)[0], expected, f"cpp_solve, margin {margin}")
    assert_same_bits(tridiagonal_solve(*args), expected, f"tridiagonal_solve, margin {margin}")


def test_cpp_solve_threshold_is_speculative_min_n():
    """cpp_solve (driver=None's C++ kernel) sends a system to the speculative kernel from the
    size that compiled.SPECULATIVE_MIN_N states: the C++ constant is the same number."""
    source = os.path.join(os.path.dirname(compiled.__file__), "csrc", "tridiag.cpp")
    if not os.path.exists(source):
        pytest.skip("the C++ source is not installed beside the package")
    with open(source) as f:
        text = f.read()
    assert f"constexpr int64_t kSpeculativeMinN = {compiled.SPECULATIVE_MIN_N};" in text
    assert "solve_counted(lower, diag, upper, rhs, kSpeculativeMinN, fallbacks)" in text


# ----------------------------------------------------------------------------------------------
# 3. The fallback count.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_no_fallback_on_a_large_dominant_system(dtype):
    """A diagonally dominant system of 10^5 unknowns: every repair agrees within its piece."""
    args = make_family("dominant", 100_000, dtype, 1, seed=3)
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == 0
    assert_same_bits(x, gtsv(*args)[0])


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2])
def test_zero_diagonal_whatever_the_fallbacks(dtype, k):
    """Interchanges at every step (the repairs may never agree): whatever the count says (0 or
    1 for one system), x is ?gtsv's."""
    args = make_family("zero_diagonal", 100_000, dtype, k, seed=4)
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks in (0, 1)
    assert_same_bits(x, gtsv(*args)[0])


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


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["zero_column", "zero_row", "nan_diag", "nan_rhs"])
def test_singular_or_nan_counts_a_fallback(dtype, case):
    """A zero pivot, or a NaN in the answer, hands the system to the sequential kernel: the
    count is at least 1, and the op reports ?gtsv's pivot or returns its NaNs."""
    n = 10_000
    args = make_family("pivoting", n, dtype, 1, seed=6)
    if case.startswith("nan"):
        (args[1] if case == "nan_diag" else args[3])[n // 3] = NAN
    else:
        singular_edit(args, case, n // 3)
    expected, info = gtsv(*args)
    x, code, fallbacks = T.cpp_solve_ex(*args, MIN_N)
    assert int(fallbacks) >= 1
    if info > 0:
        assert int(code) == info - 1
    else:
        assert int(code) == -1 and torch.isnan(expected).any()
        assert_same_bits(x, expected, case)


# ----------------------------------------------------------------------------------------------
# 4. Singular matrices.
# ----------------------------------------------------------------------------------------------
def singular_positions(n, dtype):
    """Rows 0, 511, 512, 1023, 1024, the middle of a piece, both sides of the middle piece
    boundary (with and without AVX2) and the last rows (fitting ``half_row``'s i + 1 < n)."""
    rows = {0, 511, 512, 1023, 1024, n - 2}
    for b in middle_boundaries(n, dtype):
        rows |= {b - 2, b - 1, b, b + 1, b + piece_rows(n, dtype, BLOCK[dtype]) // 2}
    return sorted(r for r in rows if 0 <= r <= n - 2)


SINGULAR = [(dtype, construction, n, i) for dtype in REAL_DTYPES
            for construction in ("zero_column", "zero_row", "half_row")
            for n in (4099, 10_007) for i in singular_positions(n, dtype)]


@pytest.mark.parametrize("dtype, construction, n, i", SINGULAR,
                         ids=[f"{str(d)[6:]}-{c}-{n}-{i}" for d, c, n, i in SINGULAR])
def test_singular_raises_at_lapack_pivot(dtype, construction, n, i):
    """compiled.solve_ex (speculative, forced or not, and sequential), cpp_solve and
    tridiagonal_solve(driver="cpp") raise at ?gtsv's pivot, INFO - 1."""
    args = make_family("pivoting", n, dtype, 2, seed=i)
    singular_edit(args, construction, i)
    _, info = gtsv(*args)
    assert info > 0
    assert_raises_lapack_pivot(args, info, f"{construction} at {i}, n={n}, {dtype}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("construction", ["zero_column", "zero_row"])
def test_singular_at_the_last_row(dtype, construction):
    """A zero last row or column: ?gtsv's last pivot, U[n-1, n-1], is zero."""
    n = 4099
    args = make_family("dominant", n, dtype, 1, seed=8)
    singular_edit(args, construction, n - 1)
    _, info = gtsv(*args)
    assert info == n
    assert_raises_lapack_pivot(args, info, construction)


# ----------------------------------------------------------------------------------------------
# 5. NaN and infinity.
# ----------------------------------------------------------------------------------------------
def non_finite_cases():
    n = 4099
    cases = []
    for dtype in REAL_DTYPES:
        b = middle_boundaries(n, dtype)[-1]
        for band in ("lower", "diag", "upper", "rhs"):
            last = n - 1 if band in ("diag", "rhs") else n - 2
            for row in sorted({0, n // 3, b - 1, b, last}):
                for value in (NAN, INF, -INF):
                    cases.append((dtype, n, band, row, value))
    return cases


NON_FINITE = non_finite_cases()


@pytest.mark.parametrize("dtype, n, band, row, value", NON_FINITE,
                         ids=[f"{str(d)[6:]}-{b}[{r}]={v}" for d, _, b, r, v in NON_FINITE])
def test_non_finite_matches_lapack(dtype, n, band, row, value):
    """One NaN or infinity in a band or the rhs (column 0 of 2): ?gtsv's bits, NaN where NaN,
    or its pivot where it reports one; an answer that is not finite counts a fallback."""
    args = make_family("pivoting", n, dtype, 2, seed=row)
    index = (row, 0) if band == "rhs" else row
    args[("lower", "diag", "upper", "rhs").index(band)][index] = value
    expected, info = gtsv(*args)
    if info > 0:
        assert_raises_lapack_pivot(args, info, f"{band}[{row}] = {value}")
        return
    x, fallbacks = compiled.solve_ex(*args)
    assert_same_bits(x, expected, f"{band}[{row}] = {value}, n={n}, {dtype}")
    if not torch.isfinite(expected).all():
        assert fallbacks >= 1
    assert_same_bits(compiled.solve_ex(*args, speculative_min_n=SEQUENTIAL)[0], expected)


# ----------------------------------------------------------------------------------------------
# 6. Inputs: not modified; strided.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["pivoting", "zero_diagonal", "nan", "singular"])
def test_inputs_not_modified(dtype, case):
    """Neither the speculative kernel, nor its repairs, nor its hand-back, write the inputs."""
    n = 10_006
    args = make_family("zero_diagonal" if case == "zero_diagonal" else "pivoting", n, dtype, 3,
                       seed=9)
    if case == "nan":
        args[1][n // 2] = NAN
    elif case == "singular":
        singular_edit(args, "zero_column", n // 2)
    before = [t.clone() for t in args]
    if case == "singular":
        with pytest.raises(SingularMatrixError):
            compiled.solve_ex(*args)
    else:
        compiled.solve_ex(*args)
    for t, b in zip(args, before):
        assert_same_bits(t, b, case)


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("k", [None, 3], ids=lambda k: "vector" if k is None else f"k{k}")
def test_non_contiguous_inputs(dtype, k):
    """Bands that are every other element of a longer tensor, and a transposed (or strided)
    rhs, give the bits of the contiguous inputs."""
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
    expected = compiled.solve_ex(*args)[0]
    assert_same_bits(compiled.solve_ex(*strided)[0], expected)
    assert_same_bits(T.cpp_solve(*strided)[0], expected)
    assert_same_bits(expected, gtsv(*args)[0])


# ----------------------------------------------------------------------------------------------
# 7. Threads; the workspace kept between calls.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_bits_on_any_thread_count(dtype, threads):
    """Pieces, repairs and the hand-back spread over 1, 2 or 3 threads: ?gtsv's bits."""
    systems = [make_family("pivoting", 100_003, dtype, 1, seed=11),
               make_family("zero_diagonal", 10_006, dtype, 2, seed=12),
               make_family("random", 20_001, dtype, 3, seed=13)]
    expected = [gtsv(*args)[0] for args in systems]
    with num_threads(threads):
        for args, e in zip(systems, expected):
            assert_same_bits(compiled.solve_ex(*args)[0], e, f"{threads} threads")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", ["inside_a_tile", "between_tiles"])
def test_a_join_that_does_not_merge(dtype, threads, where):
    """The joins of the pieces are repaired tile by tile, each tile's by the thread that
    eliminated it, and the joins between tiles after; where one of them does not merge (here: 300
    rows of the 1-D Laplacian across it, where elimination forgets its start slowly), the kernel
    repairs every join again, phase by phase. Either way: ?gtsv's bits, in a dominant system."""
    n = 40_000
    with num_threads(threads):
        width = BLOCK[dtype]
        m = piece_rows(n, dtype, width)
        if where == "between_tiles":
            assert n > width * m, "the system has a second tile"
        join = m if where == "inside_a_tile" else width * m
        lower, diag, upper, rhs = make_family("dominant", n, dtype, 1, seed=21)
        diag[join - 150:join + 150] = 2
        lower[join - 150:join + 150] = upper[join - 150:join + 150] = -1
        expected = gtsv(lower, diag, upper, rhs)[0]
        assert_same_bits(compiled.solve_ex(lower, diag, upper, rhs)[0], expected,
                         f"{where}, {threads} threads")
        clean = compiled.solve_ex(*make_family("dominant", n, dtype, 1, seed=21))
        assert clean[1] == 0


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_workspace_kept_between_calls(dtype):
    """The workspace a thread keeps after a large solve full of NaN (k = 3) leaves nothing in
    the smaller solves that follow, with fewer right-hand sides and a padded last piece."""
    big = make_family("pivoting", 60_000, dtype, 3, seed=14)
    big[1][:] = NAN
    compiled.solve_ex(*big)
    for n, k in ((5001, 1), (MIN_N, 2), (20_011, None), (4099, 3)):
        args = make_family("pivoting", n, dtype, k, seed=n)
        assert_same_bits(compiled.solve_ex(*args)[0], gtsv(*args)[0], f"n={n}, k={k}")


# ----------------------------------------------------------------------------------------------
# 8. Small batches.
# ----------------------------------------------------------------------------------------------
def batch_of(size, n, dtype, k, family="pivoting"):
    systems = [make_family(family, n, dtype, k, seed=100 + s) for s in range(size)]
    return [torch.stack(parts) for parts in zip(*systems)]


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("size", ["2", "3", "block-1", "16"])
@pytest.mark.parametrize("k", [None, 2], ids=lambda k: "vector" if k is None else f"k{k}")
def test_small_batches_match_lapack(dtype, size, k):
    """Batches smaller than a block (each system on the speculative kernel) and of 16 systems
    (the block kernel): each system's x is ?gtsv's."""
    count = BLOCK[dtype] - 1 if size == "block-1" else int(size)
    args = batch_of(count, 5000, dtype, k)
    x, _ = compiled.solve_ex(*args)
    for s in range(count):
        assert_same_bits(x[s], gtsv(*(t[s] for t in args))[0], f"system {s} of {count}")


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("count, expected_fallbacks", [(3, 1), (16, 0)])
def test_small_batch_hands_back_only_the_bad_system(dtype, count, expected_fallbacks):
    """Dominant systems (no repair goes through a piece), a NaN in system 1: in a batch of 3 that
    one system is handed to the sequential kernel (one fallback), the others stay exact; a batch
    of 16 runs on the block kernel (no speculative system, no fallback)."""
    args = batch_of(count, 5000, dtype, 1, family="dominant")
    args[1][1, 2500] = NAN
    x, fallbacks = compiled.solve_ex(*args)
    assert fallbacks == expected_fallbacks
    for s in range(count):
        assert_same_bits(x[s], gtsv(*(t[s] for t in args))[0], f"system {s} of {count}")


# ----------------------------------------------------------------------------------------------
# 9. Gradients: what the op's backward would compute with the speculative kernel.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 2], ids=lambda k: "vector" if k is None else f"k{k}")
def test_gradients_match_dense(k):
    """The backward of x = A^{-1} b with the speculative kernel, v = A^{-T} w (one more solve,
    with the transposed bands) and the bands of -v x^T (rules.band_gradients), gives the four
    gradients of (x * w).sum() that the dense reference gives, at n = SPECULATIVE_MIN_N + 5."""
    n = MIN_N + 5
    args = make_system(n, (), k, seed=16, requires_grad=True)
    w = torch.randn(args[3].shape, generator=torch.Generator().manual_seed(17),
                    dtype=torch.float64)
    lower, diag, upper, rhs = (a.detach() for a in args)
    column = (lambda t: t.unsqueeze(-1)) if k is None else (lambda t: t)
    x, _ = compiled.solve_ex(lower, diag, upper, column(rhs))
    v, _ = compiled.solve_ex(upper, diag, lower, column(w))  # A^T: the bands trade places
    grads = (*rules.band_gradients(v, x), v.reshape(rhs.shape))

    def loss(x):
        return (x * w).sum()

    assert_grads_match_dense(grads, args, loss)


# ----------------------------------------------------------------------------------------------
# 10. The 16-byte lanes (plain x86-64, aarch64), on this CPU too.
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(bool(os.environ.get("TRIDIAG_TUTORIAL_NO_AVX2")), reason="already in it")
def test_sixteen_byte_lanes_match_lapack_too():
    """With TRIDIAG_TUTORIAL_NO_AVX2=1 the kernel uses the lanes of CPUs without AVX2 (and
    other piece sizes): the bit-for-bit, signed-zero, non-finite and singular tests pass there
    as well (run in a process of their own, since the choice is made when the library loads)."""
    env = dict(os.environ, TRIDIAG_TUTORIAL_NO_AVX2="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "bit_for_bit or signed_zeros or non_finite or singular or small_batches"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
