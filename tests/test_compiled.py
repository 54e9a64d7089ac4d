"""The C++ kernel (tridiag_tutorial.kernels.compiled; the op torch.ops.tridiag_tutorial.cpp_solve): the
dense reference, LAPACK's ?gtsv bit for bit (non-finite and singular input included),
SingularMatrixError, what the raw ops refuse, opcheck, and the public op on it in every
composition."""

import functools
import shutil

import numpy as np
import pytest
import torch
from scipy.linalg import lapack as scipy_lapack
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, vmap

from tridiag_tutorial import SingularMatrixError, api, kernels, rules, tridiagonal_solve
from tridiag_tutorial.kernels import compiled, lapack
from tridiag_tutorial.kernels.compiled import PIECES_MIN_N
from tridiag_tutorial.reference import dense_solve

from conftest import ALL_DTYPES, assert_close, assert_grads_match_dense, make_system, require_cpp

LANES = {torch.float32: 16, torch.complex64: 16, torch.float64: 8, torch.complex128: 8}
T = torch.ops.tridiag_tutorial


@pytest.fixture(scope="module")
def op():
    """The kernel as the package calls it: compiled.solve (validated inputs of one batch shape,
    ``rhs`` ``(*B, n, k)``; SingularMatrixError for a singular system)."""
    require_cpp()
    return compiled.solve


def as_matrix_rhs(rhs, k):
    return rhs.unsqueeze(-1) if k is None else rhs


def lapack_solve(lower, diag, upper, rhs):
    return torch.from_numpy(lapack.solve(*(t.numpy() for t in (lower, diag, upper, rhs))))


def lapack_error(args) -> str:
    with pytest.raises(SingularMatrixError) as err:
        lapack_solve(*args)
    return str(err.value)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 17, 100])
