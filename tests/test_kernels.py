"""The kernels: joined-batch LAPACK, LU factor reuse, the pure-torch kernel, singular/non-finite."""

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from tridiag_tutorial import dense_solve, lapack, ops, torch_kernel, tridiagonal_solve
from tridiag_tutorial.custom_op import torch_kernel_on_cpu
from tridiag_tutorial.ops import _factor_reuse

from conftest import (ALL_DTYPES, assert_close, assert_grads_match_dense, kernel_context,
                      make_system)

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
def test_lu_factors_reused_for_every_transpose(dtype, n, trans):
    lower, diag, upper, rhs = make_system(n, (3,), 2, dtype=dtype, seed=n)
    x, lu = lapack.factor_solve(*numpy_args(lower, diag, upper, rhs))
    assert_close(torch.from_numpy(x), dense_solve(lower, diag, upper, rhs))
    a = {"N": (lower, diag, upper), "T": (upper, diag, lower),
         "C": (upper.conj(), diag.conj(), lower.conj())}[trans]
    y = lapack.lu_solve(lu, rhs.numpy(), trans)
    assert_close(torch.from_numpy(y), dense_solve(*a, rhs))
    assert_close(torch_kernel.lu_solve(torch.from_numpy(lu), rhs, trans), dense_solve(*a, rhs))


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_torch_kernel_factors_equal_lapack_factors(n):
    """Same algorithm, same pivots: on real inputs the packed factors agree bit for bit."""
    lower, diag, upper, rhs = make_system(n, (4,), 2, seed=20 + n)
    if n > 1:
        diag[:, 0] = 0.0
    _, lu = lapack.factor_solve(*numpy_args(lower, diag, upper, rhs))
    torch.testing.assert_close(torch_kernel.factor(lower, diag, upper), torch.from_numpy(lu),
                               rtol=0, atol=0)


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
@pytest.mark.parametrize("path", ["forward", "solve-path", "factor-path"])
def test_singular_error_is_the_same_on_every_kernel(kernel, path):
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=31)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0  # column 2 of system (1, 0)
    if path != "forward":
        diag.requires_grad_()
    expected = r"singular: pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$"
    with pytest.raises(torch.linalg.LinAlgError, match=expected):
        with _factor_reuse(path == "factor-path"), kernel_context(kernel):
            tridiagonal_solve(lower, diag, upper, rhs)


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
    """Record, in order, the calls to ``module.<name>`` (with ``trans`` for ``lu_solve``)."""
    calls = []
    for name in names:
        original = getattr(module, name)

        def counting(*a, _f=original, _n=name, **k):
            trans = k.get("trans", a[2] if len(a) > 2 else "N")
            calls.append(f"{_n}({trans})" if _n == "lu_solve" else _n)
            return _f(*a, **k)

        monkeypatch.setattr(module, name, counting)
    return calls


LAPACK_ENTRY_POINTS = ("solve", "factor_solve", "lu_solve")


@pytest.mark.parametrize(
    "dtype, n, batch, k, reuses",
    [(torch.float64, 6, (), None, False),  # real: ?gtsv twice measured as fast, and holds no memory
     (torch.float64, 6, (3,), 2, False),  # batches and several columns: reuse measured slower
     (torch.complex128, 5, (), None, False),  # one complex system, below the threshold
     (torch.complex128, 6, (), None, True),  # one complex system from the threshold on: reuse
     (torch.complex128, 6, (), 2, False),
     (torch.complex128, 6, (3,), None, False)],
    ids=["real", "real-batch", "complex-small", "complex-large", "complex-k", "complex-batch"])
def test_lapack_backward_reuses_factors_only_where_measured_faster(monkeypatch, dtype, n, batch,
                                                                   k, reuses):
    monkeypatch.setattr(ops, "_LAPACK_REUSE_MIN_N", 6)  # the rule at small sizes
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    args = make_system(n, batch, k, dtype=dtype, requires_grad=True, seed=33)
    grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    trans = "C" if dtype.is_complex else "T"
    assert calls == (["factor_solve", f"lu_solve({trans})"] if reuses else ["solve", "solve"])
    assert_grads_match_dense(grads, args, squared_norm, dtype)
    calls.clear()
    with torch.no_grad():
        tridiagonal_solve(*args)
    assert calls == ["solve"]  # no factors kept when no backward can follow


@pytest.mark.parametrize("n, reuses", [(10**5 - 1, False), (10**5, True)])
def test_lapack_reuse_threshold_for_one_complex_system(monkeypatch, n, reuses):
    """The measured crossover: reuse was faster from n = 1e5 on (benchmarks, chapter 9)."""
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    lower, diag, upper, rhs = make_system(n, dtype=torch.complex128, seed=39)
    rhs.requires_grad_()
    tridiagonal_solve(lower, diag, upper, rhs).abs().sum().backward()
    assert calls == (["factor_solve", "lu_solve(C)"] if reuses else ["solve", "solve"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_torch_kernel_backward_reuses_the_forward_factors(monkeypatch, dtype):
    """The pure-torch kernel factors once and solves with A (forward) then A^T or A^H (backward)."""
    calls = count_calls(monkeypatch, torch_kernel, ("factor", "lu_solve"))
    args = make_system(6, (2,), 2, dtype=dtype, requires_grad=True, seed=34)
    with torch_kernel_on_cpu():
        grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    assert calls == ["factor", "lu_solve(N)", f"lu_solve({'C' if dtype.is_complex else 'T'})"]
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("reuse", [False, True], ids=["solve-twice", "reuse"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_both_backward_strategies_match_dense(kernel, reuse, dtype):
    """Whichever strategy the policy picks, on either kernel, gives the dense gradients."""
    args = make_system(7, (2, 3), 2, dtype=dtype, requires_grad=True, seed=35)
    with _factor_reuse(reuse), kernel_context(kernel):
        grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args)), args)
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("reuse", [False, True], ids=["solve-twice", "reuse"])
def test_direct_backward_with_broadcast_bands_and_an_expanded_gradient(kernel, reuse):
    """x.sum() sends a stride-0 gradient; shared bands get gradients summed over the batch."""
    lower, diag, upper, _ = make_system(6, (1,), seed=37)  # one matrix for the batch of 4
    rhs = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(38))
    args = [t.requires_grad_() for t in (lower, diag, upper, rhs)]
    with _factor_reuse(reuse), kernel_context(kernel):
        grads = torch.autograd.grad(tridiagonal_solve(*args).sum(), args)
    assert_grads_match_dense(grads, args, torch.sum)


@pytest.mark.parametrize("reuse", [False, True], ids=["solve-twice", "reuse"])
def test_forced_strategy_is_what_runs(monkeypatch, reuse):
    """The override really switches the strategy (so the test above compares two code paths)."""
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    args = make_system(5, (2,), dtype=torch.float32, requires_grad=True, seed=36)
    with _factor_reuse(reuse):
        tridiagonal_solve(*args).sum().backward()
    assert calls == (["factor_solve", "lu_solve(T)"] if reuse else ["solve", "solve"])


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
