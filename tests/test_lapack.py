"""The LAPACK layer on its own: NumPy in, NumPy out, small n, trans, info handling, no aliasing."""

import numpy as np
import pytest
import torch

from tridiag_tutorial.kernels import lapack

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
TOL = {np.float32: 2e-4, np.complex64: 2e-4, np.float64: 1e-11, np.complex128: 1e-11}


def random_bands(n, dtype, k=None, seed=0):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        x = rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 1j * rng.standard_normal(shape)
        return x.astype(dtype)

    diag = draw(n) + 3 * np.sign(rng.standard_normal(n))
    b = draw(n) if k is None else draw(n, k)
    return draw(n - 1), diag.astype(dtype), draw(n - 1), b


def dense(dl, d, du):
    return np.diag(d) + np.diag(dl, -1) + np.diag(du, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [None, 3])
def test_gtsv_matches_numpy(dtype, n, k):
    dl, d, du, b = random_bands(n, dtype, k, seed=n)
    x = lapack.gtsv(dl, d, du, b)
    assert x.shape == b.shape and x.dtype == dtype and x.flags["C_CONTIGUOUS"]
    expected = np.linalg.solve(dense(dl, d, du).astype(np.complex128), b.astype(np.complex128))
    np.testing.assert_allclose(x, expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("trans", ["N", "T", "C"])
def test_gttrf_gttrs_all_transposes(dtype, n, trans):
    dl, d, du, b = random_bands(n, dtype, 2, seed=10 + n)
    factors = lapack.gttrf(dl, d, du)
    x = lapack.gttrs(factors, b, trans)
    a = dense(dl, d, du).astype(np.complex128)
    op = {"N": a, "T": a.T, "C": a.conj().T}[trans]
    np.testing.assert_allclose(x, np.linalg.solve(op, b), rtol=TOL[dtype], atol=TOL[dtype])
    # the same factors serve a vector right-hand side too
    assert lapack.gttrs(factors, b[:, 0], trans).shape == (n,)


def test_inputs_are_not_overwritten():
    dl, d, du, b = random_bands(5, np.float64, 2)
    d[0] = 0.0  # forces a row interchange, which rewrites LAPACK's working arrays
    copies = [a.copy() for a in (dl, d, du, b)]
    lapack.gtsv(dl, d, du, b)
    factors = lapack.gttrf(dl, d, du)
    lapack.gttrs(factors, b, "T")
    for a, c in zip((dl, d, du, b), copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_singular_raises_linalg_error_with_pivot(n):
    dl, d, du, b = random_bands(n, np.float64)
    d[-1], dl[-1:] = 0.0, 0.0  # last column zero below the diagonal and on it
    if n > 1:
        du[-1] = 0.0
    with pytest.raises(torch.linalg.LinAlgError, match=rf"U\[{n - 1}, {n - 1}\] is exactly zero"):
        lapack.gtsv(dl, d, du, b)
    with pytest.raises(torch.linalg.LinAlgError, match="gttrf"):
        lapack.gttrf(dl, d, du)


def test_bad_trans_raises_value_error():
    factors = lapack.gttrf(*random_bands(4, np.float64)[:3])
    with pytest.raises(ValueError, match="trans must be 'N', 'T' or 'C'"):
        lapack.gttrs(factors, np.ones(4), "X")


def test_batched_solve_names_the_singular_element():
    rng = np.random.default_rng(1)
    dl, du = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    d = rng.standard_normal((2, 3, 5)) + 5
    b = rng.standard_normal((2, 3, 5, 1))
    d[0, 2, 0], dl[0, 2, 0] = 0.0, 0.0
    with pytest.raises(torch.linalg.LinAlgError, match=r"batch element \(0, 2\)"):
        lapack.solve(dl, d, du, b)


# --- Issue 23: no cliffs, exact joins, 64-bit offsets ---------------------------------------------
# One non-finite or overflowing system in a batch used to make solve, factor and factor_solve call
# LAPACK once per system (3.6 s instead of 0.03 s for a (100000, 8) factor). The batch is now
# joined in chunks and a bad chunk is settled by splitting it; these tests count LAPACK calls and
# compare every result bit for bit with per-system calls, instead of timing anything.

class _CountingRoutines:
    """Wraps ``get_lapack_funcs`` in :mod:`lapack`: records ``(routine, rows)`` of every call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = lapack.get_lapack_funcs

        def get_lapack_funcs(names, arrays):
            return tuple(self._wrap(r, r.typecode + n) for n, r in zip(names, real(names, arrays)))

        monkeypatch.setattr(lapack, "get_lapack_funcs", get_lapack_funcs)

    def _wrap(self, routine, name):
        calls = self.calls

        class Counted:
            typecode, dtype = routine.typecode, routine.dtype

            def __call__(self, *args, **kwargs):
                rows = args[3].shape[0] if name.endswith("gttrs") else args[1].shape[0]
                calls.append((name, rows))
                return routine(*args, **kwargs)

        return Counted()

    def rows(self):
        return sum(r for _, r in self.calls)


def _bits(a):
    """The bytes of an array (so -0.0 != 0.0 and NaN payloads count), with its shape and dtype."""
    a = np.asarray(a)
    return a.shape, a.dtype, np.ascontiguousarray(a).tobytes()


def _dirty_batch(n, size=300, k=2, seed=0):
    """Random bands (no diagonal dominance: pivoting happens) with, among clean systems, NaN and
    infinite entries, a system whose solution overflows and one with a huge but finite solution."""
    rng = np.random.default_rng(seed)
    dl, du = rng.standard_normal((size, n - 1)), rng.standard_normal((size, n - 1))
    d, b = rng.standard_normal((size, n)), rng.standard_normal((size, n, k))
    d[5, -1] = np.nan  # a NaN last pivot: ?gttrf would interchange it with the next block's row
    d[17, 0] = np.nan
    b[100, 0, -1] = np.inf
    if n > 1:
        dl[50, 0], d[50] = np.inf, d[50] + 10
    dl[200], du[200], d[200], b[200] = 0.0, 0.0, 1e-300, 1e300  # finite inputs, x overflows
    d[201, -1] = 1e-300  # a large finite solution
    return dl, d, du, b


def _alone(dl, d, du, b, trans="N"):
    """Per-system calls: each system solved, factored and solved from its factors on its own."""
    x = np.stack([lapack.solve(dl[i], d[i], du[i], b[i]) for i in range(len(d))])
    factors = [lapack.factor(dl[i], d[i], du[i]) for i in range(len(d))]
    lu, piv = np.stack([f[0] for f in factors]), np.stack([f[1] for f in factors])
    y = np.stack([lapack.factor_solve(lu[i], piv[i], b[i], trans) for i in range(len(d))])
    return x, lu, piv, y


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk_rows", [None, 40, 7])
def test_batch_is_bit_identical_to_each_system_alone(monkeypatch, n, chunk_rows):
    """Finite systems give bit for bit what they give alone (no -0.0 for a +0.0 coupling, no
    leak), and so do the NaN, infinite and overflowing ones, whatever the chunking."""
    if chunk_rows is not None:
        monkeypatch.setattr(lapack, "_CHUNK_ROWS", chunk_rows, raising=False)
    dl, d, du, b = _dirty_batch(n)
    x, lu, piv, y = _alone(dl, d, du, b, "T")
    assert not np.isfinite(x[200]).all() and np.isfinite(np.delete(x, [5, 17, 50, 100, 200], 0)).all()
    assert _bits(lapack.solve(dl, d, du, b)) == _bits(x)
    lu_batch, piv_batch = lapack.factor(dl, d, du)
    assert _bits(lu_batch) == _bits(lu) and _bits(piv_batch) == _bits(piv)
    assert _bits(lapack.factor_solve(lu, piv, b, "T")) == _bits(y)


def test_one_bad_system_costs_a_few_lapack_calls_not_one_per_system(monkeypatch):
    """One NaN or overflowing system among 1000 (n = 8, one chunk) costs O(log) extra calls and
    about one batch of extra rows; it used to cost 1000 calls, one per system."""
    size, n = 1000, 8
    rng = np.random.default_rng(3)
    dl, du = rng.standard_normal((2, size, n - 1))
    d, b = rng.standard_normal((size, n)) + 4, rng.standard_normal((size, n, 1))
    lu, piv = lapack.factor(dl, d, du)
    nan_d, nan_b = d.copy(), b.copy()
    nan_d[400, 3], nan_b[400, 2, 0] = np.nan, np.nan
    big_d, big_b = d.copy(), b.copy()
    big_d[600], big_b[600] = 1e-300, 1e300  # finite inputs, overflowing solution
    nan_lu = lu.copy()
    nan_lu[400, 1, 3] = np.nan
    cases = {
        "solve, NaN": lambda: lapack.solve(dl, nan_d, du, b),
        "solve, NaN rhs": lambda: lapack.solve(dl, d, du, nan_b),
        "solve, overflow": lambda: lapack.solve(dl, big_d, du, big_b),
        "factor, NaN": lambda: lapack.factor(dl, nan_d, du),
        "factor_solve, NaN factors": lambda: lapack.factor_solve(nan_lu, piv, b),
        "factor_solve, NaN rhs": lambda: lapack.factor_solve(lu, piv, nan_b),
        "factor_solve, overflow": lambda: lapack.factor_solve(lu, piv, big_b * 1e8),
    }
    for name, call in cases.items():
        counter = _CountingRoutines(monkeypatch)
        call()
        split = getattr(lapack, "_SPLIT", 8)  # (getattr: so that this test ran on the old code)
        levels = int(np.ceil(np.log(size) / np.log(split)))
        assert len(counter.calls) <= 4 + split * levels, (name, len(counter.calls))
        assert counter.rows() <= 2.5 * size * n, (name, counter.rows())
        monkeypatch.undo()


def test_bad_system_costs_about_one_chunk_more(monkeypatch):
    """With many chunks, a bad system makes only its own chunk be solved again."""
    monkeypatch.setattr(lapack, "_CHUNK_ROWS", 80, raising=False)  # 10 systems of n = 8 per call
    size, n = 1000, 8
    rng = np.random.default_rng(4)
    dl, du = rng.standard_normal((2, size, n - 1))
    d, b = rng.standard_normal((size, n)) + 4, rng.standard_normal((size, n, 1))
    dl[203], du[203], d[203], b[203] = 0.0, 0.0, 1e-300, 1e300  # in chunk 20, x overflows
    counter = _CountingRoutines(monkeypatch)
    x = lapack.solve(dl, d, du, b)
    # 100 chunks; chunk 20 again in 8 parts (of 1 or 2 systems), the part (203, 204) in 2
    assert len(counter.calls) == size * n // 80 + 8 + 2  # 8: lapack._SPLIT
    assert counter.rows() == size * n + 80 + 2 * n
    assert _bits(x[202:205]) == _bits(np.stack([lapack.solve(dl[i], d[i], du[i], b[i])
                                                for i in range(202, 205)]))
    assert not np.isfinite(x[203]).any() and np.isfinite(np.delete(x, 203, 0)).all()


def test_chunks_bound_the_rows_of_every_lapack_call(monkeypatch):
    """No joined call holds more than the cap on rows (LAPACK's 32-bit ipiv; here lowered to 20),
    and per-chunk pivot offsets still give each system its own results."""
    monkeypatch.setattr(lapack, "_LAPACK_MAX_ROWS", 20, raising=False)
    monkeypatch.setattr(lapack, "_CHUNK_ROWS", 10**9, raising=False)
    dl, d, du, b = _dirty_batch(6)
    x, lu, piv, y = _alone(dl, d, du, b)
    counter = _CountingRoutines(monkeypatch)
    assert _bits(lapack.solve(dl, d, du, b)) == _bits(x)
    lu_batch, piv_batch = lapack.factor(dl, d, du)
    assert _bits(lu_batch) == _bits(lu) and _bits(piv_batch) == _bits(piv)
    assert _bits(lapack.factor_solve(lu, piv, b)) == _bits(y)
    assert max(rows for _, rows in counter.calls) == 18  # three systems of 6 rows


def test_chunk_and_offset_arithmetic_for_sizes_beyond_int32():
    """batch x n >= 2**31: offsets in 64 bits, and no call joins more than 2**31 - 1 rows."""
    size, n = 2**21, 2**11  # 2**32 rows in all
    bounds = lapack._chunk_bounds(size, n, max_rows=2**40)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert max((b - a) * n for a, b in bounds) <= 2**31 - 1 == lapack._LAPACK_MAX_ROWS
    assert len(bounds) == 3  # (2**31 - 1) // 2**11 = 2**20 - 1 systems per call
    assert max((b - a) * n for a, b in lapack._chunk_bounds(size, n)) <= lapack._CHUNK_ROWS
    offsets = lapack._block_offsets(2**20, 2**12)
    assert offsets.dtype == np.int64 and int(offsets[-1]) == (2**20 - 1) * 2**12 > 2**31
    assert lapack._chunk_bounds(3, 2**31 - 1) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="32-bit"):
        lapack._chunk_bounds(1, 2**31)


@pytest.mark.parametrize("n", [1, 2])
def test_small_system_with_nan_last_pivot_is_not_called_singular(n):
    """n < 3 is padded for SciPy's wrappers; padded below, a NaN last pivot was interchanged with
    an identity row and ?gttrf reported an exact zero pivot. LAPACK on the n x n system does not."""
    dl, du = np.zeros(n - 1), np.zeros(n - 1)
    d = np.ones(n)
    d[-1] = np.nan
    lu, piv = lapack.factor(dl, d, du)
    assert np.isnan(lu[1, -1]) and piv.tolist() == list(range(1, n + 1))
    assert np.isnan(lapack.factor_solve(lu, piv, np.ones((n, 1)))[-1, 0])
    assert np.isnan(lapack.gttrs(lapack.gttrf(dl, d, du), np.ones(n))[-1])


def test_factor_solve_ignores_the_padding_of_lu():
    """lu's padding entries (dl[n-1], du[n-1], du2[n-2:]) are not part of any system: nonzero
    values there must not couple consecutive systems of a batch."""
    rng = np.random.default_rng(5)
    dl, du, d = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 5))
    b = rng.standard_normal((6, 5, 1))
    lu, piv = lapack.factor(dl, d, du)
    x = lapack.factor_solve(lu, piv, b)
    padded = lu.copy()
    padded[:, 0, -1] = padded[:, 2, -1] = 7.0
    padded[:, 3, -2:] = -3.0
    assert _bits(lapack.factor_solve(padded, piv, b)) == _bits(x)


@pytest.mark.parametrize("routine", ["solve", "factor"])
def test_error_names_the_first_singular_system_in_batch_order(monkeypatch, routine):
    """NaN and overflowing systems before and after a singular one, in one chunk and in many:
    the error names the singular system and its own pivot, not a leaked or interchanged row."""
    for chunk_rows in (None, 16):
        if chunk_rows:
            monkeypatch.setattr(lapack, "_CHUNK_ROWS", chunk_rows, raising=False)
        dl, d, du, b = _dirty_batch(4, size=300, k=1)
        du[230, 1], d[230, 2], dl[230, 2] = 0.0, 0.0, 0.0  # column 2 of system 230 is zero
        expected = r"pivot U\[2, 2\] is exactly zero, in batch element \(230,\)"
        with pytest.raises(torch.linalg.LinAlgError, match=expected):
            getattr(lapack, routine)(dl, d, du, *([b] if routine == "solve" else []))
        dl[120], d[120], du[120] = 0.0, 0.0, 0.0  # an all-zero system earlier: U[0, 0]
        with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\] .*\(120,\)"):
            getattr(lapack, routine)(dl, d, du, *([b] if routine == "solve" else []))