@pytest.mark.parametrize("batch", [(), (5,), (3, 4)], ids=str)
@pytest.mark.parametrize("k", [None, 3])
def test_matches_dense_and_lapack(op, dtype, n, batch, k):
    """Equal to the dense solve to tolerance, and to LAPACK's ?gtsv bit for bit: the kernel does
    ?gtsv's operations in ?gtsv's order (complex products and Smith's division as gfortran
    evaluates them), so with the OpenBLAS build SciPy ships all four dtypes agree exactly. The
    raw op returns the same x and info = -1."""
    lower, diag, upper, rhs = make_system(n, batch, k, dtype=dtype, seed=n + len(batch))
    b = as_matrix_rhs(rhs, k)
    x = op(lower, diag, upper, b)
    assert x.shape == b.shape and x.dtype == dtype and x.is_contiguous()
    assert_close(x, as_matrix_rhs(dense_solve(lower, diag, upper, rhs), k), dtype)
    torch.testing.assert_close(x, lapack_solve(lower, diag, upper, b), rtol=0, atol=0)
    raw_x, info = T.cpp_solve(lower, diag, upper, b)
    assert info.dtype == torch.int64 and info.shape == () and int(info) == -1
    torch.testing.assert_close(raw_x, x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("size", [1, 3, 7, 9, 17, 35])
def test_batch_sizes_around_the_block_width(op, dtype, size):
    """Batches smaller than the block width W (the sequential path), and not multiples of W
    (a padded tail block), with row interchanges forced in some systems."""
    assert LANES[dtype] in (8, 16)
    lower, diag, upper, rhs = make_system(6, (size,), 2, dtype=dtype, seed=size)
    diag[::2, 0] = 0.0
    diag[1::3, 3] = 0.0
    x = op(lower, diag, upper, rhs)
    assert_close(x, dense_solve(lower, diag, upper, rhs), dtype)
    torch.testing.assert_close(x, lapack_solve(lower, diag, upper, rhs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_pivoting(op, dtype):
    """[[0, 1], [1, 0]] (a zero first pivot) and zero diagonals everywhere need interchanges."""
    lower = torch.ones(1, dtype=dtype)
    diag = torch.zeros(2, dtype=dtype)
    rhs = torch.tensor([[2.0], [3.0]], dtype=dtype)
    torch.testing.assert_close(op(lower, diag, lower.clone(), rhs),
                               torch.tensor([[3.0], [2.0]], dtype=dtype), rtol=0, atol=0)
    lower, diag, upper, rhs = make_system(12, (10,), 1, dtype=dtype, seed=3)
    diag[:, ::2] = 0.0
    x = op(lower, diag, upper, rhs)
    assert_close(x, dense_solve(lower, diag, upper, rhs), dtype)
    torch.testing.assert_close(x, lapack_solve(lower, diag, upper, rhs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3), (20,)], ids=str)
def test_singular_message_equals_lapack(op, dtype, batch):
    """A zero pivot raises SingularMatrixError with exactly the LAPACK path's message and
    attributes: the first singular system in C order, and its first zero pivot (here the last
    one, U[n-1, n-1]). The raw op reports it as info = system * n + pivot."""
    n = 4
    lower, diag, upper, rhs = make_system(n, batch, 2, dtype=dtype, seed=7)
    flat = [t.reshape(-1, *t.shape[len(batch):]) for t in (lower, diag, upper)]
    last = flat[1].shape[0] - 1
    for element in sorted({last, last // 2}):
        flat[0][element, -1] = 0.0  # row n-1 = [0, 0, ..., 0]: pivot U[n-1, n-1] is zero
        flat[1][element, -1] = 0.0
    args = (lower, diag, upper, rhs)
    with pytest.raises(SingularMatrixError) as err:
        op(*args)
    assert isinstance(err.value, torch.linalg.LinAlgError)
    assert str(err.value) == lapack_error(args)
    assert f"pivot U[{n - 1}, {n - 1}] is exactly zero" in str(err.value)
    assert ("in batch element" in str(err.value)) == bool(batch)
    first = last // 2
    expected_index = tuple(int(i) for i in np.unravel_index(first, batch)) if batch else ()
    assert err.value.pivot == n - 1 and err.value.batch_index == expected_index
    _, info = T.cpp_solve(*args)
    assert int(info) == first * n + n - 1


def test_singular_first_pivot_and_zero_columns(op):
    """A zero first column (pivot U[0, 0]) in two elements: the first of them is named; k = 0
    still raises, as LAPACK's path does."""
    lower, diag, upper, rhs = make_system(5, (2, 3), 1, seed=8)
    for element in [(1, 0), (1, 2)]:
        diag[element][0] = 0.0
        lower[element][0] = 0.0
    for b in (rhs, rhs[..., :0]):
        with pytest.raises(SingularMatrixError) as err:
            op(lower, diag, upper, b)
        assert str(err.value) == ("the tridiagonal matrix is singular: pivot U[0, 0] is exactly "
                                  "zero, in batch element (1, 0)")
        assert str(err.value) == lapack_error((lower, diag, upper, rhs))
        assert (err.value.pivot, err.value.batch_index) == (0, (1, 0))


def test_nan_stays_in_its_batch_element(op):
    """Systems are solved apart: a NaN in one band or rhs leaves every other system exact."""
    lower, diag, upper, rhs = make_system(9, (11,), 2, seed=9)
    diag[4, 3] = float("nan")
    rhs[7, 0, 1] = float("nan")
    x = op(lower, diag, upper, rhs)
    finite = torch.isfinite(x).reshape(11, -1).all(dim=1)
    assert not finite[4] and not finite[7]
    keep = [i for i in range(11) if i not in (4, 7)]
    assert finite[keep].all()
    torch.testing.assert_close(x[keep], lapack_solve(*(t[keep] for t in (lower, diag, upper,
                                                                          rhs))), rtol=0, atol=0)


def test_inputs_not_modified(op):
    args = make_system(10, (9,), 2, dtype=torch.complex128, seed=10)
    args[1][:, 0] = 0.0
    before = [t.clone() for t in args]
    op(*args)
    for t, b in zip(args, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)


def test_non_contiguous_inputs(op):
    """A transposed rhs, expanded (stride-0) bands, a strided diagonal, a conjugate view and a
    negated one."""
    lower, diag, upper, rhs = make_system(7, (), 4, dtype=torch.complex128, seed=11)
    rhs_t = rhs.T.contiguous().T  # (7, 4) with strides (1, 7)
    big = rhs_t.expand(5, 7, 4)
    bands = [t.expand(5, *t.shape) for t in (lower, diag, upper)]
    diag_strided = torch.stack([bands[1], bands[1]], dim=-1)[..., 0]
    conj = upper.conj().expand(5, 6)  # a lazily conjugated view
    x = op(bands[0], diag_strided, conj, big)
    expected = lapack_solve(*(t.expand(5, *t.shape).contiguous()
                              for t in (lower, diag, upper.conj().resolve_conj(), rhs)))
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    assert x.is_contiguous()
    real_args = [t.real.contiguous() for t in (lower, diag, upper, rhs)]
    negated = (real_args[0] * 1j).conj().imag  # a view with the negative bit set: -lower.real
    assert negated.is_neg()
    torch.testing.assert_close(op(negated, *real_args[1:]),
                               lapack_solve(-real_args[0], *real_args[1:]), rtol=0, atol=0)


def test_one_large_system(op):
    """One system of 1e5 unknowns, which the pieces kernel solves (its rounding is not ?gtsv's):
    a forward error within 10 times LAPACK's, against the extended-precision reference."""
    from tridiag_tutorial.bench import accuracy
    lower, diag, upper, rhs = make_system(100_000, (), 1, seed=12)
    diag[::7] = 0.0
    x = op(lower, diag, upper, rhs)
    arrays = [t.numpy() for t in (lower, diag, upper, rhs)]
    reference = accuracy.reference(*arrays)
    ours = accuracy.forward_error(x.numpy(), reference)
    lapacks = accuracy.forward_error(lapack_solve(lower, diag, upper, rhs).numpy(), reference)
    assert 0 < ours <= 10 * max(lapacks, 4 * torch.finfo(torch.float64).eps), (ours, lapacks)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_opcheck(op, dtype):
    """The raw op, and the package's ops on the C++ kernel: schema, fake kernel, AOT dispatch."""
    args = make_system(6, (3,), 2, dtype=dtype, seed=13)
    for target, extra in ((T.cpp_solve.default, ()),
                          (T.solve_kernel.default, (None, None, "N", "cpp")),
                          (T.solve.default, (None, None, "N", "cpp"))):
        result = torch.library.opcheck(target, (*args, *extra))
        assert result and all(v == "SUCCESS" for v in result.values()), (target, result)


# ----------------------------------------------------------------------------------------------
# The public op on the C++ kernel: the automatic choice for a batch on the CPU, in every
# composition, forward and backward (the backward solves with A^H on the same kernel).
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def calls(op, monkeypatch):
    """Counts the calls of the C++ kernel (compiled.solve, compiled.solve_backward) and of LAPACK
    (lapack.solve)."""
    counts = {"cpp": 0, "lapack": 0}

    def counting(key, real):
        def call(*a):
            counts[key] += 1
            return real(*a)
        return call

    monkeypatch.setattr(compiled, "solve", counting("cpp", compiled.solve))
    # the C++ backward in one call (the solve with A^H and the band products): the kernel too
    monkeypatch.setattr(compiled, "solve_backward", counting("cpp", compiled.solve_backward))
    monkeypatch.setattr(lapack, "solve", counting("lapack", lapack.solve))
    return counts


def squared(x):
    return x.abs().pow(2).sum()


on_lapack = functools.partial(tridiagonal_solve, driver="lapack")


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_public_op_runs_the_kernel_forward_and_backward(calls, dtype):
    """driver=None on a CPU batch: the forward and the backward's solve with A^H both run the
    C++ kernel; a forward without grad calls it once."""
    args = make_system(7, (5,), 2, dtype=dtype, requires_grad=True, seed=50)
    grads = torch.autograd.grad(squared(tridiagonal_solve(*args)), args)
    assert calls == {"cpp": 2, "lapack": 0}
    expected = torch.autograd.grad(squared(dense_solve(*args)), args)
    for g, e in zip(grads, expected):
        assert_close(g, e)
    with torch.no_grad():
        tridiagonal_solve(*args)
    assert calls == {"cpp": 3, "lapack": 0}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 17])
@pytest.mark.parametrize("batch, k", [((), None), ((3,), None), ((2, 3), 4), ((), 2)], ids=str)
@pytest.mark.parametrize("driver", [None, "cpp"])
def test_backward_on_the_kernel_matches_dense(calls, dtype, n, batch, k, driver):
    args = make_system(n, batch, k, dtype=dtype, requires_grad=True, seed=60 + n)
    x = tridiagonal_solve(*args, driver=driver)
    if driver is None:  # nothing else observes the call: functions._CppSolve, the op with a backward
        assert x.grad_fn.name() == "_CppSolveBackward"
    else:  # the general path's Function ((..., n): a squeeze last)
        node = x.grad_fn.next_functions[0][0] if k is None else x.grad_fn
        assert "TridiagonalSolve" in node.name()
    grads = torch.autograd.grad(squared(x), args)
    assert calls == {"cpp": 2, "lapack": 0}
    assert_grads_match_dense(grads, args, squared, dtype)
    assert x.shape == args[3].shape


def test_broadcast_bands_and_some_inputs(calls):
    """Bands broadcast against a batch of right-hand sides (the gradients are summed back to
    the bands' shapes), and only the inputs that require grad get one."""
    lower, diag, upper, rhs = make_system(6, (4,), seed=61)
    lower, diag, upper = (t[:1].clone().requires_grad_() for t in (lower, diag, upper))
    args = (lower, diag, upper, rhs)
    grads = torch.autograd.grad(squared(tridiagonal_solve(*args)), (lower, diag, upper))
    expected = torch.autograd.grad(squared(dense_solve(*args)), (lower, diag, upper))
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        assert_close(g, e)
    rhs.requires_grad_()
    diag.requires_grad_(False)
    x = tridiagonal_solve(lower.detach(), diag, upper.detach(), rhs)
    (g,) = torch.autograd.grad(squared(x), rhs)
    assert_close(g, torch.autograd.grad(squared(dense_solve(lower, diag, upper, rhs)), rhs)[0])
    assert calls == {"cpp": 4, "lapack": 0}


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_gradcheck_forward_ad_and_second_order_on_the_kernel(calls, dtype):
    """Finite differences (reverse and forward mode, batched gradients) and second order."""
    args = make_system(5, (3,), 2, dtype=dtype, requires_grad=True, seed=62)
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True, check_batched_grad=True)
    assert gradgradcheck(tridiagonal_solve, args)
    vector = make_system(6, (), dtype=dtype, requires_grad=True, seed=63)
    solve = functools.partial(tridiagonal_solve, driver="cpp")
    assert gradcheck(solve, vector) and gradgradcheck(solve, vector)
    assert calls["cpp"] > 0 and calls["lapack"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("batch", [(2,), (9,)], ids=str)
def test_batched_gradients_on_the_kernel(calls, dtype, batch):
    """is_grads_batched (also with create_graph) and jacobian(vectorize=True) on the C++
    kernel, against LAPACK's. (The old C++ backward raised "Cannot access data pointer of
    Tensor that doesn't have storage" here.)"""
    args = make_system(5, batch, 2, dtype=dtype, requires_grad=True, seed=90)
    lower, diag, upper, rhs = args

    def batched_grads(solve, create_graph):
        x = solve(*args)
        eye = torch.eye(x.numel(), dtype=dtype).reshape(-1, *x.shape)[:7]
        return torch.autograd.grad(x, args, eye, is_grads_batched=True, create_graph=create_graph)

    for create_graph in (False, True):
        expected = batched_grads(on_lapack, create_graph)
        before = dict(calls)
        got = batched_grads(tridiagonal_solve, create_graph)
        assert calls["cpp"] > before["cpp"] and calls["lapack"] == before["lapack"]
        for g, e in zip(got, expected):
            assert_close(g, e)
    jac = {driver: torch.autograd.functional.jacobian(
        lambda d: tridiagonal_solve(lower, d, upper, rhs, driver=driver), diag, vectorize=True)
        for driver in ("lapack", "cpp")}
    assert_close(jac["cpp"], jac["lapack"])


def test_vmap_of_autograd_grad_on_the_kernel(calls):
    """torch.func.vmap over torch.autograd.grad of the op's output: the backward runs with
    batched cotangents (what is_grads_batched does), forward once."""
    args = make_system(6, (3,), 2, requires_grad=True, seed=97)
    x = tridiagonal_solve(*args)
    assert calls == {"cpp": 1, "lapack": 0}
    cotangents = torch.randn(4, *x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    got = vmap(lambda v: torch.autograd.grad(x, args, v, retain_graph=True))(cotangents)
    expected = [torch.stack(g) for g in zip(*(torch.autograd.grad(dense_solve(*args), args, v)
                                              for v in cotangents))]
    for g, e in zip(got, expected):
        assert_close(g, e)
    assert calls["cpp"] > 1 and calls["lapack"] == 0


def test_forward_ad_and_torch_func_on_the_kernel(calls):
    import torch.autograd.forward_ad as fwAD

    lower, diag, upper, rhs = make_system(6, (4,), seed=53)
    with fwAD.dual_level():
        dual = fwAD.make_dual(diag, torch.ones_like(diag))
        tangent = fwAD.unpack_dual(tridiagonal_solve(lower, dual, upper, rhs)).tangent
    with fwAD.dual_level():
        dual = fwAD.make_dual(diag, torch.ones_like(diag))
        expected = fwAD.unpack_dual(dense_solve(lower, dual, upper, rhs)).tangent
    assert_close(tangent, expected)

    def f(d):
        return squared(tridiagonal_solve(lower, d, upper, rhs))

    def f_dense(d):
        return squared(dense_solve(lower, d, upper, rhs))

    for transform in (grad, jacfwd, hessian):
        assert_close(transform(f)(diag), transform(f_dense)(diag))
    diags = diag + 0.1 * torch.arange(3, dtype=torch.float64)[:, None, None]
    assert_close(vmap(grad(f))(diags), vmap(grad(f_dense))(diags))
    assert calls["cpp"] > 0 and calls["lapack"] == 0


def test_errors_and_inputs_on_the_kernel(calls):
    """A singular matrix raises the package's error (also when a backward would follow); the
    inputs are not modified; modifying the result in place before the backward is caught by
    autograd."""
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=66)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0
    diag.requires_grad_()
    with pytest.raises(SingularMatrixError,
                       match=r"pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$") as err:
        tridiagonal_solve(lower, diag, upper, rhs)
    assert (err.value.pivot, err.value.batch_index) == (2, (1, 0))
    args = make_system(6, (3,), requires_grad=True, seed=67)
    before = [t.detach().clone() for t in args]
    x = tridiagonal_solve(*args)
    torch.autograd.grad(squared(x), args)
    for t, b in zip(args, before):
        assert torch.equal(t, b)
    y = tridiagonal_solve(*args)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert calls == {"cpp": 4, "lapack": 0}


def test_one_large_complex_system_stays_on_lapack(calls):
    """One complex system of n > CPP_ONE_COMPLEX_SYSTEM_MAX_N goes to LAPACK; one of
    n = CPP_ONE_COMPLEX_SYSTEM_MAX_N, a batch of two larger ones and one large real system (the
    solve in pieces) to the C++ kernel."""
    top = kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N
    tridiagonal_solve(*make_system(top + 1, dtype=torch.complex128, seed=51))
    assert calls == {"cpp": 0, "lapack": 1}
    tridiagonal_solve(*make_system(top, dtype=torch.complex128, seed=51))
    assert calls == {"cpp": 1, "lapack": 1}
    tridiagonal_solve(*make_system(top + 1, (2,), dtype=torch.complex128, seed=51))
    assert calls == {"cpp": 2, "lapack": 1}
    tridiagonal_solve(*make_system(10 * top, seed=51))
    assert calls == {"cpp": 3, "lapack": 1}


def test_compile_fullgraph_on_the_kernel(calls):
    torch._dynamo.reset()
    args = make_system(6, (3,), 2, requires_grad=True, seed=54)

    def loss(*a):
        return squared(tridiagonal_solve(*a))

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    expected = torch.autograd.grad(squared(dense_solve(*args)), args)
    for g, e in zip(got, expected):
        assert_close(g, e)
    assert calls["cpp"] >= 2 and calls["lapack"] == 0


def test_public_op_singular_message_is_unchanged(calls):
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=55)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0
    with pytest.raises(SingularMatrixError,
                       match=r"pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$"):
        tridiagonal_solve(lower, diag, upper, rhs)
    assert calls == {"cpp": 1, "lapack": 0}


def test_lapack_driver_keeps_lapack(calls):
    args = make_system(5, (4,), seed=56, requires_grad=True)
    torch.autograd.grad(on_lapack(*args).sum(), args)
    assert calls == {"cpp": 0, "lapack": 2}


# ----------------------------------------------------------------------------------------------
# LAPACK's decisions on non-finite and singular input (issue 23): which systems raise, which
# pivot is named, where NaN goes; bit for bit against raw ?gtsv per system and lapack.solve.
# ----------------------------------------------------------------------------------------------
RAW_GTSV = {torch.float32: scipy_lapack.sgtsv, torch.float64: scipy_lapack.dgtsv,
            torch.complex64: scipy_lapack.cgtsv, torch.complex128: scipy_lapack.zgtsv}
NAN, INF = float("nan"), float("inf")


def singular_message(info, system, batch):
    msg = f"the tridiagonal matrix is singular: pivot U[{info - 1}, {info - 1}] is exactly zero"
    if batch:
        index = ", ".join(str(int(i)) for i in np.unravel_index(system, batch))
        msg += f", in batch element ({index}{',' if len(batch) == 1 else ''})"
    return msg


def raw_gtsv_outcome(lower, diag, upper, rhs):
    """``(x, None)`` or ``(None, message)``: SciPy's ?gtsv called on each system in turn (n >= 2),
    the first system with info > 0 named, as the package's message does."""
    batch = tuple(diag.shape[:-1])
    flat = [t.reshape(-1, *t.shape[len(batch):]).numpy() for t in (lower, diag, upper, rhs)]
    xs = []
    for s in range(flat[1].shape[0]):
        *_, x, info = RAW_GTSV[diag.dtype](*(a[s] for a in flat))
        if info > 0:
            return None, singular_message(info, s, batch)
        xs.append(torch.from_numpy(np.ascontiguousarray(x)))
    return torch.stack(xs).reshape(rhs.shape), None


def outcome(solve, args):
    try:
        return solve(*args), None
    except SingularMatrixError as err:
        return None, str(err)


def raw_op_outcome(args):
    """The raw op's ``(x, info)`` as an outcome: the message that ``info`` = system * n + pivot
    stands for."""
    x, info = T.cpp_solve(*args)
    code, n = int(info), args[1].shape[-1]
    if code < 0:
        return x, None
    return None, singular_message(code % n + 1, code // n, tuple(args[1].shape[:-1]))


def assert_same_outcome(got, expected, label):
    assert got[1] == expected[1], label
    if expected[1] is None:
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{label}: {m}")


def non_finite_and_singular_families(n):
    """(name, edits) with edits (band, row, value) made to one system: NaN or infinity in every
    band and the rhs at the first, a middle and the last row; NaN on the diagonal above a zero
    subdiagonal entry (dgtsv's unchecked interchange branch) and the reverse; a zero first column,
    a zero row, a zero last row, zero diagonals (interchanges everywhere), and rows r + 1 = c row r
    (rank-deficient; c = 0.5 reaches the zero pivot without an interchange, c = 2 with one)."""
    mid = n // 2
    families = []
    for value in (NAN, INF, -INF):
        for band, last in (("lower", n - 2), ("diag", n - 1), ("upper", n - 2), ("rhs", n - 1)):
            for row in sorted({0, min(mid, last), last}):
                families.append((f"{band}[{row}] = {value}", [(band, row, value)]))
    for row in sorted({0, min(mid, n - 2), n - 2}):
        families.append((f"NaN diag[{row}] above zero lower", [("diag", row, NAN),
                                                                ("lower", row, 0.0)]))
        families.append((f"zero diag[{row}] above NaN lower", [("diag", row, 0.0),
                                                                ("lower", row, NAN)]))
    families.append(("zero first column", [("diag", 0, 0.0), ("lower", 0, 0.0)]))
    if n > 2:
        families.append((f"zero row {mid}", [("lower", mid - 1, 0.0), ("diag", mid, 0.0),
                                             ("upper", mid, 0.0)]))
    families.append(("zero last row", [("lower", n - 2, 0.0), ("diag", n - 1, 0.0)]))
    families.append(("zero diagonal", [("diag", i, 0.0) for i in range(n)]))
    for r in range(n - 1):
        for c in (0.5, 2.0):
            families.append((f"row {r + 1} = {c} row {r}", ("scaled", r, c)))
    return families


def apply_edits(args, system, edits):
    lower, diag, upper, rhs = args
    bands = {"lower": lower, "diag": diag, "upper": upper}
    if edits[0] == "scaled":  # row r+1 = c * row r (exact in binary for c = 0.5 and 2)
        _, r, c = edits
        if r > 0:
            lower[system, r - 1] = 0.0
        lower[system, r] = c * diag[system, r]
        diag[system, r + 1] = c * upper[system, r]
        if r + 1 < upper.shape[-1]:
            upper[system, r + 1] = 0.0
        rhs[system, r + 1] = c * rhs[system, r]
        return
    for band, row, value in edits:
        if band == "rhs":
            rhs[system, row, 0] = value
        else:
            bands[band][system, row] = value


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("size", [1, 17])  # the W = 1 code; blocks of 8 / 16 and a tail block
def test_lapack_decisions_on_non_finite_and_singular_input(op, dtype, size):
    """For every family, one system of the batch is edited (the first, the third, the last) and
    the rest are random: the kernel raises exactly when ?gtsv reports info > 0 for some system,
    with the message naming the first such system and ?gtsv's pivot (the raw op's info says the
    same), and otherwise returns, bit for bit and NaN for NaN, what ?gtsv returns for each system
    on its own and what the package's LAPACK path (lapack.solve) returns."""
    cases = 0
    for n in (2, 7):
        for name, edits in non_finite_and_singular_families(n):
            for system in sorted({0, min(2, size - 1), size - 1}):
                args = make_system(n, (size,), 2, dtype=dtype, seed=100 * n + system)
                apply_edits(args, system, edits)
                label = f"{dtype}, n={n}, batch {size}, system {system}: {name}"
                expected = raw_gtsv_outcome(*args)
                assert_same_outcome(outcome(op, args), expected, label)
                assert_same_outcome(raw_op_outcome(args), expected, label + " (raw op)")
                assert_same_outcome(outcome(lapack_solve, args), expected, label + " (LAPACK)")
                cases += 1
    assert cases > 50


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("size", [1, 9, 17])
def test_nan_over_zero_subdiagonal_stays_in_its_system(op, dtype, size):
    """The probe's case: NaN on the diagonal above a zero subdiagonal entry in one system. ?gtsv
    takes the interchange branch, divides by zero and returns NaN with info = 0; the other
    systems are solved exactly. (The kernel used to raise "pivot U[0, 0] is exactly zero".)"""
    lower, diag, upper, rhs = make_system(6, (size,), 3, dtype=dtype, seed=70 + size)
    bad = size // 2
    diag[bad, 0], lower[bad, 0] = NAN, 0.0
    x = op(lower, diag, upper, rhs)
    assert torch.isnan(x[bad]).any()  # all of it for real dtypes; row 0 for complex (zgtsv)
    keep = [i for i in range(size) if i != bad]
    if keep:
        torch.testing.assert_close(x[keep], lapack_solve(lower[keep], diag[keep], upper[keep],
                                                         rhs[keep]), rtol=0, atol=0)
    torch.testing.assert_close(x, raw_gtsv_outcome(lower, diag, upper, rhs)[0], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("size", [4, 17])
def test_nan_system_beside_a_singular_one(op, dtype, size):
    """A NaN system (not singular by ?gtsv) before a singular one: the singular one is named. A
    system singular before its NaN row is named itself, being first."""
    for nan_system_singular, named in ((False, 3), (True, 0)):
        args = make_system(7, (size,), 2, dtype=dtype, seed=80)
        lower, diag, upper, rhs = args
        diag[0, 3], lower[0, 3] = NAN, 0.0
        if nan_system_singular:
            diag[0, 0], lower[0, 0] = 0.0, 0.0
        diag[3, 0], lower[3, 0] = 0.0, 0.0
        expected = raw_gtsv_outcome(*args)
        assert expected[1] == singular_message(1, named, (size,))
        assert_same_outcome(outcome(op, args), expected, f"{dtype}, {size}")
        assert_same_outcome(raw_op_outcome(args), expected, f"{dtype}, {size} (raw op)")
        assert_same_outcome(outcome(lapack_solve, args), expected, f"{dtype}, {size} (LAPACK)")


# ----------------------------------------------------------------------------------------------
# The raw ops, called directly: cpp_solve, and the package's solve / solve_kernel with
# driver="cpp". Under vmap, and on bad input a clear error, never a crash or an uninitialised
# result.
# ----------------------------------------------------------------------------------------------
RAW_OPS = {"cpp_solve": lambda *a: T.cpp_solve(*a)[0],
           "solve": lambda *a: T.solve(*a, None, None, "N", "cpp"),
           "solve_kernel": lambda *a: T.solve_kernel(*a, None, None, "N", "cpp")}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_under_vmap(op, dtype, name):
    """torch.func.vmap of each raw op, over any input (others unbatched) and a non-leading
    dimension, and over a batch of 1 and of 17: what LAPACK gives for the stacked systems.
    (solve and solve_kernel have vmap rules; cpp_solve has none, and runs per sample.)"""
    raw = RAW_OPS[name]
    for size in (1, 17):
        samples = make_system(6, (size, 3), 2, dtype=dtype, seed=95)
        fixed = [t[0] for t in samples]
        for which in range(4):
            in_dims = [None] * 4
            in_dims[which] = 1
            inputs = list(fixed)
            inputs[which] = samples[which].movedim(0, 1)
            x = vmap(raw, in_dims=tuple(in_dims))(*inputs)
            full = [samples[i] if i == which else fixed[i].expand_as(samples[i]).contiguous()
                    for i in range(4)]
            torch.testing.assert_close(x, lapack_solve(*full), rtol=0, atol=0)
    if name == "cpp_solve":  # info per sample, under vmap
        lower, diag, upper, rhs = make_system(6, (4, 3), 2, dtype=dtype, seed=96)
        diag[2, 1, 4], lower[2, 1, 4], upper[2, 1, 3] = 0.0, 0.0, 0.0  # column 4 of (2, 1)
        _, info = vmap(T.cpp_solve)(lower, diag, upper, rhs)
        assert info.tolist() == [-1, -1, 1 * 6 + 4, -1]


LAYOUTS = {"nested": lambda t: torch.nested.nested_tensor(list(t)),
           "jagged": lambda t: torch.nested.nested_tensor(list(t), layout=torch.jagged),
           "sparse": lambda t: t.to_sparse(),
           "sparse_csr": lambda t: t.to_sparse_csr(),
           "mkldnn": lambda t: t.float().to_mkldnn()}
# What each raw op does with a tensor of each layout (measured; either error is acceptable, as
# long as it is an exception that names the op or the argument, not a crash). cpp_solve has only
# a CPU kernel, so the dispatcher refuses every other backend. solve and solve_kernel have Python
# kernels for the dense backends and, beside them, the C++ library's CompositeExplicitAutograd
# kernel: a sparse or mkldnn tensor reaches that one, whose layout check names the argument; a
# nested tensor passes solve's Autograd kernel and stops at solve_kernel in the dispatcher.
BACKEND = {"nested": "AutogradNestedTensor", "jagged": "AutogradNestedTensor",
           "sparse": "SparseCPU", "sparse_csr": "SparseCsrCPU", "mkldnn": "MkldnnCPU"}
ARGS = ("lower", "diag", "upper", "rhs")


def layout_error(name, layout, which):
    if name == "cpp_solve":
        return NotImplementedError, (f"Could not run 'tridiag_tutorial::cpp_solve' with arguments "
                                     f"from the '{BACKEND[layout]}' backend")
    if layout in ("nested", "jagged"):
        return NotImplementedError, ("Could not run 'tridiag_tutorial::solve_kernel' with "
                                     "arguments from the 'AutogradNestedTensor' backend")
    return RuntimeError, (f"tridiag_tutorial::cpp_solve: {ARGS[which]} must be a dense (strided) "
                          "tensor")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_refuse_other_layouts(op, name, layout):
    """Nested (strided and jagged), sparse (COO and CSR) and mkldnn tensors, in each argument:
    an exception with a message that says what is wrong."""
    args = make_system(5, (2,), 3, seed=98)
    for which in range(4):
        bad = list(args)
        bad[which] = LAYOUTS[layout](bad[which])
        kind, message = layout_error(name, layout, which)
        with pytest.raises(kind) as err:
            RAW_OPS[name](*bad)
        assert message in str(err.value), (which, str(err.value)[:300])


@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_refuse_mixed_devices(op, name):
    """One input on meta beside CPU tensors (once it reached a fake kernel, which returned an
    uninitialised CPU tensor): ValueError listing the devices, for each input in turn."""
    args = make_system(5, (2,), 3, seed=99)
    for which in range(4):
        mixed = [t.to("meta") if i == which else t for i, t in enumerate(args)]
        listed = ", ".join(f"{arg} on {'meta' if i == which else 'cpu'}"
                           for i, arg in enumerate(ARGS))
        with pytest.raises(ValueError,
                           match=f"all inputs must be on the same device, got {listed}$"):
            RAW_OPS[name](*mixed)


# Bad input, and what the fake kernel (on meta tensors; also what torch.compile traces with) and
# the C++ kernel (on CPU tensors) say about it: both refuse the same inputs, each naming the
# problem in its own words. The fake kernels are the package's Python checks
# (_validation.validate_kernel_args: ValueError / TypeError); the C++ kernel raises RuntimeError.
def bad_inputs():
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=100)
    return {
        "short band": ((lower[..., :3], diag, upper, rhs), ValueError,
                       r"lower and upper must have n-1 = 4 entries",
                       r"shapes must be lower, upper \(\*B, n-1\), diag \(\*B, n\) and "
                       r"rhs \(\*B, n\) or \(\*B, n, k\)"),
        "batch shapes": ((lower, diag, upper, rhs[:1]), ValueError,
                         r"the inputs must have one batch shape \(this op does not broadcast\)",
                         r"shapes must be lower, upper \(\*B, n-1\), diag \(\*B, n\) and rhs "
                         r"\(\*B, n\) or \(\*B, n, k\), with one batch shape"),
        "mixed dtypes": ((lower.float(), diag, upper, rhs), TypeError,
                         r"all inputs must have the same dtype, got lower=torch.float32",
                         r"all inputs must have one dtype"),
        "half": (tuple(t.half() for t in (lower, diag, upper, rhs)), TypeError,
                 r"dtype torch.float16 is not supported; use one of torch.float32",
                 r"dtype must be float32, float64, complex64 or complex128"),
        "n = 0": ((lower[..., :0], diag[..., :0], upper[..., :0], rhs[..., :0, :]), ValueError,
                  r"the matrix must be at least 1 x 1", r"n must be at least 1"),
        "rhs of neither shape": ((lower, diag, upper, rhs[None]), ValueError,
                                 r"rhs must be \(\*batch, n, k\) with n = 5",
                                 r"rhs must be \(\*B, n\) or \(\*B, n, k\) for diag "
                                 r"\(\*B, n\)"),
        "scalars": (tuple(t.reshape(-1)[0] for t in (lower, diag, upper, rhs)), ValueError,
                    r"must have at least one dimension, got a scalar",
                    r"diag must have a last dimension n"),
    }


def test_vector_rhs_on_the_raw_ops(op):
    """cpp_solve (what tridiagonal_solve calls for a (*B, n) rhs) takes one right-hand side per
    system as (*B, n), its fake kernel too; solve and solve_kernel, the ops of compiled graphs,
    take (*B, n, k) only, their real and fake kernels alike."""
    lower, diag, upper, rhs = make_system(5, (2,), seed=100)
    x, info = T.cpp_solve(lower, diag, upper, rhs)
    assert x.shape == (2, 5) and int(info) == -1
    assert_close(x, dense_solve(lower, diag, upper, rhs))
    fake, _ = T.cpp_solve(*(t.to("meta") for t in (lower, diag, upper, rhs)))
    assert fake.shape == (2, 5) and fake.device.type == "meta"
    for name in ("solve", "solve_kernel"):
        for device in ("cpu", "meta"):
            with pytest.raises(ValueError, match=r"rhs must be \(\*batch, n, k\) with n = 5"):
                RAW_OPS[name](*(t.to(device) for t in (lower, diag, upper, rhs)))


@pytest.mark.parametrize("case", list(bad_inputs()))
@pytest.mark.parametrize("name", RAW_OPS)
def test_fake_kernel_checks_like_the_kernel(op, name, case):
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=100)
    good = RAW_OPS[name](*(t.to("meta") for t in (lower, diag, upper, rhs)))
    assert good.shape == (2, 5, 3) and good.device.type == "meta" and good.is_contiguous()
    args, fake_error, fake_message, real_message = bad_inputs()[case]
    with pytest.raises(fake_error, match=fake_message):
        RAW_OPS[name](*(t.to("meta") for t in args))
    if name != "cpp_solve" and args[3].ndim != args[1].ndim + 1:
        # solve and solve_kernel check an rhs that is not (*B, n, k) as their fake kernel does
        with pytest.raises(fake_error, match=fake_message):
            RAW_OPS[name](*args)
        return
    with pytest.raises(RuntimeError, match=f"tridiag_tutorial::cpp_solve: {real_message}"):
        RAW_OPS[name](*args)


def test_cpp_solve_fake_kernel_gives_info():
    require_cpp()
    args = [t.to("meta") for t in make_system(5, (2, 3), 1, seed=100)]
    x, info = T.cpp_solve(*args)
    assert x.shape == (2, 3, 5, 1) and info.shape == () and info.dtype == torch.int64


@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_empty_and_strided_inputs(op, name):
    """k = 0, an empty batch, n = 1, expanded, transposed and sliced inputs, integer, half and
    bool dtypes: a result of the right shape equal to LAPACK's, or an error naming the problem."""
    raw = RAW_OPS[name]
    lower, diag, upper, rhs = make_system(5, (3,), 2, seed=101)
    assert raw(lower, diag, upper, rhs[..., :0]).shape == (3, 5, 0)
    assert raw(lower[:0], diag[:0], upper[:0], rhs[:0]).shape == (0, 5, 2)
    one = make_system(1, (3,), 2, seed=102)
    torch.testing.assert_close(raw(*one), lapack_solve(*one), rtol=0, atol=0)
    strided = (lower[:1].expand(3, 4), diag[:, None].expand(3, 2, 5)[:, 1],
               upper.T.contiguous().T, rhs.transpose(-1, -2).contiguous().transpose(-1, -2))
    wide = torch.zeros(3, 5, 4, dtype=rhs.dtype)
    wide[..., ::2] = rhs
    for args in (strided, (lower, diag, upper, wide[..., ::2])):
        torch.testing.assert_close(raw(*args), lapack_solve(*(t.contiguous() for t in args)),
                                   rtol=0, atol=0)
    for dtype in (torch.int64, torch.float16, torch.bool):
        with pytest.raises(RuntimeError, match="tridiag_tutorial::cpp_solve: dtype must be "
                                               "float32, float64, complex64 or complex128"):
            raw(*(t.to(dtype) for t in (lower, diag, upper, rhs)))


def test_require_cpp_fails_where_the_build_should_have_worked(monkeypatch):
    """Without the C++ kernel, conftest.require_cpp fails (not skips) in CI (CI=true) and where a
    C++ compiler is on PATH, naming the build error; elsewhere it skips."""
    import conftest

    monkeypatch.setattr(compiled, "is_available", lambda: False)
    monkeypatch.setattr(compiled, "BUILD_ERROR", "ImportError: no module named _C (the test)")
    monkeypatch.setenv("CXX", "c++")
    monkeypatch.setenv("CI", "true")
    for which in (lambda name: f"/usr/bin/{name}", lambda name: None):
        monkeypatch.setattr(shutil, "which", which)
        with pytest.raises(pytest.fail.Exception, match=r"no module named _C \(the test\)"):
            conftest.require_cpp()
    monkeypatch.setenv("CI", "false")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(pytest.fail.Exception, match="although a compiler is here"):
        conftest.require_cpp()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"not built at install: ImportError"):
        conftest.require_cpp()


