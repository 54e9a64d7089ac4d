"""The forward solve of every version against the dense reference, pivoting, errors, aliasing."""

import doctest

import pytest
import torch

import tridiag_tutorial
from tridiag_tutorial import to_dense, tridiag_matmul, tridiagonal_solve
from tridiag_tutorial.book.autograd_function import tridiagonal_solve_function
from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op
from tridiag_tutorial.reference import dense_solve

from conftest import ALL_DTYPES, REAL_DTYPES, assert_close, make_system

VERSIONS = {
    "final": tridiagonal_solve,
    "custom_op": tridiagonal_solve_custom_op,
    "autograd_function": tridiagonal_solve_function,
}


def reference(lower, diag, upper, rhs):
    """The dense solve in double precision (complex128 for complex inputs)."""
    wide = torch.complex128 if diag.dtype.is_complex else torch.float64
    return dense_solve(*(t.detach().to(wide) for t in (lower, diag, upper, rhs)))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)], ids=str)
@pytest.mark.parametrize("k", [None, 1, 4], ids=lambda k: "vector" if k is None else f"k={k}")
def test_matches_dense_reference(dtype, n, batch, k):
    lower, diag, upper, rhs = make_system(n, batch, k, dtype=dtype, seed=n)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    assert x.shape == rhs.shape and x.dtype == dtype
    assert_close(x, reference(lower, diag, upper, rhs).to(dtype), dtype)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("k", [None, 3])
def test_every_version_solves(version, k):
    lower, diag, upper, rhs = make_system(6, (2,), k, seed=1)
    assert_close(VERSIONS[version](lower, diag, upper, rhs), reference(lower, diag, upper, rhs))


@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
def test_residual_is_small(dtype):
    """An independent check for a larger n: the backward error |A x - b| / (|A| |x| + |b|).

    Gaussian elimination with partial pivoting is backward stable on tridiagonal matrices (the
    growth factor is at most 2), so the bound is a small multiple of the unit roundoff.
    """
    lower, diag, upper, rhs = make_system(2000, (2,), 3, dtype=dtype, seed=3)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    residual = tridiag_matmul(lower, diag, upper, x) - rhs
    scale = tridiag_matmul(lower.abs(), diag.abs(), upper.abs(), x.abs()) + rhs.abs()
    assert (residual.abs() / scale).max() <= 20 * torch.finfo(dtype).eps


def test_batch_dimensions_broadcast():
    n = 5
    lower, _, _, _ = make_system(n, (), seed=4)
    _, diag, _, _ = make_system(n, (2, 1), seed=5)
    _, _, upper, _ = make_system(n, (3,), seed=6)
    _, _, _, rhs = make_system(n, (2, 3), k=2, seed=7)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    assert x.shape == (2, 3, n, 2)
    for i in range(2):
        for j in range(3):
            expected = torch.linalg.solve(to_dense(lower, diag[i, 0], upper[j]), rhs[i, j])
            assert_close(x[i, j], expected)


def test_shared_matrix_many_vectors_as_columns():
    """One A and a batch of vectors: pass them as the k columns of a matrix rhs."""
    lower, diag, upper, _ = make_system(8, seed=8)
    vectors = torch.randn(5, 8, dtype=torch.float64)
    x = tridiagonal_solve(lower, diag, upper, vectors.T)
    assert_close(x.T, torch.stack([dense_solve(lower, diag, upper, v) for v in vectors]))


