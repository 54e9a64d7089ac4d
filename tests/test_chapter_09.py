"""Chapter 9's claims about its forward model, recomputed with the package.

The chapter prints the figures; these tests check the claims its prose draws from them: the
finite-volume operator is symmetric negative definite, Crank-Nicolson with a backward Euler start
is the only one of the three schemes whose error stays below the noise at 25 steps, factoring the
step matrix once gives the snapshots and gradient of solving every step, and the gradient through
the tridiagonal solver equals the dense solver's."""

import math

import pytest
import torch

import tridiag_tutorial as tt

DTYPE = torch.float64
SIGMA, DT, STEPS = 0.01, 0.004, 25


def grid(n):
    h = 1.0 / (n + 1)
    return h, torch.arange(1, n + 1, dtype=DTYPE) * h, (torch.arange(n + 1, dtype=DTYPE) + 0.5) * h


def bands(kappa, h):
    return kappa[1:-1] / h**2, -(kappa[:-1] + kappa[1:]) / h**2


def kappa_true(x):
    return 0.5 + torch.exp(-((x - 0.3) / 0.07) ** 2) + 0.7 * (x > 0.65)


def initial(x):
    modes = [torch.sin(m * math.pi * x) for m in (1, 2, 3)]
    bumps = [torch.exp(-((x - c) / 0.1) ** 2) * torch.sin(math.pi * x) for c in (0.2, 0.5, 0.8)]
    return torch.stack(modes + bumps, dim=-1)


def step(u, off, diag, dt, w, solve):
    rhs = u if w == 1 else tt.tridiag_matmul(
        (1 - w) * dt * off, 1 + (1 - w) * dt * diag, (1 - w) * dt * off, u)
    return solve(-w * dt * off, 1 - w * dt * diag, -w * dt * off, rhs)


def simulate(kappa, u0, h, dt, steps, scheme="cn-start", solve=tt.tridiagonal_solve):
    off, diag = bands(kappa, h)
    u, out = u0, []
    for k in range(1, steps + 1):
        if scheme == "be":
            u = step(u, off, diag, dt, 1.0, solve)
        elif scheme == "cn" or k > 1:
            u = step(u, off, diag, dt, 0.5, solve)
        else:
            u = step(step(u, off, diag, dt / 2, 1.0, solve), off, diag, dt / 2, 1.0, solve)
        out.append(u)
    return torch.stack(out)


def factor_once():
    cache = []

    def solve(lower, diag, upper, rhs):
        for factors in cache:
            if all(torch.equal(a, b) for a, b in zip(factors[:3], (lower, diag, upper))):
                return tt.tridiagonal_lu_solve(factors, rhs)
        cache.append(tt.tridiagonal_lu_factor(lower, diag, upper))
        return tt.tridiagonal_lu_solve(cache[-1], rhs)

    solve.cache = cache
    return solve


def test_operator_is_symmetric_negative_definite():
    gen = torch.Generator().manual_seed(1)
    h, _, _ = grid(9)
    off, diag = bands(0.1 + torch.rand(10, dtype=DTYPE, generator=gen), h)
    L = tt.to_dense(off, diag, off)
    assert torch.equal(L, L.T)
    assert torch.linalg.eigvalsh(L).max() < 0


def test_only_the_crank_nicolson_start_stays_below_the_noise():
    h, x, faces = grid(63)
    u0 = initial(x)
    with torch.no_grad():
        reference = simulate(kappa_true(faces), u0, h, 0.1 / 2000, 2000, "cn-start")[399::400]
        errors = {s: (simulate(kappa_true(faces), u0, h, DT, STEPS, s)[4::5] - reference).abs().max().item()
                  for s in ("be", "cn", "cn-start")}
    assert errors["cn-start"] < SIGMA / 2
    assert min(errors["be"], errors["cn"]) > SIGMA