# ----------------------------------------------------------------------------------------------
# driver=None on the CPU without gradients: the C++ fast path (api._solve_on_cpp), which skips
# the Python validation (the op checks the inputs, and on a refusal the general path validates
# them and raises the typed error).
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def no_python_validation(monkeypatch):
    """Fail the test if the general path's validation runs."""
    require_cpp()
    monkeypatch.setattr(api, "validate", lambda *a, **k: pytest.fail("validated in Python"))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("batch, k", [((), None), ((3,), None), ((2, 3), 2), ((), 4)], ids=str)
def test_fast_path_solves_without_python_validation(no_python_validation, dtype, batch, k):
    """Plain CPU tensors of one batch shape, no gradient asked for (no_grad, or inputs that do
    not require grad): the fast path runs and gives the dense answer; the inputs are left as
    they were and the result is a new tensor."""
    args = make_system(9, batch, k, dtype=dtype, seed=70, requires_grad=True)
    before = [t.detach().clone() for t in args]
    with torch.no_grad():
        x = tridiagonal_solve(*args)
    assert x.shape == args[3].shape and x.is_contiguous() and not x.requires_grad
    assert_close(x, dense_solve(*before))
    plain = [t.detach() for t in args]
    y = tridiagonal_solve(*plain)
    assert torch.equal(x, y) and all(y.data_ptr() != t.data_ptr() for t in plain)
    for t, b in zip(args, before):
        assert torch.equal(t.detach(), b)


