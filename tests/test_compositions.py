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
    """The dense reference; ``rhs`` is ``(*batch, n)``, its batch broadcast with the bands'."""
    return (torch.linalg.inv(to_dense(lower, diag, upper)) @ rhs.unsqueeze(-1)).squeeze(-1)


def cases(solve, lower=LOWER, diag=DIAG, upper=UPPER, rhs=RHS, batch=None):
    """Each entry: a function of nothing that applies one composition to ``solve`` on the system
    ``(lower, diag, upper, rhs)`` (by default the n = 5 one above; ``tests/test_kernel_matrix.py``
    runs the same cases on every kernel and at other sizes); ``batch`` stacks diagonals for
    ``vmap`` (by default three shifted copies of ``diag``)."""
    if batch is None:
        batch = diag + torch.arange(3, dtype=diag.dtype).reshape(3, *[1] * diag.ndim)
    LOWER, DIAG, UPPER, RHS, BATCH = lower, diag, upper, rhs, batch  # noqa: N806

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


def _factored(lower, diag, upper, rhs):
    from tridiag_tutorial import tridiagonal_lu_factor, tridiagonal_lu_solve
    return tridiagonal_lu_solve(tridiagonal_lu_factor(lower, diag, upper), rhs)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("path", ["solve", "factored"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic-dynamic"])
def test_jacfwd_compiles_with_dynamic_shapes(path, fullgraph, dynamic):
    """torch.compile(jacfwd(f), dynamic=True) raised "Cannot call storage_offset() on tensor with
    symbolic sizes/strides"; with automatic dynamic shapes (dynamic=None) the second size hit it."""
    solve = tridiagonal_solve if path == "solve" else _factored
    compiled = torch.compile(lambda l, d, u, b: jacfwd(lambda d: solve(l, d, u, b))(d),
                             fullgraph=fullgraph, dynamic=dynamic, backend="aot_eager")
    for n in (5, 7, 9):
        args = make_system(n, seed=n)
        reference = jacfwd(lambda d: dense(args[0], d, args[2], args[3]))(args[1])
        torch.testing.assert_close(compiled(*args), reference, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("tangent", ["batched", "unbatched"])
def test_vmap_of_jvp_over_rhs_compiles_with_dynamic_shapes(tangent):
    """The primal vmapped over rhs (its vmapped dimension innermost in memory), the tangent
    vmapped with it or not: the tangent keeps or gets the primal's layout."""
    def f(solve, l, d, u, b):
        t = b.flip(-1)
        return vmap(lambda bb: jvp(lambda b: solve(l, d, u, b), (bb,),
                                   (2 * bb if tangent == "batched" else t,))[1])(
            torch.stack([b, b + 1, 3 * b]))
    compiled = torch.compile(lambda *a: f(tridiagonal_solve, *a), dynamic=True, backend="aot_eager")
    for n in (5, 7):
        args = make_system(n, seed=n)
        torch.testing.assert_close(compiled(*args), f(dense, *args), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("n", [5, 100], ids=["sequential", "partitioned"])
@pytest.mark.parametrize("path", ["solve", "factored"])
def test_checkpoint_recomputes_on_the_forwards_kernel(monkeypatch, n, path):
    """Forward under torch_kernel_on_cpu() inside a non-reentrant checkpoint, backward after the
    block: the recomputation runs on the forward's kernel (it ran on LAPACK, and torch raised
    CheckpointError: 7 tensors saved in the forward, 5 in the recomputation)."""
    from torch.utils.checkpoint import checkpoint

    from tridiag_tutorial import kernels, lapack

    solve = tridiagonal_solve if path == "solve" else _factored
    lower, diag, upper, rhs = make_system(n, seed=n)
    d = diag.clone().requires_grad_()
    with kernels.torch_kernel_on_cpu():
        value = checkpoint(lambda d: solve(lower, d, upper, rhs).pow(2).sum(), d,
                           use_reentrant=False)
    for name in ("solve", "gtsv", "factor", "factor_solve"):
        monkeypatch.setattr(lapack, name, lambda *a, **k: pytest.fail("LAPACK ran after the block"))
    value.backward()
    reference = grad(lambda d: dense(lower, d, upper, rhs).pow(2).sum())(diag)
    torch.testing.assert_close(d.grad, reference, rtol=1e-9, atol=1e-11)
