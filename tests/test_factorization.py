"""The public factorization: tridiagonal_lu_factor / tridiagonal_lu_solve.

Values and gradients against the dense reference (``torch.linalg.solve`` on ``A``, ``A^T`` or
``A^H``), gradcheck in float64 (reverse, forward and second order), every torch.func transform,
vmap (including the fold of a right-hand-side-only batch into columns), torch.compile with
fullgraph, both kernels, and the errors.
"""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from tridiag_tutorial import (
    TridiagonalFactors,
    kernels,
    rules,
    to_dense,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.kernels import compiled, lapack

from conftest import ALL_DTYPES, assert_close, make_system

TRANS = ["N", "T", "C"]


def dense_op(lower, diag, upper, trans):
    a = to_dense(lower, diag, upper)
    return {"N": a, "T": a.mT, "C": a.mH}[trans]


def dense(lower, diag, upper, rhs, trans="N"):
    """The reference: ``op(A)^{-1} rhs`` for a vector or matrix ``rhs``."""
    a = dense_op(lower, diag, upper, trans)
    vector = rhs.ndim == diag.ndim
    x = torch.linalg.solve(a, rhs.unsqueeze(-1) if vector else rhs)
    return x.squeeze(-1) if vector else x


# The factor drivers, by the tests' kernel names: "torch" is the sequential kernel in torch ops,
# the one other devices (CUDA) factor with.
FACTOR_DRIVER = {"lapack": "lapack", "torch": "sequential"}


def factored(lower, diag, upper, rhs, trans="N", driver=None):
    f = tridiagonal_lu_factor(lower, diag, upper, driver=driver)
    return tridiagonal_lu_solve(f, rhs, trans, driver=driver)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("trans", TRANS)
@pytest.mark.parametrize("n, batch, k", [(1, (), None), (2, (3,), 2), (7, (2, 3), None),
                                         (7, (), 4)])
def test_solve_with_factors_matches_dense(kernel, dtype, trans, n, batch, k):
    args = make_system(n, batch, k, dtype=dtype, seed=n)
    x = factored(*args, trans, driver=FACTOR_DRIVER[kernel])
    assert x.shape == args[3].shape and x.dtype == dtype
    assert_close(x, dense(*args, trans), dtype)


def test_factors_object_describes_the_matrix():
    lower, diag, upper, _ = make_system(6, (2, 3), seed=1)
    f = tridiagonal_lu_factor(lower, diag, upper)
    assert isinstance(f, TridiagonalFactors) and isinstance(f, tuple)
    assert f.batch_shape == (2, 3) and f.n == 6 and f.device == diag.device
    assert f.dtype == torch.float64
    assert f.lu.shape == (2, 3, 4, 6) and f.pivots.shape == (2, 3, 6)
    assert f.pivots.dtype == torch.int32
    assert f.lower is lower and f.diag is diag and f.upper is upper  # kept, not copied
    # the pivots are LAPACK's: each row is interchanged with itself or the next (1-based)
    rows = torch.arange(1, 7, dtype=torch.int32)
    assert bool(((f.pivots == rows) | (f.pivots == rows + 1)).all())


def test_factors_broadcast_against_a_batched_rhs():
    """One matrix, a batch of right-hand sides: the factors broadcast like the bands."""
    lower, diag, upper, _ = make_system(5, (1,), seed=2)
    rhs = torch.randn(4, 5, dtype=torch.float64)
    x = factored(lower, diag, upper, rhs)
    assert x.shape == (4, 5)
    assert_close(x, dense(lower, diag, upper, rhs))


@pytest.mark.parametrize("batch", [(), (2,)], ids=["one-system", "batch"])
def test_inputs_are_not_modified(batch):
    args = make_system(6, batch, 2, dtype=torch.complex128, seed=3)
    copies = [a.clone() for a in args]
    f = tridiagonal_lu_factor(*args[:3])
    lu, pivots = f.lu.clone(), f.pivots.clone()
    for trans in TRANS:
        tridiagonal_lu_solve(f, args[3], trans)
    for a, c in zip(args, copies):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    torch.testing.assert_close(f.lu, lu, rtol=0, atol=0)
    torch.testing.assert_close(f.pivots, pivots, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("trans", TRANS)
def test_gradcheck_through_the_factors(kernel, dtype, trans):
    """Reverse, forward and second-order derivatives with respect to the bands and rhs."""
    args = make_system(5, (2,), 2, dtype=dtype, requires_grad=True, seed=4)
    driver = FACTOR_DRIVER[kernel]
    assert gradcheck(lambda *a: factored(*a, trans, driver=driver), args, check_forward_ad=True)
    assert gradgradcheck(lambda *a: factored(*a, trans, driver=driver), args)


@pytest.mark.parametrize("trans", TRANS)
def test_gradients_match_dense(trans):
    args = make_system(6, (3,), 2, dtype=torch.complex128, requires_grad=True, seed=5)

    def loss(x):
        return x.abs().pow(2).sum()

    got = torch.autograd.grad(loss(factored(*args, trans)), args)
    expected = torch.autograd.grad(loss(dense(*args, trans)), args)
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_only_rhs_differentiable_when_the_bands_are_constant():
    lower, diag, upper, rhs = make_system(6, seed=6)
    f = tridiagonal_lu_factor(lower, diag, upper)
    rhs.requires_grad_()
    x = tridiagonal_lu_solve(f, rhs)
    (g,) = torch.autograd.grad(x.sum(), rhs)
    assert_close(g, dense(lower, diag, upper, torch.ones(6, dtype=torch.float64), "T"))


def test_torch_func_transforms_through_the_factors():
    lower, diag, upper, rhs = make_system(5, seed=7)

    def f(d, b):
        return factored(lower, d, upper, b).pow(2).sum()

    def f_dense(d, b):
        return dense(lower, d, upper, b).pow(2).sum()

    for transform in (grad, jacrev, jacfwd):
        for argnums in (0, 1):
            assert_close(transform(f, argnums=argnums)(diag, rhs),
                         transform(f_dense, argnums=argnums)(diag, rhs))
    assert_close(hessian(f, argnums=1)(diag, rhs), hessian(f_dense, argnums=1)(diag, rhs))
    assert_close(jvp(f, (diag, rhs), (torch.ones_like(diag), rhs))[1],
                 jvp(f_dense, (diag, rhs), (torch.ones_like(diag), rhs))[1])
    diags = diag + 0.1 * torch.arange(3, dtype=torch.float64)[:, None]
    assert_close(vmap(grad(f), in_dims=(0, None))(diags, rhs),
                 vmap(grad(f_dense), in_dims=(0, None))(diags, rhs))


def test_forward_over_forward_raises_instead_of_a_wrong_answer():
    lower, diag, upper, rhs = make_system(5, seed=8)
    with pytest.raises(NotImplementedError, match="forward-mode AD nested in forward-mode"):
        jacfwd(jacfwd(lambda b: factored(lower, diag, upper, b)))(rhs)


@pytest.mark.parametrize("in_dims", [(None, 0), (0, 0), (0, None)],
                         ids=["rhs-only", "both", "factors-only"])
def test_vmap_over_factors_and_rhs(in_dims):
    lower, diag, upper, _ = make_system(6, (4,), seed=9)
    rhs = torch.randn(4, 6, 2, dtype=torch.float64)
    f = tridiagonal_lu_factor(lower, diag, upper)
    if in_dims[0] is None:
        f = tridiagonal_lu_factor(lower[0], diag[0], upper[0])
    if in_dims[1] is None:
        rhs = rhs[0]
    x = vmap(tridiagonal_lu_solve, in_dims=in_dims)(f, rhs)
    loop = torch.stack([tridiagonal_lu_solve(
        f if in_dims[0] is None else TridiagonalFactors(*(t[i] for t in f)),
        rhs if in_dims[1] is None else rhs[i]) for i in range(4)])
    assert_close(x, loop)


@pytest.mark.parametrize("solve", ["tridiagonal_solve", "tridiagonal_lu_solve"])
def test_vmap_over_the_rhs_alone_is_one_solve_with_more_columns(monkeypatch, solve):
    """JAX's batching rule: a batch that only rhs has becomes its columns (no copies of A)."""
    lower, diag, upper, _ = make_system(6, seed=10)
    rhs = torch.randn(5, 6, 2, dtype=torch.float64)
    seen = []
    for name, rhs_position in (("solve", 3), ("factor_solve", 2)):
        original = getattr(lapack, name)

        def spy(*a, _f=original, _i=rhs_position, **k):
            seen.append(a[_i].shape)
            return _f(*a, **k)
        monkeypatch.setattr(lapack, name, spy)
    if solve == "tridiagonal_solve":
        x = vmap(lambda b: tridiagonal_solve(lower, diag, upper, b, driver="lapack"))(rhs)
    else:
        f = tridiagonal_lu_factor(lower, diag, upper)
        x = vmap(lambda b: tridiagonal_lu_solve(f, b))(rhs)
    assert seen == [(6, 10)]  # one call: 2 columns x 5 batch elements, bands unbatched
    assert_close(x, dense(lower, diag, upper, rhs))


def test_vmap_fold_keeps_gradients_right():
    args = make_system(6, dtype=torch.float64, seed=11)
    rhs = torch.randn(3, 6, dtype=torch.float64)

    def loss(d, b):
        return vmap(lambda r: tridiagonal_solve(args[0], d, args[2], r))(b).pow(2).sum()

    def loss_dense(d, b):
        return dense(args[0], d, args[2], b.T).pow(2).sum()  # the batch as columns

    for argnums in (0, 1):
        assert_close(grad(loss, argnums=argnums)(args[1], rhs),
                     grad(loss_dense, argnums=argnums)(args[1], rhs))


@pytest.mark.parametrize("where", ["factor-inside", "factors-as-input"])
def test_compile_fullgraph_forward_and_backward(where):
    torch._dynamo.reset()
    args = make_system(6, (2,), dtype=torch.float64, requires_grad=True, seed=12)
    f_outside = tridiagonal_lu_factor(*args[:3])

    def step(lower, diag, upper, rhs):
        f = tridiagonal_lu_factor(lower, diag, upper) if where == "factor-inside" else f_outside
        u = rhs
        for _ in range(3):
            u = tridiagonal_lu_solve(f, u)
        return u.pow(2).sum()

    compiled = torch.compile(step, fullgraph=True)
    explanation = torch._dynamo.explain(step)(*args)
    assert explanation.graph_break_count == 0
    value = compiled(*args)
    got = torch.autograd.grad(value, args)
    expected = torch.autograd.grad(step(*args), args)
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_backward_skips_band_gradients_nobody_asked_for(monkeypatch):
    """ctx.needs_input_grad: with only rhs requiring grad, no band gradient is computed (by
    the rules in torch ops, or by the C++ kernel's fused backward where the C++ fast path ran)."""
    calls = []
    for module, name in [(rules, "band_gradients"), (compiled, "solve_backward")]:
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    lower, diag, upper, rhs = make_system(6, (2,), seed=13)
    rhs.requires_grad_()
    (g,) = torch.autograd.grad(tridiagonal_solve(lower, diag, upper, rhs).sum(), rhs)
    assert calls == []
    assert_close(g, dense(lower, diag, upper, torch.ones_like(rhs), "T"))
    diag.requires_grad_()
    torch.autograd.grad(tridiagonal_solve(lower, diag, upper, rhs).sum(), (diag, rhs))
    assert calls == [1]
    calls.clear()
    torch.autograd.grad(torch.compile(tridiagonal_solve, fullgraph=True)(
        lower, diag.detach(), upper, rhs).sum(), rhs)
    assert calls == []


def test_singular_matrix_raises_at_factor_time():
    lower, diag, upper, _ = make_system(4, (3,), seed=14)
    diag[2, 1], lower[2, 0], lower[2, 1], upper[2, 0], upper[2, 1] = 0, 0, 0, 0, 0
    with pytest.raises(torch.linalg.LinAlgError,
                       match=r"pivot U\[1, 1\] is exactly zero, in batch element \(2,\)$"):
        tridiagonal_lu_factor(lower, diag, upper)


def test_errors_name_the_problem():
    lower, diag, upper, rhs = make_system(4, seed=15)
    f = tridiagonal_lu_factor(lower, diag, upper)
    with pytest.raises(TypeError, match="factors must be the TridiagonalFactors"):
        tridiagonal_lu_solve((lower, diag, upper), rhs)
    with pytest.raises(ValueError, match="trans must be 'N'.*got 'X'"):
        tridiagonal_lu_solve(f, rhs, "X")
    with pytest.raises(ValueError, match="do not fit their bands"):
        tridiagonal_lu_solve(f._replace(lu=f.lu[..., :3, :]), rhs)
    with pytest.raises(ValueError, match="rhs must have n = 4 rows"):
        tridiagonal_lu_solve(f, torch.ones(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="same dtype"):
        tridiagonal_lu_solve(f, rhs.float())
    with pytest.raises(ValueError, match="tridiagonal_lu_factor: with n = diag.shape"):
        tridiagonal_lu_factor(lower[:2], diag, upper)
    with pytest.raises(TypeError, match="tridiagonal_lu_factor: dtype torch.int64"):
        tridiagonal_lu_factor(lower.long(), diag.long(), upper.long())


def test_torch_kernel_factors_do_not_factor_again_in_the_backward(monkeypatch):
    from tridiag_tutorial.kernels import sequential
    args = make_system(6, (2,), dtype=torch.float64, requires_grad=True, seed=16)
    f = tridiagonal_lu_factor(*args[:3], driver="sequential")
    calls = []
    original = sequential.factor
    monkeypatch.setattr(sequential, "factor", lambda *a: calls.append(1) or original(*a))
    x = tridiagonal_lu_solve(f, args[3], driver="sequential")
    torch.autograd.grad(x.sum(), args)
    assert calls == []
    assert kernels._sequential is sequential


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("where", ["rhs", "bands"])
def test_non_finite_value_stays_in_its_own_system(kernel, where):
    args = make_system(5, (4,), 2, seed=17)
    if where == "rhs":
        args[3][1, 2, 0] = float("nan")
    else:
        args[0][1, 2] = float("nan")
    x = factored(*args, "T", driver=FACTOR_DRIVER[kernel])
    assert not torch.isfinite(x[1]).all()
    others = [0, 2, 3]
    assert_close(x[others], dense(*(a[others] for a in args), "T"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_factors_solve_and_differentiate():
    args = [a.cuda().requires_grad_() for a in make_system(9, (3,), 2, seed=18)]
    f = tridiagonal_lu_factor(*args[:3])
    assert f.lu.device.type == "cuda" and f.pivots.device.type == "cuda"
    for trans in TRANS:
        x = tridiagonal_lu_solve(f, args[3], trans)
        assert_close(x.cpu(), dense(*(a.detach().cpu() for a in args), trans))
    assert gradcheck(lambda *a: factored(*a, "C"), args, check_forward_ad=True)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
def test_vmap_over_the_factorization_itself(kernel):
    """The factor op's own vmap rule: one factorization of the whole batch."""
    lower, diag, upper, rhs = make_system(6, (3,), seed=19)
    driver = FACTOR_DRIVER[kernel]
    x = vmap(lambda d, b: factored(lower[0], d, upper[0], b, "T", driver=driver))(diag, rhs)
    assert_close(x, dense(lower[0].expand(3, 5), diag, upper[0].expand(3, 5), rhs, "T"))


def test_compile_fullgraph_on_the_pure_torch_kernel():
    """On the kernel of other devices the compiled graph factors once for forward and backward."""
    torch._dynamo.reset()
    args = make_system(5, (2,), 2, dtype=torch.float64, requires_grad=True, seed=20)

    def loss(*a):
        return (tridiagonal_solve(*a, driver="sequential").pow(2).sum()
                + factored(*a, "C", driver="sequential").pow(2).sum())

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    expected = torch.autograd.grad(loss(*args), args)
    for g, e in zip(got, expected):
        assert_close(g, e)


# --- issue 23: the factors are checked before any kernel uses them -------------------------------
def tampered(f, index, value):
    p = f.pivots.clone()
    p[index] = value
    return f._replace(pivots=p)


@pytest.mark.parametrize("value", ["i", "i+3", "zero", "negative", "huge"])
@pytest.mark.parametrize("where", ["op", "public"])
def test_tampered_pivots_raise_on_the_torch_kernel(value, where):
    """Issue 23: on the torch kernel tampered pivots gave a wrong answer without error. (LAPACK
    crashed on them: tests/test_fuzz.py runs those in a subprocess.)"""
    lower, diag, upper, rhs = make_system(6, (2,), 2, seed=21)
    f = tridiagonal_lu_factor(lower, diag, upper)
    i = 3
    bad = {"i": i, "i+3": i + 3, "zero": 0, "negative": -7, "huge": 10**6}[value]
    t = tampered(f, (1, i), bad)
    with pytest.raises(
            ValueError, match=rf"tridiagonal_lu_solve: pivots\[\.\.\., 3\] = {bad} in batch "
                              r"element \(1,\) is not a pivot.*1-based: 4 or 5"):
        if where == "public":
            tridiagonal_lu_solve(t, rhs, driver="sequential")
        else:
            torch.ops.tridiag_tutorial.solve_kernel(lower, diag, upper, rhs, t.lu, t.pivots, "N",
                                                    "sequential")


def test_wrong_last_pivot_raises_on_the_torch_kernel():
    lower, diag, upper, rhs = make_system(4, seed=22)
    f = tridiagonal_lu_factor(lower, diag, upper)
    with pytest.raises(ValueError, match=r"pivots\[\.\.\., 3\] = 3 "
                       r"is not a pivot.*1-based: 4 \(the last row\)"):
        tridiagonal_lu_solve(tampered(f, 3, 3), rhs, driver="sequential")


def test_tampered_pivots_raise_inside_a_compiled_graph():
    """The value check runs in the op's real kernel, so a compiled graph checks them too."""
    torch._dynamo.reset()
    lower, diag, upper, rhs = make_system(5, (3,), seed=23)
    f = tridiagonal_lu_factor(lower, diag, upper)
    solve = torch.compile(lambda f, b: tridiagonal_lu_solve(f, b, driver="sequential"),
                          fullgraph=True)
    assert_close(solve(f, rhs), dense(lower, diag, upper, rhs))
    with pytest.raises(ValueError, match=r"pivots\[\.\.\., 1\] = 9 in batch element \(2,\)"):
        solve(tampered(f, (2, 1), 9), rhs)


@pytest.mark.parametrize("field, bad, error, match", [
    ("lu", lambda t: t.float(), TypeError, "lu must have the bands' dtype torch.float64, got "
                                           "torch.float32"),
    ("lu", lambda t: t.to(torch.complex128), TypeError, "lu must have the bands' dtype"),
    ("pivots", lambda t: t.long(), TypeError, "pivots must be torch.int32"),
    ("lu", lambda t: t.to("meta"), ValueError, "same device.*lu on meta"),
    ("pivots", lambda t: t.to("meta"), ValueError, "same device.*pivots on meta"),
    ("pivots", lambda t: t[:2], ValueError, "do not fit their bands"),
    ("lu", lambda t: t.expand(2, 3, 4, 5), ValueError, "do not fit their bands"),
    ("pivots", lambda t: t.tolist(), TypeError, "pivots must be a torch.Tensor, got list"),
    ("diag", lambda t: t.tolist(), TypeError, "factors.diag must be a torch.Tensor"),
])
@pytest.mark.parametrize("kernel", ["lapack", "torch"])
def test_factors_metadata_is_checked(kernel, field, bad, error, match):
    """Issue 23: a float32 lu returned float32 on LAPACK and float64 on the torch kernel, a complex
    lu gave a complex answer, and meta factors returned an uninitialised CPU tensor."""
    lower, diag, upper, rhs = make_system(5, (3,), seed=24)
    f = tridiagonal_lu_factor(lower, diag, upper)
    f = f._replace(**{field: bad(getattr(f, field))})
    with pytest.raises(error, match="tridiagonal_lu_solve: .*" + match):
        tridiagonal_lu_solve(f, rhs, driver=FACTOR_DRIVER[kernel])


def test_a_meta_rhs_beside_cpu_factors_raises():
    lower, diag, upper, rhs = make_system(5, seed=25)
    f = tridiagonal_lu_factor(lower, diag, upper)
    with pytest.raises(ValueError, match="tridiagonal_lu_solve: all inputs must be on the same"):
        tridiagonal_lu_solve(f, rhs.to("meta"))


def _kernel_op_cases():
    """(description, args of solve_kernel / solve, error, match), n = 5."""
    lower, diag, upper, rhs = make_system(5, (), 1, seed=26)
    f = tridiagonal_lu_factor(lower, diag, upper)
    bands = (lower, diag, upper)
    return [
        ("7-row rhs", (*bands, torch.ones(7, 1, dtype=torch.float64), None, None, "N"),
         ValueError, r"rhs must be \(\*batch, n, k\) with n = 5"),
        ("vector rhs", (*bands, rhs[:, 0], None, None, "N"), ValueError, "rhs must be"),
        ("lu without pivots", (*bands, rhs, f.lu, None, "N"), ValueError,
         "lu and pivots must be given together"),
        ("pivots without lu", (*bands, rhs, None, f.pivots, "N"), ValueError,
         "lu and pivots must be given together"),
        ("trans T without factors", (*bands, rhs, None, None, "T"), ValueError,
         "trans='T' needs the factors"),
        ("trans X", (*bands, rhs, f.lu, f.pivots, "X"), ValueError, "trans must be 'N'"),
        ("a band on meta", (lower.to("meta"), diag, upper, rhs, None, None, "N"), ValueError,
         "same device.*lower on meta"),
        ("lu on meta", (*bands, rhs, f.lu.to("meta"), f.pivots, "N"), ValueError,
         "same device.*lu on meta"),
        ("float32 lu", (*bands, rhs, f.lu.float(), f.pivots, "N"), TypeError,
         "lu must have the bands' dtype"),
        ("batched lower", (lower.expand(2, 4), diag, upper, rhs, None, None, "N"), ValueError,
         "one batch shape"),
        ("int64 pivots", (*bands, rhs, f.lu, f.pivots.long(), "N"), TypeError,
         "pivots must be torch.int32"),
    ]


@pytest.mark.parametrize("op", ["solve", "solve_kernel"])
@pytest.mark.parametrize("kernel", ["lapack", "torch"])
def test_registered_ops_check_their_arguments(op, kernel):
    """Issue 23: solve accepted a 7-row rhs for n = 5 on the torch kernel and returned (7, 1); lu
    without pivots raised AttributeError from NumPy; one band on meta returned an uninitialised
    CPU tensor."""
    for what, args, error, match in _kernel_op_cases():
        with pytest.raises(error, match="tridiag_tutorial::solve_kernel: .*" + match):
            getattr(torch.ops.tridiag_tutorial, op)(*args, FACTOR_DRIVER[kernel])
            pytest.fail(f"no error for {what}")


def test_fake_kernels_check_what_the_real_kernels_check():
    """The fake kernels (torch.compile, torch.export) refuse the same arguments, with the same
    error, as the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for what, args, error, match in _kernel_op_cases():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and a.device.type != "meta"
                else a for a in args]
        with mode, pytest.raises(error, match="tridiag_tutorial::solve_kernel: .*" + match):
            torch.ops.tridiag_tutorial.solve_kernel(*fake, "lapack")
            pytest.fail(f"no error for {what}")
    lower, diag, upper, _ = make_system(5, (2,), seed=27)
    for args, match in [((lower.to("meta"), diag, upper), "same device.*lower on meta"),
                        ((lower[0], diag, upper), "one batch shape"),
                        ((lower, diag.float(), upper), "same dtype")]:
        with pytest.raises((ValueError, TypeError), match="tridiag_tutorial::lu_factor: .*" + match):
            torch.ops.tridiag_tutorial.lu_factor(*args, "lapack")


def test_pivot_check_in_torch_ops_agrees_with_the_numpy_one():
    """The check of other devices (torch ops) and the CPU's (NumPy) flag the same entries."""
    from tridiag_tutorial import _validation
    g = torch.Generator().manual_seed(28)
    for n in (1, 2, 7):
        rows = torch.arange(1, n + 1, dtype=torch.int32)
        p = rows + torch.randint(-3, 4, (50, n), generator=g, dtype=torch.int32)
        p[:5] = torch.tensor([-2**31, 2**31 - 1, 0, 10**6, n + 1])[:5, None].int()
        mask = _validation._bad_pivots_in_torch(p)
        step = p.long() - rows.long()
        expected = (step < 0) | (step > 1) | ((step != 0) & (rows == n))  # independent, in int64
        assert torch.equal(mask, expected)
        for j in range(p.shape[0]):
            if bool(expected[j].any()):
                with pytest.raises(ValueError, match=rf"pivots\[\.\.\., {int(expected[j].int().argmax())}\]"):
                    _validation.check_pivot_values(p[j])
            else:
                _validation.check_pivot_values(p[j])
