"""Chapter 11's claims about symmetric positive-definite tridiagonal solves, recomputed.

The capstone op itself is the reader's exercise and lives in the chapter; these tests check the
facts its prose builds on, with SciPy's LAPACK and the package: ?ptsv's factors and its error
code, that its default flags leave the inputs alone while overwrite_b writes into a Fortran-ordered
b, that ?gttrf pivots on a positive-definite matrix that is not diagonally dominant while ?pttrf
needs no pivot, that ?gtsv keeps only U (the bands ?gttrf computes), that a NaN passes ?pttrf's
pivot test and spreads through a joined batch, that the chapter's own NumPy kernel keeps a
non-finite input from spoiling the other systems of its batch, that passing one off-diagonal twice
to tridiagonal_solve adds its two band gradients as the symmetric formula does, and the periodic
(Sherman-Morrison) solve of exercise 2."""

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tridiag_tutorial as tt

from conftest import torch_trap

lapack = pytest.importorskip("scipy.linalg.lapack")

DTYPE = torch.float64


def test_ptsv_factors_solve_and_leave_the_inputs_alone():
    rng = np.random.default_rng(0)
    n = 8
    d, e = 3 + rng.random(n), rng.random(n - 1) - 0.5
    b = rng.standard_normal((n, 2))
    before = [a.copy() for a in (d, e, b)]
    factor_d, factor_e, x, info = lapack.dptsv(d, e, b)
    A = np.diag(d) + np.diag(e, -1) + np.diag(e, 1)
    L = np.eye(n) + np.diag(factor_e, -1)
    assert info == 0
    assert np.abs(A @ x - b).max() < 1e-13
    assert np.abs(L @ np.diag(factor_d) @ L.T - A).max() < 1e-13
    assert all(np.array_equal(a, a0) for a, a0 in zip((d, e, b), before))
    b_fortran = np.asfortranarray(b.copy())
    lapack.dptsv(d, e, b_fortran, overwrite_b=1)
    assert np.abs(b_fortran - x).max() < 1e-15


def test_ptsv_reports_the_first_non_positive_pivot():
    *_, info = lapack.dptsv(np.array([1.0, 1.0, 1.0]), np.array([2.0, 0.5]), np.ones((3, 1)))
    assert info == 2


def test_gttrf_pivots_where_pttrf_needs_none():
    d, e = np.array([1.0, 5.0, 5.0]), np.array([2.0, 1.0])
    A = np.diag(d) + np.diag(e, -1) + np.diag(e, 1)
    assert np.linalg.eigvalsh(A).min() > 0 and abs(e[0]) > d[0]
    assert (lapack.dgttrf(e, d, e)[4] != np.arange(1, 4)).sum() > 0
    assert lapack.dpttrf(d, e)[2] == 0



def test_gtsv_returns_only_u_the_bands_gttrf_computes():
    # section 11.4: ?gtsv eliminates in place; what it returns beside x is U, with no pivot array
    d, e = np.array([1.0, 5.0, 5.0, 4.0]), np.array([2.0, 1.0, 1.5])
    du2, u_diag, u_du, x, info = lapack.dgtsv(e, d, e, np.ones((4, 1)))
    _, f_diag, f_du, f_du2, ipiv, f_info = lapack.dgttrf(e, d, e)
    assert info == f_info == 0
    assert (ipiv != np.arange(1, 5)).any()   # an interchange: U has a second band
    assert np.abs(u_diag - f_diag).max() < 1e-14
    assert np.abs(u_du - f_du).max() < 1e-14
    assert np.abs(du2[:2] - f_du2).max() < 1e-14 and np.abs(f_du2).max() > 0


def test_a_nan_pivot_passes_pttrf_and_spreads_through_a_joined_batch():
    # exercise 4's hint: ?pttrf tests D_i <= 0, which NaN passes; the op joins its batch
    d = np.array([4.0, np.nan, 4.0, 4.0, 4.0, 4.0])
    e = np.array([1.0, 1.0, 0.0, 1.0, 1.0])   # two systems of n = 3, coupled by an exact zero
    assert lapack.dpttrf(d, e)[2] == 0
    _, _, x, info = lapack.dptsv(d, e, np.ones((6, 1)))
    assert info == 0
    assert np.isnan(x[3:]).all()             # the second system, after the NaN, is lost too
    assert np.isfinite(lapack.dptsv(d[3:], e[3:], np.ones((3, 1)))[2]).all()

