"""Chapter 6 (torch.compile checks): the claims the chapter makes, recomputed with the package.

The chapter prints its counts and differences, and nbval compares them; these tests check the
claims behind them on other inputs, and the ones the chapter states without printing.
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from tridiag_tutorial import rules, tridiagonal_solve
from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op, tridiagonal_solve_op
from tridiag_tutorial.reference import dense_solve

from conftest import torch_trap

CUSTOM_OP = "tridiag_tutorial.tridiagonal_solve.default"


def system(n, batch=(), seed=0, requires_grad=False):
    """A diagonally dominant float64 system (the chapter's make_system, another seed)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(*batch, n - 1, generator=g, dtype=torch.float64),
           4 + torch.randn(*batch, n, generator=g, dtype=torch.float64),
           torch.randn(*batch, n - 1, generator=g, dtype=torch.float64),
           torch.randn(*batch, n, generator=g, dtype=torch.float64)]
    return [t.requires_grad_() for t in out] if requires_grad else out


def loss_of(solve):
    def loss(lower, diag, upper, rhs):
        return solve(lower, diag, upper, rhs).square().sum()
    return loss


loss = loss_of(tridiagonal_solve_custom_op)


def rescaled_if(lower, diag, upper, rhs):
    x = tridiagonal_solve_custom_op(lower, diag, upper, rhs)
    biggest = x.abs().max()
    if biggest > 1:
        x = x / biggest
    return x.square().sum()


def rescaled_cond(lower, diag, upper, rhs):
    x = tridiagonal_solve_custom_op(lower, diag, upper, rhs)
    biggest = x.abs().max()
    x = torch.cond(biggest > 1, lambda x, b: x / b, lambda x, b: x.clone(), (x, biggest))
    return x.square().sum()


def test_the_op_is_one_node_of_one_graph():
    explained = torch._dynamo.explain(loss)(*system(7, seed=1))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    (graph,) = explained.graphs
    assert [str(n.target) for n in graph.graph.nodes].count(CUSTOM_OP) == 1


@pytest.mark.slow  # several compilations: a few seconds
def test_if_on_a_value_breaks_and_cond_serves_both_branches_in_one_graph():
    explained = torch._dynamo.explain(rescaled_if)(*system(6, seed=2))
    assert explained.graph_break_count == 1
    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(rescaled_cond, fullgraph=True, backend=counter)
    largest = []
    for scale in (1.0, 1000.0):
        lower, diag, upper, rhs = system(6, seed=2)
        inputs = [t.requires_grad_() for t in (lower, diag, upper, scale * rhs)]
        largest.append(tridiagonal_solve_custom_op(*inputs).abs().max().item())
        value, eager = compiled(*inputs), rescaled_if(*inputs)
        torch.testing.assert_close(value, eager)
        for g, e in zip(torch.autograd.grad(value, inputs), torch.autograd.grad(eager, inputs)):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    assert largest[0] < 1 < largest[1]  # each branch taken once
    assert counter.frame_count == 1


def test_forward_and_backward_graphs_each_call_the_op_once():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    recorded = {}

    def recording(name):
        def compiler(gm, example_inputs):
            recorded[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recording("forward"), bw_compiler=recording("backward"))
    inputs = system(9, seed=3, requires_grad=True)
    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(*inputs), inputs)
    assert set(recorded) == {"forward", "backward"}
    assert all(targets.count(CUSTOM_OP) == 1 for targets in recorded.values())
    for g, e in zip(grads, torch.autograd.grad(loss_of(dense_solve)(*inputs), inputs)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@torch_trap
def test_double_backward_through_a_compiled_function_raises():
    inputs = system(6, seed=4, requires_grad=True)
    first = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs),
                                inputs, create_graph=True)
    assert all(g.requires_grad for g in first)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(first[1].sum(), inputs)


@torch_trap
def test_a_gradient_penalty_through_a_compiled_loss_raises_for_the_op_and_the_dense_solve():
    """Section 6.2: a loss that contains gradients (a gradient penalty) needs double backward, so
    .backward() on it raises, even for the dense solve, whose grad returns None with allow_unused."""
    for solve in (tridiagonal_solve_custom_op, dense_solve):
        inputs = system(6, seed=10, requires_grad=True)
        compiled = torch.compile(loss_of(solve), fullgraph=True, backend="aot_eager")
        first = torch.autograd.grad(compiled(*inputs), inputs, create_graph=True)
        penalty = sum(g.square().sum() for g in first)
        with pytest.raises(RuntimeError, match="double backward"):
            penalty.backward()
        assert all(t.grad is None for t in inputs)
        torch.compiler.reset()


