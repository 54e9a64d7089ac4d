"""Chapter 7 (torch.func and forward mode): the claims the chapter makes, recomputed.

The chapter prints its results and nbval compares them; these tests check the claims behind them
on other inputs.
"""

import gc
import inspect
import json
import re
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tridiag_tutorial import api, functions, to_dense, tridiagonal_solve
from tridiag_tutorial.kernels import compiled

from conftest import make_system, torch_trap

F64 = torch.float64
needs_cpp = pytest.mark.skipif(not compiled.is_available(), reason="the C++ kernel is not built")


def chain_loss(x):
    return (torch.sin(x) ** 2 * torch.exp(x)).sum()


def with_backward(x):
    x = x.detach().requires_grad_()
    chain_loss(x).backward()
    return x.grad


def with_autograd_grad(x, create_graph=False):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(chain_loss(x), x, create_graph=create_graph)[0]


@pytest.mark.slow  # the profiler starts slowly
@torch_trap
def test_profiler_who_frees_the_saved_arrays():
    """.backward(): mostly the backward nodes; torch.func.grad: mostly outside any operator."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.linspace(-1.0, 1.0, 100_000, dtype=F64)
    freed = {}
    for label, fn in ((".backward()", with_backward), ("grad", grad(chain_loss))):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(x)
        rows = [(r.key, r.self_cpu_memory_usage) for r in prof.key_averages()]
        freed[label] = (-sum(b for k, b in rows if b < 0 and "Backward" in k),
                        -sum(b for k, b in rows if b < 0 and "Backward" not in k))
    assert freed[".backward()"][0] > freed[".backward()"][1]
    assert freed["grad"][1] > freed["grad"][0]


def storages(*trees):
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
            for t in tree_leaves(trees) if isinstance(t, torch.Tensor)}


class PeakTensorBytes(TorchDispatchMode):
    def __enter__(self):
        self.live, self.peak = {}, 0
        gc.collect()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc_info):
        gc.enable()
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ref: n for ref, n in self.live.items() if not ref.expired()}
        inputs = storages(args, kwargs)
        self.live.update({ref: n for ref, n in storages(out).items() if ref not in inputs})
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def peak(fn, x):
    with PeakTensorBytes() as tracker:
        fn(x)
    return tracker.peak


def test_peak_tensor_bytes_counts_a_new_tensor():
    with PeakTensorBytes() as tracker:
        torch.ones(1000, dtype=F64)
    assert tracker.peak == 8000


@pytest.mark.slow  # four collections of the garbage collector
@torch_trap
def test_torch_func_grad_peaks_higher_than_backward():
    x = torch.linspace(-1.0, 1.0, 10_000, dtype=F64)
    backward, autograd_grad = peak(with_backward, x), peak(with_autograd_grad, x)
    func_grad = peak(grad(chain_loss), x)
    kept = peak(lambda t: with_autograd_grad(t, create_graph=True), x)
    assert backward == autograd_grad < func_grad <= kept


@needs_cpp
def test_vmap_calls_the_kernel_once_and_jacobians_batch_their_columns():
    n, batch = 7, 4
    lower, diag, upper, rhs = make_system(n, (batch,), seed=1)
    with mock.patch.object(compiled, "solve", wraps=compiled.solve) as counted:
        vmap(tridiagonal_solve)(lower, diag, upper, rhs)
    assert counted.call_count == 1

    l1, d1, u1, b1 = (t[0] for t in (lower, diag, upper, rhs))

    def columns(fn):
        with mock.patch.object(compiled, "solve", wraps=compiled.solve) as counted:
            fn()
        return sum(c.args[3].numel() // c.args[3].shape[-2] for c in counted.call_args_list)

    loss_d = lambda d: tridiagonal_solve(l1, d, u1, b1).square().sum()  # noqa: E731
    x_of_shift = lambda s: tridiagonal_solve(l1, d1 + s, u1, b1)  # noqa: E731
    s0 = torch.tensor(0.0, dtype=F64)
    # a scalar of n inputs: one reverse pass, n forward passes; n outputs of a scalar: the opposite
    assert columns(lambda: jacrev(loss_d)(d1)) == 2
    assert columns(lambda: jacfwd(loss_d)(d1)) == 1 + n
    assert columns(lambda: jacfwd(x_of_shift)(s0)) == 2
    assert columns(lambda: jacrev(x_of_shift)(s0)) == 1 + n
    # a Hessian-vector product solves a fixed number of columns, the Hessian O(n)
    u = torch.randn(n, dtype=F64)
    assert columns(lambda: jvp(grad(loss_d), (d1,), (u,))) < columns(lambda: hessian(loss_d)(d1))
    l2, d2, u2, b2 = make_system(2 * n, seed=6)
    loss_2n = lambda d: tridiagonal_solve(l2, d, u2, b2).square().sum()  # noqa: E731
    assert columns(lambda: jvp(grad(loss_2n), (d2,), (torch.ones_like(d2),))) == columns(
        lambda: jvp(grad(loss_d), (d1,), (u,)))
    assert columns(lambda: hessian(loss_2n)(d2)) > columns(lambda: hessian(loss_d)(d1))


def dense_routes():
    return {
        "linalg.solve": torch.linalg.solve,
        "inv": lambda A, b: torch.linalg.inv(A) @ b,
        "lu": lambda A, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(A), b[:, None])[:, 0],
    }


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@torch_trap
def test_dense_forward_over_forward_wrong_only_for_linalg_solve():
    """linalg.solve's JVP reuses non-differentiable LU factors; inv and lu_factor + lu_solve do not.
    hessian (forward over reverse) never differentiates that JVP, so it is right on all three."""
    lower, diag, upper, rhs = make_system(7, seed=2)
    target = torch.randn(7, dtype=F64, generator=torch.Generator().manual_seed(3))

    def loss_with(solve):
        return lambda d: 0.5 * (solve(to_dense(lower, d, upper), rhs) - target).square().sum()

    H = hessian(lambda d: 0.5 * (tridiagonal_solve(lower, d, upper, rhs) - target).square().sum())(diag)
    f = loss_with(torch.linalg.solve)
    h = 1e-5
    H_central = torch.stack([(grad(f)(diag + h * e) - grad(f)(diag - h * e)) / (2 * h)
                             for e in torch.eye(7, dtype=F64)])
    assert relative(H, H_central) < 1e-6
    for name, solve in dense_routes().items():
        f = loss_with(solve)
        for nesting in (lambda g: jacfwd(jacfwd(g)), lambda g: jacrev(jacfwd(g))):
            error = relative(nesting(f)(diag), H)
            assert (error > 0.01) if name == "linalg.solve" else (error < 1e-10), (name, error)
        # forward over reverse only applies the tangent rule: right on every route
        assert relative(hessian(f)(diag), H_central) < 1e-6, name


def test_the_op_refuses_forward_over_forward():
    lower, diag, upper, rhs = make_system(6, seed=4)
    loss = lambda d: tridiagonal_solve(lower, d, upper, rhs).square().sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="hessian"):
        jacfwd(jacfwd(loss))(diag)
    torch.testing.assert_close(jacrev(jacfwd(loss))(diag), hessian(loss)(diag))


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad_output

    @staticmethod
    def jvp(ctx, x_dot):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * x_dot


@torch_trap
def test_a_functions_jvp_is_not_differentiated_at_an_outer_forward_level():
    x, one = torch.tensor(1.5, dtype=F64), torch.tensor(1.0, dtype=F64)

    def first(t):
        return jvp(Cube.apply, (t,), (torch.ones_like(t),))[1]

    assert jvp(first, (x,), (one,))[1].item() == 0.0  # should be 6 x = 9
    assert grad(first)(x).item() == pytest.approx(9.0)
    assert jvp(grad(Cube.apply), (x,), (one,))[1].item() == pytest.approx(9.0)


def test_generate_vmap_rule_batches_the_cube():
    class CubeV(Cube):
        generate_vmap_rule = True

    xs = torch.tensor([0.5, -1.0, 2.5], dtype=F64)
    torch.testing.assert_close(vmap(grad(CubeV.apply))(xs), 3 * xs**2)
    torch.testing.assert_close(jacfwd(CubeV.apply)(xs), torch.diag(3 * xs**2))
    with pytest.raises(RuntimeError, match="vmap"):
        vmap(Cube.apply)(xs)


def test_without_a_vmap_rule_jacfwd_and_hessian_raise_but_jacrev_runs():
    """Section 7.7: jacfwd and hessian vmap the Function itself and need its batching rule; jacrev
    vmaps only the backward, plain torch operations for the cube, and runs without one."""
    xs = torch.tensor([0.5, -1.0, 2.5], dtype=F64)
    torch.testing.assert_close(jacrev(Cube.apply)(xs), torch.diag(3 * xs**2))
    for transform in (jacfwd(Cube.apply), hessian(lambda t: Cube.apply(t).sum())):
        with pytest.raises(RuntimeError, match="does not have vmap support"):
            transform(xs)


def test_complex_gradient_uses_the_conjugate_transpose():
    args = [t.requires_grad_() for t in make_system(7, dtype=torch.complex128, seed=5)]
    x = tridiagonal_solve(*args)
    (g_rhs,) = torch.autograd.grad(x.abs().square().sum(), args[3])
    A = to_dense(*(t.detach() for t in args[:3]))
    g = 2 * x.detach()
    torch.testing.assert_close(g_rhs, torch.linalg.solve(A.mH, g))
    assert relative(g_rhs, torch.linalg.solve(A.mT, g)) > 0.1
    # torch.func.grad follows the same convention as torch.autograd.grad
    lower, diag, upper, rhs = (t.detach() for t in args)
    func_g = grad(lambda b: tridiagonal_solve(lower, diag, upper, b).abs().square().sum())(rhs)
    torch.testing.assert_close(func_g, g_rhs)


@needs_cpp
def test_only_autograd_with_driver_none_takes_the_cpp_fast_path():
    """The chapter's contrast: driver=None without a transform takes the fast path (_CppSolve);
    driver='cpp' and every torch.func transform take the general path."""
    import tridiag_tutorial.api as api

    lower, diag, upper, rhs = make_system(8, seed=3)
    loss = lambda d, **kw: tridiagonal_solve(lower, d, upper, rhs, **kw).square().sum()  # noqa: E731

    def fast_calls(fn):
        with mock.patch.object(api, "_CPP_SOLVE_APPLY", wraps=api._CPP_SOLVE_APPLY) as counted:
            fn()
        return counted.call_count

    leaf = diag.clone().requires_grad_()
    assert fast_calls(lambda: torch.autograd.grad(loss(leaf), leaf)) == 1
    assert fast_calls(lambda: torch.autograd.grad(loss(leaf, driver="cpp"), leaf)) == 0
    assert fast_calls(lambda: grad(loss)(diag)) == 0
    assert fast_calls(lambda: vmap(grad(loss))(diag.expand(3, -1).clone())) == 0


def test_complex_jvp_is_the_tangent_rule():
    """Section 7.8: for complex inputs, jvp's tangent is A^{-1} (db - dA x), unchanged."""
    lower, diag, upper, rhs = make_system(7, dtype=torch.complex128, seed=8)
    tangents = tuple(make_system(7, dtype=torch.complex128, seed=9))
    x, x_dot = jvp(tridiagonal_solve, (lower, diag, upper, rhs), tangents)
    A, dA = to_dense(lower, diag, upper), to_dense(*tangents[:3])
    assert relative(x_dot, torch.linalg.solve(A, tangents[3] - dA @ x)) < 1e-10
    # the conjugated rule is a different vector: the check can fail
    assert relative(x_dot.conj(), torch.linalg.solve(A, tangents[3] - dA @ x)) > 0.01


