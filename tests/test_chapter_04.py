"""Chapter 4's claims about the LAPACK-backed ``autograd.Function``, recomputed: what it gets right
(values, gradients, broadcasting, what it saves) and each limit the chapter measures (graph breaks,
no ``torch.func``, no second derivative, CPU only)."""

import re

import pytest
import scipy.linalg
import torch
from torch._dynamo.utils import counters
from torch.autograd.gradcheck import GradcheckError

import tridiag_tutorial as tt
from tridiag_tutorial.book.autograd_function import (
    LapackTridiagonalSolve,
    tridiagonal_solve_function,
)
from tridiag_tutorial.reference import dense_solve, to_dense

from conftest import assert_close, assert_grads_match_dense, make_system


def leaves(args):
    return [t.detach().clone().requires_grad_() for t in args]


@pytest.mark.parametrize("k", [None, 3])
def test_values_and_gradients_match_the_dense_solve(k):
    args = make_system(6, (2,), k, seed=40)
    assert_close(tridiagonal_solve_function(*args), dense_solve(*args))
    inputs = leaves(args)
    grads = torch.autograd.grad(tridiagonal_solve_function(*inputs).pow(2).sum(), inputs)
    assert_grads_match_dense(grads, inputs, lambda x: x.pow(2).sum())
    assert torch.autograd.gradcheck(tridiagonal_solve_function, leaves(make_system(5, seed=41)))


def test_a_shared_band_gets_the_sum_of_the_batch_gradients():
    """Exercise 1: lower and upper shared by two systems, three right-hand sides each."""
    lower, _, upper, _ = make_system(5, seed=42)
    _, diag, _, rhs = make_system(5, (2,), 3, seed=43)
    inputs = leaves((lower, diag, upper, rhs))
    assert torch.autograd.gradcheck(tridiagonal_solve_function, inputs)
    grads = torch.autograd.grad(tridiagonal_solve_function(*inputs).sum(), inputs)
    per_system = [torch.autograd.grad(tridiagonal_solve_function(inputs[0], inputs[1][i], inputs[2],
                                                                 inputs[3][i]).sum(), inputs[0])[0]
                  for i in range(2)]
    assert grads[0].shape == lower.shape
    assert_close(grads[0], per_system[0] + per_system[1])


def test_the_gradients_are_the_bands_of_minus_v_x_transpose():
    """Exercise 2: v = A^{-T} g, and the band gradients are the bands of -v x^T."""
    args = make_system(5, seed=44)
    inputs = leaves(args)
    x = tridiagonal_solve_function(*inputs)
    g = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(45))
    x.backward(g)
    v = torch.linalg.solve(to_dense(*args[:3]).T, g)
    grad_a = -torch.outer(v, x.detach())
    for leaf, expected in zip(inputs, [grad_a.diagonal(-1), grad_a.diagonal(), grad_a.diagonal(1), v]):
        assert_close(leaf.grad, expected)


def test_rhs_is_not_saved_so_its_buffer_may_be_reused():
    lower, diag, upper, rhs = make_system(5, seed=46)
    d = diag.clone().requires_grad_()
    buffer = rhs.unsqueeze(-1).clone()
    x = LapackTridiagonalSolve.apply(lower, d, upper, buffer)
    expected = torch.autograd.grad(dense_solve(lower, d, upper, rhs).pow(2).sum(), d)[0]
    buffer.zero_()
    x.pow(2).sum().backward()
    assert_close(d.grad, expected)


