"""The compiled C++ kernel (tridiag_tutorial.compiled): dense reference, LAPACK, errors, opcheck."""

import shutil

import numpy as np
import pytest
import torch
from scipy.linalg import lapack as scipy_lapack
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, vmap

from tridiag_tutorial import compiled, dense_solve, lapack, tridiagonal_solve

from conftest import (
    ALL_DTYPES,
    assert_close,
    assert_grads_match_dense,
    load_compiled_or_skip,
    make_system,
)

LANES = {torch.float32: 16, torch.complex64: 16, torch.float64: 8, torch.complex128: 8}


@pytest.fixture(scope="module")
def op():
    return load_compiled_or_skip()


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
    except torch.linalg.LinAlgError as err:
        return None, str(err)


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
    with the message naming the first such system and ?gtsv's pivot, and otherwise returns,
    bit for bit and NaN for NaN, what ?gtsv returns for each system on its own and what the
    package's LAPACK path (lapack.solve) returns."""
    cases = 0
    for n in (2, 7):
        for name, edits in non_finite_and_singular_families(n):
            for system in sorted({0, min(2, size - 1), size - 1}):
                args = make_system(n, (size,), 2, dtype=dtype, seed=100 * n + system)
                apply_edits(args, system, edits)
                label = f"{dtype}, n={n}, batch {size}, system {system}: {name}"
                expected = raw_gtsv_outcome(*args)
                assert_same_outcome(outcome(op, args), expected, label)
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
        assert_same_outcome(outcome(lapack_solve, args), expected, f"{dtype}, {size} (LAPACK)")


# ----------------------------------------------------------------------------------------------
# The C++ backward under batched gradients and vmap (issue 23): the ops have vmap rules
# (compiled._register_vmap), and the backward leaves batched tensors to ATen operations.
# ----------------------------------------------------------------------------------------------
def on_lapack(f):
    from tridiag_tutorial import kernels

    with kernels.use_compiled(False):
        return f()


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("batch", [(2,), (9,)], ids=str)
def test_cpp_backward_under_batched_gradients(on_compiled, dtype, batch):
    """is_grads_batched (also with create_graph), jacobian(vectorize=True) and
    gradcheck(check_batched_grad=True) through the op whose backward is in C++, against the
    LAPACK path. They raised "Cannot access data pointer of Tensor that doesn't have storage"."""
    args = make_system(5, batch, 2, dtype=dtype, requires_grad=True, seed=90)
    lower, diag, upper, rhs = args

    def batched_grads(create_graph):
        x = tridiagonal_solve(*args)
        eye = torch.eye(x.numel(), dtype=dtype).reshape(-1, *x.shape)[:7]
        return torch.autograd.grad(x, args, eye, is_grads_batched=True, create_graph=create_graph)

    for create_graph in (False, True):
        got = batched_grads(create_graph)
        calls = on_compiled["autograd"]
        for g, e in zip(got, on_lapack(lambda: batched_grads(create_graph))):
            assert_close(g, e)
        assert calls >= 1
    f = lambda d: tridiagonal_solve(lower, d, upper, rhs)
    jac = torch.autograd.functional.jacobian(f, diag, vectorize=True)
    assert_close(jac, on_lapack(lambda: torch.autograd.functional.jacobian(f, diag,
                                                                            vectorize=True)))
    before = dict(on_compiled)
    assert gradcheck(tridiagonal_solve, args, check_batched_grad=True)
    assert on_compiled["autograd"] > before["autograd"]
    assert on_compiled["lapack"] == before["lapack"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["solve", "solve_autograd"])