def test_fast_path_takes_lazy_views(no_python_validation):
    """A lazily conjugated complex band, a lazily negated real one (the imaginary part of a
    conjugate view) and non-contiguous views: resolved and copied by the op, as validate's route
    does."""
    lower, diag, upper, rhs = make_system(7, (4,), 2, dtype=torch.complex128, seed=71)
    conj_lower = lower.conj()
    assert conj_lower.is_conj()
    x = tridiagonal_solve(conj_lower, diag, upper, rhs)
    assert_close(x, dense_solve(conj_lower.resolve_conj(), diag, upper, rhs))
    real = [t.real.contiguous() for t in (lower, diag, upper)]
    neg = (torch.complex(real[1], real[1] + 2) * 1j).conj().imag  # a negative view: -real[1]
    assert neg.is_neg()
    b = rhs.real.mT.contiguous().mT  # non-contiguous
    x = tridiagonal_solve(real[0], neg, real[2], b)
    assert_close(x, dense_solve(real[0], neg.resolve_neg(), real[2], b.contiguous()))


@pytest.mark.parametrize("args, error, message", [
    ((torch.ones(4), torch.ones(5, dtype=torch.float64), torch.ones(4), torch.ones(5)),
     TypeError, r"all inputs must have the same dtype"),
    ((torch.ones(3, dtype=torch.float64), torch.ones(5, dtype=torch.float64),
      torch.ones(4, dtype=torch.float64), torch.ones(5, dtype=torch.float64)),
     ValueError, r"lower and upper must have n-1 = 4 entries"),
    ((torch.ones(4, dtype=torch.int64),) * 2 + (torch.ones(4, dtype=torch.int64),) * 2,
     TypeError, r"dtype torch.int64 is not supported"),
    ((torch.ones(4), torch.ones(5), torch.ones(4), torch.ones(6)),
     ValueError, r"rhs must have n = 5 rows"),
    ((torch.ones(4), torch.ones(5), torch.ones(4), torch.ones(2, 3, 5, 1)),
     ValueError, r"rhs must have diag.ndim = 1 dimensions"),
], ids=["dtypes", "band length", "integer", "rhs rows", "rhs ndim"])
def test_fast_path_refusals_raise_the_typed_errors(args, error, message):
    """Inputs the op refuses: the general path validates them and raises the error that names the
    problem, never the op's RuntimeError."""
    require_cpp()
    with pytest.raises(error, match=message):
        tridiagonal_solve(*args)