def test_grad_calls_the_function_again_in_its_backward():
    """Section 7.11's split: torch.func.grad, like autograd.grad with create_graph=True, calls the
    op's autograd.Function in the forward and again in the backward; without create_graph the
    backward calls the kernel directly."""
    lower, diag, upper, rhs = make_system(8, seed=11)
    loss = lambda d: tridiagonal_solve(lower, d, upper, rhs, driver="lapack").square().sum()  # noqa: E731

    def calls(fn):
        phases = []
        apply = functions._apply

        def counted(*args):
            phases.append("backward" if torch._C._current_graph_task_id() != -1 else "forward")
            return apply(*args)

        with mock.patch.object(api, "_apply", counted), mock.patch.object(functions, "_apply", counted):
            fn()
        return phases

    def with_autograd(create_graph):
        leaf = diag.clone().requires_grad_()
        return lambda: torch.autograd.grad(loss(leaf), leaf, create_graph=create_graph)

    assert calls(lambda: grad(loss)(diag)) == ["forward", "backward"]
    assert calls(with_autograd(create_graph=True)) == ["forward", "backward"]
    assert calls(with_autograd(create_graph=False)) == ["forward"]


CHAPTER = Path(__file__).resolve().parents[1] / "notebooks" / "07_torch_func.ipynb"


