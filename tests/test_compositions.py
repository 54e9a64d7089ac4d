"""The whole support matrix: eager and torch.compile (fullgraph off and on) composed with every
torch.func transform, forward-mode dual numbers and double backward.

Every cell either equals an independent reference (the same transform applied to a dense solve
through ``torch.linalg.inv``, which torch differentiates correctly at every order; its
``linalg.solve`` does not) or raises an error that names ``tridiagonal_solve``. A silently wrong
or missing result fails the test, whichever the expected outcome.
"""

import pytest
import torch
from torch.autograd import forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from tridiag_tutorial import to_dense, tridiagonal_solve

from conftest import make_system, torch_trap

LOWER, DIAG, UPPER, RHS = make_system(5, seed=11)
BATCH = DIAG + torch.arange(3, dtype=torch.float64)[:, None]  # 3 diagonals for vmap


def dense(lower, diag, upper, rhs):
    return torch.linalg.inv(to_dense(lower, diag, upper)) @ rhs


def cases(solve):
    """Each entry: a function of nothing that applies one composition to ``solve``."""
    def x(d):
        return solve(LOWER, d, UPPER, RHS)

    def loss(d):
        return x(d).pow(2).sum()

    def dual():
        with fwAD.dual_level():
            return fwAD.unpack_dual(x(fwAD.make_dual(DIAG, RHS))).tangent

    return {
        "grad": lambda: grad(loss)(DIAG),
        "vjp": lambda: vjp(x, DIAG)[1](RHS)[0],
        "jvp": lambda: jvp(x, (DIAG,), (RHS,))[1],
        "jacrev": lambda: jacrev(x)(DIAG),
        "jacfwd": lambda: jacfwd(x)(DIAG),
        "hessian": lambda: hessian(loss)(DIAG),
        "vmap": lambda: vmap(x)(BATCH),
        "vmap(grad)": lambda: vmap(grad(loss))(BATCH),
        "dual": dual,
        "grad(grad)": lambda: grad(lambda d: grad(loss)(d).sum())(DIAG),
        "jvp(jvp)": lambda: jvp(lambda d: jvp(x, (d,), (RHS,))[1], (DIAG,), (RHS,))[1],
        "jacfwd(jacfwd)": lambda: jacfwd(jacfwd(loss))(DIAG),
    }


REFERENCE = {name: f() for name, f in cases(dense).items()}

# What each composition gives: "ok" (equals the reference) or the error it raises.
FORWARD_OVER_FORWARD = (NotImplementedError, "forward-mode AD nested in forward-mode AD")
NESTED_COMPILED = (torch._dynamo.exc.Unsupported, "nested differentiation inside torch.compile")
EXPECTED = {
    "eager": {"jvp(jvp)": FORWARD_OVER_FORWARD, "jacfwd(jacfwd)": FORWARD_OVER_FORWARD},
    # Dynamo breaks the graph at the error and runs that frame eagerly, where nesting works.
    "compile": {"jvp(jvp)": FORWARD_OVER_FORWARD, "jacfwd(jacfwd)": FORWARD_OVER_FORWARD},
    "compile(fullgraph)": {"hessian": NESTED_COMPILED, "grad(grad)": NESTED_COMPILED,
                           "jvp(jvp)": NESTED_COMPILED, "jacfwd(jacfwd)": NESTED_COMPILED},
}
MODES = {
    "eager": lambda f: f,
    "compile": lambda f: torch.compile(f, backend="aot_eager"),
    "compile(fullgraph)": lambda f: torch.compile(f, fullgraph=True, backend="aot_eager"),
}


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("mode", list(MODES))
def test_composition(mode, name):
    run = MODES[mode](cases(tridiagonal_solve)[name])
    expected = EXPECTED[mode].get(name, "ok")
    if expected == "ok":
        out = run()
        assert out is not None, "no tangent or gradient came back"
        torch.testing.assert_close(out, REFERENCE[name], rtol=1e-9, atol=1e-11)
    else:
        error, words = expected
        with pytest.raises(error) as info:
            run()
        assert "tridiagonal_solve" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("name", ["grad", "jacfwd", "hessian", "vmap(grad)"])
