"""Chapter 5's claims about the custom op ``tridiag_tutorial::tridiagonal_solve``, recomputed: its
schema, the fake kernel's strides, the backward that calls the op, the dispatch table, the
``driver`` argument, the vmap rule, and where the op stops under ``torch.func``."""

from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op, tridiagonal_solve_op
from tridiag_tutorial.kernels import lapack, sequential
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, assert_grads_match_dense, make_system, torch_trap

NAME = "tridiag_tutorial::tridiagonal_solve"


def leaves(args):
    return [t.detach().clone().requires_grad_() for t in args]


def kernel_counts(fn):
    with mock.patch.object(lapack, "solve", wraps=lapack.solve) as lapack_solve, \
         mock.patch.object(sequential, "solve", wraps=sequential.solve) as torch_solve:
        fn()
    return lapack_solve.call_count, torch_solve.call_count


def test_schema_has_the_driver_and_no_mutation():
    schema = str(torch.ops.tridiag_tutorial.tridiagonal_solve.default._schema)
    assert "str? driver=None" in schema and "!" not in schema


@pytest.mark.parametrize("layout", ["C", "Fortran"])
def test_the_fake_kernel_gives_the_real_kernels_strides(layout):
    lower, diag, upper, rhs = make_system(6, (), 3, seed=50)
    if layout == "Fortran":
        rhs = rhs.mT.contiguous().mT
    real = tridiagonal_solve_op(lower, diag, upper, rhs)
    mode = FakeTensorMode()
    with mode:
        fake = tridiagonal_solve_op(*(mode.from_tensor(t) for t in (lower, diag, upper, rhs)))
    assert fake.shape == real.shape and fake.stride() == real.stride() == (3, 1)
    assert_close(real, dense_solve(lower, diag, upper, rhs))


def test_backward_calls_the_op_so_it_is_differentiable_twice():
    args = leaves(make_system(5, (), 2, seed=51))
    assert torch.autograd.gradcheck(tridiagonal_solve_op, args)
    assert torch.autograd.gradgradcheck(tridiagonal_solve_op, args)


@pytest.mark.slow
def test_one_graph_and_compiled_gradients_equal_the_dense_ones():
    args = leaves(make_system(6, (), 3, seed=52))

    def loss(*a):
        return tridiagonal_solve_op(*a).square().sum()

    assert torch._dynamo.explain(loss)(*args).graph_break_count == 0
    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*args), args)
    assert_grads_match_dense(grads, args, lambda x: x.square().sum())


def test_dispatch_table_has_one_entry_per_registration():
    keys = sorted(line.split(":")[0].removesuffix("[alias]")
                  for line in torch._C._dispatch_dump(NAME).splitlines()
                  if " registered at " in line and not line.startswith("debug:"))
    assert keys == ["Autograd", "CPU", "CompositeExplicitAutograd", "FuncTorchBatched", "Meta"]
    assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(NAME, "CUDA")


def test_the_driver_argument_picks_the_kernel_forward_and_backward():
    args = make_system(6, (), 3, seed=53)
    assert kernel_counts(lambda: tridiagonal_solve_op(*args)) == (1, 0)
    assert kernel_counts(lambda: tridiagonal_solve_op(*args, "sequential")) == (0, 1)
    with tridiagonal_solve_op.set_kernel_enabled("cpu", False):
        assert kernel_counts(lambda: tridiagonal_solve_op(*args)) == (0, 1)
    inputs = leaves(args)
    assert kernel_counts(lambda: torch.autograd.grad(
        tridiagonal_solve_op(*inputs, "sequential").square().sum(), inputs)) == (0, 2)
    for driver in (None, "sequential"):
        assert_close(tridiagonal_solve_op(*args, driver), dense_solve(*args))


def test_vmap_calls_the_kernel_once_and_equals_the_loop():
    many = make_system(6, (16,), 3, seed=54)
    loop = torch.stack([tridiagonal_solve_op(*(t[s] for t in many)) for s in range(16)])
    assert kernel_counts(lambda: torch.func.vmap(tridiagonal_solve_op)(*many)) == (1, 0)
    assert_close(torch.func.vmap(tridiagonal_solve_op)(*many), loop)
    rhs_last = many[3].movedim(0, -1)
    mixed = torch.func.vmap(tridiagonal_solve_op, in_dims=(None, 0, None, 2))(
        many[0][0], many[1], many[2][0], rhs_last)
    mixed_loop = torch.stack([tridiagonal_solve_op(many[0][0], many[1][s], many[2][0], rhs_last[..., s])
                              for s in range(16)])
    assert_close(mixed, mixed_loop)