CHAPTER = Path(__file__).resolve().parents[1] / "notebooks" / "11_capstone.ipynb"


def _chapter_kernel():
    """The chapter's ``_ptsv_numpy`` (and the functions and the cache it uses), from the notebook's cell."""
    cells = ["".join(c["source"]) for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    (source,) = [c for c in cells if "def _ptsv_numpy(" in c]
    defs = [node for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) or isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)]
    from scipy.linalg import get_lapack_funcs
    namespace = {"math": math, "np": np, "torch": torch, "get_lapack_funcs": get_lapack_funcs}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(CHAPTER), "exec"), namespace)
    return namespace["_ptsv_numpy"]


def _alone(d, e, b):
    """Each system of a (S, ...) batch solved by its own dptsv call."""
    return np.stack([lapack.dptsv(d[j], e[j], b[j])[2] for j in range(len(d))])


def test_the_chapters_kernel_keeps_a_non_finite_system_to_itself():
    # step 2: a NaN or Inf in one system must not make the other systems' x NaN
    ptsv_numpy = _chapter_kernel()
    rng = np.random.default_rng(11)
    systems, n, k = 5, 6, 2
    d = 3 + rng.random((systems, n))
    e = 2 * rng.random((systems, n - 1)) - 1
    b = rng.standard_normal((systems, n, k))
    for name, where, value in (("d", (2, 3), np.nan), ("e", (1, 2), np.nan),
                               ("b", (3, 0, 1), np.inf), ("b", (0, 4, 0), np.nan)):
        inputs = {"d": d.copy(), "e": e.copy(), "b": b.copy()}
        inputs[name][where] = value
        x = ptsv_numpy(inputs["d"], inputs["e"], inputs["b"])
        expected = _alone(inputs["d"], inputs["e"], inputs["b"])
        clean = [j for j in range(systems) if j != where[0]]
        assert x.shape == (systems, n, k) and x.flags.c_contiguous
        assert np.isfinite(x[clean]).all(), (name, where)
        assert np.abs(x[clean] - expected[clean]).max() < 1e-14, (name, where)
        np.testing.assert_array_equal(np.isfinite(x[where[0]]), np.isfinite(expected[where[0]]))


def test_the_chapters_kernel_names_a_matrix_that_a_nan_before_it_hides():
    # with a NaN in d of system 0, the joined call cannot see that system 3 is not positive definite
    ptsv_numpy = _chapter_kernel()
    d, e = np.full((4, 5), 4.0), np.ones((4, 4))
    d[0, 1], d[3, 2] = np.nan, -1.0
    with pytest.raises(torch.linalg.LinAlgError, match=r"batch element \(3,\).*pivot 2"):
        ptsv_numpy(d, e, np.ones((4, 5, 1)))


def test_the_chapters_kernel_picks_the_routine_by_dtype_after_caching_it():
    # step 2 caches ?ptsv per dtype: a float32 call after a float64 one must still use sptsv
    ptsv_numpy = _chapter_kernel()
    rng = np.random.default_rng(12)
    d, e, b = 3 + rng.random((2, 6)), 2 * rng.random((2, 5)) - 1, rng.standard_normal((2, 6, 1))
    x64 = ptsv_numpy(d, e, b)
    x32 = ptsv_numpy(d.astype(np.float32), e.astype(np.float32), b.astype(np.float32))
    assert x64.dtype == np.float64 and x32.dtype == np.float32
    assert np.abs(x64 - _alone(d, e, b)).max() < 1e-14
    assert np.abs(x32 - x64).max() < 1e-5


def test_one_off_diagonal_passed_twice_gets_the_symmetric_gradient():
    gen = torch.Generator().manual_seed(13)
    n, k = 30, 2
    d = (3 + torch.rand(n, dtype=DTYPE, generator=gen)).requires_grad_()
    e = (2 * torch.rand(n - 1, dtype=DTYPE, generator=gen) - 1).requires_grad_()
    b = torch.randn(n, k, dtype=DTYPE, generator=gen)
    g = torch.randn(n, k, dtype=DTYPE, generator=gen)
    x = tt.tridiagonal_solve(e, d, e, b)
    grad_d, grad_e = torch.autograd.grad(x, (d, e), grad_outputs=g)
    with torch.no_grad():
        v = tt.tridiagonal_solve(e, d, e, g)   # A^T = A
        assert (grad_d + (v * x).sum(-1)).abs().max() < 1e-13
        assert (grad_e + (v[1:] * x[:-1] + v[:-1] * x[1:]).sum(-1)).abs().max() < 1e-13


