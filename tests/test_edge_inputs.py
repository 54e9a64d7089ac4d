"""Inputs that once broke the public function: negative-bit tensors, k = 0 with a singular
matrix, sparse and nested layouts, NaN in one system of a large batch, torch.jit.trace."""


import pytest
import torch
from torch.func import grad, vmap

from tridiag_tutorial import tridiagonal_solve
from tridiag_tutorial.book.autograd_function import tridiagonal_solve_function
from tridiag_tutorial.kernels import lapack
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, assert_grads_match_dense, driver_for, make_system


def negative_bit(t):
    """The same values as ``t``, as a view whose negative bit is set."""
    out = (t * -1j).conj().imag
    assert out.is_neg() and torch.equal(out, t)
    return out


@pytest.mark.parametrize("which", range(4))
@pytest.mark.parametrize("solve", [tridiagonal_solve, tridiagonal_solve_function],
                         ids=["final", "chapter4"])
def test_negative_bit_arguments(which, solve):
    args = make_system(6, (2,), 2, seed=which)
    args[which] = negative_bit(args[which])
    expected = dense_solve(*[a.resolve_neg() for a in args])
    assert_close(solve(*args), expected)
    leaves = [a.resolve_neg().clone().requires_grad_() for a in args]
    views = [negative_bit(t) if i == which else t for i, t in enumerate(leaves)]
    x = solve(*views)
    grads = torch.autograd.grad(x, leaves, negative_bit(torch.ones_like(x)))  # neg-bit grad too
    assert_grads_match_dense(grads, leaves, lambda y: y.sum())


def test_negative_bit_under_torch_func():
    lower, diag, upper, rhs = make_system(5, seed=3)
    neg = negative_bit(rhs)
    g = grad(lambda d: tridiagonal_solve(lower, d, upper, neg).pow(2).sum())(diag)
    ref = grad(lambda d: dense_solve(lower, d, upper, rhs).pow(2).sum())(diag)
    assert_close(g, ref)
    batch = negative_bit(torch.stack([rhs, 2 * rhs]))
    assert_close(vmap(lambda b: tridiagonal_solve(lower, diag, upper, b))(batch),
                 dense_solve(lower.expand(2, 4), diag.expand(2, 5), upper.expand(2, 4),
                             batch.resolve_neg()))


@pytest.mark.parametrize("kernel", ["lapack", "torch"])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_singular_matrix_with_no_right_hand_side_raises(kernel, batch):
    lower, diag, upper, _ = make_system(4, batch, seed=5)
    diag[..., 0], lower[..., 0] = 0.0, 0.0  # column 0 is zero: singular at pivot 0
    rhs = torch.empty(*batch, 4, 0, dtype=torch.float64)
    with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\]"):
        tridiagonal_solve(lower, diag, upper, rhs, driver=driver_for(kernel, 4))
    with pytest.raises(torch.linalg.LinAlgError):  # what torch.linalg.solve does
        torch.linalg.solve(torch.zeros(4, 4, dtype=torch.float64), rhs)


def test_nonsingular_matrix_with_no_right_hand_side_is_empty():
    lower, diag, upper, _ = make_system(4, (2,), seed=6)
    x = tridiagonal_solve(lower, diag, upper, torch.empty(2, 4, 0, dtype=torch.float64))
    assert x.shape == (2, 4, 0)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_sparse_and_nested_layouts_are_named(layout):
    lower, diag, upper, rhs = make_system(4, seed=7)
    if layout == "nested":
        bad = torch.nested.nested_tensor([rhs, rhs[:3]])
        diag, lower, upper = diag.expand(2, 4), lower.expand(2, 3), upper.expand(2, 3)
    elif layout == "sparse_coo":
        bad = rhs.to_sparse()
    else:
        bad, rhs = rhs.reshape(2, 2).to_sparse_csr(), None
        lower, diag, upper = lower[:1], diag[:2], upper[:1]
    with pytest.raises(TypeError, match=r"rhs must be a dense \(torch.strided\) tensor, got layout"):
        tridiagonal_solve(lower, diag, upper, bad)


def test_nan_stays_in_its_system_and_the_batch_stays_joined(monkeypatch):
    """A NaN in one system: that system is NaN, every other equals its own solve, and the others
    are still solved in one joined call (one gtsv for them, one for the NaN system)."""
    lower, diag, upper, rhs = make_system(6, (50,), 2, seed=8)
    rhs[17, 2, 1] = float("nan")
    calls = []
    real = lapack.gtsv
    monkeypatch.setattr(lapack, "gtsv", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    x = tridiagonal_solve(lower, diag, upper, rhs, driver="lapack")
    assert torch.isnan(x[17]).any() and torch.isfinite(x[torch.arange(50) != 17]).all()
    others = torch.arange(50) != 17
    assert_close(x[others], dense_solve(lower[others], diag[others], upper[others], rhs[others]))
    # joined; then, in batch order, the systems before it joined, the NaN system alone and the
    # systems after it joined (lapack._settle)
    assert calls == [50 * 6, 17 * 6, 6, 32 * 6]


def test_overflow_in_a_finite_system_falls_back_to_one_solve_each():
    lower, diag, upper, rhs = make_system(4, (3,), seed=9)
    rhs[1] = 1e308
    diag[1] = 1e-300
    x = tridiagonal_solve(lower, diag, upper, rhs)
    assert_close(x[[0, 2]], dense_solve(lower[[0, 2]], diag[[0, 2]], upper[[0, 2]], rhs[[0, 2]]))


def test_jit_trace_is_refused_with_advice():
    args = make_system(4, seed=10)
    with pytest.raises(RuntimeError, match=r"tridiagonal_solve: torch.jit.trace .*torch.compile"):
        torch.jit.trace(tridiagonal_solve, args)


def test_singular_message_has_one_format_with_or_without_nan():
    lower, diag, upper, rhs = make_system(4, (3,), seed=12)
    diag[2, 0], lower[2, 0] = 0.0, 0.0
    expected = r"singular: pivot U\[0, 0\] is exactly zero, in batch element \(2,\)$"
    with pytest.raises(torch.linalg.LinAlgError, match=expected):
        tridiagonal_solve(lower, diag, upper, rhs)
    rhs[0, 1] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match=expected):
        tridiagonal_solve(lower, diag, upper, rhs)


def test_jit_trace_of_the_factorization_is_refused_with_advice():
    """Issue 23: the trace held the example's factors as a constant, with only a TracerWarning."""
    from tridiag_tutorial import tridiagonal_lu_factor
    args = make_system(4, seed=13)[:3]
    with pytest.raises(RuntimeError, match=r"tridiagonal_lu_factor: torch.jit.trace .*torch.compile"):
        torch.jit.trace(lambda *a: tridiagonal_lu_factor(*a).lu, args)


@pytest.mark.parametrize("name", ["tridiagonal_solve", "tridiagonal_lu_factor",
                                  "tridiagonal_lu_solve"])
def test_jit_script_names_the_function_and_the_alternative(name):
    """Issue 23: torch.jit.script raised "Compiled functions can't take variable number of
    arguments" (or a complaint about f-strings, try blocks) from deep inside the validation."""
    import tridiag_tutorial
    fn = getattr(tridiag_tutorial, name)
    expected = rf"{name}: torch.jit.script cannot compile .*torch.compile.*torch.export"
    with pytest.raises(RuntimeError, match=expected):
        torch.jit.script(fn)

    def caller(lower, diag, upper, rhs):  # scripting a caller scripts the callee
        return fn(lower, diag, upper)

    with pytest.raises(RuntimeError, match=expected):
        torch.jit.script(caller)