def test_x_is_saved_so_modifying_it_in_place_breaks_backward():
    """Section 4.3: saving x spares a second solve, but the caller must then not modify x in place."""
    lower, diag, upper, rhs = make_system(5, seed=46)
    d = diag.clone().requires_grad_()
    x = LapackTridiagonalSolve.apply(lower, d, upper, rhs.unsqueeze(-1).clone())
    loss = x.pow(2).sum()
    with torch.no_grad():
        x.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_package_backward_returns_every_gradient_and_autograd_drops_the_unneeded():
    """Section 4.4: the package's backward ignores ``ctx.needs_input_grad`` (it returns all four
    gradients), and autograd keeps only those of the inputs that need one."""
    lower, diag, upper, rhs = make_system(5, seed=54)
    returned = []

    class Recording(LapackTridiagonalSolve):
        @staticmethod
        def backward(ctx, grad_x):
            grads = LapackTridiagonalSolve.backward(ctx, grad_x)
            returned.extend(grads)
            return grads

    d = diag.clone().requires_grad_()
    Recording.apply(lower, d, upper, rhs.unsqueeze(-1)).pow(2).sum().backward()
    assert len(returned) == 4 and all(isinstance(g, torch.Tensor) for g in returned)
    expected = torch.autograd.grad(dense_solve(lower, d, upper, rhs).pow(2).sum(), d)[0]
    assert_close(d.grad, expected)
    assert lower.grad is None and upper.grad is None


def test_no_second_derivative():
    args = make_system(5, seed=47)
    with pytest.raises(GradcheckError, match="Jacobian mismatch"):
        torch.autograd.gradgradcheck(tridiagonal_solve_function, leaves(args))
    inputs = leaves(args)
    (grad_diag,) = torch.autograd.grad(tridiagonal_solve_function(*inputs).pow(2).sum(), inputs[1],
                                       create_graph=True)
    penalty = grad_diag.pow(2).sum()
    assert type(grad_diag.grad_fn).__name__ == "Error"
    assert torch.autograd.grad(penalty, inputs[1], allow_unused=True, retain_graph=True) == (None,)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(penalty, inputs[1], retain_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        penalty.backward()
    (plain,) = torch.autograd.grad(tridiagonal_solve_function(*inputs).sum(), inputs[1], create_graph=True)
    assert plain.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        plain.pow(2).sum().backward()
    assert torch.autograd.gradgradcheck(tt.tridiagonal_solve, leaves(args))



def test_autograd_grad_silently_drops_the_once_differentiable_term_when_another_path_exists():
    """Section 4.5(c): the Error node hangs off detached outputs, so torch.autograd.grad on a loss
    with another path to diag returns only that path's gradient, with no error; .backward() raises."""
    args = make_system(5, seed=47)
    inputs = leaves(args)
    (grad_diag,) = torch.autograd.grad(tridiagonal_solve_function(*inputs).pow(2).sum(), inputs[1],
                                       create_graph=True)
    total = grad_diag.pow(2).sum() + inputs[1].pow(2).sum()
    (second,) = torch.autograd.grad(total, inputs[1], retain_graph=True)
    assert torch.equal(second, 2 * inputs[1])
    d = args[1].clone().requires_grad_()
    (first,) = torch.autograd.grad(dense_solve(args[0], d, args[2], args[3]).pow(2).sum(), d, create_graph=True)
    (right,) = torch.autograd.grad(first.pow(2).sum() + d.pow(2).sum(), d)
    assert (second - right).abs().max() > 1e-3 * right.abs().max()
    with pytest.raises(RuntimeError, match="once_differentiable"):
        total.backward()


def test_without_once_differentiable_the_second_derivative_is_silently_wrong():
    """The same NumPy backward, undecorated: recorded only through the saved x, so v = A^{-T} g is
    a constant and the second derivative is wrong, with no error."""

    class Undecorated(LapackTridiagonalSolve):
        @staticmethod
        def backward(ctx, grad_x):
            return LapackTridiagonalSolve.backward.__wrapped__(ctx, grad_x)

    lower, diag, upper, rhs = make_system(5, seed=53)

    def second_derivative(solve):
        d = diag.clone().requires_grad_()
        (first,) = torch.autograd.grad(solve(lower, d, upper, rhs).pow(2).sum(), d, create_graph=True)
        return torch.autograd.grad(first.pow(2).sum(), d)[0]

    wrong = second_derivative(lambda lo, d, up, b: Undecorated.apply(lo, d, up, b.unsqueeze(-1)).squeeze(-1))
    right = second_derivative(dense_solve)
    assert (wrong - right).abs().max() > 1e-2 * right.abs().max()

@pytest.mark.slow
def test_numpy_in_forward_breaks_the_graph():
    args = make_system(5, seed=48)

    def loss(*a):
        return tridiagonal_solve_function(*a).pow(2).sum()

    explanation = torch._dynamo.explain(loss)(*args)
    assert explanation.graph_break_count > 0
    assert any(frame.filename.endswith("lapack.py") for frame in explanation.break_reasons[0].user_stack)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="ndarray") as info:
        torch.compile(loss, fullgraph=True)(*args)
    assert type(info.value).__name__ == "Unsupported"