def cyclic_solve(lower, diag, upper, alpha, beta, b):
    n = diag.shape[-1]
    gamma = -diag[0]
    diag_t = torch.cat([(diag[0] - gamma).reshape(1), diag[1:-1],
                        (diag[-1] - alpha * beta / gamma).reshape(1)])
    u = torch.cat([gamma.reshape(1), b.new_zeros(n - 2), alpha.reshape(1)])
    yz = tt.tridiagonal_solve(lower, diag_t, upper, torch.stack([b, u], dim=-1))
    y, z = yz[:, 0], yz[:, 1]
    return y - (y[0] + beta / gamma * y[-1]) / (1 + z[0] + beta / gamma * z[-1]) * z


def test_periodic_solve_by_sherman_morrison():
    gen = torch.Generator().manual_seed(2)
    n = 7
    args = [torch.randn(n - 1, dtype=DTYPE, generator=gen), 4 + torch.randn(n, dtype=DTYPE, generator=gen),
            torch.randn(n - 1, dtype=DTYPE, generator=gen), torch.randn((), dtype=DTYPE, generator=gen),
            torch.randn((), dtype=DTYPE, generator=gen), torch.randn(n, dtype=DTYPE, generator=gen)]
    A = tt.to_dense(*args[:3])
    A[n - 1, 0] += args[3]
    A[0, n - 1] += args[4]
    assert (cyclic_solve(*args) - torch.linalg.solve(A, args[5])).abs().max() < 1e-12
    leaves = [t.clone().requires_grad_() for t in args]
    assert torch.autograd.gradcheck(cyclic_solve, leaves)
    assert torch.autograd.gradgradcheck(cyclic_solve, leaves)


def test_pttrf_keeps_two_float_arrays_and_gttrf_four_plus_the_pivots():
    rng = np.random.default_rng(3)
    d, e = 3 + rng.random(50), 2 * rng.random(49) - 1
    *pt, pt_info = lapack.dpttrf(d, e)
    *gt, gt_info = lapack.dgttrf(e, d, e)
    assert pt_info == gt_info == 0
    assert [a.dtype.kind for a in pt] == ["f", "f"]
    assert [a.dtype.kind for a in gt] == ["f", "f", "f", "f", "i"]
    assert [a.shape for a in gt[:4]] == [(49,), (50,), (49,), (48,)]


def _diagonal_op(name):
    """x = b / d as a custom op whose derivative is registered with register_autograd."""
    @torch.library.custom_op(f"test_chapter_11::{name}", mutates_args=(), device_types="cpu")
    def op(d: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if d.shape != b.shape:
            raise ValueError(f"{name}: d and b must have one shape; got {tuple(d.shape)}, {tuple(b.shape)}")
        return b / d

    @op.register_fake
    def _(d, b):
        if d.shape != b.shape:
            raise ValueError(f"{name}: d and b must have one shape; got {tuple(d.shape)}, {tuple(b.shape)}")
        return torch.empty_like(b)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    def backward(ctx, grad_x):
        d, x = ctx.saved_tensors
        v = op(d, grad_x)
        return -v * x, v

    op.register_autograd(backward, setup_context=setup_context)
    return op


@torch_trap
def test_torch_func_gives_zero_tangents_and_grad_raises_through_register_autograd():
    # section 11.3's last cell: torch.func.jvp returns zeros without an error, grad raises
    op = _diagonal_op("scale_func")
    d = torch.tensor([2.0, 4.0], dtype=DTYPE)
    b = torch.tensor([1.0, 3.0], dtype=DTYPE)
    _, tangent = torch.func.jvp(op, (d, b), (torch.ones_like(d), torch.ones_like(b)))
    _, expected = torch.func.jvp(lambda d, b: b / d, (d, b), (torch.ones_like(d), torch.ones_like(b)))
    if expected.abs().max() == 0:
        pytest.fail("the reference tangent is zero: the test cannot tell")
    if tangent.abs().max() != 0:
        pytest.fail(f"torch.func.jvp through register_autograd now gives {tangent.tolist()}: "
                    "chapter 11's limit is gone, update the chapter")
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda d: op(d, b).sum())(d)


