"""Tests for tridiag_tutorial.book.finite_diff: accuracy, error orders, gradients, bad input."""
import doctest
import math

import numpy as np
import pytest
import torch

import tridiag_tutorial.book.finite_diff as fd
from tridiag_tutorial.book.finite_diff import (
    central_difference,
    forward_difference,
    numerical_gradient,
    optimal_step,
)

F64 = torch.float64

# (function, derivative, second derivative, third derivative) on Python floats
SCALAR_CASES = {
    "sin": (math.sin, math.cos, lambda x: -math.sin(x), lambda x: -math.cos(x)),
    "exp": (math.exp, math.exp, math.exp, math.exp),
    "cubic": (lambda x: x**3 - 2 * x, lambda x: 3 * x**2 - 2, lambda x: 6 * x, lambda x: 6.0),
}


def test_doctests_pass():
    result = doctest.testmod(fd, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("name", sorted(SCALAR_CASES))
@pytest.mark.parametrize("x", [-0.7, 0.3, 1.0, 2.5])
def test_match_analytic_derivatives(name, x):
    f, df, _, _ = SCALAR_CASES[name]
    scale = max(1.0, abs(df(x)))
    assert forward_difference(f, x, 1e-8) == pytest.approx(df(x), abs=1e-6 * scale)
    assert central_difference(f, x, 1e-5) == pytest.approx(df(x), abs=1e-9 * scale)


@pytest.mark.parametrize("name", sorted(SCALAR_CASES))
def test_leading_error_terms(name):
    """The error is h/2 f'' (forward) and h**2/6 f''' (central) to leading order."""
    f, df, d2f, d3f = SCALAR_CASES[name]
    x, h = 0.8, 1e-3
    assert forward_difference(f, x, h) - df(x) == pytest.approx(h / 2 * d2f(x), rel=1e-2)
    assert central_difference(f, x, h) - df(x) == pytest.approx(h**2 / 6 * d3f(x), rel=1e-2)


def test_central_difference_is_exact_for_quadratics_up_to_round_off():
    f = lambda x: 3 * x**2 - x + 5  # noqa: E731
    for h in (1e-1, 1e-2, 1e-3):
        assert central_difference(f, 2.0, h) == pytest.approx(11.0, abs=1e-10)
        # ... while the forward difference keeps its O(h) error, h * f''/2 = 3 h
        assert forward_difference(f, 2.0, h) - 11.0 == pytest.approx(3 * h, rel=1e-6)


@pytest.mark.parametrize("name", ["sin", "exp"])
def test_error_orders_when_halving_h(name):
    """Truncation-dominated regime: halving h halves the forward error, quarters the central one."""
    f, df, _, _ = SCALAR_CASES[name]
    x = 1.0
    for h in (1e-2, 1e-3):
        fwd_ratio = abs(forward_difference(f, x, h) - df(x)) / abs(forward_difference(f, x, h / 2) - df(x))
        cen_ratio = abs(central_difference(f, x, h) - df(x)) / abs(central_difference(f, x, h / 2) - df(x))
        assert fwd_ratio == pytest.approx(2.0, rel=0.02)
        assert cen_ratio == pytest.approx(4.0, rel=0.02)


def test_log_log_slopes():
    hs = np.logspace(-4, -1, 13)
    fwd = [abs(forward_difference(math.sin, 1.0, h) - math.cos(1.0)) for h in hs]
    cen = [abs(central_difference(math.sin, 1.0, h) - math.cos(1.0)) for h in hs]
    assert np.polyfit(np.log(hs), np.log(fwd), 1)[0] == pytest.approx(1.0, abs=0.05)
    assert np.polyfit(np.log(hs), np.log(cen), 1)[0] == pytest.approx(2.0, abs=0.05)


def test_elementwise_on_tensors():
    x = torch.linspace(-3, 3, 11, dtype=F64)
    x_before = x.clone()
    for method, h, tol in ((forward_difference, 1e-8, 1e-6), (central_difference, 1e-5, 1e-9)):
        out = method(torch.sin, x, h)
        assert out.shape == x.shape and out.dtype == F64
        torch.testing.assert_close(out, torch.cos(x), rtol=0, atol=tol)
    assert torch.equal(x, x_before)


def test_works_on_numpy_arrays():
    x = np.linspace(0, 1, 5)
    np.testing.assert_allclose(central_difference(np.exp, x, 1e-5), np.exp(x), rtol=1e-9)


@pytest.mark.parametrize("method", [forward_difference, central_difference])
@pytest.mark.parametrize("h", [0.0, -1e-3, math.inf, math.nan])
def test_bad_step_values(method, h):
    with pytest.raises(ValueError, match="h must be positive"):
        method(math.sin, 1.0, h)


@pytest.mark.parametrize("method", [forward_difference, central_difference])
@pytest.mark.parametrize("h", ["1e-3", None, True, torch.tensor(1e-3), 1e-3j])
def test_bad_step_types(method, h):
    with pytest.raises(TypeError, match="h must be a real number"):
        method(math.sin, 1.0, h)


def test_optimal_step_values():
    assert optimal_step("forward") == pytest.approx(math.sqrt(2.0**-52))
    assert optimal_step("central") == pytest.approx(2.0 ** (-52 / 3))
    assert optimal_step("forward") == pytest.approx(1.49e-8, rel=1e-3)
    assert optimal_step("central") == pytest.approx(6.06e-6, rel=1e-3)
    assert optimal_step("forward", eps=1e-16) == pytest.approx(1e-8)
    assert optimal_step("forward", eps=1e-16, scale=5.0) == pytest.approx(5e-8)
    assert optimal_step("central", eps=1e-12, scale=3.0) == pytest.approx(3e-4)
    assert optimal_step("forward", dtype=torch.float32) == pytest.approx(math.sqrt(2.0**-23))


def test_optimal_step_beats_much_smaller_and_larger_steps():
    for kind, method in (("forward", forward_difference), ("central", central_difference)):
        h = optimal_step(kind)
        err = lambda step: abs(method(math.sin, 1.0, step) - math.cos(1.0))  # noqa: E731
        assert err(h) < err(h * 1e-3)
        assert err(h) < err(h * 1e3)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kind="backward"), ValueError, "kind must be"),
    (dict(kind="forward", eps=0.0), ValueError, "eps must be positive"),
    (dict(kind="forward", eps=-1e-16), ValueError, "eps must be positive"),
    (dict(kind="central", scale=0.0), ValueError, "scale must be positive"),
    (dict(kind="central", eps="tiny"), TypeError, "eps must be a real number"),
    (dict(kind="central", dtype=torch.int64), TypeError, "floating-point"),
])
def test_optimal_step_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        optimal_step(**kwargs)


