"""The kernels: joined-batch LAPACK, LU factors, the pure-torch kernel, singular/non-finite."""

import contextlib

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from tridiag_tutorial import (
    custom_op,
    dense_solve,
    kernels,
    lapack,
    torch_kernel,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.custom_op import torch_kernel_on_cpu

from conftest import ALL_DTYPES, assert_close, assert_grads_match_dense, kernel_context, make_system

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def numpy_args(*tensors):
    return [t.numpy() for t in tensors]


def test_joined_batch_equals_one_call_per_system():
    """One ?gtsv call on the block-diagonal system gives bit-identical results to a loop."""
    args = make_system(9, (4, 5), 3, seed=1)
    args[1][1, 2, 0] = 0.0  # a pivot that forces a row interchange
    joined = lapack.solve(*numpy_args(*args))
    loop = np.stack([lapack.gtsv(*(a.reshape(20, *a.shape[2:])[i] for a in numpy_args(*args)))
                     for i in range(20)]).reshape(joined.shape)
    np.testing.assert_array_equal(joined, loop)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 6])
@pytest.mark.parametrize("trans", ["N", "T", "C"])
def test_lu_factors_solve_every_transpose(dtype, n, trans):
    """LAPACK's batched factors solve with A, A^T and A^H, on both kernels' solves."""
    lower, diag, upper, rhs = make_system(n, (3,), 2, dtype=dtype, seed=n)
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    assert lu.shape == (3, 4, n) and pivots.shape == (3, n) and pivots.dtype == np.int32
    a = {"N": (lower, diag, upper), "T": (upper, diag, lower),
         "C": (upper.conj(), diag.conj(), lower.conj())}[trans]
    y = lapack.factor_solve(lu, pivots, rhs.numpy(), trans)
    assert_close(torch.from_numpy(y), dense_solve(*a, rhs))
    lu_t, pivots_t = torch.from_numpy(lu), torch.from_numpy(pivots)
    assert_close(torch_kernel.lu_solve(lu_t, pivots_t, rhs, trans), dense_solve(*a, rhs))


def test_batched_factors_equal_one_call_per_system():
    """gttrf on the joined system gives each system's own factors and 1-based pivots."""
    lower, diag, upper, _ = make_system(7, (2, 3), seed=2)
    diag[0, 1, 0] = 0.0  # forces a row interchange
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    for i, j in np.ndindex(2, 3):
        f = lapack.gttrf(*(t[i, j].numpy() for t in (lower, diag, upper)))
        np.testing.assert_array_equal(lu[i, j, 0, :6], f.dl)
        np.testing.assert_array_equal(lu[i, j, 1], f.d)
        np.testing.assert_array_equal(lu[i, j, 2, :6], f.du)
        np.testing.assert_array_equal(lu[i, j, 3, :5], f.du2)
        np.testing.assert_array_equal(pivots[i, j], f.ipiv)
    assert pivots[0, 1, 0] == 2  # the interchange is recorded, relative to its own system


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_torch_kernel_factors_equal_lapack_factors(n):
    """Same algorithm, same pivots: on real inputs the factors agree bit for bit."""
    lower, diag, upper, _ = make_system(n, (4,), 2, seed=20 + n)
    if n > 1:
        diag[:, 0] = 0.0
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    lu_t, pivots_t = torch_kernel.factor(lower, diag, upper)
    torch.testing.assert_close(lu_t, torch.from_numpy(lu), rtol=0, atol=0)
    torch.testing.assert_close(pivots_t, torch.from_numpy(pivots), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [None, 3])
def test_torch_kernel_path_matches_dense(dtype, n, k):
    args = make_system(n, (2, 3), k, dtype=dtype, seed=n)
    with torch_kernel_on_cpu():
        x = tridiagonal_solve(*args)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    assert_close(x, dense_solve(*(a.to(wide) for a in args)).to(dtype), dtype)


def test_torch_kernel_path_gradients():
    args = make_system(5, (2,), 2, requires_grad=True, seed=30)
    with torch_kernel_on_cpu():
        assert gradcheck(tridiagonal_solve, args, check_forward_ad=True)
        assert gradgradcheck(tridiagonal_solve, args)


def test_torch_kernel_needs_no_diagonal_dominance():
    """It pivots: the zero-diagonal system Thomas cannot solve (A x = [4, 10, 5], x = [1, 2, 3])."""
    lower = torch.tensor([1.0, 1.0], dtype=torch.float64)
    diag = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    upper = torch.tensor([2.0, 3.0], dtype=torch.float64)
    rhs = torch.tensor([4.0, 10.0, 5.0], dtype=torch.float64)
    with torch_kernel_on_cpu():
        x = tridiagonal_solve(lower, diag, upper, rhs)
    torch.testing.assert_close(x, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("path", ["forward", "with-grad", "lu_factor"])
def test_singular_error_is_the_same_on_every_kernel(kernel, path):
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=31)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0  # column 2 of system (1, 0)
    if path == "with-grad":  # the torch kernel then factors first, for the backward
        diag.requires_grad_()
    expected = r"singular: pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$"
    with pytest.raises(torch.linalg.LinAlgError, match=expected):
        with kernel_context(kernel):
            if path == "lu_factor":
                tridiagonal_lu_factor(lower, diag, upper)
            else:
                tridiagonal_solve(lower, diag, upper, rhs)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