def test_transform_outside_a_compiled_function(name):
    """The advice the errors give: compile the function, apply the transform outside."""
    compiled = torch.compile(lambda d: tridiagonal_solve(LOWER, d, UPPER, RHS).pow(2).sum(),
                             backend="aot_eager")
    transform = {"grad": grad, "jacfwd": jacfwd, "hessian": hessian,
                 "vmap(grad)": lambda f: vmap(grad(f))}[name]
    arg = BATCH if name == "vmap(grad)" else DIAG
    reference = transform(lambda d: dense(LOWER, d, UPPER, RHS).pow(2).sum())(arg)
    torch.testing.assert_close(transform(compiled)(arg), reference, rtol=1e-9, atol=1e-11)


@torch_trap
def test_double_backward_eager_and_compiled():
    """create_graph=True works eagerly; through a compiled function torch itself refuses."""
    d = DIAG.clone().requires_grad_()

    def second(solve, wrap):
        g, = torch.autograd.grad(wrap(lambda d: solve(LOWER, d, UPPER, RHS).pow(2).sum())(d), d,
                                 create_graph=True)
        return torch.autograd.grad(g.sum(), d)[0]

    torch.testing.assert_close(second(tridiagonal_solve, lambda f: f),
                               second(dense, lambda f: f), rtol=1e-9, atol=1e-11)
    with pytest.raises(RuntimeError, match="double backward"):
        second(tridiagonal_solve, lambda f: torch.compile(f, backend="aot_eager"))


def test_compiled_kernel_choice_is_kept_for_the_backward(monkeypatch):
    """Compiled under torch_kernel_on_cpu(), forward and backward run the pure-torch kernel,
    even when the backward runs after the block."""
    from tridiag_tutorial import lapack
    from tridiag_tutorial.custom_op import torch_kernel_on_cpu

    d = DIAG.clone().requires_grad_()
    compiled = torch.compile(lambda d: tridiagonal_solve(LOWER, d, UPPER, RHS).pow(2).sum(),
                             fullgraph=True, backend="aot_eager")
    with torch_kernel_on_cpu():
        value = compiled(d)
    monkeypatch.setattr(lapack, "solve", lambda *a: pytest.fail("LAPACK ran in the backward"))
    value.backward()
    torch.testing.assert_close(d.grad, grad(lambda d: dense(LOWER, d, UPPER, RHS).pow(2).sum())(DIAG))


def test_eager_backward_runs_on_the_forwards_kernel(monkeypatch):
    from tridiag_tutorial import lapack
    from tridiag_tutorial.custom_op import torch_kernel_on_cpu

    d = DIAG.clone().requires_grad_()
    with torch_kernel_on_cpu():
        value = tridiagonal_solve(LOWER, d, UPPER, RHS).pow(2).sum()
    for name in ("solve", "gtsv", "factor", "factor_solve"):
        monkeypatch.setattr(lapack, name, lambda *a, **k: pytest.fail("LAPACK ran in the backward"))
    value.backward()
    torch.testing.assert_close(d.grad, grad(lambda d: dense(LOWER, d, UPPER, RHS).pow(2).sum())(DIAG))


def test_kernel_choice_is_local_to_a_thread(monkeypatch):
    """While one thread is inside torch_kernel_on_cpu(), another thread's solve runs LAPACK."""
    import threading

    from tridiag_tutorial import lapack, torch_kernel
    from tridiag_tutorial.custom_op import torch_kernel_on_cpu

    used, inside, done = [], threading.Event(), threading.Event()
    real_lapack, real_torch = lapack.solve, torch_kernel.solve
    monkeypatch.setattr(lapack, "solve", lambda *a: used.append("lapack") or real_lapack(*a))
    monkeypatch.setattr(torch_kernel, "solve", lambda *a: used.append("torch") or real_torch(*a))

    def holder():
        with torch_kernel_on_cpu():
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    inside.wait(10)
    try:
        tridiagonal_solve(LOWER, DIAG, UPPER, RHS)
    finally:
        done.set()
        thread.join()
    assert used == ["lapack"]
