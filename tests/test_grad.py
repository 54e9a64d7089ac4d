"""Gradients: gradcheck/gradgradcheck in float64, the dense reference, and opcheck."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from tridiag_tutorial import kernels, tridiagonal_solve
from tridiag_tutorial._schemas import lu_factor_op as _factor_op
from tridiag_tutorial._schemas import solve_kernel_op as _kernel_op
from tridiag_tutorial.api import _factors
from tridiag_tutorial.book.autograd_function import tridiagonal_solve_function
from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op, tridiagonal_solve_op
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, make_system

SHAPES = {  # (n, batch, k): vector and matrix rhs, batches, the small-n special cases
    "n1-vector": (1, (), None),
    "n2-vector": (2, (), None),
    "n5-matrix": (5, (), 3),
    "batch-vector": (4, (2,), None),
    "batch-matrix": (3, (2, 2), 2),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("solve", [tridiagonal_solve, tridiagonal_solve_custom_op],
                         ids=["final", "custom_op"])
def test_gradcheck_and_gradgradcheck(solve, shape):
    args = make_system(*SHAPES[shape], requires_grad=True, seed=1)
    assert gradcheck(solve, args)
    assert gradgradcheck(solve, args)


def test_gradcheck_broadcast_inputs():
    """Gradients of broadcast inputs are summed over the batch they were broadcast to."""
    lower = make_system(4, (), requires_grad=True)[0]
    _, diag, _, _ = make_system(4, (1, 3), requires_grad=True, seed=2)  # diag sets the rank
    _, _, upper, rhs = make_system(4, (2, 3), 2, requires_grad=True, seed=3)
    assert gradcheck(tridiagonal_solve, (lower, diag, upper, rhs))
    assert gradgradcheck(tridiagonal_solve, (lower, diag, upper, rhs))


def test_chapter4_function_gradcheck():
    args = make_system(5, (2,), 2, requires_grad=True, seed=4)
    assert gradcheck(tridiagonal_solve_function, args)


def test_chapter4_function_has_no_second_derivative():
    """Its backward calls NumPy, so it is once_differentiable: double backward must raise."""
    args = make_system(4, requires_grad=True, seed=5)
    grads = torch.autograd.grad(tridiagonal_solve_function(*args).pow(2).sum(), args,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        grads[1].sum().backward()
    assert not gradgradcheck(tridiagonal_solve_function, args, raise_exception=False)


@pytest.mark.parametrize("solve", [tridiagonal_solve, tridiagonal_solve_custom_op,
                                   tridiagonal_solve_function],
                         ids=["final", "custom_op", "autograd_function"])
@pytest.mark.parametrize("k", [None, 3])
def test_gradients_match_dense_autograd(solve, k):
    args = make_system(9, (2,), k, requires_grad=True, seed=6)
    weights = torch.randn(args[3].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((solve(*args) * weights).sum(), args)
    expected = torch.autograd.grad((dense_solve(*args) * weights).sum(), args)
    for g, e in zip(grads, expected):
        assert_close(g, e)


def test_second_derivatives_match_dense():
    args = make_system(6, (), 2, requires_grad=True, seed=7)

    def hessian_vector(solve):
        (g_diag,) = torch.autograd.grad(solve(*args).pow(3).sum(), args[1], create_graph=True)
        return torch.autograd.grad((g_diag * torch.arange(6.0, dtype=torch.float64)).sum(), args)

    for h, e in zip(hessian_vector(tridiagonal_solve), hessian_vector(dense_solve)):
        assert_close(h, e)


def test_only_requested_gradients_flow():
    lower, diag, upper, rhs = make_system(5, seed=8)
    rhs.requires_grad_()
    tridiagonal_solve(lower, diag, upper, rhs).sum().backward()
    assert rhs.grad is not None and lower.grad is None and diag.grad is None


@pytest.mark.parametrize("k", [1, 3])
def test_opcheck(k):
    """Schema, autograd registration, fake tensor and AOT dispatch (not gradient correctness)."""
    lower, diag, upper, rhs = make_system(5, (2,), k, requires_grad=True, seed=9)
    result = torch.library.opcheck(tridiagonal_solve_op, (lower, diag, upper, rhs))
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_strided_rhs():
    """The fake kernel must give the real kernel's strides even for a transposed rhs."""
    lower, diag, upper, _ = make_system(5, (2,), seed=10)
    rhs = torch.randn(2, 3, 5, dtype=torch.float64).mT
    result = torch.library.opcheck(tridiagonal_solve_op, (lower, diag, upper, rhs))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("kernel", ["lapack", "torch", "partitioned"])
@pytest.mark.parametrize("factors, trans", [(False, "N"), (True, "N"), (True, "T"), (True, "C")],
                         ids=["bands", "factors-N", "factors-T", "factors-C"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed-rhs"])
def test_opcheck_kernel_ops(kernel, factors, trans, strided):
    """The compiled path's ops: schema, fake kernels (shapes, dtypes, strides), vmap, AOT.
    ``"partitioned"``: the torch kernels at a size that takes the partitioned kernel."""
    n = kernels.PARTITIONED_MIN_N + 3 if kernel == "partitioned" else 5
    lower, diag, upper, rhs = make_system(n, (2,), 3, dtype=torch.complex128, seed=11)
    if strided:
        rhs = rhs.mT.contiguous().mT
    driver = "lapack" if kernel == "lapack" else "sequential"
    result = torch.library.opcheck(_factor_op, (lower, diag, upper, driver))
    assert set(result.values()) == {"SUCCESS"}, result
    lu, pivots = _factors(lower, diag, upper, driver) if factors else (None, None)
    if not factors and kernel == "partitioned":
        driver = "partitioned"
    result = torch.library.opcheck(
        _kernel_op, (lower, diag, upper, rhs, lu, pivots, trans, driver))
    assert set(result.values()) == {"SUCCESS"}, result