def test_eager_second_derivatives_of_the_custom_op():
    inputs = system(5, batch=(2,), seed=5, requires_grad=True)
    assert torch.autograd.gradgradcheck(loss, inputs)
    first = torch.autograd.grad(loss(*inputs), inputs, create_graph=True)
    second = torch.autograd.grad(first[1].sum(), inputs)
    dense = loss_of(dense_solve)
    first_dense = torch.autograd.grad(dense(*inputs), inputs, create_graph=True)
    for s, e in zip(second, torch.autograd.grad(first_dense[1].sum(), inputs)):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-12)


def test_the_second_derivatives_the_compiled_dense_solve_returns_as_none_are_not_zero():
    """Section 6.2's warning: the compiled dense solve's None second derivatives are wrong, because
    the eager ones (d/d inputs of the summed dL/ddiag) are not zero."""
    inputs = system(6, seed=6, requires_grad=True)
    dense = loss_of(dense_solve)
    first = torch.autograd.grad(dense(*inputs), inputs, create_graph=True)
    second = torch.autograd.grad(first[1].sum(), inputs)
    assert all(s.abs().max() > 1e-3 for s in second)


def test_the_documented_compiled_autograd_switch_compiles_the_backward_whole():
    """Section 6.2: with torch._dynamo.config.compiled_autograd on, a .backward() inside a compiled
    function reaches the function's own backend as one graph: the op once, one accumulation per input."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes])
        return gm.forward

    def loss_and_backward(lower, diag, upper, rhs):
        value = loss(lower, diag, upper, rhs)
        value.backward()
        return value.detach()

    torch.compiler.reset()
    inputs = system(9, seed=12, requires_grad=True)
    torch._dynamo.config.compiled_autograd = True
    try:
        torch.compile(loss_and_backward, backend=keep)(*inputs)
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch.compiler.reset()
    accumulate = "torch._dynamo.compiled_autograd.ops.AccumulateGrad"
    backward = [targets for targets in graphs if accumulate in targets]
    assert len(backward) == 1
    assert backward[0].count(accumulate) == 4 and backward[0].count(CUSTOM_OP) == 1
    dense = torch.autograd.grad(loss_of(dense_solve)(*inputs), inputs)
    for t, e in zip(inputs, dense):
        torch.testing.assert_close(t.grad, e, rtol=1e-10, atol=1e-12)


def count_compiles(sizes, mark_dynamic=False, **options):
    torch.compiler.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, **options)
    counts = []
    for n in sizes:
        inputs = system(n, seed=n)
        if mark_dynamic:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
        torch.testing.assert_close(compiled(*inputs), loss(*inputs))
        counts.append(counter.frame_count)
    return counts


@pytest.mark.slow  # several compilations: a few seconds
def test_recompilations_when_n_changes():
    sizes = [12, 13, 14, 15]
    assert count_compiles(sizes) == [1, 2, 2, 2]  # automatic dynamic: once static, once symbolic
    assert count_compiles(sizes, dynamic=False) == [1, 2, 3, 4]
    assert count_compiles(sizes, dynamic=True) == [1, 1, 1, 1]
    assert count_compiles(sizes, mark_dynamic=True) == [1, 1, 1, 1]


def test_the_recompiles_log_names_the_failed_guard():
    """What set_logs(graph_breaks=True, recompiles=True) logs, read from the records themselves: a
    handler on every torch logger that set_logs equipped (where torch's own handler writes, and to
    which stream, differs between releases)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep()
    torch.compiler.reset()
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    equipped = [logger for name, logger in list(logging.root.manager.loggerDict.items())
                if name.startswith("torch") and isinstance(logger, logging.Logger) and logger.handlers]
    for logger in equipped:
        logger.addHandler(keep)
    try:
        compiled = torch.compile(rescaled_if, backend="eager")
        compiled(*system(10, seed=6))
        compiled(*system(11, seed=7))
    finally:
        torch._logging.set_logs()
        for logger in equipped:
            logger.removeHandler(keep)
    text = "\n".join(records)
    assert "Recompiling function rescaled_if" in text
    assert "size mismatch at index 0. expected 10, actual 11" in text
    assert "Graph Break Reason" in text


class SolveNoJvp(torch.autograd.Function):
    @staticmethod
    def forward(lower, diag, upper, rhs):
        return tridiagonal_solve_op(lower, diag, upper, rhs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _ = inputs
        ctx.save_for_backward(lower, diag, upper, output)
        ctx.save_for_forward(lower, diag, upper, output)

    @staticmethod
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_backward(tridiagonal_solve_op, lower, diag, upper, x, grad_x)


class SolveWithJvp(SolveNoJvp):
    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs):
        lower, diag, upper, x = ctx.saved_tensors
        return rules.solve_jvp(tridiagonal_solve_op, lower, diag, upper, x,
                               d_lower, d_diag, d_upper, d_rhs)