def test_autograd_agrees_with_the_dense_reference():
    lower, diag, upper, rhs = make_system(6, seed=55)
    d = diag.clone().requires_grad_()
    (grad,) = torch.autograd.grad(tridiagonal_solve_custom_op(lower, d, upper, rhs).sum(), d)
    (expected,) = torch.autograd.grad(dense_solve(lower, d, upper, rhs).sum(), d)
    assert_close(grad, expected)


@torch_trap
def test_where_the_op_stops_under_torch_func():
    """torch 2.13: grad and jacrev raise; jvp and jacfwd return zero tangents without an error."""
    lower, diag, upper, rhs = make_system(6, seed=56)

    def solve_in_diag(d):
        return tridiagonal_solve_custom_op(lower, d, upper, rhs)

    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda d: solve_in_diag(d).sum())(diag)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.jacrev(solve_in_diag)(diag)
    u = torch.ones_like(diag)
    _, tangent = torch.func.jvp(solve_in_diag, (diag,), (u,))
    _, dense_tangent = torch.func.jvp(lambda d: dense_solve(lower, d, upper, rhs), (diag,), (u,))
    assert torch.all(tangent == 0) and dense_tangent.abs().max() > 1e-3
    assert torch.all(torch.func.jacfwd(solve_in_diag)(diag) == 0)


