"""The compiled C++ kernel (tridiag_tutorial.compiled): dense reference, LAPACK, errors, opcheck."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, vmap

from tridiag_tutorial import compiled, dense_solve, lapack, tridiagonal_solve

from conftest import ALL_DTYPES, assert_close, assert_grads_match_dense, make_system

LANES = {torch.float32: 16, torch.complex64: 16, torch.float64: 8, torch.complex128: 8}


@pytest.fixture(scope="module")
def op():
    try:
        return compiled.load()
    except RuntimeError as err:  # no C++ compiler or no ninja: LAPACK stays the default
        pytest.skip(f"the C++ kernel cannot be built here: {err}")


def as_matrix_rhs(rhs, k):
    return rhs.unsqueeze(-1) if k is None else rhs


def lapack_solve(lower, diag, upper, rhs):
    return torch.from_numpy(lapack.solve(*(t.numpy() for t in (lower, diag, upper, rhs))))


def lapack_error(args) -> str:
    with pytest.raises(torch.linalg.LinAlgError) as err:
        lapack_solve(*args)
    return str(err.value)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 17, 100])
@pytest.mark.parametrize("batch", [(), (5,), (3, 4)], ids=str)
@pytest.mark.parametrize("k", [None, 3])
def test_matches_dense_and_lapack(op, dtype, n, batch, k):
    """Equal to the dense solve to tolerance, and to LAPACK's ?gtsv bit for bit: the kernel does
    ?gtsv's operations in ?gtsv's order (complex products and Smith's division as gfortran
    evaluates them), so with the OpenBLAS build SciPy ships all four dtypes agree exactly."""
    lower, diag, upper, rhs = make_system(n, batch, k, dtype=dtype, seed=n + len(batch))
    b = as_matrix_rhs(rhs, k)
    x = op(lower, diag, upper, b)
    assert x.shape == b.shape and x.dtype == dtype and x.is_contiguous()
    assert_close(x, as_matrix_rhs(dense_solve(lower, diag, upper, rhs), k), dtype)
    torch.testing.assert_close(x, lapack_solve(lower, diag, upper, b), rtol=0, atol=0)


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
    """A zero pivot raises LinAlgError with exactly the LAPACK path's message: the first
    singular system in C order, and its first zero pivot (here the last one, U[n-1, n-1])."""
    n = 4
    lower, diag, upper, rhs = make_system(n, batch, 2, dtype=dtype, seed=7)
    flat = [t.reshape(-1, *t.shape[len(batch):]) for t in (lower, diag, upper)]
    last = flat[1].shape[0] - 1
    for element in sorted({last, last // 2}):
        flat[0][element, -1] = 0.0  # row n-1 = [0, 0, ..., 0]: pivot U[n-1, n-1] is zero
        flat[1][element, -1] = 0.0
    args = (lower, diag, upper, rhs)
    with pytest.raises(torch.linalg.LinAlgError) as err:
        op(*args)
    assert str(err.value) == lapack_error(args)
    assert f"pivot U[{n - 1}, {n - 1}] is exactly zero" in str(err.value)
    assert ("in batch element" in str(err.value)) == bool(batch)


def test_singular_first_pivot_and_zero_columns(op):
    """A zero first column (pivot U[0, 0]) in two elements: the first of them is named; k = 0
    still raises, as LAPACK's path does."""
    lower, diag, upper, rhs = make_system(5, (2, 3), 1, seed=8)
    for element in [(1, 0), (1, 2)]:
        diag[element][0] = 0.0
        lower[element][0] = 0.0
    for b in (rhs, rhs[..., :0]):
        with pytest.raises(torch.linalg.LinAlgError) as err:
            op(lower, diag, upper, b)
        assert str(err.value) == ("the tridiagonal matrix is singular: pivot U[0, 0] is exactly "
                                  "zero, in batch element (1, 0)")
        assert str(err.value) == lapack_error((lower, diag, upper, rhs))


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
    """A transposed rhs, expanded (stride-0) bands, a strided diagonal and a conjugate view."""
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