GRAD_CASES = [((), None, torch.float64), ((3,), None, torch.float32), ((2, 3), 2, torch.complex128),
              ((), 4, torch.complex64), ((), None, torch.float64, 1030)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_fast_path_with_gradients_runs_cpp_solve(monkeypatch, no_python_validation, case):
    """A gradient asked for, nothing else observing the call: functions._CppSolve, the C++ op forward
    and its backward op (the solve with A^H and the band products) once, no Python validation;
    the four gradients equal the
    dense solve's (also for a system on the solve in pieces, n = 1030), and only the gradients
    asked for are formed."""
    batch, k, dtype, *size = case
    n = size[0] if size else 9
    calls = []
    real_solve, real_backward = compiled.solve, compiled.solve_backward
    monkeypatch.setattr(compiled, "solve", lambda *a: calls.append("solve") or real_solve(*a))
    monkeypatch.setattr(compiled, "solve_backward",
                        lambda *a: calls.append("backward") or real_backward(*a))
    args = make_system(n, batch, k, dtype=dtype, seed=75, requires_grad=True)
    x = tridiagonal_solve(*args)
    assert type(x.grad_fn).__name__ == "_CppSolveBackward" and calls == ["solve"]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(76), dtype=dtype)

    def loss(x):
        return (x * w).real.sum() if dtype.is_complex else (x * w).sum()

    grads = torch.autograd.grad(loss(x), args)
    assert calls == ["solve", "backward"]  # the backward: one call of cpp_solve_backward
    assert_grads_match_dense(grads, args, loss, dtype)
    only_rhs = [t.detach() for t in args[:3]] + [args[3]]
    (g,) = torch.autograd.grad(loss(tridiagonal_solve(*only_rhs)), [args[3]])
    assert_close(g, grads[3])