def test_singular_real_valued_complex_matrix_raises_on_every_kernel(kernel):
    """Row 4 is exactly half of row 3, stored as complex numbers: the elimination's multiplier
    0.5 d / d must come out exactly 0.5 (Smith's division, as LAPACK's), or the zero pivot
    becomes round-off and the torch kernel returns garbage where LAPACK raises."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        lower, diag, upper = (torch.randn(m, generator=g, dtype=torch.float64) + 3 for m in (9, 10, 9))
        lower[2], upper[4] = 0.0, 0.0
        lower[3], diag[4] = 0.5 * diag[3], 0.5 * upper[3]
        args = [t.to(torch.complex128) for t in (lower, diag, upper, torch.ones(10))]
        with pytest.raises(torch.linalg.LinAlgError, match="singular"):
            with kernel_context(kernel):
                tridiagonal_solve(*args)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_stays_in_its_own_system(kernel, bad):
    args = make_system(5, (4,), 2, seed=32)
    args[3][1, 2, 0] = bad
    with kernel_context(kernel):
        x = tridiagonal_solve(*args)
    assert not torch.isfinite(x[1]).all()
    others = [0, 2, 3]
    assert torch.isfinite(x[others]).all()
    assert_close(x[others], dense_solve(*(a[others] for a in args)))


def squared_norm(x):
    return x.abs().pow(2).sum()


def count_calls(monkeypatch, module, names):
    """Record, in order, the calls to ``module.<name>`` (with ``trans`` for the solves with
    factors, ``factor_solve`` and ``lu_solve``)."""
    calls = []
    for name in names:
        original = getattr(module, name)

        def counting(*a, _f=original, _n=name, **k):
            if _n in ("factor_solve", "lu_solve"):
                calls.append(f"{_n}({k.get('trans', a[3] if len(a) > 3 else 'N')})")
            else:
                calls.append(_n)
            return _f(*a, **k)

        monkeypatch.setattr(module, name, counting)
    return calls


LAPACK_ENTRY_POINTS = ("solve", "factor", "factor_solve")


@pytest.mark.parametrize(
    "dtype, n, batch, k",
    [(torch.float64, 6, (), None), (torch.float64, 6, (3,), 2),
     (torch.complex128, 6, (), None), (torch.complex128, 6, (3,), 2)],
    ids=["real", "real-batch", "complex", "complex-batch"])
def test_lapack_backward_solves_again_with_the_adjoint(monkeypatch, dtype, n, batch, k):
    """With LAPACK, ?gtsv factors and solves in one sweep: the backward calls it on A^H."""
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    args = make_system(n, batch, k, dtype=dtype, requires_grad=True, seed=33)
    grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    assert calls == ["solve", "solve"]
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_torch_kernel_backward_reuses_the_forward_factors(monkeypatch, dtype):
    """The pure-torch kernel factors once and solves with A (forward) then A^T or A^H (backward)."""
    calls = count_calls(monkeypatch, torch_kernel, ("factor", "lu_solve"))
    args = make_system(6, (2,), 2, dtype=dtype, requires_grad=True, seed=34)
    with torch_kernel_on_cpu():
        grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    assert calls == ["factor", "lu_solve(N)", "lu_solve(C)"]  # A^H (A^T for real dtypes)
    assert_grads_match_dense(grads, args, squared_norm, dtype)
    calls.clear()
    with torch.no_grad(), torch_kernel_on_cpu():
        tridiagonal_solve(*args)
    assert calls == ["factor", "lu_solve(N)"]  # torch_kernel.solve: no factors kept


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backward_matches_dense_on_both_kernels(kernel, dtype):
    args = make_system(7, (2, 3), 2, dtype=dtype, requires_grad=True, seed=35)
    with kernel_context(kernel):
        grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
def test_direct_backward_with_broadcast_bands_and_an_expanded_gradient(kernel):
    """x.sum() sends a stride-0 gradient; shared bands get gradients summed over the batch."""
    lower, diag, upper, _ = make_system(6, (1,), seed=37)  # one matrix for the batch of 4
    rhs = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(38))
    args = [t.requires_grad_() for t in (lower, diag, upper, rhs)]
    with kernel_context(kernel):
        grads = torch.autograd.grad(tridiagonal_solve(*args).sum(), args)
    assert_grads_match_dense(grads, args, torch.sum)


def test_lu_solve_with_factors_runs_no_factorisation(monkeypatch):
    """Solving with factors, forward and backward, runs ?gttrs only: nothing factors again."""
    args = make_system(6, (2,), 2, requires_grad=True, seed=39)
    factors = tridiagonal_lu_factor(*args[:3])
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    grads = torch.autograd.grad(squared_norm(tridiagonal_lu_solve(factors, args[3])), args)
    assert calls == ["factor_solve(N)", "factor_solve(C)"]
    assert_grads_match_dense(grads, args, squared_norm)


@CUDA
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_matches_dense(dtype):
    args = [a.cuda() for a in make_system(33, (4,), 2, dtype=dtype, seed=40)]
    x = tridiagonal_solve(*args)
    assert x.device.type == "cuda"
    assert_close(x.cpu(), dense_solve(*(a.cpu() for a in args)), dtype)


@CUDA
def test_cuda_gradients_and_compile():
    args = [a.cuda().requires_grad_() for a in make_system(6, (2,), 2, seed=41)]
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True)
    loss = lambda *a: tridiagonal_solve(*a).pow(2).sum()
    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    for g, e in zip(grads, torch.autograd.grad(loss(*args), args)):
        assert_close(g, e)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_small_backward_runs_on_numpy_views_and_large_on_torch(monkeypatch, dtype):
    """A first-order backward on LAPACK without factors runs on NumPy views up to
    kernels.NUMPY_BACKWARD_MAX_ELEMENTS elements, on torch tensors above; both match dense."""
    from tridiag_tutorial import ops

    calls = []
    real = ops._numpy_backward
    monkeypatch.setattr(ops, "_numpy_backward", lambda *a: calls.append(1) or real(*a))
    limit = kernels.NUMPY_BACKWARD_MAX_ELEMENTS
    for n, batch, expected in ((7, (3,), [1]), (limit // 2 + 1, (2,), [])):
        calls.clear()
        args = make_system(n, batch, dtype=dtype, requires_grad=True, seed=n)
        grads = torch.autograd.grad(tridiagonal_solve(*args).abs().pow(2).sum(), args)
        assert calls == expected
        if n < 100:
            assert_grads_match_dense(grads, args, lambda x: x.abs().pow(2).sum(), dtype)
        else:  # too large for the dense reference: the other kernel's backward must agree
            with torch_kernel_on_cpu():
                expected_grads = torch.autograd.grad(
                    tridiagonal_solve(*args).abs().pow(2).sum(), args)
            for g, e in zip(grads, expected_grads):
                assert_close(g, e, dtype)


# ---- Chapter 5's op: one kernel per device (torch.library's register_kernel) ----------------
def test_chapter5_op_registers_a_default_and_a_cpu_kernel():
    """The op's CPU kernel is its own registration; every other device gets the default one."""
    name = "tridiag_tutorial::tridiagonal_solve"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(name, "CPU") and has(name, "CompositeExplicitAutograd")
    assert not has(name, "CUDA")  # CUDA falls through to the default (CompositeExplicitAutograd)