def shown_block(starts_with):
    """The fenced Python block of the chapter's markdown whose code starts with ``starts_with``."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    blocks = [block for c in cells if c["cell_type"] == "markdown"
              for block in re.findall(r"```python\n(.*?)```", "".join(c["source"]), re.S)]
    (block,) = [b for b in blocks if b.startswith(starts_with)]
    return block


def test_the_hand_written_cube_vmap_rule_the_chapter_shows_batches_every_transform():
    """Section 7.7 shows a hand-written vmap staticmethod for the cube: run that text."""
    scope = {"Cube": Cube}
    exec(shown_block("class CubeBatched(Cube):"), scope)
    cube = scope["CubeBatched"].apply
    xs = torch.tensor([0.5, -1.0, 2.5], dtype=F64)
    torch.testing.assert_close(vmap(cube)(xs), xs**3)
    torch.testing.assert_close(vmap(cube, in_dims=1)(xs[None]), (xs**3)[:, None])
    torch.testing.assert_close(vmap(grad(cube))(xs), 3 * xs**2)
    torch.testing.assert_close(jacfwd(cube)(xs), torch.diag(3 * xs**2))
    assert hessian(cube)(torch.tensor(2.0, dtype=F64)).item() == pytest.approx(12.0)


def test_the_batch_rule_the_chapter_shows_is_the_packages():
    """Section 7.7 quotes functions._batch_rule without its docstring: it must be the current code."""
    source = inspect.getsource(functions._batch_rule)
    without_docstring = re.sub(r'\n    """.*?"""\n', "\n", source, count=1, flags=re.S)
    assert without_docstring != source
    assert shown_block("def _batch_rule(") == without_docstring


@pytest.mark.slow  # three collections of the garbage collector
@torch_trap
def test_create_graph_raises_the_peak_by_retaining_and_by_recording():
    """Section 7.11: create_graph=True implies retain_graph=True (the forward's saved arrays stay)
    and records the backward; each alone raises the peak over a plain autograd.grad."""
    x = torch.linspace(-1.0, 1.0, 10_000, dtype=F64)

    def retained(t):
        t = t.detach().requires_grad_()
        return torch.autograd.grad(chain_loss(t), t, retain_graph=True)[0]

    plain, kept = peak(with_autograd_grad, x), peak(retained, x)
    recorded = peak(lambda t: with_autograd_grad(t, create_graph=True), x)
    assert plain < kept < recorded


@pytest.mark.slow  # three collections of the garbage collector
@torch_trap
def test_grad_peaks_below_create_graph_because_it_does_not_retain_the_graph():
    """Section 7.11: torch.func.grad's backward passes create_graph=True but retain_graph=False, so it
    peaks like autograd.grad called that way, below autograd.grad's create_graph=True (which retains)."""
    source = inspect.getsource(torch._functorch.eager_transforms._autograd_grad)
    assert re.search(r"retain_graph: bool = False", source)
    x = torch.linspace(-1.0, 1.0, 10_000, dtype=F64)

    def not_retained(t):
        t = t.detach().requires_grad_()
        return torch.autograd.grad(chain_loss(t), t, create_graph=True, retain_graph=False)[0]

    func_grad = peak(grad(chain_loss), x)
    kept = peak(lambda t: with_autograd_grad(t, create_graph=True), x)
    assert func_grad == peak(not_retained, x) < kept


def test_the_backward_and_jvp_the_chapter_shows_are_the_packages():
    """Section 7.7 quotes _TridiagonalSolve.backward and .jvp and the forward-over-forward check."""
    parts = (functions._TridiagonalSolve.backward, functions._TridiagonalSolve.jvp,
             functions._check_not_forward_over_forward)
    current = "\n".join(textwrap.dedent(inspect.getsource(part)) for part in parts)
    assert shown_block("@staticmethod\ndef backward(") == current