def test_factor_once_gives_the_same_snapshots_and_gradient():
    h, x, faces = grid(63)
    theta = (0.3 * torch.randn(64, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
             ).requires_grad_()
    once = factor_once()
    a = simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, STEPS, solve=once)
    b = simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, STEPS)
    assert len(once.cache) == 1
    assert (a - b).abs().max() < 1e-12
    ga, = torch.autograd.grad(a.square().sum(), theta)
    gb, = torch.autograd.grad(b.square().sum(), theta)
    assert (ga - gb).abs().max() < 1e-11 * gb.abs().max()


def test_gradient_equals_the_dense_solvers():
    h, x, _ = grid(31)
    theta = (0.3 * torch.randn(32, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
             ).requires_grad_()
    grads = [torch.autograd.grad(simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, 10,
                                          solve=solve).sin().sum(), theta)[0]
             for solve in (tt.tridiagonal_solve, tt.dense_solve)]
    assert (grads[0] - grads[1]).abs().max() < 1e-11 * grads[1].abs().max()


def test_gradcheck_of_a_tiny_simulation():
    h, x, _ = grid(6)
    u0 = initial(x)[:, :2]
    theta = torch.randn(7, dtype=DTYPE, generator=torch.Generator().manual_seed(0)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: simulate(torch.nn.functional.softplus(t), u0, h, 0.01, 3), (theta,))


@pytest.mark.parametrize("kappa, dominant, amplifies", [(1.0, True, False), (-0.01, True, True),
                                                        (-0.1, False, True)])
def test_crank_nicolson_step_needs_a_positive_kappa(kappa, dominant, amplifies):
    h, _, _ = grid(63)
    off, diag = bands(torch.full((64,), kappa, dtype=DTYPE), h)
    L = tt.to_dense(off, diag, off)
    eye = torch.eye(63, dtype=DTYPE)
    A, B = eye - DT / 2 * L, eye + DT / 2 * L
    margin = (A.diagonal() - (A - torch.diag(A.diagonal())).abs().sum(dim=1)).min().item()
    growth = torch.linalg.eigvals(torch.linalg.solve(A, B)).abs().max().item()
    assert (margin > 0) == dominant
    assert (growth > 1) == amplifies


@pytest.mark.parametrize("driver", [None, "lapack"])
def test_each_solve_has_one_backward_run_that_solves_with_the_transpose(driver):
    """The counts and the A^T comparison of section 9.7, for both drivers of section 9.10."""
    n = 63
    h, x, faces = grid(n)
    theta = (0.3 * torch.randn(n + 1, dtype=DTYPE, generator=torch.Generator().manual_seed(0))).requires_grad_()
    runs = {"forward": 0, "backward": 0}

    def counting(lower, diag, upper, rhs):
        runs["forward"] += 1
        out = tt.tridiagonal_solve(lower, diag, upper, rhs, driver=driver)
        out.grad_fn.register_hook(lambda *_: runs.__setitem__("backward", runs["backward"] + 1))
        return out

    simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, STEPS, solve=counting).sum().backward()
    assert runs == {"forward": STEPS + 1, "backward": STEPS + 1}

    gen = torch.Generator().manual_seed(2)
    lower, upper = (-torch.rand(n - 1, dtype=DTYPE, generator=gen) for _ in range(2))
    main = 3 + torch.rand(n, dtype=DTYPE, generator=gen)
    rhs = torch.randn(n, 6, dtype=DTYPE, generator=gen).requires_grad_()
    g = torch.randn(n, 6, dtype=DTYPE, generator=gen)
    grad, = torch.autograd.grad(tt.tridiagonal_solve(lower, main, upper, rhs, driver=driver), rhs, g)
    dense = torch.linalg.solve(tt.to_dense(lower, main, upper).mT, g)     # independent: A^T v = g
    assert (grad - dense).abs().max() < 1e-13
    assert (grad - torch.linalg.solve(tt.to_dense(lower, main, upper), g)).abs().max() > 1e-6  # A is not symmetric