# ---------------------------------------------------------------- numerical_gradient

def _autograd_gradient(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves)


GRADIENT_CASES = {
    "sum_of_squares": (lambda x: (x**2).sum(), [(5,)]),
    "sin_times_exp": (lambda x: (torch.sin(x) ** 2 * torch.exp(x)).sum(), [(4,)]),
    "bilinear": (lambda x, A, y: x @ A @ y, [(3,), (3, 4), (4,)]),
    "logsumexp_matrix": (lambda M: torch.logsumexp(M, dim=(0, 1)), [(2, 3)]),
    "solve": (lambda A, b: torch.linalg.solve(A, b).square().sum(), [(3, 3), (3,)]),
    "scalar_input": (lambda s, v: torch.tanh(s * v).sum(), [(), (3,)]),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_numerical_gradient_matches_autograd(name):
    fn, shapes = GRADIENT_CASES[name]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen, dtype=F64) for s in shapes]
    if name == "solve":  # keep the matrix well conditioned
        inputs[0] = inputs[0] + 4 * torch.eye(3, dtype=F64)
    numeric = numerical_gradient(fn, tuple(inputs))
    analytic = _autograd_gradient(fn, inputs)
    assert isinstance(numeric, tuple) and len(numeric) == len(inputs)
    for n, a, x in zip(numeric, analytic, inputs):
        assert n.shape == x.shape and n.dtype == F64
        torch.testing.assert_close(n, a, rtol=1e-6, atol=1e-8)


