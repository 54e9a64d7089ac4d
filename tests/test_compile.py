"""torch.compile: zero graph breaks forward and backward, and compiled gradients equal eager ones."""

import pytest
import torch

from tridiag_tutorial import tridiagonal_solve
from tridiag_tutorial.book.autograd_function import tridiagonal_solve_function
from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op

from conftest import assert_close, make_system, torch_trap


def loss_of(solve):
    def loss(lower, diag, upper, rhs):
        return solve(lower, diag, upper, rhs).pow(2).sum()
    return loss


@pytest.mark.parametrize("solve", [tridiagonal_solve, tridiagonal_solve_custom_op],
                         ids=["final", "custom_op"])
def test_forward_has_no_graph_break(solve):
    args = make_system(6, (2,), 3, seed=1)
    explanation = torch._dynamo.explain(loss_of(solve))(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_chapter4_function_breaks_the_graph():
    """The limit chapter 4 shows: NumPy inside forward is opaque to Dynamo."""
    args = make_system(6, seed=2)
    explanation = torch._dynamo.explain(loss_of(tridiagonal_solve_function))(*args)
    assert explanation.graph_break_count >= 1


@pytest.mark.parametrize("k", [None, 2])
def test_compiled_fullgraph_gradients_equal_eager(k):
    args = make_system(7, (3,), k, requires_grad=True, seed=3)
    loss = loss_of(tridiagonal_solve)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    value = compiled(*args)
    grads = torch.autograd.grad(value, args)
    expected = torch.autograd.grad(loss(*args), args)
    assert_close(value, loss(*args))
    for g, e in zip(grads, expected):
        assert_close(g, e)


def test_backward_compiles_fullgraph_with_compiled_autograd():
    """Compiled autograd traces the backward graph too; fullgraph=True fails on any break there."""
    args = make_system(5, (), 2, requires_grad=True, seed=4)
    loss = loss_of(tridiagonal_solve)
    expected = torch.autograd.grad(loss(*args), args)
    compiler = torch.compile(fullgraph=True, backend="aot_eager")
    with torch._dynamo.compiled_autograd._enable(compiler):
        value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*args)
        value.backward()
    for a, e in zip(args, expected):
        assert_close(a.grad, e)


def test_inductor_compiles_and_matches():
    """The default backend (Inductor) end to end, forward and backward."""
    args = make_system(8, (2,), requires_grad=True, seed=5)
    loss = loss_of(tridiagonal_solve)
    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    for g, e in zip(grads, torch.autograd.grad(loss(*args), args)):
        assert_close(g, e)


@torch_trap
def test_function_with_jvp_cannot_be_traced_fullgraph():
    """Pins the torch 2.13 trap behind the final op's design: Dynamo refuses an autograd.Function
    with a jvp staticmethod under fullgraph=True, so the compiled path must use the custom op."""
    from tridiag_tutorial.functions import _TridiagonalSolve

    args = make_system(5, (), 1, requires_grad=True, seed=7)
    fn = torch.compile(lambda *a: _TridiagonalSolve.apply(*a, False)[0].sum(), fullgraph=True,
                       backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="custom jvp"):
        fn(*args)