@pytest.mark.parametrize("inside_block", [False, True])
def test_chapter5_op_cpu_kernel_runs_lapack_unless_torch_kernel_on_cpu(monkeypatch, inside_block):
    seen = []
    original = kernels.solve
    monkeypatch.setattr(kernels, "solve",
                        lambda *a: seen.append(a[7]) or original(*a))
    lower, diag, upper, rhs = make_system(7, (3,), 2, seed=4)
    with torch_kernel_on_cpu() if inside_block else contextlib.nullcontext():
        x = custom_op.tridiagonal_solve_op(lower, diag, upper, rhs)
    assert seen == [inside_block]  # the torch_kernel argument: False means LAPACK on the CPU
    assert_close(x, dense_solve(lower, diag, upper, rhs))


def test_chapter5_op_default_kernel_solves_in_torch_ops(monkeypatch):
    """The default kernel (the function under @custom_op, which CUDA and other devices get) asks
    for the torch-op kernels, and its answer equals the dense solve; shown on CPU tensors."""
    calls = count_calls(monkeypatch, lapack, ["solve"])
    lower, diag, upper, rhs = make_system(9, (2,), 3, seed=5)
    x = custom_op.tridiagonal_solve_op._init_fn(lower, diag, upper, rhs)
    assert calls == []  # no LAPACK call
    assert_close(x, dense_solve(lower, diag, upper, rhs))


@CUDA
def test_chapter5_op_on_cuda_uses_the_default_kernel():
    lower, diag, upper, rhs = (t.cuda() for t in make_system(9, (2,), 3, seed=6))
    x = custom_op.tridiagonal_solve_op(lower, diag, upper, rhs)
    assert x.device.type == "cuda"
    assert_close(x.cpu(), dense_solve(*(t.cpu() for t in (lower, diag, upper, rhs))))