def test_fast_path_with_gradients_unwraps_dead_functorch_wrappers(no_python_validation):
    """A tensor that leaked out of torch.func.vjp is a dead functorch wrapper of a tensor that
    requires a gradient: the fast path unwraps it as Function.apply does, so the gradient reaches
    that tensor (without the unwrapping autograd.grad finds it unused) and equals the plain one."""
    lower, diag, upper, rhs = make_system(12, seed=79)
    d0 = diag.clone().requires_grad_()
    leaked = []
    torch.func.vjp(lambda d: leaked.append(d) or d * 1, d0)
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    x = tridiagonal_solve(lower, dead, upper, rhs)
    assert type(x.grad_fn).__name__ == "_CppSolveBackward"
    (g,) = torch.autograd.grad(x.sum(), [d0])
    d1 = diag.clone().requires_grad_()
    x_plain = tridiagonal_solve(lower, d1, upper, rhs)
    (g_plain,) = torch.autograd.grad(x_plain.sum(), [d1])
    assert torch.equal(x.detach(), x_plain.detach()) and torch.equal(g, g_plain)


def test_fast_path_takes_parameters_and_no_other_subclass(monkeypatch):
    """Learnable bands (nn.Parameter, whose __torch_function__ is disabled) take the fast path
    as plain tensors do, with a gradient (_CppSolve, no Python validation) and without one; a
    subclass with its own __torch_function__ still takes the general path, which it sees."""
    require_cpp()
    lower, diag, upper, rhs = make_system(10, (2,), seed=81)
    params = [torch.nn.Parameter(t.clone()) for t in (lower, diag, upper, rhs)]
    with monkeypatch.context() as m:
        m.setattr(api, "validate", lambda *a, **k: pytest.fail("validated in Python"))
        x = tridiagonal_solve(*params)
        assert type(x.grad_fn).__name__ == "_CppSolveBackward"
        grads = torch.autograd.grad(x.square().sum(), params)
        with torch.no_grad():
            assert torch.equal(tridiagonal_solve(*params), x.detach())
    assert_grads_match_dense(grads, [t.requires_grad_() for t in (lower, diag, upper, rhs)],
                             lambda x: x.square().sum(), torch.float64)

    seen = []

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    watched = diag.clone().as_subclass(Watched)
    with torch.no_grad():
        y = tridiagonal_solve(lower, watched, upper, rhs)
    assert seen and torch.allclose(y.as_subclass(torch.Tensor), x.detach())