@torch_trap
def test_a_function_with_jvp_does_not_compile_fullgraph_when_gradients_are_needed():
    lower, diag, upper, rhs = system(7, seed=8)
    inputs = [t.requires_grad_() for t in (lower, diag, upper, rhs.unsqueeze(-1))]
    no_jvp = lambda *a: SolveNoJvp.apply(*a).square().sum()  # noqa: E731
    with_jvp = lambda *a: SolveWithJvp.apply(*a).square().sum()  # noqa: E731
    value = torch.compile(no_jvp, fullgraph=True, backend="aot_eager")(*inputs)
    for g, e in zip(torch.autograd.grad(value, inputs), torch.autograd.grad(no_jvp(*inputs), inputs)):
        torch.testing.assert_close(g, e)
    torch.compiler.reset()
    with pytest.raises(Exception, match="jvp"):
        torch.compile(with_jvp, fullgraph=True, backend="aot_eager")(*inputs)
    torch.compiler.reset()
    plain = [t.detach() for t in inputs]
    torch.testing.assert_close(torch.compile(with_jvp, fullgraph=True, backend="aot_eager")(*plain),
                               with_jvp(*plain))
    torch.compiler.reset()
    with torch.no_grad():  # inputs requiring grad, but grad mode off: nothing to record, so it compiles
        value = torch.compile(with_jvp, fullgraph=True, backend="aot_eager")(*inputs)
    torch.compiler.reset()
    torch.testing.assert_close(value, with_jvp(*plain))
    with pytest.raises(NotImplementedError):
        torch.func.jvp(SolveNoJvp.apply, tuple(plain), tuple(torch.ones_like(t) for t in plain))


def test_the_final_op_compiles_fullgraph_and_has_forward_mode():
    inputs = system(8, seed=9, requires_grad=True)
    final = loss_of(tridiagonal_solve)
    value = torch.compile(final, fullgraph=True, backend="aot_eager")(*inputs)
    for g, e in zip(torch.autograd.grad(value, inputs), torch.autograd.grad(final(*inputs), inputs)):
        torch.testing.assert_close(g, e)
    primals = tuple(t.detach() for t in inputs)
    tangents = tuple(torch.randn_like(t) for t in primals)
    dense_tangent = torch.func.jvp(dense_solve, primals, tangents)[1]
    torch.testing.assert_close(torch.func.jvp(tridiagonal_solve, primals, tangents)[1], dense_tangent)
    # compiled, the jvp goes through the compiled path: one graph holding the op tridiag_tutorial::solve
    graphs = []

    def keep(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes])
        return gm.forward

    torch.compiler.reset()
    compiled_jvp = torch.compile(lambda p, t: torch.func.jvp(tridiagonal_solve, p, t)[1],
                                 fullgraph=True, backend=keep)
    torch.testing.assert_close(compiled_jvp(primals, tangents), dense_tangent)
    torch.compiler.reset()
    assert len(graphs) == 1 and any(t.startswith("tridiag_tutorial.solve.") for t in graphs[0])


# The implicit smoother of section 6.5, on its own seeds.
N_POINTS = 64
T_GRID = torch.linspace(0, 1, N_POINTS, dtype=torch.float64)


def make_signals(seed, count):
    g = torch.Generator().manual_seed(seed)
    modes = torch.stack([torch.sin(j * torch.pi * T_GRID) for j in (1, 2, 3)], dim=-1)
    clean = (modes @ torch.randn(3, count, generator=g, dtype=torch.float64)
             + (T_GRID > 0.6).double().unsqueeze(-1) * torch.randn(count, generator=g, dtype=torch.float64))
    return clean, clean + 0.2 * torch.randn(clean.shape, generator=g, dtype=torch.float64)


def smooth(theta, noisy):
    w = F.softplus(theta)
    zero = w.new_zeros(1)
    return tridiagonal_solve_custom_op(-w, 1 + torch.cat([w, zero]) + torch.cat([zero, w]), -w, noisy)


