"""Chapter 9's claims about its forward model, recomputed with the package.

The chapter prints the figures; these tests check the claims its prose draws from them: the
finite-volume operator is symmetric negative definite, Crank-Nicolson with a backward Euler start
is the only one of the three schemes whose error stays below the noise at 25 steps (and smoothing
the jump of kappa lets plain Crank-Nicolson catch up), factoring the step matrix once gives the
snapshots and gradient of solving every step, the gradient through the tridiagonal solver equals
the dense solver's, and the compiled objective's forward and backward graphs hold every solve."""

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


def test_smoothing_the_jump_lets_plain_crank_nicolson_catch_up():
    """The jump of kappa is what excites the components that plain Crank-Nicolson leaves undamped."""
    h, x, faces = grid(63)
    u0 = initial(x)
    smooth = 0.5 + torch.exp(-((faces - 0.3) / 0.07) ** 2) + 0.35 * (1 + torch.tanh((faces - 0.65) / 0.03))
    gaps = {}
    with torch.no_grad():
        for name, kappa in (("jump", kappa_true(faces)), ("smooth", smooth)):
            reference = simulate(kappa, u0, h, 0.1 / 2000, 2000)[399::400]
            cn, start = ((simulate(kappa, u0, h, DT, STEPS, s)[4::5] - reference).abs().max().item()
                         for s in ("cn", "cn-start"))
            gaps[name] = cn / start
    assert gaps["jump"] > 3
    assert gaps["smooth"] < 1.5


def test_the_jump_gives_the_initial_temperatures_larger_stiff_components():
    """Section 9.4: with u0 = sum c_k v_k, L u0 = sum lambda_k c_k v_k spikes at the jump, so the
    stiff terms (|lambda_k| dt > 10) of L u0 are larger than with the jump smoothed."""
    h, x, faces = grid(63)
    u0 = initial(x)
    smooth = 0.5 + torch.exp(-((faces - 0.3) / 0.07) ** 2) + 0.35 * (1 + torch.tanh((faces - 0.65) / 0.03))
    stiff_size = {}
    for name, kappa in (("jump", kappa_true(faces)), ("smooth", smooth)):
        off, diag = bands(kappa, h)
        eigenvalues, vectors = torch.linalg.eigh(tt.to_dense(off, diag, off))
        coefficients = vectors.mT @ u0                                   # c_k, one column per experiment
        stiff = eigenvalues.abs() * DT > 10
        stiff_size[name] = (eigenvalues[:, None] * coefficients)[stiff].norm().item()
    assert stiff_size["jump"] > 2 * stiff_size["smooth"]


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


@pytest.mark.parametrize("kappa, dominant, amplifies, nearly_singular",
                         [(1.0, True, False, False), (-0.01, True, True, False), (-0.1, False, True, True)])
def test_crank_nicolson_step_needs_a_positive_kappa(kappa, dominant, amplifies, nearly_singular):
    h, _, _ = grid(63)
    off, diag = bands(torch.full((64,), kappa, dtype=DTYPE), h)
    L = tt.to_dense(off, diag, off)
    eye = torch.eye(63, dtype=DTYPE)
    A, B = eye - DT / 2 * L, eye + DT / 2 * L
    margin = (A.diagonal() - (A - torch.diag(A.diagonal())).abs().sum(dim=1)).min().item()
    growth = torch.linalg.eigvals(torch.linalg.solve(A, B)).abs().max().item()
    assert (margin > 0) == dominant
    assert (growth > 1) == amplifies
    eigenvalues = torch.linalg.eigvalsh(A)
    a = eigenvalues[eigenvalues.abs().argmin()].item()  # A's eigenvalue nearest zero
    assert (abs(a) < 0.05) == nearly_singular
    assert (eigenvalues.min() > 1) == (kappa > 0)  # a positive kappa: every eigenvalue of A above 1
    if nearly_singular:  # the growth comes from that eigenvalue: B = 2I - A, so |2 - a| / |a|
        assert growth > 10 and abs(growth - abs(2 - a) / abs(a)) < 1e-6 * growth


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
    for bands_need_grad in (False, True):  # the backward for the rhs alone, and the fused one
        lower, upper = (-torch.rand(n - 1, dtype=DTYPE, generator=gen).requires_grad_(bands_need_grad)
                        for _ in range(2))
        main = (3 + torch.rand(n, dtype=DTYPE, generator=gen)).requires_grad_(bands_need_grad)
        rhs = torch.randn(n, 6, dtype=DTYPE, generator=gen).requires_grad_()
        g = torch.randn(n, 6, dtype=DTYPE, generator=gen)
        inputs = (lower, main, upper, rhs) if bands_need_grad else (rhs,)
        *_, grad = torch.autograd.grad(tt.tridiagonal_solve(lower, main, upper, rhs, driver=driver), inputs, g)
        check_transpose_solve(lower.detach(), main.detach(), upper.detach(), g, grad)


def check_transpose_solve(lower, main, upper, g, grad):
    dense = torch.linalg.solve(tt.to_dense(lower, main, upper).mT, g)     # independent: A^T v = g
    assert (grad - dense).abs().max() < 1e-13
    assert (grad - torch.linalg.solve(tt.to_dense(lower, main, upper), g)).abs().max() > 1e-6  # A is not symmetric