def test_fast_path_with_gradients_composes(no_python_validation):
    """functions._CppSolve's backward, differentiated again (gradgradcheck, create_graph=True) and
    vmapped by torch.autograd.functional.jacobian(vectorize=True): the general path's
    differentiable rules take over there."""
    args = make_system(6, (2,), 2, seed=77, requires_grad=True)
    assert type(tridiagonal_solve(*args).grad_fn).__name__ == "_CppSolveBackward"
    assert gradcheck(tridiagonal_solve, args)
    assert gradgradcheck(tridiagonal_solve, args)
    lower, diag, upper, rhs = (t.detach() for t in args)
    jac = torch.autograd.functional.jacobian(
        lambda d: tridiagonal_solve(lower, d, upper, rhs), diag, vectorize=True)
    dense = torch.autograd.functional.jacobian(lambda d: dense_solve(lower, d, upper, rhs), diag)
    assert_close(jac, dense)
    hess = torch.autograd.functional.hessian(
        lambda d: tridiagonal_solve(lower, d, upper, rhs).square().sum(), diag)
    dense_hess = torch.autograd.functional.hessian(
        lambda d: dense_solve(lower, d, upper, rhs).square().sum(), diag)
    assert_close(hess, dense_hess)


def test_fast_path_singular_matrix_error(no_python_validation):
    lower, diag, upper, rhs = make_system(6, (2, 3), seed=72)
    diag[1, 2, 0], lower[1, 2, 0] = 0.0, 0.0
    with pytest.raises(SingularMatrixError) as info:
        tridiagonal_solve(lower, diag, upper, rhs)
    assert (info.value.pivot, info.value.batch_index) == (0, (1, 2))


def test_fast_path_is_skipped_where_it_does_not_apply(monkeypatch):
    """Broadcasting, a named driver, forward-mode AD, a transform, a mode, a tensor subclass and
    one complex system above the C++ threshold take the general path; plain tensors, under
    inference mode or asking for a gradient (then through functions._CppSolve), and one large real
    system, take the fast path."""
    require_cpp()
    taken = []
    real = api._solve_on_cpp
    monkeypatch.setattr(api, "_solve_on_cpp", lambda *a: taken.append(real(*a)[0] is not None)
                        or real(*a))
    lower, diag, upper, rhs = make_system(6, (3,), seed=73)

    def took(fn):
        taken.clear()
        fn()
        return list(taken)

    assert took(lambda: tridiagonal_solve(lower, diag, upper, rhs)) == [True]
    with torch.inference_mode():
        assert took(lambda: tridiagonal_solve(lower, diag, upper, rhs)) == [True]
    grad_diag = diag.clone().requires_grad_()
    assert took(lambda: tridiagonal_solve(lower, grad_diag, upper, rhs)) == [True]
    with torch.no_grad():
        assert took(lambda: tridiagonal_solve(lower, grad_diag, upper, rhs)) == [True]
    assert took(lambda: tridiagonal_solve(lower[:1], diag, upper, rhs)) == [False]
    assert took(lambda: tridiagonal_solve(lower, diag, upper, rhs, driver="cpp")) == []
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(diag, torch.ones_like(diag))
        assert took(lambda: tridiagonal_solve(lower, dual, upper, rhs)) == [False]
    assert took(lambda: vmap(tridiagonal_solve)(lower, diag, upper, rhs)) == [False]
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        assert took(lambda: tridiagonal_solve(lower, diag, upper, rhs)) == [False]

    class Sub(torch.Tensor):
        pass
    assert took(lambda: tridiagonal_solve(lower, diag.as_subclass(Sub), upper, rhs)) == [False]
    big = make_system(kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N + 1, dtype=torch.complex128, seed=74)
    assert took(lambda: tridiagonal_solve(*big)) == [False]
    big_real = make_system(kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N + 1, seed=74)
    assert took(lambda: tridiagonal_solve(*big_real)) == [True]


# ----------------------------------------------------------------------------------------------
# The reverse mode in one call: cpp_solve_backward (compiled.solve_backward), what
# tridiagonal_solve's backward runs on the C++ kernel. Checked against the rules it fuses (the
# solve with A^H's bands and rules.band_gradients), against the dense reference, and on what it
# must refuse.
# ----------------------------------------------------------------------------------------------
def fused_reference(lower, diag, upper, x, grad_x):
    """``rules.solve_backward`` on the kernel: the solve with ``A^H`` and the band products."""
    column = (lambda t: t.unsqueeze(-1)) if x.ndim == diag.ndim else (lambda t: t)
    v = compiled.solve(upper.conj(), diag.conj(), lower.conj(), grad_x)
    return (*rules.band_gradients(column(v), column(x)), v)