def test_torch_func_grad_asks_for_setup_context():
    lower, diag, upper, rhs = make_system(5, seed=49)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda d: tridiagonal_solve_function(lower, d, upper, rhs).sum())(diag)


def test_cpu_only():
    meta = [torch.empty(s, dtype=torch.float64, device="meta") for s in (4, 5, 4, 5)]
    with pytest.raises(ValueError, match="CPU only"):
        tridiagonal_solve_function(*meta)
    with pytest.raises(TypeError, match="numpy"):
        LapackTridiagonalSolve.apply(*meta[:3], meta[3].unsqueeze(-1))
    out = tt.tridiagonal_solve(*meta)
    assert out.device.type == "meta" and out.shape == (5,) and out.dtype == torch.float64


@pytest.mark.slow
def test_the_break_count_follows_the_code_path_and_plain_numpy_is_traced():
    """A vector rhs adds two one-operation graphs (the wrapper's unsqueeze and squeeze) to the
    matrix rhs's four graphs; the breaks are at SciPy's wrapper or a branch, never at a NumPy reshape."""
    lower, diag, upper, rhs = make_system(5, seed=50)

    def loss(*a):
        return tridiagonal_solve_function(*a).pow(2).sum()

    def sizes(b):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(loss)(lower, diag, upper, b)
        assert explanation.graph_break_count == explanation.graph_count - 1
        return [sum(n.op in ("call_function", "call_method") for n in g.graph.nodes) for g in explanation.graphs], explanation

    vector_sizes, vector = sizes(rhs)
    matrix_sizes, matrix = sizes(torch.randn(5, 3, dtype=torch.float64))
    torch._dynamo.reset()
    # what each matrix-rhs graph holds: reshapes, slicing and ascontiguousarray, the finiteness test, the loss
    held = [" ".join(str(n.target) for n in g.graph.nodes if n.op in ("call_function", "call_method"))
            for g in matrix.graphs]
    assert len(held) == 4
    for graph, names in zip(held, [("reshape",), ("getitem", "ascontiguousarray"), ("isfinite", "all"),
                                   ("pow", "sum")]):
        assert all(name in graph for name in names), (graph, names)
    assert len(vector_sizes) == len(matrix_sizes) + 2
    assert vector_sizes[0] == vector_sizes[-2] == 1
    assert all(size > 0 for size in vector_sizes + matrix_sizes)
    stops = {reason.user_stack[-1].filename.split("/")[-1] for reason in vector.break_reasons}
    assert stops <= {"blas.py", "lapack.py"}


def _explain_the_lapack_loss():
    """Section 4.5(a)'s trace of the LAPACK Function's loss: explain's result, and the breaks
    Dynamo's counter recorded meanwhile."""
    lower, diag, upper, rhs = make_system(5, seed=55)

    def loss(*a):
        return tridiagonal_solve_function(*a).pow(2).sum()

    torch._dynamo.reset()
    counters.clear()
    explanation = torch._dynamo.explain(loss)(lower, diag, upper, rhs)
    at_calls = list(counters["graph_break"])
    torch._dynamo.reset()
    return explanation, at_calls


@pytest.mark.slow
def test_graphs_end_at_a_break_or_a_return_and_the_lapack_call_breaks_where_no_graph_ends():
    """Section 4.5(a): explain's break_reasons are the graphs that end at a break, fewer than
    graph_break_count; Dynamo's counter also holds the break at SciPy's compiled routine."""
    explanation, at_calls = _explain_the_lapack_loss()
    at_break = [graph.compile_subgraph_reason.graph_break for graph in explanation.graphs]
    assert 0 < sum(at_break) == len(explanation.break_reasons) < explanation.graph_break_count
    assert not at_break[-1]
    assert any("`fortran`" in message for message in at_calls)
    assert not any("fortran" in reason.reason for reason in explanation.break_reasons)
    assert type(scipy.linalg.lapack.dgtsv).__name__ == "fortran"