def test_raw_ops_under_vmap(op, dtype, name):
    """torch.func.vmap of each raw op, over any input (others unbatched) and a non-leading
    dimension, and over a batch of 1 and of 17: what LAPACK gives for the stacked systems."""
    raw = getattr(torch.ops.tridiag_tutorial_cpp, name)
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
    if name == "solve_autograd":  # one vector per system
        samples = make_system(6, (4, 3), dtype=dtype, seed=96)
        x = vmap(raw)(*samples)
        expected = lapack_solve(*samples[:3], samples[3].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_cpp_backward_under_vmap_of_autograd_grad(on_compiled):
    """torch.func.vmap over torch.autograd.grad of the C++ op's output: the backward runs with
    batched cotangents (what is_grads_batched does), forward once."""
    args = make_system(6, (3,), 2, requires_grad=True, seed=97)
    x = tridiagonal_solve(*args)
    cotangents = torch.randn(4, *x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    got = vmap(lambda v: torch.autograd.grad(x, args, v, retain_graph=True))(cotangents)
    expected = [torch.stack(g) for g in zip(*(torch.autograd.grad(dense_solve(*args), args, v)
                                              for v in cotangents))]
    for g, e in zip(got, expected):
        assert_close(g, e)
    assert on_compiled["autograd"] == 1


# ----------------------------------------------------------------------------------------------
# Bad input to the raw ops (issue 23): a clear error, never a crash or an uninitialised result.
# ----------------------------------------------------------------------------------------------
RAW_OPS = ["solve", "solve_autograd"]


@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_refuse_other_layouts(op, name):
    """Nested (strided and jagged), sparse and mkldnn tensors: an error naming the argument.
    (solve_autograd said "Internal error: NestedTensorImpl doesn't support sizes. Please file an
    issue"; solve, "Could not run ... with arguments from the ... backend".)"""
    raw = getattr(torch.ops.tridiag_tutorial_cpp, name)
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=98)
    makers = {"a nested tensor": lambda t: torch.nested.nested_tensor(list(t)),
              "a nested tensor ": lambda t: torch.nested.nested_tensor(list(t), layout=torch.jagged),
              "Sparse": lambda t: t.to_sparse(),
              "Mkldnn": lambda t: t.float().to_mkldnn()}
    for got, make in makers.items():
        with pytest.raises(RuntimeError, match=rf"tridiag_tutorial_cpp::{name}: diag must be a "
                           rf"dense \(strided\) tensor, got {got.strip()}"):
            raw(lower, make(diag), upper, rhs)


@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_refuse_mixed_devices(op, name):
    """One input on meta beside CPU tensors reached the fake kernel, which returned an
    uninitialised CPU tensor: now ValueError, for each input in turn."""
    raw = getattr(torch.ops.tridiag_tutorial_cpp, name)
    args = make_system(5, (2,), 3, seed=99)
    for which in range(4):
        mixed = [t.to("meta") if i == which else t for i, t in enumerate(args)]
        with pytest.raises(ValueError, match="all inputs must be on one device"):
            raw(*mixed)


@pytest.mark.parametrize("name", RAW_OPS)
def test_fake_kernel_checks_like_the_kernel(op, name):
    """On meta tensors (the fake kernel, also what torch.compile traces with) the checks of the
    C++ kernel hold: shapes, dtypes and n >= 1; good input gives the kernel's shape."""
    raw = getattr(torch.ops.tridiag_tutorial_cpp, name)
    lower, diag, upper, rhs = make_system(5, (2,), 3, seed=100)
    assert raw(*(t.to("meta") for t in (lower, diag, upper, rhs))).shape == (2, 5, 3)
    bad = {"shapes must be": (lower[..., :3], diag, upper, rhs),
           "one batch shape": (lower, diag, upper, rhs[:1]),
           "one dtype": (lower.float(), diag, upper, rhs),
           "dtype must be float32, float64, complex64 or complex128": tuple(
               t.half() for t in (lower, diag, upper, rhs)),
           "n must be at least 1": (lower[..., :0], diag[..., :0], upper[..., :0],
                                    rhs[..., :0, :])}
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=message):
            raw(*(t.to("meta") for t in args))
        with pytest.raises(RuntimeError, match=message):  # and the CPU kernel says the same
            raw(*args)


@pytest.mark.parametrize("name", RAW_OPS)
def test_raw_ops_empty_and_strided_inputs(op, name):
    """k = 0, an empty batch, n = 1, expanded, transposed and sliced inputs, integer and half
    dtypes: a result of the right shape equal to LAPACK's, or an error naming the problem."""
    raw = getattr(torch.ops.tridiag_tutorial_cpp, name)
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
    for dtype, shown in ((torch.int64, "Long"), (torch.float16, "Half"), (torch.bool, "Bool")):
        with pytest.raises(RuntimeError, match=f"dtype must be float32, float64, complex64 or "
                                               f"complex128, got {shown}"):
            raw(*(t.to(dtype) for t in (lower, diag, upper, rhs)))


def test_load_compiled_or_skip_fails_in_ci_when_the_build_fails(monkeypatch):
    """With CI=true and a compiler on PATH, a failing build (or missing ninja) is a failure, not
    a skip; without the tools and outside CI it is a skip."""
    def broken_load(verbose=False):
        raise RuntimeError("Error building extension 'tridiag_tutorial_cpp'")

    monkeypatch.setattr(compiled, "load", broken_load)
    monkeypatch.setenv("CXX", "c++")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("CI", "true")
    for missing in ([], ["ninja (...)"]):
        monkeypatch.setattr(compiled, "_missing_tools", lambda: missing)
        with pytest.raises(pytest.fail.Exception, match="Error building extension"):
            load_compiled_or_skip()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="ninja"):
        load_compiled_or_skip()
    monkeypatch.setattr(compiled, "_missing_tools", lambda: [])
    with pytest.raises(pytest.fail.Exception):
        load_compiled_or_skip()