def test_one_large_system(op):
    lower, diag, upper, rhs = make_system(100_000, (), 1, seed=12)
    diag[::7] = 0.0
    x = op(lower, diag, upper, rhs)
    torch.testing.assert_close(x, lapack_solve(lower, diag, upper, rhs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_opcheck(op, dtype):
    args = make_system(6, (3,), 2, dtype=dtype, seed=13)
    result = torch.library.opcheck(op, tuple(args))
    assert result and all(v == "SUCCESS" for v in result.values()), result


def test_load_is_cached(op):
    assert compiled.is_loaded()
    assert compiled.load() is op


def test_no_compiler_raises(monkeypatch):
    """Without a compiler, load() names what is missing and says LAPACK stays the default."""
    monkeypatch.setattr(compiled, "_op", None)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no-such-compiler-xyz.*LAPACK"):
        compiled.load()


def test_import_does_not_compile():
    import subprocess
    import sys

    code = ("import tridiag_tutorial, tridiag_tutorial.compiled as c; "
            "import torch.utils.cpp_extension as e; print(c.is_loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# Once loaded, the public op uses the kernel where it measured faster, in every composition.
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def on_compiled(op, monkeypatch):
    """The public op with the compiled kernel allowed; counts calls of the kernel and of LAPACK."""
    from tridiag_tutorial import kernels

    calls = {"compiled": 0, "lapack": 0, "autograd": 0}
    real_op, real_autograd, real_lapack = compiled._op, compiled._autograd_op, lapack.solve

    def counting(key, real):
        def call(*a):
            calls[key] += 1
            return real(*a)
        return call

    monkeypatch.setattr(compiled, "_op", counting("compiled", real_op))
    monkeypatch.setattr(compiled, "_autograd_op", counting("autograd", real_autograd))
    monkeypatch.setattr(lapack, "solve", counting("lapack", real_lapack))
    with kernels.use_compiled(True):
        yield calls


def squared(x):
    return x.abs().pow(2).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_public_op_runs_the_kernel_forward_and_backward(on_compiled, dtype):
    """Reverse mode goes to the op whose backward is in C++ (one call: the backward's solve with
    A^H happens inside it); a forward without grad calls the kernel directly."""
    args = make_system(7, (5,), 2, dtype=dtype, requires_grad=True, seed=50)
    grads = torch.autograd.grad(squared(tridiagonal_solve(*args)), args)
    assert on_compiled == {"compiled": 0, "lapack": 0, "autograd": 1}
    expected = torch.autograd.grad(squared(dense_solve(*args)), args)
    for g, e in zip(grads, expected):
        assert_close(g, e)
    with torch.no_grad():
        tridiagonal_solve(*args)
    assert on_compiled == {"compiled": 1, "lapack": 0, "autograd": 1}


# ----------------------------------------------------------------------------------------------
# The op with its backward in C++ (csrc/tridiag_autograd.cpp): eager reverse mode only.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 17])
@pytest.mark.parametrize("batch, k", [((), None), ((3,), None), ((2, 3), 4), ((), 2)], ids=str)
def test_cpp_backward_matches_dense(on_compiled, dtype, n, batch, k):
    args = make_system(n, batch, k, dtype=dtype, requires_grad=True, seed=60 + n)
    x = tridiagonal_solve(*args)
    assert "TridiagonalSolve" in x.grad_fn.name() and on_compiled["autograd"] == 1
    grads = torch.autograd.grad(squared(x), args)
    assert_grads_match_dense(grads, args, squared, dtype)
    assert x.shape == args[3].shape


def test_cpp_backward_broadcast_bands_and_some_inputs(on_compiled):
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
    assert on_compiled["autograd"] == 2 and on_compiled["lapack"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_cpp_backward_gradcheck_and_double_backward(on_compiled, dtype):
    """Finite differences, and create_graph=True: the C++ backward records its own solve."""
    args = make_system(5, (3,), 2, dtype=dtype, requires_grad=True, seed=62)
    assert gradcheck(tridiagonal_solve, args)
    assert gradgradcheck(tridiagonal_solve, args)
    vector = make_system(6, (), dtype=dtype, requires_grad=True, seed=63)
    assert gradcheck(tridiagonal_solve, vector) and gradgradcheck(tridiagonal_solve, vector)
    assert on_compiled["autograd"] > 0 and on_compiled["lapack"] == 0


def test_cpp_backward_with_batched_grad_outputs(on_compiled):
    """autograd.grad(is_grads_batched=True) runs the C++ backward under vmap."""
    args = make_system(5, (2,), requires_grad=True, seed=64)
    x = tridiagonal_solve(*args)
    eye = torch.eye(x.numel(), dtype=x.dtype).reshape(-1, *x.shape)
    jac = torch.autograd.grad(x, args[3], eye, is_grads_batched=True)[0]
    dense_jac = torch.autograd.grad(dense_solve(*args), args[3], eye, is_grads_batched=True)[0]
    assert_close(jac, dense_jac)
    assert on_compiled["autograd"] == 1


def test_cpp_backward_is_not_used_where_it_has_no_rule(on_compiled):
    """Forward-mode AD, torch.func transforms and tensors modes see the Python Function."""
    import torch.autograd.forward_ad as fwAD

    args = make_system(5, (2,), requires_grad=True, seed=65)
    with fwAD.dual_level():
        dual = fwAD.make_dual(args[1].detach(), torch.ones_like(args[1]))
        tangent = fwAD.unpack_dual(tridiagonal_solve(args[0], dual, args[2], args[3])).tangent
    with fwAD.dual_level():
        dual = fwAD.make_dual(args[1].detach(), torch.ones_like(args[1]))
        expected = fwAD.unpack_dual(dense_solve(args[0], dual, args[2], args[3])).tangent
    assert_close(tangent, expected)
    grad(lambda d: squared(tridiagonal_solve(args[0], d, args[2], args[3])))(args[1])
    assert on_compiled["autograd"] == 0 and on_compiled["compiled"] > 0


def test_cpp_backward_errors_and_inputs(on_compiled):
    """A singular matrix raises the package's error; the inputs are not modified; modifying the
    result in place before the backward is caught by autograd."""
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=66)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0
    diag.requires_grad_()
    with pytest.raises(torch.linalg.LinAlgError,
                       match=r"pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$"):
        tridiagonal_solve(lower, diag, upper, rhs)
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
    assert on_compiled["autograd"] == 3


def test_one_large_system_stays_on_lapack(on_compiled):
    from tridiag_tutorial import kernels

    args = make_system(kernels.COMPILED_ONE_SYSTEM_MAX_N + 1, seed=51)
    tridiagonal_solve(*args)
    assert on_compiled == {"compiled": 0, "lapack": 1, "autograd": 0}
    tridiagonal_solve(*make_system(kernels.COMPILED_ONE_SYSTEM_MAX_N, seed=51))
    assert on_compiled == {"compiled": 1, "lapack": 1, "autograd": 0}


def test_gradcheck_forward_ad_and_second_order_on_the_kernel(on_compiled):
    args = make_system(5, (3,), 2, requires_grad=True, seed=52)
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True)
    assert gradgradcheck(tridiagonal_solve, args)
    assert on_compiled["compiled"] > 0 and on_compiled["lapack"] == 0


def test_torch_func_transforms_on_the_kernel(on_compiled):
    lower, diag, upper, rhs = make_system(6, (4,), seed=53)

    def f(d):
        return squared(tridiagonal_solve(lower, d, upper, rhs))

    def f_dense(d):
        return squared(dense_solve(lower, d, upper, rhs))

    for transform in (grad, jacfwd, hessian):
        assert_close(transform(f)(diag), transform(f_dense)(diag))
    diags = diag + 0.1 * torch.arange(3, dtype=torch.float64)[:, None, None]
    assert_close(vmap(grad(f))(diags), vmap(grad(f_dense))(diags))
    assert on_compiled["compiled"] > 0 and on_compiled["lapack"] == 0


def test_compile_fullgraph_on_the_kernel(on_compiled):
    torch._dynamo.reset()
    args = make_system(6, (3,), 2, requires_grad=True, seed=54)

    def loss(*a):
        return squared(tridiagonal_solve(*a))

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    expected = torch.autograd.grad(squared(dense_solve(*args)), args)
    for g, e in zip(got, expected):
        assert_close(g, e)
    assert on_compiled["compiled"] > 0 and on_compiled["lapack"] == 0


def test_public_op_singular_message_is_unchanged(on_compiled):
    lower, diag, upper, rhs = make_system(4, (2, 3), seed=55)
    diag[1, 0, 2], lower[1, 0, 2], upper[1, 0, 1] = 0.0, 0.0, 0.0
    with pytest.raises(torch.linalg.LinAlgError,
                       match=r"pivot U\[2, 2\] is exactly zero, in batch element \(1, 0\)$"):
        tridiagonal_solve(lower, diag, upper, rhs)
    assert on_compiled == {"compiled": 1, "lapack": 0, "autograd": 0}


def test_use_compiled_false_keeps_lapack(on_compiled):
    from tridiag_tutorial import kernels

    with kernels.use_compiled(False):
        tridiagonal_solve(*make_system(5, (4,), seed=56))
    assert on_compiled == {"compiled": 0, "lapack": 1, "autograd": 0}


def test_bad_input_to_the_raw_op_names_the_problem(op):
    """The op checks what it relies on (the public function validates before it is reached)."""
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=57)
    with pytest.raises(RuntimeError, match=r"shapes must be lower, upper \(\*B, n-1\)"):
        op(lower[..., :3], diag, upper, rhs)
    with pytest.raises(RuntimeError, match=r"one batch shape; got \[2, 4\], \[2, 5\], \[2, 4\], \[1, 5, 3\]"):
        op(lower, diag, upper, rhs[:1])
    with pytest.raises(RuntimeError, match="rhs must be \\(\\*B, n, k\\)"):
        op(lower, diag, upper, rhs[..., 0])
    with pytest.raises(RuntimeError, match="one dtype"):
        op(lower.float(), diag, upper, rhs)
    with pytest.raises(RuntimeError):  # integer tensors: no kernel for them
        op(*(t.long() for t in (lower, diag, upper, rhs)))