@pytest.mark.slow
def test_under_torch_compile_the_fake_kernels_value_error_arrives_wrapped():
    # step 7: the spec's ValueError reaches the caller inside Dynamo's own error
    op = _diagonal_op("scale_compile")
    compiled = torch.compile(lambda d, b: op(d, b).sum(), fullgraph=True)
    try:
        with pytest.raises(Exception) as caught:
            compiled(torch.ones(3, dtype=DTYPE), torch.ones(2, dtype=DTYPE))
    finally:
        torch.compiler.reset()
    assert not isinstance(caught.value, ValueError)
    assert "scale_compile: d and b must have one shape; got (3,), (2,)" in str(caught.value)


def _chapter_checks():
    """The chapter's ``_check_inputs`` (and ``_shapes``), from the notebook's cell."""
    cells = ["".join(c["source"]) for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    (source,) = [c for c in cells if "def _check_inputs(" in c]
    defs = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(CHAPTER), "exec"), namespace)
    return namespace["_check_inputs"]


def test_the_chapters_checks_raise_every_error_its_specification_lists():
    # section 11.2: one dtype (TypeError), shapes (ValueError); the op reaches these checks only on
    # dense CPU tensors, which the dispatcher ensures first, but the checks refuse the rest too
    check = _chapter_checks()
    d, e, b = torch.full((3,), 4.0, dtype=DTYPE), torch.ones(2, dtype=DTYPE), torch.ones(3, dtype=DTYPE)
    assert check(d, e, b) is None and check(d, e, b[:, None]) is None
    with pytest.raises(TypeError, match="float32 or all float64"):
        check(d, e.float(), b)
    with pytest.raises(TypeError, match="dense"):
        check(d, e, b.to_sparse())
    with pytest.raises(ValueError, match="one device"):
        check(d, e.to("meta"), b)
    with pytest.raises(ValueError, match=r"got d\(3,\), e\(1,\), b\(3,\)"):
        check(d, e[:1], b)



@torch_trap
def test_the_dispatcher_refuses_a_sparse_tensor_before_the_checks_and_a_meta_one_reaches_the_fake():
    # section 11.2's spec: with device_types="cpu", a sparse input gets the dispatcher's
    # NotImplementedError, not the layout TypeError; a meta tensor among CPU ones reaches the fake
    # kernel, where the device check raises the ValueError
    check = _chapter_checks()

    @torch.library.custom_op("test_chapter_11::checked", mutates_args=(), device_types="cpu")
    def op(d: torch.Tensor, e: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        check(d, e, b)
        return b.clone()

    @op.register_fake
    def _(d, e, b):
        check(d, e, b)
        return b.new_empty(b.shape)

    d, e, b = torch.full((3,), 4.0, dtype=DTYPE), torch.ones(2, dtype=DTYPE), torch.ones(3, dtype=DTYPE)
    assert torch.equal(op(d, e, b), b)
    with pytest.raises(NotImplementedError, match="SparseCPU"):
        op(d, e, b.to_sparse())
    with pytest.raises(ValueError, match="one device"):
        op(d, e.to("meta"), b)

@torch_trap
def test_register_autograds_kernel_runs_without_grad_and_inference_mode_skips_it():
    # section 11.4's layers: the Python Autograd kernel that register_autograd installs runs on a
    # call where nothing requires grad; under torch.inference_mode() the dispatcher skips it
    import sys
    op = _diagonal_op("scale_layers")
    d, b = torch.tensor([2.0, 4.0], dtype=DTYPE), torch.tensor([1.0, 3.0], dtype=DTYPE)
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "autograd_impl":
            calls.append(frame.f_code.co_filename)

    def count(call):
        calls.clear()
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        return len(calls)

    def in_inference_mode():
        with torch.inference_mode():
            torch.ops.test_chapter_11.scale_layers.default(d, b)

    assert count(lambda: op(d, b)) == 1, "register_autograd's kernel no longer runs without grad"
    assert count(in_inference_mode) == 0
