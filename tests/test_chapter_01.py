"""Chapter 1's claims, recomputed: finite-difference error orders, the V-shaped error curve and
its best step, float64 against float32 at gradcheck's step, and what gradcheck catches."""

import math

import numpy as np
import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from tridiag_tutorial.book.finite_diff import (
    central_difference,
    forward_difference,
    numerical_gradient,
    optimal_step,
)

X0 = 1.0
EXACT = math.cos(X0)
STEPS = np.array([10.0 ** (k / 20) for k in range(-320, -19)])  # 1e-16 ... 1e-1, as the chapter


def errors(difference):
    return np.array([abs(difference(math.sin, X0, h) - EXACT) for h in STEPS])


def test_taylor_predicts_the_truncation_error_to_one_percent():
    h = 1e-3
    assert math.isclose(forward_difference(math.sin, X0, h) - EXACT, -h / 2 * math.sin(X0), rel_tol=1e-2)
    assert math.isclose(central_difference(math.sin, X0, h) - EXACT, -h**2 / 6 * math.cos(X0), rel_tol=1e-2)


@pytest.mark.parametrize("difference, order", [(forward_difference, 1), (central_difference, 2)])
def test_the_right_arm_of_the_v_has_the_order_as_slope(difference, order):
    errs = errors(difference)
    arm = STEPS >= 1e-4
    slope = np.polyfit(np.log(STEPS[arm]), np.log(errs[arm]), 1)[0]
    assert abs(slope - order) < 0.05


@pytest.mark.parametrize("difference, kind, smallest", [(forward_difference, "forward", 1e-9),
                                                        (central_difference, "central", 1e-12)])
def test_the_best_step_is_within_ten_of_the_rule_of_thumb(difference, kind, smallest):
    errs = errors(difference)
    predicted, observed = optimal_step(kind), STEPS[np.argmin(errs)]
    assert predicted / 10 < observed < 10 * predicted
    assert errs.min() < smallest


def test_at_the_smallest_step_the_forward_difference_is_zero():
    assert 1.0 + STEPS[0] == 1.0 and forward_difference(math.sin, X0, STEPS[0]) == 0.0


def test_gradchecks_step_is_fine_in_float64_and_useless_in_float32():
    xs = torch.linspace(0.5, 1.5, 101, dtype=torch.float64)
    tolerance = 1e-5 + 1e-3 * torch.cos(xs).abs()  # gradcheck's atol + rtol * |numerical|
    err = {dtype: (central_difference(torch.sin, xs.to(dtype), 1e-6).double() - torch.cos(xs)).abs()
           for dtype in (torch.float64, torch.float32)}
    assert (err[torch.float64] < 1e-6 * tolerance).all()
    assert (err[torch.float32] > tolerance).all()
    one = torch.tensor(X0, dtype=torch.float32)
    assert abs(((one + 1e-6) - (one - 1e-6)).item() / 2 / 1e-6 - 1) > 0.01  # the float32 step is rounded


def test_gradcheck_warns_and_fails_in_float32():
    with pytest.warns(UserWarning, match="not a double precision"):
        with pytest.raises(GradcheckError, match="^Jacobian mismatch"):
            torch.autograd.gradcheck(torch.sin, (torch.tensor([X0], requires_grad=True),))


@pytest.mark.parametrize("kind", ["forward", "central"])
def test_the_mean_error_bottoms_out_at_the_rule_of_thumb_to_a_power_of_ten(kind):
    points = np.random.default_rng(1).uniform(0.5, 1.5, size=100)
    if kind == "forward":
        mean = [np.abs((np.sin(points + h) - np.sin(points)) / h - np.cos(points)).mean() for h in STEPS]
    else:
        mean = [np.abs((np.sin(points + h) - np.sin(points - h)) / (2 * h) - np.cos(points)).mean()
                for h in STEPS]
    best = STEPS[int(np.argmin(mean))]
    assert round(math.log10(best)) == round(math.log10(optimal_step(kind)))


def test_autograd_matches_the_closed_form_and_finite_differences():
    x = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (torch.sin(x) ** 2 * torch.exp(x)).backward()
    s, c, e = math.sin(0.7), math.cos(0.7), math.exp(0.7)
    assert math.isclose(x.grad.item(), 2 * s * c * e + s * s * e, rel_tol=1e-14)
    xs = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    (numeric,) = numerical_gradient(lambda t: (torch.sin(t) ** 2 * torch.exp(t)).sum(), (xs,))
    exact = 2 * torch.sin(xs) * torch.cos(xs) * torch.exp(xs) + torch.sin(xs) ** 2 * torch.exp(xs)
    assert (numeric - exact).abs().max() < 1e-8