@pytest.mark.parametrize("driver", [None, "lapack"])
def test_a_solves_node_saves_the_bands_and_x_and_no_factors(driver):
    """Section 9.7: what the backward needs is the bands and the solution; it eliminates again."""
    gen = torch.Generator().manual_seed(6)
    n = 12
    lower, upper = (-torch.rand(n - 1, dtype=DTYPE, generator=gen).requires_grad_() for _ in range(2))
    main = (3 + torch.rand(n, dtype=DTYPE, generator=gen)).requires_grad_()
    rhs = torch.randn(n, 3, dtype=DTYPE, generator=gen).requires_grad_()
    x = tt.tridiagonal_solve(lower, main, upper, rhs, driver=driver)
    saved = [t for t in x.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 4
    for t, expected in zip(saved, (lower, main, upper, x)):
        assert torch.equal(t, expected)


def test_factoring_before_the_time_loop_gives_the_same_snapshots_and_gradient():
    """Section 9.10's simulate_factored: one factorisation of A = I - dt/2 L serves every step."""
    h, x, faces = grid(31)
    theta = (0.3 * torch.randn(32, dtype=DTYPE, generator=torch.Generator().manual_seed(7))).requires_grad_()
    off, diag = bands(torch.nn.functional.softplus(theta), h)
    factors = tt.tridiagonal_lu_factor(-DT / 2 * off, 1 - DT / 2 * diag, -DT / 2 * off)
    u = tt.tridiagonal_lu_solve(factors, tt.tridiagonal_lu_solve(factors, initial(x)))
    out = [u]
    for _ in range(STEPS - 1):
        u = tt.tridiagonal_lu_solve(factors, tt.tridiag_matmul(DT / 2 * off, 1 + DT / 2 * diag, DT / 2 * off, u))
        out.append(u)
    factored = torch.stack(out)
    every = simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, STEPS)
    assert (factored - every).abs().max() < 1e-12
    ga, = torch.autograd.grad(factored.sin().sum(), theta)
    gb, = torch.autograd.grad(every.sin().sum(), theta)
    assert (ga - gb).abs().max() < 1e-11 * gb.abs().max()


def test_compiled_graphs_hold_every_solve_forward_and_backward():
    """AOTAutograd's forward and backward graphs (what Inductor compiles) call the op's kernel once
    per solve each: the compiled step makes the solves of the eager one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    h, x, faces = grid(15)
    steps, counts = 3, {}

    def counting(graph):
        def compiler(gm, example_inputs):
            counts[graph] = sum(1 for node in gm.graph.nodes if node.op == "call_function"
                                and getattr(node.target, "namespace", None) == "tridiag_tutorial")
            return make_boxed_func(gm.forward)
        return compiler

    def loss(theta):
        return simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, steps).square().sum()

    theta = torch.zeros(16, dtype=DTYPE, requires_grad=True)
    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    try:
        torch.compile(loss, backend=backend, fullgraph=True)(theta).backward()
    finally:
        torch.compiler.reset()
    assert counts == {"forward": steps + 1, "backward": steps + 1}


def test_factor_once_needs_equal_bands_to_be_the_same_function_of_theta():
    """Section 9.10's caveat: the solver matches matrices by value, so two matrices equal in value
    but depending differently on theta share one set of factors, and the gradient goes wrong."""
    theta = torch.tensor(1.0, dtype=DTYPE, requires_grad=True)
    off = torch.full((7,), -1.0, dtype=DTYPE)
    rhs = torch.linspace(1.0, 2.0, 8, dtype=DTYPE)

    def loss(solve):
        first = solve(off, 3 + theta * torch.ones(8, dtype=DTYPE), off, rhs)
        second = solve(off, 3 + theta**2 * torch.ones(8, dtype=DTYPE), off, rhs)  # equal at theta = 1
        return (first + 2 * second).sum()

    once = factor_once()
    value_once, value_every = loss(once), loss(tt.tridiagonal_solve)
    grad_once, = torch.autograd.grad(value_once, theta)
    grad_every, = torch.autograd.grad(value_every, theta)
    assert len(once.cache) == 1
    assert abs(value_once - value_every) < 1e-12 * abs(value_every)
    assert abs(grad_once - grad_every) > 0.1 * abs(grad_every)


def test_a_compiled_objective_compiles_once_for_later_fits():
    """Section 9.11: a new leaf of the same shape, as each fit makes, reuses the compiled code."""
    h, x, _ = grid(15)
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    def loss(theta):
        return simulate(torch.nn.functional.softplus(theta), initial(x), h, DT, 3).square().sum()

    f = torch.compile(loss, backend=backend, fullgraph=True)
    try:
        for seed in range(3):
            theta = torch.randn(16, dtype=DTYPE, generator=torch.Generator().manual_seed(seed))
            f(theta.requires_grad_()).backward()
    finally:
        torch.compiler.reset()
    assert len(compiled) == 1


def test_factoring_once_has_no_cpp_kernel_on_the_cpu():
    """Section 9.10: on the CPU the factor/solve pair runs LAPACK through SciPy; there is no C++
    kernel for it, so the default solve's C++ kernel competes with SciPy's ?gttrf/?gttrs."""
    from tridiag_tutorial import kernels

    off, diag = -torch.ones(4, dtype=DTYPE), 3 * torch.ones(5, dtype=DTYPE)
    assert kernels.choose_factor_driver("cpu") == "lapack"
    assert "cpp" not in kernels.FACTOR_DRIVERS
    with pytest.raises(ValueError, match="solves without factors only"):
        tt.tridiagonal_lu_factor(off, diag, off, driver="cpp")
