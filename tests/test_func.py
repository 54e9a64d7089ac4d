"""torch.func transforms, forward-mode AD and complex numbers, each against the dense reference."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

from tridiag_tutorial import tridiagonal_solve
from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, make_system, torch_trap

ARGNUMS = (0, 1, 2, 3)


def plain(*args):
    return [a.detach() for a in args]


def loss_of(solve):
    return lambda *a: (solve(*a) ** 3).sum()


@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("transform", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobians_match_dense(transform, k):
    """jacfwd here would be all zeros if tangents were silently dropped (the custom-op trap)."""
    args = make_system(5, (2,), k, seed=1)
    jac = transform(tridiagonal_solve, argnums=ARGNUMS)(*args)
    expected = transform(dense_solve, argnums=ARGNUMS)(*args)
    for j, e in zip(jac, expected):
        assert e.abs().max() > 0.1
        assert_close(j, e)


@torch_trap
def test_custom_op_version_jacfwd_is_silently_zero():
    """Pins the torch trap the final op exists to avoid (pytorch #168393 and related)."""
    args = make_system(4, seed=2)
    jac = jacfwd(tridiagonal_solve_custom_op, argnums=3)(*args)
    assert torch.count_nonzero(jac) == 0
    with pytest.raises(RuntimeError, match="setup_context"):
        grad(loss_of(tridiagonal_solve_custom_op), argnums=3)(*args)


def test_grad_and_grad_and_value():
    args = make_system(6, (3,), 2, seed=3)
    grads = grad(loss_of(tridiagonal_solve), argnums=ARGNUMS)(*args)
    (grads2, value) = grad_and_value(loss_of(tridiagonal_solve), argnums=ARGNUMS)(*args)
    expected = grad(loss_of(dense_solve), argnums=ARGNUMS)(*args)
    assert_close(value, loss_of(dense_solve)(*args))
    for g, g2, e in zip(grads, grads2, expected):
        assert_close(g, e)
        assert_close(g2, e)


def test_vjp_and_jvp():
    args = make_system(6, (2,), seed=4)
    cotangent = torch.randn(2, 6, dtype=torch.float64)
    tangents = tuple(torch.randn_like(a) for a in args)
    _, pullback = vjp(tridiagonal_solve, *args)
    _, pullback_dense = vjp(dense_solve, *args)
    for g, e in zip(pullback(cotangent), pullback_dense(cotangent)):
        assert_close(g, e)
    out, tangent_out = jvp(tridiagonal_solve, tuple(args), tangents)
    out_dense, tangent_dense = jvp(dense_solve, tuple(args), tangents)
    assert_close(out, out_dense)
    assert_close(tangent_out, tangent_dense)


@pytest.mark.parametrize("argnum", [0, 1, 2, 3])
def test_hessian_matches_dense(argnum):
    args = make_system(4, seed=5)
    h = hessian(loss_of(tridiagonal_solve), argnums=argnum)(*args)
    assert_close(h, hessian(loss_of(dense_solve), argnums=argnum)(*args))


def test_jacrev_of_jacrev_matches_dense():
    args = make_system(4, seed=6)
    f = lambda d: jacrev(loss_of(tridiagonal_solve), argnums=1)(args[0], d, args[2], args[3])
    fd = lambda d: jacrev(loss_of(dense_solve), argnums=1)(args[0], d, args[2], args[3])
    assert_close(jacrev(f)(args[1]), jacrev(fd)(args[1]))


IN_DIMS = {
    "lower": (0, None, None, None),
    "diag": (None, 0, None, None),
    "upper": (None, None, 0, None),
    "rhs": (None, None, None, 0),
    "all": (0, 0, 0, 0),
    "rhs-dim1": (None, None, None, 1),
}


@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("case", IN_DIMS)
def test_vmap_over_any_argument(case, k):
    in_dims = IN_DIMS[case]
    single = make_system(5, (), k, seed=7)
    batched = make_system(5, (3,), k, seed=8)
    args = [b if d == 0 else s for s, b, d in zip(single, batched, in_dims)]
    if in_dims[3] == 1:
        args[3] = batched[3].movedim(0, 1)
    out = vmap(tridiagonal_solve, in_dims=in_dims)(*args)
    expected = torch.stack([
        dense_solve(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)])
        for i in range(3)
    ])
    assert_close(out, expected)


def test_nested_vmap_and_batch_dims():
    args = make_system(4, (2, 3), 2, seed=9)
    out = vmap(vmap(tridiagonal_solve))(*args)
    assert_close(out, dense_solve(*args))


def test_per_example_gradients():
    """vmap(grad(...)): one gradient of the band per example, as in DP-SGD or Fisher estimates."""
    lower, diag, upper, _ = make_system(6, seed=10)
    examples = torch.randn(8, 6, dtype=torch.float64)
    targets = torch.randn(8, 6, dtype=torch.float64)

    def loss(solve, d, b, t):
        return ((solve(lower, d, upper, b) - t) ** 2).sum()

    per_example = vmap(grad(lambda d, b, t: loss(tridiagonal_solve, d, b, t)),
                       in_dims=(None, 0, 0))(diag, examples, targets)
    expected = torch.stack([grad(lambda d: loss(dense_solve, d, b, t))(diag)
                            for b, t in zip(examples, targets)])
    assert_close(per_example, expected)


@pytest.mark.parametrize("k", [None, 3])
def test_gradcheck_forward_ad_and_batched(k):
    args = make_system(5, (2,), k, requires_grad=True, seed=11)
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True, check_batched_grad=True,
                     check_batched_forward_grad=True)
    assert gradgradcheck(tridiagonal_solve, args, check_fwd_over_rev=True, check_rev_over_rev=True)


def test_forward_ad_dual_numbers():
    import torch.autograd.forward_ad as fwAD

    args = make_system(6, (2,), 2, seed=12)
    tangents = [torch.randn_like(a) for a in args]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
        tangent = fwAD.unpack_dual(tridiagonal_solve(*duals)).tangent
    _, expected = jvp(dense_solve, tuple(args), tuple(tangents))
    assert_close(tangent, expected)


def test_complex128_gradcheck():
    args = make_system(5, (2,), 2, dtype=torch.complex128, requires_grad=True, seed=13)
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True, check_batched_grad=True)
    assert gradgradcheck(tridiagonal_solve, args)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_gradients_use_conjugate_transpose(dtype):
    """PyTorch's convention: grad_rhs = A^{-H} g and grad_A = -grad_rhs x^H (dense autograd)."""
    args = make_system(7, (), 2, dtype=dtype, requires_grad=True, seed=14)
    loss = lambda solve: (solve(*args).abs() ** 2).sum()
    grads = torch.autograd.grad(loss(tridiagonal_solve), args)
    expected = torch.autograd.grad(loss(dense_solve), args)
    for g, e in zip(grads, expected):
        assert_close(g, e)