def test_backward_of_a_vector_needs_gradient():
    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        torch.sin(x).backward()
    torch.sin(x).backward(gradient=torch.ones(5, dtype=torch.float64))
    assert torch.allclose(x.grad, torch.cos(x.detach()), rtol=0, atol=1e-15)


class NeoReLU(torch.autograd.Function):
    """The chapter's NeoReLU, backward ignoring grad_output."""

    @staticmethod
    def forward(x):
        return torch.where(x > 0, x, -0.1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return (x > 0).to(grad_output.dtype)


class NeoReLUFixed(NeoReLU):
    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * (x > 0)


def test_gradcheck_catches_a_backward_that_ignores_grad_output():
    x = torch.tensor([1.6, -0.4, -2.3, 0.7, -1.2], dtype=torch.float64, requires_grad=True)
    with pytest.raises(GradcheckError, match="^Jacobian mismatch for output 0 with respect to input 0"):
        torch.autograd.gradcheck(NeoReLU.apply, (x,))
    with pytest.raises(GradcheckError, match="backward not multiplied by grad_output"):
        torch.autograd.gradcheck(lambda t: NeoReLU.apply(t).sum(), (x,))
    assert torch.autograd.gradcheck(NeoReLUFixed.apply, (x,))


@pytest.mark.parametrize("point, passes", [(2e-6, True), (3e-7, False), (0.0, False)])
def test_across_the_jump_the_central_difference_measures_the_jump(point, passes):
    t = torch.tensor([-1.0, point, 2.0], dtype=torch.float64, requires_grad=True)
    (slopes,) = numerical_gradient(lambda s: NeoReLUFixed.apply(s).sum(), (t,))
    expected = 1.0 if passes else (0.1 + point + 1e-6) / 2e-6  # the jump over 2 eps
    assert abs(slopes[1].item() - expected) < 1e-3
    if passes:
        assert torch.autograd.gradcheck(NeoReLUFixed.apply, (t,))
    else:
        with pytest.raises(GradcheckError):
            torch.autograd.gradcheck(NeoReLUFixed.apply, (t,))


def test_the_exercises_five_point_stencil_and_complex_step():
    def five_point(h):
        f = math.sin
        return abs((-f(X0 + 2 * h) + 8 * f(X0 + h) - 8 * f(X0 - h) + f(X0 - 2 * h)) / (12 * h) - EXACT)

    assert abs(five_point(1e-2) / five_point(5e-3) - 16) < 0.5
    z = torch.tensor(X0 + 1e-20j, dtype=torch.complex128)
    assert abs(torch.sin(z).imag.item() / 1e-20 - EXACT) < 1e-15
    assert central_difference(math.sin, X0, 1e-20) == 0.0


def five_point_stencil(f, x, h):
    return (-f(x + 2 * h) + 8 * f(x + h) - 8 * f(x - h) + f(x - 2 * h)) / (12 * h)


def test_the_five_point_error_model_and_its_best_step():
    h = 1e-2  # truncation-dominated: the error is -h^4/30 f^(5), and f^(5) = cos for sin
    assert math.isclose(five_point_stencil(math.sin, X0, h) - EXACT, -(h**4) / 30 * math.cos(X0),
                        rel_tol=1e-2)
    eps = np.finfo(float).eps  # the model's minimum, found on a fine grid, against the closed form
    grid = np.logspace(-4, -2, 20001)
    model = grid**4 / 30 * math.cos(X0) + 18 * eps * math.sin(X0) / (12 * grid)
    closed = (11.25 * eps * math.sin(X0) / math.cos(X0)) ** 0.2
    assert math.isclose(grid[np.argmin(model)], closed, rel_tol=1e-3)
    near = np.random.default_rng(1).uniform(0.5, 1.5, size=100)  # the chapter's 100 points
    mean = [np.abs(five_point_stencil(np.sin, near, h) - np.cos(near)).mean() for h in STEPS]
    best = STEPS[int(np.argmin(mean))]
    assert round(math.log10(best)) == round(math.log10(eps**0.2))


def test_the_truncation_and_round_off_terms_at_h_1e_5_are_both_near_1e_11():
    f = lambda t: torch.sin(t) ** 2 * torch.exp(t)
    x = torch.tensor(0.7, dtype=torch.float64)
    f3 = torch.func.grad(torch.func.grad(torch.func.grad(f)))(x).item()
    s, e = math.sin(0.7), math.exp(0.7)
    d1 = lambda t: (2 * math.sin(t) * math.cos(t) + math.sin(t) ** 2) * math.exp(t)
    assert math.isclose(f3, (d1(0.7 + 1e-4) - 2 * d1(0.7) + d1(0.7 - 1e-4)) / 1e-8, rel_tol=1e-5)
    truncation, round_off = 1e-10 * abs(f3) / 6, np.finfo(float).eps * s * s * e / 1e-5
    assert 1e-11 < truncation < 3e-11 and 1e-11 < round_off < 3e-11


def test_the_graph_reaches_one_accumulate_grad_node_by_two_paths():
    x = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    y = torch.sin(x) ** 2 * torch.exp(x)
    via_sin = y.grad_fn.next_functions[0][0].next_functions[0][0].next_functions[0][0]
    via_exp = y.grad_fn.next_functions[1][0].next_functions[0][0]
    assert type(via_sin).__name__ == "AccumulateGrad" and via_sin is via_exp
    assert via_sin.variable is x


def test_grad_and_value_matches_backward():
    f = lambda t: (torch.sin(t) ** 2 * torch.exp(t)).sum()
    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    g, value = torch.func.grad_and_value(f)(x)
    leaf = x.clone().requires_grad_()
    f(leaf).backward()
    assert (g - leaf.grad).abs().max() < 1e-15 and value.item() == f(x).item()


def test_the_setup_context_form_works_with_torch_func():
    x = torch.tensor([1.6, -0.4, 0.7], dtype=torch.float64)
    g = torch.func.grad(lambda t: (3 * NeoReLUFixed.apply(t)).sum())(x)
    assert torch.equal(g, torch.tensor([3.0, 0.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("difference", [forward_difference, central_difference])
def test_the_round_off_arm_lies_below_eps_f_over_h(difference):
    errs, arm = errors(difference), STEPS <= 1e-9
    ratio = errs[arm] / (np.finfo(float).eps * abs(math.sin(X0)) / STEPS[arm])
    assert ratio.max() < 1 and np.median(ratio) > 0.01  # below the line, yet parallel to it


@pytest.mark.parametrize("kind", ["forward", "central", "five-point"])
def test_the_worst_case_constants_do_not_bring_the_predicted_step_closer(kind):
    points = np.random.default_rng(1).uniform(0.5, 1.5, size=100)  # the chapter's 100 points
    eps = np.finfo(float).eps
    rules = {"forward": (lambda h: (np.sin(points + h) - np.sin(points)) / h,
                         math.sqrt(eps), 2 * math.sqrt(eps)),
             "central": (lambda h: (np.sin(points + h) - np.sin(points - h)) / (2 * h),
                         eps ** (1 / 3), (3 * eps * math.tan(X0)) ** (1 / 3)),
             "five-point": (lambda h: five_point_stencil(np.sin, points, h),
                            eps ** 0.2, (11.25 * eps * math.tan(X0)) ** 0.2)}
    estimate, rule_of_thumb, with_constants = rules[kind]
    best = STEPS[int(np.argmin([np.abs(estimate(h) - np.cos(points)).mean() for h in STEPS]))]
    assert abs(math.log(best / rule_of_thumb)) < abs(math.log(best / with_constants))


@pytest.mark.parametrize("difference, kind", [(forward_difference, "forward"), (central_difference, "central")])
def test_the_best_step_of_the_mean_error_is_within_a_factor_two_of_the_rule_of_thumb(difference, kind):
    points = np.random.default_rng(1).uniform(0.5, 1.5, size=100)  # the chapter's 100 points
    sin = np.vectorize(math.sin)  # scalar float64 sin, as the chapter
    mean = [np.abs(difference(sin, points, h) - np.cos(points)).mean() for h in STEPS]
    ratio = STEPS[int(np.argmin(mean))] / optimal_step(kind)
    assert 0.5 < ratio < 2
