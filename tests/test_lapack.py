"""The LAPACK layer on its own: NumPy in, NumPy out, small n, trans, info handling, no aliasing."""

import numpy as np
import pytest
import torch

from tridiag_tutorial import lapack

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