@pytest.mark.slow
def test_the_break_counter_misses_the_branch_and_dynamo_resumes_gtsv_after_the_lapack_call():
    """Section 4.5(a): the branch on array data is in break_reasons but not in Dynamo's counter of
    breaks (a branch, not a call); after the breaks, graphs are traced in the rest of a function
    that was running (the rest of gtsv, after the LAPACK call, among them) and the last graph is
    the rest of the loss."""
    explanation, at_calls = _explain_the_lapack_loss()
    assert any(reason.reason.startswith("generic_jump") for reason in explanation.break_reasons)
    assert not any("branch" in message or "jump" in message for message in at_calls)

    def traced_in(graph):
        first = next(node for node in graph.graph.nodes if node.op in ("call_function", "call_method"))
        return first.meta["stack_trace"].split(", in ")[-1].split()[0]

    functions = [traced_in(graph) for graph in explanation.graphs]
    assert any(name.startswith("torch_dynamo_resume_in_gtsv_at_") for name in functions), functions
    assert functions[-1].startswith("torch_dynamo_resume_in_loss_at_"), functions


@pytest.mark.slow
def test_the_first_graph_stops_at_the_function_call_and_the_numpy_conversions_are_in_no_graph():
    """Section 4.5(a)'s dropdown: the first graph holds only the wrapper's unsqueeze; Dynamo resumes
    tridiagonal_solve_function after the call (a graph with only its squeeze); no graph holds an
    operation of _lapack_solve (the .numpy() conversions) or of lapack.solve (its reshapes)."""
    explanation, _ = _explain_the_lapack_loss()

    def ops(graph):
        return [node for node in graph.graph.nodes if node.op in ("call_function", "call_method")]

    def innermost(node):
        return re.findall(r", in (\w+)", node.meta["stack_trace"])[-1]

    def name(node):
        return node.target if isinstance(node.target, str) else node.target.__name__

    first = explanation.graphs[0]
    assert [name(node) for node in ops(first)] == ["unsqueeze"], [name(n) for n in ops(first)]
    resumed = [graph for graph in explanation.graphs
               if innermost(ops(graph)[0]).startswith("torch_dynamo_resume_in_tridiagonal_solve_function_at_")]
    assert [[name(node) for node in ops(graph)] for graph in resumed] == [["squeeze"]]
    every = [node for graph in explanation.graphs for node in ops(graph)]
    assert not {name(node) for node in every} & {"detach", "resolve_conj", "resolve_neg", "numpy"}
    places = {re.sub(r"^torch_dynamo_resume_in_(\w+)_at_\d+$", r"\1", innermost(node)) for node in every}
    assert not places & {"_lapack_solve", "solve"}, places


@pytest.mark.slow
def test_the_lapack_function_breaks_alike_whether_or_not_its_inputs_require_grad():
    """Section 4.5(a) traces the LAPACK Function on inputs without grad and says the same graphs
    and break reasons come with inputs that require grad, the case of the Thomas run beside it."""
    system = make_system(5, seed=55)

    def loss(*a):
        return tridiagonal_solve_function(*a).pow(2).sum()

    found = []
    for requires_grad in (False, True):
        torch._dynamo.reset()
        args = [t.clone().requires_grad_(requires_grad) for t in system]
        explanation = torch._dynamo.explain(loss)(*args)
        found.append((explanation.graph_count,
                      [str(r.reason).splitlines()[0] for r in explanation.break_reasons]))
    torch._dynamo.reset()
    assert found[0] == found[1] and found[0][0] > 1 and found[0][1]


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(t):
        return t * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 2 * g


@pytest.mark.slow
def test_a_traceable_function_is_one_higher_order_operation_with_forward_and_backward():
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda t: _Double.apply(t).sum())(torch.randn(3, requires_grad=True))
    torch._dynamo.reset()
    (graph,) = explanation.graphs
    targets = [getattr(node.target, "__name__", str(node.target)) for node in graph.graph.nodes
               if node.op == "call_function"]
    assert targets.count("autograd_function_apply") == 1 and "mul" not in targets
    assert sorted(name.split("_")[0] for name, _ in graph.named_children()) == ["bwd", "fwd"]