def test_numerical_gradient_detects_a_wrong_gradient():
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    (g,) = numerical_gradient(lambda t: torch.sin(t).sum(), (x,))
    assert not torch.allclose(g, torch.sin(x), atol=1e-3)  # a wrong "derivative" is far off
    torch.testing.assert_close(g, torch.cos(x), rtol=0, atol=1e-9)


def test_numerical_gradient_leaves_inputs_unchanged():
    x = torch.randn(4, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    A = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(2)).t()  # non-contiguous
    x_before, A_before = x.detach().clone(), A.clone()
    gx, gA = numerical_gradient(lambda x, A: (A @ torch.sin(x[:3])).prod(), (x, A))
    assert torch.equal(x.detach(), x_before) and torch.equal(A, A_before)
    assert x.grad is None and x.requires_grad and not A.is_contiguous()
    assert gx.shape == x.shape and gA.shape == A.shape


def test_numerical_gradient_survives_a_function_that_works_in_place():
    def fn(x):
        x.mul_(2)  # a badly behaved function that overwrites its argument
        return x.square().sum()

    x = torch.tensor([1.0, -3.0], dtype=F64)
    (g,) = numerical_gradient(fn, (x,))
    torch.testing.assert_close(g, 8 * x, rtol=1e-7, atol=1e-7)  # d/dx (2x)^2 = 8x
    assert torch.equal(x, torch.tensor([1.0, -3.0], dtype=F64))


def test_numerical_gradient_accepts_a_single_tensor_and_a_list():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    (g1,) = numerical_gradient(lambda t: t.pow(3).sum(), x)
    (g2,) = numerical_gradient(lambda t: t.pow(3).sum(), [x])
    torch.testing.assert_close(g1, 3 * x**2)
    torch.testing.assert_close(g2, g1)


def test_numerical_gradient_eps_controls_the_truncation_error():
    x = torch.tensor([1.0], dtype=F64)
    (coarse,) = numerical_gradient(lambda t: torch.sin(t).sum(), (x,), eps=1e-2)
    # central difference error is eps**2/6 * |sin'''(1)| = eps**2/6 * cos(1)
    assert (coarse - torch.cos(x)).item() == pytest.approx(-1e-4 / 6 * math.cos(1.0), rel=1e-2)


@pytest.mark.parametrize("fn, inputs, error, match", [
    (lambda x: x * 2, (torch.ones(3, dtype=F64),), ValueError, "must return a scalar"),
    (lambda x: float(x.sum()), (torch.ones(3, dtype=F64),), TypeError, "must return a tensor"),
    (lambda x: x.sum(), (torch.ones(3),), TypeError, "float64"),
    (lambda x: x.sum(), (torch.ones(3, dtype=torch.int64),), TypeError, "float64"),
    (lambda x: x.sum(), ([1.0, 2.0],), TypeError, r"inputs\[0\] must be a torch.Tensor"),
    (lambda: torch.zeros((), dtype=F64), (), ValueError, "at least one tensor"),
    (lambda x: x.sum(), 3.0, TypeError, "inputs must be a tensor or a tuple"),
])
def test_numerical_gradient_bad_input(fn, inputs, error, match):
    with pytest.raises(error, match=match):
        numerical_gradient(fn, inputs)


@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_numerical_gradient_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be positive"):
        numerical_gradient(lambda x: x.sum(), (torch.ones(2, dtype=F64),), eps=eps)