@pytest.mark.parametrize("version", VERSIONS)
def test_pivoting_hand_solved(version):
    """Zero on the diagonal: Gaussian elimination without pivoting divides by zero here.

    A = [[0, 2, 0],      x = [1, 2, 3]  gives  b = A x = [4, 10, 5].
         [1, 0, 3],
         [0, 1, 1]]
    """
    lower = torch.tensor([1.0, 1.0], dtype=torch.float64)
    diag = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    upper = torch.tensor([2.0, 3.0], dtype=torch.float64)
    rhs = torch.tensor([4.0, 10.0, 5.0], dtype=torch.float64)
    x = VERSIONS[version](lower, diag, upper, rhs)
    torch.testing.assert_close(x, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def test_pivoting_2x2_hand_solved():
    """[[0, 1], [1, 0]] x = [2, 3] swaps: x = [3, 2] (n = 2 bypasses SciPy's ?gttrf limits)."""
    one = torch.ones(1, dtype=torch.float64)
    x = tridiagonal_solve(one, torch.zeros(2, dtype=torch.float64), one,
                          torch.tensor([2.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(x, torch.tensor([3.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("version", VERSIONS)
def test_singular_2x2_raises(version):
    one = torch.ones(1, dtype=torch.float64)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        VERSIONS[version](one, torch.ones(2, dtype=torch.float64), one,
                          torch.ones(2, dtype=torch.float64))


def test_singular_1x1_raises():
    """n = 1: SciPy's ?gtsv wrapper cannot even be called (regression: 'unexpected array size')."""
    empty = torch.zeros(0)
    with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\]"):
        tridiagonal_solve(empty, torch.zeros(1), empty, torch.ones(1))
    x = tridiagonal_solve(empty, torch.tensor([4.0]), empty, torch.tensor([2.0]))
    torch.testing.assert_close(x, torch.tensor([0.5]))


def test_singular_batch_element_is_named():
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=9)
    diag[1, 2] = 0.0
    lower[1, 2] = 0.0  # column 0 of system (1, 2) is now all zeros: singular at pivot 0
    with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\].*batch element \(1, 2\)"):
        tridiagonal_solve(lower, diag, upper, rhs)


BAD_INPUTS = {
    "mixed dtypes": (TypeError, "same dtype.*float32.*float64",
                     lambda l, d, u, r: (l.float(), d, u, r)),
    "integer dtype": (TypeError, "torch.int64 is not supported",
                      lambda l, d, u, r: (l.long(), d.long(), u.long(), r.long())),
    "half precision": (TypeError, "torch.float16 is not supported",
                       lambda l, d, u, r: (l.half(), d.half(), u.half(), r.half())),
    "not a tensor": (TypeError, "rhs must be a torch.Tensor, got list",
                     lambda l, d, u, r: (l, d, u, r.tolist())),
    "mixed devices": (ValueError, "same device.*meta",
                      lambda l, d, u, r: (l, d, u, r.to("meta"))),
    "short lower": (ValueError, r"n-1 = 4 .*lower\(3,\)", lambda l, d, u, r: (l[:-1], d, u, r)),
    "long upper": (ValueError, r"n-1 = 4 .*upper\(5,\)",
                   lambda l, d, u, r: (l, d, torch.cat([u, u[:1]]), r)),
    "rhs rows": (ValueError, r"rhs must have n = 5 rows.*rhs\(4,\)",
                 lambda l, d, u, r: (l, d, u, r[:-1])),
    "rhs matrix rows": (ValueError, r"n = 5 rows \(its second-to-last.*rhs\(4, 2\)",
                        lambda l, d, u, r: (l, d, u, torch.ones(4, 2, dtype=r.dtype))),
    "rhs ndim": (ValueError, r"rhs must have diag.ndim = 1 dimensions.*rhs\(1, 5, 2\)",
                 lambda l, d, u, r: (l, d, u, torch.ones(1, 5, 2, dtype=r.dtype))),
    "scalar diag": (ValueError, "diag must have at least one dimension",
                    lambda l, d, u, r: (l, d[0], u, r)),
    "empty matrix": (ValueError, "at least 1 x 1",
                     lambda l, d, u, r: (l[:0], d[:0], u[:0], r[:0])),
    "batch mismatch": (ValueError, r"do not broadcast.*diag\(3, 5\).*rhs\(2, 5\)",
                       lambda l, d, u, r: (l, d.expand(3, 5), u, r.expand(2, 5))),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_clear_error(version, case):
    error, message, corrupt = BAD_INPUTS[case]
    args = corrupt(*make_system(5, seed=10))
    with pytest.raises(error, match=message):
        VERSIONS[version](*args)


def test_inputs_are_not_modified():
    # Pivoting rewrites LAPACK's arrays in place; a zero diagonal forces row swaps.
    lower, diag, upper, rhs = make_system(6, (2,), 3, seed=11)
    diag[:, 0] = 0.0
    before = [t.clone() for t in (lower, diag, upper, rhs)]
    for solve in VERSIONS.values():
        solve(lower, diag, upper, rhs)
    for t, b in zip((lower, diag, upper, rhs), before):
        assert torch.equal(t, b)


def test_non_contiguous_and_strided_inputs():
    n = 6
    g = torch.Generator().manual_seed(12)
    big = torch.randn(4, 3 * n, dtype=torch.float64, generator=g)
    lower = big[:, : 2 * (n - 1) : 2]              # stride 2 along the band
    diag = 4 + big[:, n: 2 * n].abs()
    upper = big.flip(-1)[:, : n - 1]                # negative-stride source, flipped view
    rhs = torch.randn(4, 2, n, dtype=torch.float64, generator=g).mT  # (4, n, 2), transposed
    assert not (lower.is_contiguous() and rhs.is_contiguous())
    x = tridiagonal_solve(lower, diag, upper, rhs)
    assert_close(x, reference(lower, diag, upper, rhs))


def test_output_is_a_new_tensor():
    lower, diag, upper, rhs = make_system(4, seed=13)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    assert x.data_ptr() not in {t.data_ptr() for t in (lower, diag, upper, rhs)}


def test_empty_batch():
    lower, diag, upper, rhs = make_system(4, (0,), k=2)
    assert tridiagonal_solve(lower, diag, upper, rhs).shape == (0, 4, 2)


def test_large_system_is_linear_time():
    """n = 10^6 would need 8 TB densely; the banded solve is exact to rounding."""
    n = 10**6
    lower, diag, upper, rhs = make_system(n, seed=14)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    residual = tridiag_matmul(lower, diag, upper, x.unsqueeze(-1)).squeeze(-1) - rhs
    assert residual.abs().max() < 1e-8


@pytest.mark.parametrize("module", ["api", "reference"])
def test_docstring_examples_run(module):
    mod = getattr(tridiag_tutorial, module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