def test_generate_vmap_rule_runs_forward_on_batched_tensors_that_numpy_cannot_read():
    class Generated(_Double):
        generate_vmap_rule = True

    class GeneratedNumpy(Generated):
        @staticmethod
        def forward(t):
            return torch.from_numpy(t.detach().numpy() * 2)

    batch = torch.randn(3, 4)
    assert_close(torch.func.vmap(Generated.apply)(batch), 2 * batch)
    with pytest.raises(RuntimeError, match="storage"):
        torch.func.vmap(GeneratedNumpy.apply)(batch)


def _thomas(lower, diag, upper, rhs):
    n = diag.shape[-1]
    c, y = [upper[0] / diag[0]], [rhs[0] / diag[0]]
    for i in range(1, n):
        denom = diag[i] - lower[i - 1] * c[i - 1]
        if i < n - 1:
            c.append(upper[i] / denom)
        y.append((rhs[i] - lower[i - 1] * y[i - 1]) / denom)
    x = [y[-1]]
    for i in range(n - 2, -1, -1):
        x.insert(0, y[i] - c[i] * x[0])
    return torch.stack(x)


@pytest.mark.slow
def test_a_python_loop_in_torch_ops_compiles_to_one_graph_per_n_growing_with_n():
    sizes = []

    def count(graph_module, example_inputs):
        sizes.append(sum(n.op in ("call_function", "call_method") for n in graph_module.graph.nodes))
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(_thomas, backend=count, fullgraph=True)
    for n in (5, 10, 5):
        args = make_system(n, seed=51, dominant=True)
        assert_close(compiled(*args), dense_solve(*args))
    torch._dynamo.reset()
    assert len(sizes) == 2 and sizes[1] > 1.5 * sizes[0]


def has_storage(t):
    """Whether a tensor has storage of its own (torch.func's wrappers have none)."""
    try:
        t.data_ptr()
        return True
    except RuntimeError:
        return False


class SavesItsInput(torch.autograd.Function):
    """The split form's setup_context, saving the one input, for the Functions below."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])


def test_vjp_fn_after_vjp_gets_plain_grad_x_and_saved_wrappers_that_detach_unwraps():
    lower, diag, upper, rhs = make_system(5, seed=52)
    seen = {}

    class Peek(SavesItsInput):
        @staticmethod
        def forward(d):
            return d * 2

        @staticmethod
        def backward(ctx, g):
            (saved,) = ctx.saved_tensors
            seen.update(grad=has_storage(g), saved=has_storage(saved), detached=has_storage(saved.detach()))
            return 2 * g

    _, vjp_fn = torch.func.vjp(Peek.apply, diag)
    vjp_fn(torch.ones_like(diag))
    assert seen == {"grad": True, "saved": False, "detached": True}
    torch.func.grad(lambda d: Peek.apply(d).sum())(diag)
    assert seen == {"grad": False, "saved": False, "detached": False}


def test_under_torch_func_grad_forward_gets_tensors_with_storage_and_backward_gets_wrappers():
    """Section 4.5(b): apply unwraps its inputs before forward, so forward may call .numpy(); the
    backward's incoming gradient and saved tensors are wrappers without storage."""
    lower, diag, upper, rhs = make_system(5, seed=52)
    seen = []

    class Peek(SavesItsInput):
        @staticmethod
        def forward(d):
            seen.append(("forward", has_storage(d)))
            return torch.from_numpy(d.detach().numpy() * 2)

        @staticmethod
        def backward(ctx, g):
            (saved,) = ctx.saved_tensors
            seen.append(("backward", has_storage(g) or has_storage(saved)))
            return Peek.apply(g)                    # calling the Function again is fine

    grad = torch.func.grad(lambda d: Peek.apply(d).sum())(diag)
    assert_close(grad, torch.full_like(diag, 2.0))
    assert seen == [("forward", True), ("backward", False), ("forward", True)]