def test_redefining_a_custom_op_replaces_it_for_every_handle():
    @torch.library.custom_op("test_ch05::plus", mutates_args=())
    def plus(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    first = plus

    @torch.library.custom_op("test_ch05::plus", mutates_args=())
    def plus(x: torch.Tensor) -> torch.Tensor:  # noqa: F811 (the redefinition is the point)
        return x + 2

    x = torch.zeros(2)
    assert torch.equal(first(x), x + 2) and torch.equal(torch.ops.test_ch05.plus(x), x + 2)


def test_a_cpu_only_op_has_no_kernel_for_cuda():
    @torch.library.custom_op("test_ch05::cpu_only", mutates_args=(), device_types="cpu")
    def cpu_only(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    name = "test_ch05::cpu_only"
    assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU")
    assert not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CUDA")


@torch_trap
def test_the_vmap_fallback_warns_on_stderr_only(capfd):
    """torch 2.13: the fallback's TORCH_WARN reaches standard error, not Python's warnings."""
    import warnings

    @torch.library.custom_op("test_ch05::no_rule", mutates_args=())
    def no_rule(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.vmap(no_rule)(torch.ones(3, 2))
    err = capfd.readouterr().err
    python_warnings = [str(w.message) for w in caught]
    if torch.__version__.startswith("2.13."):  # the release the chapter runs: stderr only
        assert python_warnings == []
        assert "batching rule for test_ch05::no_rule" in err
    else:  # other releases may route it through Python's warnings; it must reach the user somewhere
        assert any("batching rule for test_ch05::no_rule" in text for text in [err, *python_warnings])


def test_opcheck_autograd_registration_passes_a_custom_op_without_backward():
    @torch.library.custom_op("test_ch05::no_backward", mutates_args=())
    def no_backward(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(2 * x.numpy())

    no_backward.register_fake(lambda x: torch.empty_like(x))
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    results = torch.library.opcheck(no_backward, (x,), test_utils="test_autograd_registration",
                                    raise_exception=False)
    assert results == {"test_autograd_registration": "SUCCESS"}
    with pytest.raises(RuntimeError, match="no autograd formula"):
        no_backward(x).sum().backward()


def test_an_op_without_device_types_claims_every_backend():
    """Section 5.5: the chapter's NumPy ops omit ``device_types``, so they claim CUDA and MPS too."""
    @torch.library.custom_op("test_ch05::numpy_everywhere", mutates_args=())
    def numpy_everywhere(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(2 * x.numpy())

    name = "test_ch05::numpy_everywhere"
    for key in ("CPU", "CUDA", "MPS"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, key)


def test_the_kernel_runs_with_grad_mode_off_when_an_input_requires_grad():
    """Section 5.2: why ``.numpy()`` works in the kernel on an input that requires grad."""
    seen = []

    @torch.library.custom_op("test_ch05::grad_mode", mutates_args=())
    def grad_mode(x: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), x.requires_grad))
        return torch.from_numpy(2 * x.numpy())

    grad_mode(torch.ones(2, dtype=torch.float64, requires_grad=True))
    assert seen == [(False, True)]


def test_the_generated_meta_kernel_raises_unless_the_op_mutates_and_returns_nothing():
    """Section 5.5: ``custom_op``'s ``Meta`` kernel without ``register_fake``."""
    @torch.library.custom_op("test_ch05::returns_nothing", mutates_args=())
    def returns_nothing(x: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("test_ch05::mutates_nothing_returned", mutates_args={"x"})
    def mutates(x: torch.Tensor) -> None:
        x.mul_(2)

    with pytest.raises(RuntimeError, match="no fake impl"):
        returns_nothing(torch.ones(2, device="meta"))
    assert mutates(torch.ones(2, device="meta")) is None


def test_a_dual_tensor_does_not_require_grad_and_cpu_tensors_carry_autograd_cpu():
    """Sections 5.5 and 5.8: the dispatch keys of a plain tensor, and a dual tensor's flag."""
    import torch.autograd.forward_ad as fwAD

    assert "AutogradCPU" in str(torch._C._dispatch_keys(torch.ones(2)))
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        assert not dual.requires_grad and fwAD.unpack_dual(dual).tangent is not None


def test_empty_like_with_contiguous_format_matches_new_empty():
    """Section 5.3: both fake kernels promise C order whatever ``rhs``'s strides are."""
    rhs_f = torch.randn(6, 3, dtype=torch.float64).mT.contiguous().mT
    assert rhs_f.stride() == (1, 6)
    assert torch.empty_like(rhs_f).stride() == (1, 6)
    assert (torch.empty_like(rhs_f, memory_format=torch.contiguous_format).stride()
            == rhs_f.new_empty(rhs_f.shape).stride() == (3, 1))


def test_the_autograd_kernel_records_only_when_grad_is_on_and_an_input_requires_grad():
    """Section 5.5: every CPU tensor carries ``AutogradCPU``; the ``Autograd`` kernel decides."""
    lower, diag, upper, rhs = make_system(6, (), 3, seed=57)
    assert "AutogradCPU" in str(torch._C._dispatch_keys(rhs))
    assert tridiagonal_solve_op(lower, diag, upper, rhs).grad_fn is None
    d = diag.clone().requires_grad_()
    assert tridiagonal_solve_op(lower, d, upper, rhs).grad_fn is not None
    with torch.no_grad():
        assert tridiagonal_solve_op(lower, d, upper, rhs).grad_fn is None


@pytest.mark.parametrize("driver", [None, "sequential", "partitioned"])
@pytest.mark.parametrize("layout", ["Fortran", "expanded"])
def test_opcheck_passes_the_package_op_on_other_rhs_layouts(driver, layout):
    """Section 5.7: the opcheck of cell 'B = 2', repeated on layouts that can hide a fake kernel's
    wrong strides (section 5.3): a column-major ``rhs``, and one expanded along the batch."""
    lower, diag, upper, rhs = make_system(6, (2,), 3, seed=58)
    rhs = rhs.mT.contiguous().mT if layout == "Fortran" else rhs[:1].expand(2, 6, 3)
    args = [*leaves((lower, diag, upper)), rhs.detach().requires_grad_()]
    results = torch.library.opcheck(tridiagonal_solve_op, (*args, driver), raise_exception=False)
    assert set(results.values()) == {"SUCCESS"}, results


def _template_source():
    """The Python block after '**Template.**' in section 5.9's Markdown."""
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "05_custom_op.ipynb"
    markdown = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                       if c["cell_type"] == "markdown")
    block = re.search(r"\*\*Template\.\*\*.*?```python\n(.*?)```", markdown, re.S)
    assert block, "section 5.9 has no template"
    return block.group(1)


def test_the_template_of_section_5_9_is_a_complete_op():
    """Section 5.9's template: CPU only, opcheck on three layouts, first and second derivatives
    against the dense solve, vmap with mixed in_dims."""
    namespace = {}
    exec(compile(_template_source(), "template", "exec"), namespace)
    solve = namespace["solve"]
    name = "mylib::solve"
    assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU")
    assert not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CUDA")

    lower, diag, upper, rhs = make_system(6, (2,), 3, seed=59)
    for b in (rhs, rhs.mT.contiguous().mT, rhs[:1].expand(2, 6, 3)):
        args = [*leaves((lower, diag, upper)), b.detach().requires_grad_()]
        results = torch.library.opcheck(solve, args, raise_exception=False)
        assert set(results.values()) == {"SUCCESS"}, results
    args = leaves((lower, diag, upper, rhs))
    assert_close(solve(*args), dense_solve(*args))
    assert torch.autograd.gradcheck(solve, args)
    assert torch.autograd.gradgradcheck(solve, args)
    loss = lambda x: x.square().sum()  # noqa: E731
    assert_grads_match_dense(torch.autograd.grad(loss(solve(*args)), args), args, loss)

    x = torch.func.vmap(solve, in_dims=(None, 0, None, 0))(lower[0], diag, upper[0], rhs)
    assert_close(x, dense_solve(lower[0].expand(2, 5), diag, upper[0].expand(2, 5), rhs))