def train(loss_fn, steps=60):
    theta = torch.zeros(N_POINTS - 1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([theta], lr=0.1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad()
        value = loss_fn(theta)
        value.backward()
        optimizer.step()
        history.append(value.detach())
    return torch.stack(history), theta.detach()


def test_compiled_training_follows_eager_and_learns_the_step():
    clean, noisy = make_signals(seed=10, count=16)
    smoother_loss = lambda theta: (smooth(theta, noisy) - clean).square().mean()  # noqa: E731
    history, theta = train(smoother_loss)
    torch.compiler.reset()
    history_c, theta_c = train(torch.compile(smoother_loss, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(history_c, history, rtol=1e-9, atol=0)
    torch.testing.assert_close(theta_c, theta, rtol=1e-9, atol=1e-12)

    weights = F.softplus(theta)
    edge = int((T_GRID > 0.6).nonzero()[0]) - 1
    others = torch.cat([weights[:edge], weights[edge + 1:]])
    assert weights[edge] < others.min() / 4

    clean_test, noisy_test = make_signals(seed=11, count=64)

    def test_error(th):
        return (smooth(th, noisy_test) - clean_test).square().mean().item()

    best_single = min(test_error(torch.full_like(theta, c)) for c in torch.linspace(-3, 4, 36).tolist())
    assert test_error(theta) < 0.9 * best_single < 0.9 * test_error(torch.zeros_like(theta))


@pytest.mark.slow  # compiles twice
@torch_trap
def test_one_break_splits_the_backward_into_two_compiled_graphs():
    """Section 6.3: with gradients, each piece around a break gets its own compiled backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def prepare(a, theta, c, b):
        return 0.5 * a.clamp(-1, 1), 3.0 + theta * theta, 0.5 * c.clamp(-1, 1), 2.0 * b + 1.0

    def workload(break_before_solve):
        def f(a, theta, c, b):
            bands = prepare(a, theta, c, b)
            if break_before_solve:
                torch._dynamo.graph_break()
            return tridiagonal_solve_custom_op(*bands).square().sum()
        return f

    backward_graphs = {}
    for broken in (False, True):
        count = []

        def bw_compiler(gm, example_inputs, count=count):
            count.append(gm)
            return make_boxed_func(gm.forward)

        backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                               bw_compiler=bw_compiler)
        torch.compiler.reset()
        inputs = system(12, seed=5, requires_grad=True)
        grads = torch.autograd.grad(torch.compile(workload(broken), backend=backend)(*inputs), inputs)
        eager = torch.autograd.grad(workload(False)(*inputs), inputs)
        for g, e in zip(grads, eager):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
        backward_graphs[broken] = len(count)
    torch.compiler.reset()
    assert backward_graphs == {False: 1, True: 2}


def test_after_warm_up_the_timed_calls_run_compiled_graphs_without_compiling():
    """Section 6.3 times under set_stance("fail_on_recompile"): warmed-up calls run the graphs
    already compiled, and a call that needed a new graph would raise instead of compiling."""
    torch.compiler.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend=counter)
    for requires_grad in (False, True):  # warm-up: one graph each
        compiled(*system(9, requires_grad=requires_grad))
    assert counter.frame_count == 2
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (9, 50):  # dynamic=True: another size needs no new graph
            for requires_grad in (False, True):
                inputs = system(n, seed=3, requires_grad=requires_grad)
                torch.testing.assert_close(compiled(*inputs), loss(*inputs))
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            compiled(*[t.float() for t in system(9)])  # float32: a guard fails
    assert counter.frame_count == 2
    torch.compiler.reset()


@torch_trap
def test_the_dense_compiled_backward_saves_no_input_so_second_derivatives_are_none():
    """Section 6.2: the op's compiled backward takes the input bands (so double backward raises);
    the dense solve's takes only tensors computed in the forward graph, so its second derivatives
    come back None with allow_unused=True, and without it grad raises that an input was unused."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    placeholders = {}
    for name, solve in [("op", tridiagonal_solve_custom_op), ("dense", dense_solve)]:
        def bw_compiler(gm, example_inputs, name=name):
            placeholders[name] = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
            return make_boxed_func(gm.forward)

        backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                               bw_compiler=bw_compiler)
        inputs = system(6, seed=6, requires_grad=True)
        first = torch.autograd.grad(torch.compile(loss_of(solve), fullgraph=True, backend=backend)(*inputs),
                                    inputs, create_graph=True)
        if name == "dense":
            assert all(g is None for g in torch.autograd.grad(first[1].sum(), inputs, allow_unused=True))
            with pytest.raises(RuntimeError, match="not have been used"):
                torch.autograd.grad(first[1].sum(), inputs)
        torch.compiler.reset()
    assert sum(p.startswith("primals") for p in placeholders["op"]) == 3  # lower, diag, upper
    assert not any(p.startswith("primals") for p in placeholders["dense"])


@torch_trap
def test_chapter_4_compiled_dynamic_makes_13_graphs_for_both_grad_settings():
    """Section 6.3: explain counts 7 graphs; compiled with dynamic=True the size reads add graphs,
    and the pieces inside the Function's forward serve both grad settings (13, not 2 x 7)."""
    from tridiag_tutorial.book.autograd_function import tridiagonal_solve_function

    def workload(a, theta, c, b):
        lower, diag, upper, rhs = 0.5 * a.clamp(-1, 1), 3.0 + theta * theta, 0.5 * c.clamp(-1, 1), 2.0 * b + 1.0
        x = tridiagonal_solve_function(lower, diag, upper, rhs)
        return (x * x).sum()

    torch.compiler.reset()
    assert torch._dynamo.explain(workload)(*system(100)).graph_count == 7
    torch.compiler.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(workload, dynamic=True, backend=counter)
    inputs = system(100, requires_grad=True)
    torch.autograd.grad(compiled(*inputs), inputs)
    with_grad = counter.frame_count
    compiled(*system(100))
    assert (with_grad, counter.frame_count) == (9, 13)
    torch.compiler.reset()


@torch_trap
def test_a_function_with_jvp_compiles_with_a_graph_break_without_fullgraph():
    """Section 6.6: without fullgraph=True, Dynamo breaks the graph at the Function with a jvp,
    and the compiled gradients equal eager mode's."""
    lower, diag, upper, rhs = system(7, seed=9)
    inputs = [t.requires_grad_() for t in (lower, diag, upper, rhs.unsqueeze(-1))]
    with_jvp = lambda *a: SolveWithJvp.apply(*a).square().sum()  # noqa: E731
    torch.compiler.reset()
    assert torch._dynamo.explain(with_jvp)(*inputs).graph_count == 2
    torch.compiler.reset()
    value = torch.compile(with_jvp, backend="aot_eager")(*inputs)
    for g, e in zip(torch.autograd.grad(value, inputs), torch.autograd.grad(with_jvp(*inputs), inputs)):
        torch.testing.assert_close(g, e)
    torch.compiler.reset()


def test_the_symbolic_graph_serves_later_sizes_from_3_but_not_2():
    """Section 6.4: after automatic dynamic shapes recompile with n symbolic, that graph serves
    every later size n >= 3; n = 2 gives lower and upper one element, which Dynamo does not make
    symbolic (exercise 2), so it compiles again."""
    torch.compiler.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    counts = []
    for n in (8, 9, 10, 3, 17, 2):
        inputs = system(n, seed=n)
        torch.testing.assert_close(compiled(*inputs), loss(*inputs))
        counts.append(counter.frame_count)
    torch.compiler.reset()
    assert counts == [1, 2, 2, 2, 2, 3]


def test_the_compiled_graph_calls_the_op_without_its_python_autograd_layer():
    """Section 6.3: eager, a step with gradients runs the op's generated autograd Function (a
    profiler row GeneratedBackwardFor_...); the compiled graph calls the op below that layer."""
    from torch.profiler import ProfilerActivity, profile

    inputs = system(50, seed=13, requires_grad=True)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.autograd.grad(compiled(*inputs), inputs)  # compile outside the profile
    keys = {}
    for name, fn in [("eager", loss), ("compiled", compiled)]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(fn(*inputs), inputs)
        keys[name] = [e.key for e in prof.key_averages()]
    torch.compiler.reset()
    layer = "GeneratedBackwardFor_tridiag_tutorial_tridiagonal_solve"
    assert any(k.startswith(layer) for k in keys["eager"])
    assert not any(k.startswith(layer) for k in keys["compiled"])
    assert any(k == "tridiag_tutorial::tridiagonal_solve" for k in keys["compiled"])


@pytest.mark.slow  # Inductor generates and builds C++
def test_inductor_cpu_kernels_get_profiler_rows_with_kernel_profiling_on():
    """Section 6.3 names the tool: with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 (the config
    cpp.enable_kernel_profile), each CPU kernel Inductor generates gets a profiler row of its own."""
    from torch._inductor import config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    def prepare_sum(a, b):
        return (0.5 * a.clamp(-1, 1) * b + 1.0).sum()

    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    rows = {}
    for enabled in (False, True):
        torch.compiler.reset()
        with inductor_config.patch({"cpp.enable_kernel_profile": enabled}):
            compiled = torch.compile(prepare_sum, fullgraph=True)
            compiled(a, b)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                torch.testing.assert_close(compiled(a, b), prepare_sum(a, b))
        rows[enabled] = [e.key for e in prof.key_averages() if "cpp_fused" in e.key]
    torch.compiler.reset()
    assert rows[False] == [] and len(rows[True]) >= 1