# sizes on both sides of PIECES_MIN_N (one real system goes to the pieces kernel from
# there), batches, one or three right-hand sides
BACKWARD_CASES = [(1, (), None), (2, (3,), 2), (5, (2, 3), None), (40, (7,), 3),
                  (PIECES_MIN_N - 1, (), None), (PIECES_MIN_N + 6, (), None),
                  (PIECES_MIN_N + 6, (), 3), (3000, (2,), 1)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n, batch, k", BACKWARD_CASES)
def test_solve_backward_matches_the_rules(op, dtype, n, batch, k):
    """grad_rhs is the solve with A^H bit for bit; the band gradients equal rules.band_gradients
    (bit for bit for one real right-hand side, where the products are the same operations;
    else to round-off, the sums over columns being in another order)."""
    lower, diag, upper, rhs = make_system(n, batch, k, dtype=dtype, seed=140 + n)
    x = compiled.solve(lower, diag, upper, rhs)
    grad_x = make_system(n, batch, k, dtype=dtype, seed=141 + n)[3]
    inputs = [t.clone() for t in (lower, diag, upper, x, grad_x)]
    got = compiled.solve_backward(lower, diag, upper, x, grad_x)
    want = fused_reference(lower, diag, upper, x, grad_x)
    for a, b in zip(inputs, (lower, diag, upper, x, grad_x)):
        assert torch.equal(a, b)  # the inputs are left as they were
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)
    exact = not dtype.is_complex and (k is None or k == 1)
    for g, w, band in zip(got[:3], want[:3], (lower, diag, upper)):
        assert g.shape == band.shape and g.dtype == dtype and g.is_contiguous()
        if exact:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:
            assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_solve_backward_against_dense(op, dtype):
    """The four gradients of sum(w * x) (w random, conjugated for complex) equal what autograd
    gives through torch.linalg.solve on the dense matrix."""
    args = make_system(9, (2,), 2, dtype=dtype, seed=150)
    weight = make_system(9, (2,), 2, dtype=dtype, seed=151)[3]
    x = compiled.solve(*args)
    grads = compiled.solve_backward(*args[:3], x, weight.conj())
    leaves = [a.clone().requires_grad_() for a in args]
    assert_grads_match_dense(grads, leaves, lambda x: (weight * x).sum().real)


def test_solve_backward_views_and_layouts(op):
    """Conjugated, negated and non-contiguous views are read for their values."""
    lower, diag, upper, rhs = make_system(12, (3,), 2, dtype=torch.complex128, seed=152)
    x = compiled.solve(lower, diag, upper, rhs)
    grad_x = make_system(12, (3,), 2, dtype=torch.complex128, seed=153)[3]
    expected = compiled.solve_backward(lower, diag, upper, x, grad_x)
    views = (lower.conj().conj(), diag.conj().resolve_conj().conj().conj(),
             upper.mT.contiguous().mT, x.conj().conj(), grad_x.mT.contiguous().mT)
    assert views[0].is_conj() is False and not views[2].is_contiguous()
    got = compiled.solve_backward(*views)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # the bands given as conjugate views: A is then conj(A), and so is everything else
    conj = compiled.solve_backward(lower.conj(), diag.conj(), upper.conj(), x.conj(),
                                   grad_x.conj())
    for g, e in zip(conj, expected):
        torch.testing.assert_close(g, e.conj(), rtol=0, atol=0)
    real = make_system(12, (3,), None, seed=154)
    xr = compiled.solve(*real)
    plain = compiled.solve_backward(*real[:3], xr, real[3])
    negated = torch._neg_view(-real[3])
    assert negated.is_neg()
    for g, e in zip(compiled.solve_backward(*real[:3], xr, negated), plain):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_solve_backward_singular_and_not_finite(op):
    """A singular A: info from the op, SingularMatrixError from compiled.solve_backward. A NaN
    in one system's grad_x stays in that system's gradients."""
    lower, diag, upper, rhs = make_system(6, (4,), None, seed=155)
    x = compiled.solve(lower, diag, upper, rhs)
    grad_x = torch.ones_like(rhs)
    singular = [t.clone() for t in (lower, diag, upper)]
    singular[1][2, 3], singular[0][2, 3], singular[2][2, 2] = 0.0, 0.0, 0.0  # column 3 of A[2]
    *_, info = T.cpp_solve_backward(*singular, x, grad_x)
    assert int(info) >= 0 and int(info) // 6 == 2
    with pytest.raises(SingularMatrixError, match="singular") as err:
        compiled.solve_backward(*singular, x, grad_x)
    assert err.value.batch_index == (2,)
    clean = compiled.solve_backward(lower, diag, upper, x, grad_x)
    poisoned = grad_x.clone()
    poisoned[1, 4] = float("nan")
    got = compiled.solve_backward(lower, diag, upper, x, poisoned)
    for g, c in zip(got, clean):
        assert g[1].isnan().any()
        others = [0, 2, 3]
        torch.testing.assert_close(g[others], c[others], rtol=0, atol=0)


def bad_backward_inputs():
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=156)
    x = rhs.clone()
    return {
        "x of another shape": ((lower, diag, upper, x[..., :2], rhs),
                               "x and grad_x must have one shape"),
        "x of another dtype": ((lower, diag, upper, x.float(), rhs), "must have one dtype"),
        "grad_x of another dtype": ((lower, diag, upper, x, rhs.float()), "must have one dtype"),
        "grad_x too short": ((lower, diag, upper, x[..., :4, :], rhs[..., :4, :]), "shapes must be"),
        "grad_x with a dimension too many": ((lower, diag, upper, x[..., None], rhs[..., None]),
                                             "grad_x must be (*B, n)"),
        "short band": ((lower[..., :3], diag, upper, x, rhs), "shapes must be"),
        "integer dtype": ((lower.long(), diag.long(), upper.long(), x.long(), rhs.long()),
                          "dtype must be"),
        "sparse x": ((lower, diag, upper, x.to_sparse(), rhs), None),
    }


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize("case", list(bad_backward_inputs()))
def test_solve_backward_refuses_bad_input(op, case):
    """Each bad input: an error that names the op and the problem, on the CPU (the C++ checks)
    and on meta tensors (the fake kernel), before anything is read."""
    args, message = bad_backward_inputs()[case]
    with pytest.raises((RuntimeError, NotImplementedError)) as err:
        T.cpp_solve_backward(*args)
    assert "tridiag_tutorial::cpp_solve_backward" in str(err.value), str(err.value)[:300]
    if message:
        assert message in str(err.value), str(err.value)[:300]
    if case != "sparse x":
        with pytest.raises((RuntimeError, ValueError, TypeError)) as err:
            T.cpp_solve_backward(*(t.to("meta") for t in args))
        assert "tridiag_tutorial::cpp_solve_backward" in str(err.value), str(err.value)[:300]


def test_solve_backward_opcheck(op):
    """Schema, fake kernel (shapes of the four gradients and info) and AOT dispatch."""
    for dtype in (torch.float64, torch.complex128):
        lower, diag, upper, rhs = make_system(6, (3,), 2, dtype=dtype, seed=157)
        x = compiled.solve(lower, diag, upper, rhs)
        result = torch.library.opcheck(T.cpp_solve_backward.default, (lower, diag, upper, x, rhs))
        assert result and all(v == "SUCCESS" for v in result.values()), result
        fake = T.cpp_solve_backward(*(t.to("meta") for t in (lower, diag, upper, x, rhs)))
        assert [tuple(t.shape) for t in fake] == [(3, 5), (3, 6), (3, 5), (3, 6, 2), ()]
        assert fake[4].dtype == torch.int64
