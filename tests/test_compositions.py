"""The whole support matrix: eager and torch.compile (fullgraph off and on) composed with every
torch.func transform, forward-mode dual numbers and double backward.

Every cell either equals an independent reference (the same transform applied to a dense solve
through ``torch.linalg.inv``, which torch differentiates correctly at every order; its
``linalg.solve`` does not) or raises an error that names ``tridiagonal_solve``. A silently wrong
or missing result fails the test, whichever the expected outcome.

Then the ``driver`` argument (issue 24) through the same machinery: the backward, a
``torch.utils.checkpoint`` recomputation and a compiled function run the kernel the call names
(or the automatic choice for its shapes), seen by spies on the kernels' entry points.
"""

import contextlib
import functools
import threading

import numpy as np
import pytest
import torch
from scipy.linalg import solve_banded
from torch.autograd import forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from tridiag_tutorial import (
    kernels,
    to_dense,
    tridiag_matmul,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.kernels import compiled, lapack, partitioned, sequential

from conftest import KERNELS, make_system, require_cpp, torch_trap

# --------------------------------------------------------------------------------------------
# Which kernel ran: spies on the kernels' entry points (tests/test_kernel_matrix.py uses them too).
# --------------------------------------------------------------------------------------------
# The functions through which tridiag_tutorial.kernels calls each driver's kernel.
KERNEL_ENTRIES = {
    "lapack": [(lapack, "solve"), (lapack, "factor"), (lapack, "factor_solve")],
    "cpp": [(compiled, "solve"), (compiled, "solve_backward")],
    "sequential": [(sequential, "solve"), (sequential, "factor"), (sequential, "lu_solve")],
    "partitioned": [(partitioned, "solve")],
}
# What driver=None runs on the CPU for one system (the spec of kernels.choose_driver): the C++
# kernel, where it was built, for a real system of any size (from compiled.PIECES_MIN_N
# unknowns its solve in pieces) and for a complex one up to CPP_ONE_COMPLEX_SYSTEM_MAX_N
# unknowns; LAPACK for a larger complex one.
AUTO_ONE_SMALL_SYSTEM = "cpp" if kernels.cpp_available() else "lapack"
BIG = kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N + 1


class KernelSpy:
    """Records the driver of every kernel entry point that runs (in :attr:`calls`, with the
    thread), counting only the outermost call: the partitioned kernel's own calls of the
    sequential kernel's functions (its small systems, its fallback) are part of it."""

    def __init__(self, monkeypatch):
        self.calls = []
        self._local = threading.local()
        for driver, entries in KERNEL_ENTRIES.items():
            for module, name in entries:
                monkeypatch.setattr(module, name, self._wrap(driver, getattr(module, name)))

    def _wrap(self, driver, real):
        @functools.wraps(real)
        def spy(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.calls.append((threading.get_ident(), driver))
            self._local.depth = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._local.depth = depth
        return spy

    def take(self):
        """The drivers that ran since the last call, in order (this thread's and others')."""
        drivers = [d for _, d in self.calls]
        self.calls.clear()
        return drivers


def needs(driver):
    """Skip (or fail, where it should have been built) a test of the C++ kernel without it."""
    if driver == "cpp":
        require_cpp()


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


# A torch.func transform inside ordinary autograd (a gradient penalty, a Hessian-vector product):
# the compiled op's single-level Function attaches its derivative to the transform's level only,
# so ordinary autograd's record of the call would miss it. The op refuses; Dynamo then runs the
# frame eagerly (right), fullgraph raises, and the op called directly raises.
INSIDE_AUTOGRAD = {
    "grad": lambda x, d: grad(lambda e: x(e).pow(2).sum())(d),
    "vjp": lambda x, d: vjp(x, d)[1](RHS)[0],
    "jvp": lambda x, d: jvp(x, (d,), (RHS,))[1],
    "jacrev": lambda x, d: jacrev(x)(d),
    "jacfwd": lambda x, d: jacfwd(x)(d),
    "vmap(grad)": lambda x, d: vmap(grad(lambda e: x(e).pow(2).sum()))(
        d + torch.arange(3, dtype=d.dtype).reshape(3, 1)),
}


def _direct_op(lower, diag, upper, rhs):
    return torch.ops.tridiag_tutorial.solve(lower, diag, upper, rhs.unsqueeze(-1), None, None,
                                            "N", "lapack").squeeze(-1)


def _outer_gradient(solve, transform, wrap):
    """d/d(diag) of sum(transform's result) + sum(diag), by ordinary autograd."""
    d = DIAG.clone().requires_grad_()
    inner = wrap(lambda d: INSIDE_AUTOGRAD[transform](lambda e: solve(LOWER, e, UPPER, RHS), d))
    return torch.autograd.grad(inner(d).sum() + d.sum(), d)[0]


@pytest.mark.parametrize("transform", list(INSIDE_AUTOGRAD))
@pytest.mark.parametrize("mode", list(MODES))
def test_transform_inside_ordinary_autograd(mode, transform):
    torch.compiler.reset()
    reference = _outer_gradient(dense, transform, lambda f: f)
    assert not torch.equal(reference, torch.ones_like(reference))  # the inner term is there
    if mode == "compile(fullgraph)":
        with pytest.raises(torch._dynamo.exc.Unsupported, match="ordinary autograd also records"):
            _outer_gradient(tridiagonal_solve, transform, MODES[mode])
    else:
        got = _outer_gradient(tridiagonal_solve, transform, MODES[mode])
        torch.testing.assert_close(got, reference, rtol=1e-9, atol=1e-11)
    with pytest.raises(NotImplementedError, match="ordinary autograd also records"):
        _outer_gradient(_direct_op, transform, lambda f: f)
    torch.compiler.reset()


@pytest.mark.parametrize("outside", ["no_grad", "detached"])
def test_transform_inside_autograd_that_records_nothing_runs_the_op(outside):
    """The refusal above only where ordinary autograd records: under no_grad, or on inputs that
    do not require grad, the op itself runs inside the transform and is right."""
    d = DIAG.clone().requires_grad_(outside == "no_grad")
    f = lambda e: INSIDE_AUTOGRAD["grad"](lambda e: _direct_op(LOWER, e, UPPER, RHS), e)  # noqa: E731
    with torch.no_grad() if outside == "no_grad" else contextlib.nullcontext():
        got = f(d)
    want = INSIDE_AUTOGRAD["grad"](lambda e: dense(LOWER, e, UPPER, RHS), DIAG)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


# Dual numbers made outside a compiled function (a dual_level around compiled code): torch.compile
# does not trace their tangents, so the op refuses there (and its kernel refuses tangents that
# reach it in a graph compiled earlier); uncompiled, and with duals made inside, it is right.
AROUND_COMPILED = {
    "x": lambda solve: (lambda d: solve(LOWER, d, UPPER, RHS)),
    "vmap(x)": lambda solve: (lambda d: vmap(lambda e: solve(LOWER, e, UPPER, RHS))(
        d.expand(3, -1))),
    "grad": lambda solve: (lambda d: grad(lambda e: solve(LOWER, e, UPPER, RHS).pow(2).sum())(d)),
}


def _tangent_through(f, warm=False):
    if warm:
        f(DIAG)
    with fwAD.dual_level():
        out = f(fwAD.make_dual(DIAG, RHS))
        return fwAD.unpack_dual(out).tangent


@pytest.mark.parametrize("case", list(AROUND_COMPILED))
@pytest.mark.parametrize("mode", ["compile", "compile(fullgraph)", "compiled before the level"])
def test_duals_made_outside_a_compiled_function_are_right_or_refused(mode, case):
    torch.compiler.reset()
    reference = _tangent_through(AROUND_COMPILED[case](dense))
    assert reference is not None and reference.abs().max() > 0.1
    compiled = torch.compile(AROUND_COMPILED[case](tridiagonal_solve), backend="aot_eager",
                             fullgraph=mode == "compile(fullgraph)")
    try:
        got = _tangent_through(compiled, warm=mode == "compiled before the level")
    except (NotImplementedError, torch._dynamo.exc.Unsupported) as error:
        ours = "tridiagonal_solve" in str(error) and "dual" in str(error)
        torchs = "dual tensor input" in str(error)  # from torch 2.14 Dynamo refuses them itself
        assert ours or torchs, str(error)
        assert mode != "compile" or case != "vmap(x)"  # Dynamo runs that one eagerly: right
    else:
        assert got is not None, "the tangent was dropped"
        torch.testing.assert_close(got, reference, rtol=1e-9, atol=1e-11)
    torch.compiler.reset()


def test_the_op_called_directly_under_grad_inside_a_dual_level_refuses():
    with fwAD.dual_level():
        d = fwAD.make_dual(DIAG, RHS)
        with pytest.raises(NotImplementedError, match="ordinary autograd also records"):
            grad(lambda e: _direct_op(LOWER, e, UPPER, RHS).pow(2).sum())(d)


def sum_of_squares_grad(lower, d, upper, rhs):
    """The reference: the gradient with respect to the diagonal of ``sum(solve(...)**2)``."""
    return grad(lambda d: dense(lower, d, upper, rhs).pow(2).sum())(d)


def banded_sum_of_squares_grad(lower, diag, upper, rhs):
    """The same reference for a real system too large for a dense one, with SciPy's banded
    solver: ``x = A^{-1} rhs``, ``v = A^{-T} (2 x)`` and the gradient ``-v * x``."""
    lower, diag, upper, rhs = (t.detach().numpy() for t in (lower, diag, upper, rhs))

    def bands(lo, up):
        ab = np.zeros((3, diag.shape[-1]))
        ab[0, 1:], ab[1], ab[2, :-1] = up, diag, lo
        return ab

    x = solve_banded((1, 1), bands(lower, upper), rhs)
    v = solve_banded((1, 1), bands(upper, lower), 2 * x)
    return torch.from_numpy(-v * x)


@pytest.mark.parametrize("driver", [None, *KERNELS])
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_backward_runs_on_the_forwards_kernel(monkeypatch, driver, compile_):
    """The backward solves with ``A^H`` on the kernel that the forward ran, eagerly and through
    a function compiled with fullgraph=True; with driver=None, the automatic choice."""
    needs(driver)
    spy = KernelSpy(monkeypatch)
    expected = driver or AUTO_ONE_SMALL_SYSTEM
    d = DIAG.clone().requires_grad_()

    def loss(d):
        return tridiagonal_solve(LOWER, d, UPPER, RHS, driver=driver).pow(2).sum()

    value = (torch.compile(loss, fullgraph=True, backend="aot_eager") if compile_ else loss)(d)
    assert set(spy.take()) == {expected}
    value.backward()
    backward = spy.take()
    assert backward and set(backward) == {expected}, backward
    torch.testing.assert_close(d.grad, sum_of_squares_grad(LOWER, DIAG, UPPER, RHS))


def test_drivers_of_concurrent_calls_do_not_mix(monkeypatch):
    """While one thread is inside a solve with driver="sequential", another thread's solve with
    driver=None runs the automatic choice: the driver is the call's argument, not a state that
    threads share (before issue 24 it was a thread-local context)."""
    inside, done = threading.Event(), threading.Event()
    real = sequential.solve

    def blocking(*args):
        inside.set()
        assert done.wait(10), "the other thread's solve did not finish"
        return real(*args)

    monkeypatch.setattr(sequential, "solve", blocking)
    spy = KernelSpy(monkeypatch)
    out = {}

    def holder():
        out["x"] = tridiagonal_solve(LOWER, DIAG, UPPER, RHS, driver="sequential")

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(10), "the sequential solve did not start"
        x = tridiagonal_solve(LOWER, DIAG, UPPER, RHS)
    finally:
        done.set()
        thread.join()
    main = threading.get_ident()
    assert [d for t, d in spy.calls if t == main] == [AUTO_ONE_SMALL_SYSTEM]
    assert [d for t, d in spy.calls if t != main] == ["sequential"]
    torch.testing.assert_close(x, dense(LOWER, DIAG, UPPER, RHS))
    torch.testing.assert_close(out["x"], dense(LOWER, DIAG, UPPER, RHS))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", ["argument", "closure"])
def test_compiled_function_follows_the_driver_it_is_given(monkeypatch, backend, how):
    """Dynamo guards on the driver: a function compiled with driver="lapack" and then called
    with "sequential" (an argument, or a closure variable that changed) runs the sequential
    kernel, forward and backward; called with "lapack" again, LAPACK; then "partitioned". No
    choice is baked into a graph."""
    spy = KernelSpy(monkeypatch)
    drv = "lapack"
    if how == "argument":
        compiled_loss = torch.compile(
            lambda d, drv: tridiagonal_solve(LOWER, d, UPPER, RHS, driver=drv).pow(2).sum(),
            backend=backend)

        def call(d):
            return compiled_loss(d, drv)
    else:
        call = torch.compile(
            lambda d: tridiagonal_solve(LOWER, d, UPPER, RHS, driver=drv).pow(2).sum(),
            backend=backend)
    reference = sum_of_squares_grad(LOWER, DIAG, UPPER, RHS)
    for drv in ("lapack", "sequential", "lapack", "partitioned"):  # the closure reads drv
        d = DIAG.clone().requires_grad_()
        value = call(d)
        assert set(spy.take()) == {drv}, drv
        torch.testing.assert_close(value, dense(LOWER, DIAG, UPPER, RHS).pow(2).sum())
        value.backward()
        backward = spy.take()
        assert backward and set(backward) == {drv}, (drv, backward)
        torch.testing.assert_close(d.grad, reference)


@pytest.mark.parametrize("dynamic", [None, True, False],
                         ids=["automatic-dynamic", "dynamic", "static"])
def test_compiled_automatic_choice_follows_the_shapes(monkeypatch, dynamic):
    """driver=None inside a compiled function: compiled for one complex system of n = 5 (the
    C++ kernel), then called with shapes that change the automatic choice (one complex system of
    n = 5000 or just above CPP_ONE_COMPLEX_SYSTEM_MAX_N: LAPACK; a batch of two such systems: the
    C++ kernel), it runs the kernel each shape gets: Dynamo guards on what the choice read. Real
    systems run on the C++ kernel at every size (its solve in pieces from
    PIECES_MIN_N unknowns is inside the kernel): no shape changes their kernel."""
    require_cpp()
    spy = KernelSpy(monkeypatch)
    f = torch.compile(lambda l, d, u, b: tridiagonal_solve(l, d, u, b), backend="aot_eager",
                      dynamic=dynamic)
    top = kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N
    c128, f64 = torch.complex128, torch.float64
    for n, batch, dtype, expected in [
            (5, (), c128, "cpp"), (5000, (), c128, "lapack"), (5000, (2,), c128, "cpp"),
            (top, (), c128, "cpp"), (top + 1, (), c128, "lapack"), (7, (), c128, "cpp"),
            (top + 1, (2,), c128, "cpp"), (5, (), f64, "cpp"), (5000, (), f64, "cpp"),
            (top + 1, (), f64, "cpp")]:
        lower, diag, upper, rhs = make_system(n, batch, dtype=dtype, seed=n, dominant=True)
        x = f(lower, diag, upper, rhs)
        assert spy.take() == [expected], (n, batch, dtype)
        torch.testing.assert_close(tridiag_matmul(lower, diag, upper, x.unsqueeze(-1)).squeeze(-1),
                                   rhs, rtol=1e-10, atol=1e-10)


def _factored(lower, diag, upper, rhs):
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


def _factored_on(driver):
    def solve(lower, diag, upper, rhs):
        return tridiagonal_lu_solve(tridiagonal_lu_factor(lower, diag, upper, driver=driver), rhs,
                                    driver=driver)
    return solve


# (path, driver, n): every driver, and driver=None on both sides of the C++ kernel's
# PIECES_MIN_N (BIG is above it); the torch-op kernels on both sides of PARTITIONED_MIN_N.
CHECKPOINTED = [("solve", "lapack", 5), ("solve", "cpp", 5), ("solve", "sequential", 5),
                ("solve", "sequential", 100), ("solve", "partitioned", 5),
                ("solve", "partitioned", 100), ("solve", None, 5), ("solve", None, BIG),
                ("factored", "lapack", 5), ("factored", "sequential", 5),
                ("factored", "sequential", 100), ("factored", None, 5)]


@pytest.mark.parametrize("path, driver, n", CHECKPOINTED,
                         ids=[f"{p}-{d}-n{n}" for p, d, n in CHECKPOINTED])
def test_checkpoint_recomputes_on_the_forwards_kernel(monkeypatch, path, driver, n):
    """``torch.utils.checkpoint(..., use_reentrant=False)`` of a solve: the recomputation at
    backward time runs the forward's kernel, as many times as the forward did, and then the
    backward's solve runs on it too. (Before issue 24 the kernel was chosen by a context that
    the recomputation, outside it, did not see: it ran on LAPACK, and torch raised
    CheckpointError: 7 tensors saved in the forward, 5 in the recomputation.) With
    driver=None the automatic choice, made again from the same inputs, is the same kernel."""
    from torch.utils.checkpoint import checkpoint

    needs(driver)
    spy = KernelSpy(monkeypatch)
    if path == "solve":
        solve = functools.partial(tridiagonal_solve, driver=driver)
        expected = driver or AUTO_ONE_SMALL_SYSTEM  # a real system: any size
    else:
        solve = _factored_on(driver)
        expected = driver or "lapack"
    lower, diag, upper, rhs = make_system(n, seed=n, dominant=n >= BIG)

    def loss(d):
        return solve(lower, d, upper, rhs).pow(2).sum()

    d = diag.clone().requires_grad_()
    value = loss(d)  # without checkpoint: the kernels that a forward and a backward run
    plain_forward = spy.take()
    value.backward()
    plain_backward = spy.take()
    reference = d.grad
    d = diag.clone().requires_grad_()
    value = checkpoint(loss, d, use_reentrant=False)
    forward = spy.take()
    value.backward()
    recomputed_and_backward = spy.take()
    assert plain_forward and set(plain_forward) == {expected}, plain_forward
    assert set(plain_backward) == {expected}, plain_backward
    assert forward == plain_forward
    # The backward of the checkpoint is the recomputation (the forward's kernel calls again,
    # on its kernel) followed by the backward's own.
    assert recomputed_and_backward == plain_forward + plain_backward, recomputed_and_backward
    if n < BIG:
        expected_grad = sum_of_squares_grad(lower, diag, upper, rhs)
    else:
        expected_grad = banded_sum_of_squares_grad(lower, diag, upper, rhs)
    torch.testing.assert_close(d.grad, expected_grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(reference, expected_grad, rtol=1e-9, atol=1e-11)
