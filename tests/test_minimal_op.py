"""Chapter 8's minimal operator (tridiag_tutorial.book.minimal_op): right answers, or a clear error."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from tridiag_tutorial.book import minimal_op
from tridiag_tutorial.book.minimal_op import SolveFunction, _solve_op, solve
from tridiag_tutorial.reference import to_dense

from conftest import torch_trap

F64 = torch.float64


def system(n=7, batch=(), dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)
    sign = torch.where(torch.rand(*batch, n, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    return randn(*batch, n - 1), (1.5 + randn(*batch, n).abs()) * sign, randn(*batch, n - 1), randn(*batch, n)


def dense(dl, d, du, b):
    """The dense reference: inv(A) @ b (torch.linalg.solve is wrong under some nested transforms)."""
    return (torch.linalg.inv(to_dense(dl, d, du)) @ b.unsqueeze(-1)).squeeze(-1)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [F64, torch.complex128])
def test_values_match_the_dense_solve(dtype):
    args = system(9, batch=(3,), dtype=dtype)
    close(solve(*args), dense(*args))


@pytest.mark.slow
def test_opcheck_passes():
    args = [t.requires_grad_() for t in system(6, batch=(2,))]
    result = torch.library.opcheck(_solve_op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_gradcheck_reverse_and_forward():
    args = [t.requires_grad_() for t in system(5)]
    assert torch.autograd.gradcheck(solve, args, check_forward_ad=True, check_batched_grad=True,
                                    check_batched_forward_grad=True)
    assert torch.autograd.gradgradcheck(solve, args, check_fwd_over_rev=True)


def test_dense_gradients_match():
    dl, d, du, b = system(6)
    loss = lambda f: (lambda *a: f(*a).pow(3).sum())
    for got, want in zip(grad(loss(solve), argnums=(0, 1, 2, 3))(dl, d, du, b),
                         grad(loss(dense), argnums=(0, 1, 2, 3))(dl, d, du, b)):
        close(got, want)


def test_transforms_match_the_dense_reference():
    dl, d, du, b = system(6)
    of_d = lambda f: (lambda x: f(dl, x, du, b))
    cube = lambda f: (lambda x: f(dl, x, du, b).pow(3).sum())
    close(jacrev(of_d(solve))(d), jacrev(of_d(dense))(d))
    close(jacfwd(of_d(solve))(d), jacrev(of_d(dense))(d))
    close(jvp(of_d(solve), (d,), (torch.ones_like(d),))[1], jacrev(of_d(dense))(d).sum(1))
    close(vjp(of_d(solve), d)[1](torch.ones_like(b))[0], jacrev(of_d(dense))(d).sum(0))
    close(hessian(cube(solve))(d), hessian(cube(dense))(d))
    close(jacrev(jacfwd(cube(solve)))(d), hessian(cube(dense))(d))
    bs = system(6, batch=(4,), seed=1)[3]
    close(vmap(lambda r: solve(dl, d, du, r))(bs), dense(dl, d, du, bs))
    ds = system(6, batch=(4,), seed=2)[1]
    close(vmap(grad(cube(solve)))(ds), vmap(grad(cube(dense)))(ds))
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(solve(dl, fwAD.make_dual(d, torch.ones_like(d)), du, b)).tangent
    close(tangent, jacrev(of_d(dense))(d).sum(1))


def test_reverse_derivative_with_respect_to_an_inner_jvps_tangent():
    """The tangent of jvp is linear in the tangent: its Jacobian there is the solve's Jacobian."""
    dl, d, du, b = system(6)
    u = torch.linspace(-1, 1, d.numel(), dtype=F64)
    tangent_of = lambda f: (lambda t: jvp(lambda x: f(dl, x, du, b), (d,), (t,))[1])
    close(jacrev(tangent_of(solve))(u), jacrev(tangent_of(dense))(u))


@pytest.mark.parametrize("wrt", ["d", "b"])
def test_forward_derivative_with_respect_to_an_inner_jvps_tangent_raises(wrt):
    """jacfwd of a jvp's tangent calls the Function's jvp once, and torch runs that jvp with the
    outer forward level off: the answer would be silently wrong (0.085 and 0.23 here), so solve
    must refuse, naming the reverse-mode remedy."""
    dl, d, du, b = system(6)
    u = torch.linspace(-1, 1, d.numel(), dtype=F64)
    if wrt == "d":
        tangent_of = lambda f: (lambda t: jvp(lambda x: f(dl, x, du, b), (d,), (t,))[1])
    else:
        tangent_of = lambda f: (lambda t: jvp(lambda x: f(dl, d, du, x), (b,), (t,))[1])
    with pytest.raises(NotImplementedError, match=r"jacfwd of a jvp's tangent.*jacrev"):
        jacfwd(tangent_of(solve))(u)
    close(jacrev(tangent_of(solve))(u), jacrev(tangent_of(dense))(u))  # the remedy is right


def test_forward_over_forward_raises():
    dl, d, du, b = system(6)
    cube = lambda x: solve(dl, x, du, b).pow(3).sum()
    with pytest.raises(NotImplementedError, match="forward over forward"):
        jacfwd(jacfwd(cube))(d)
    with pytest.raises(NotImplementedError, match="forward over forward"):
        jvp(lambda x: jvp(cube, (x,), (torch.ones_like(x),))[1], (d,), (torch.ones_like(d),))
    jacfwd(cube)(d)  # one level still works after the error


@pytest.mark.slow
def test_compiled_forward_and_backward():
    dl, d, du, b = system(6)
    torch.compiler.reset()
    loss = torch.compile(lambda x: solve(dl, x, du, b).pow(3).sum(), backend="aot_eager", fullgraph=True)
    x = d.clone().requires_grad_()
    value = loss(x)
    close(value, dense(dl, d, du, b).pow(3).sum())
    close(torch.autograd.grad(value, x)[0], grad(lambda y: dense(dl, y, du, b).pow(3).sum())(d))
    compiled_vmap = torch.compile(vmap(lambda r: solve(dl, d, du, r)), backend="aot_eager", fullgraph=True)
    bs = system(6, batch=(3,), seed=1)[3]
    close(compiled_vmap(bs), dense(dl, d, du, bs))
    torch.compiler.reset()


@pytest.mark.slow
def test_compiled_forward_mode_raises():
    dl, d, du, b = system(6)
    ones = torch.ones_like(d)

    def dual_numbers():
        with fwAD.dual_level():
            return fwAD.unpack_dual(solve(dl, fwAD.make_dual(d, ones), du, b)).tangent

    tangent = lambda: jvp(lambda x: solve(dl, x, du, b), (d,), (ones,))[1]
    for job in (tangent, dual_numbers):
        torch.compiler.reset()
        with pytest.raises(Exception, match="forward-mode AD .* inside torch.compile is not supported"):
            torch.compile(job, backend="aot_eager", fullgraph=True)()
    # without fullgraph, jvp's refusal while tracing becomes a graph break, and solve runs eagerly;
    # dual numbers made inside meet the op's own refusal
    torch.compiler.reset()
    close(torch.compile(tangent, backend="aot_eager")(), jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1])
    torch.compiler.reset()
    with pytest.raises(Exception, match="forward-mode AD reached the op|active forward-AD level"):
        torch.compile(dual_numbers, backend="aot_eager")()
    torch.compiler.reset()
    close(jvp(torch.compile(lambda x: solve(dl, x, du, b), backend="aot_eager"), (d,), (ones,))[1],
          jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1])  # a graph break, then eager
    torch.compiler.reset()


@pytest.mark.slow
def test_compiled_grad_raises_and_grad_around_compiled_is_refused_or_eager():
    dl, d, du, b = system(6)
    torch.compiler.reset()
    job = lambda: grad(lambda x: solve(dl, x, du, b).sum())(d)
    with pytest.raises(Exception, match="setup_context"):
        torch.compile(job, backend="aot_eager", fullgraph=True)()
    seen = []

    def loss(x):
        seen.append(torch.compiler.is_compiling())
        return solve(dl, x, du, b).sum()

    torch.compiler.reset()  # Dynamo refuses a torch.func transform around a compiled function
    with pytest.raises(Exception, match=r"torch.func.grad\(compiled_fn\) .*not supported"):
        grad(torch.compile(loss, backend="aot_eager", fullgraph=True))(d)
    torch.compiler.reset()  # without fullgraph it runs the function eagerly: right, but not compiled
    seen.clear()
    close(grad(torch.compile(loss, backend="aot_eager"))(d), grad(lambda x: dense(dl, x, du, b).sum())(d))
    assert seen == [False]
    torch.compiler.reset()


def test_inputs_the_kernel_cannot_take_raise_clear_errors():
    dl, d, du, b = system(6, batch=(2,))
    with pytest.raises(TypeError, match="one dtype"):
        solve(dl, d, du, b.float())  # NumPy would promote; the fake kernel would say float32
    with pytest.raises(TypeError, match="one dtype"):
        solve(dl.half(), d.half(), du.half(), b.half())
    with pytest.raises(ValueError, match=r"one batch shape; got dl \(2, 5\), d \(2, 6\), du \(2, 5\), b \(1, 6\)"):
        solve(dl, d, du, b[:1])  # no broadcasting
    with pytest.raises(ValueError, match="n >= 2"):
        solve(dl[..., :0], d[..., :1], du[..., :0], b[..., :1])
    with pytest.raises(ValueError, match="one batch shape"):
        _solve_op(dl[0], d, du, b)  # the op checks too


def test_fake_kernel_agrees_for_float32_and_complex64():
    for dtype in (torch.float32, torch.complex64):
        args = [t.requires_grad_() for t in system(6, batch=(2,), dtype=dtype)]
        assert _solve_op(*args).dtype == dtype
        torch.library.opcheck(_solve_op, args, test_utils=("test_faketensor",))


def test_a_singular_system_names_its_zero_pivot():
    dl, d, du, b = system(5, batch=(3,))
    d = d.clone()
    dl[2], d[2, 0], du[2, 0] = 0.0, 0.0, 0.0  # system 2: first row and column zero but the sub-diagonal
    with pytest.raises(ValueError, match="system 2 is singular"):
        solve(dl, d, du, b)


def test_the_op_alone_refuses_dual_numbers():
    dl, d, du, b = system(6)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD reached the op"):
        _solve_op(dl, fwAD.make_dual(d, torch.ones_like(d)), du, b)


def test_the_op_alone_refuses_torch_func_forward_mode_instead_of_a_zero_tangent():
    """The refusal one key below autograd stops jvp and jacfwd of the op alone, and jvp through an
    exported graph of solve, where the op has no forward rule (chapter 5's op gives a zero tangent
    there, section 5.8); the dense reference's tangent is not zero."""
    dl, d, du, b = system(6)
    ones = torch.ones_like(d)
    assert jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1].abs().max() > 0.01

    class Solve(torch.nn.Module):
        def forward(self, dl, d, du, b):
            return solve(dl, d, du, b)

    exported = torch.export.export(Solve(), (dl, d, du, b)).module()
    for f in (_solve_op, exported):
        with pytest.raises(NotImplementedError, match="torch.func forward mode"):
            jvp(lambda x: f(dl, x, du, b), (d,), (ones,))
        with pytest.raises(NotImplementedError, match="torch.func forward mode"):
            jacfwd(lambda x: f(dl, x, du, b))(d)
    # the refusal is only under a forward transform: vmap, grad-free calls and solve's jvp still answer
    close(torch.vmap(lambda x: _solve_op(dl, x, du, b))(d.expand(3, 6)), dense(dl, d, du, b).expand(3, 6))
    close(jvp(lambda x: solve(dl, x, du, b), (d,), (ones,))[1], jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1])
    close(torch.vmap(lambda x: jvp(lambda y: solve(dl, y, du, b), (x,), (ones,))[1])(d.expand(2, 6)),
          jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1].expand(2, 6))


def test_a_direct_apply_of_the_function_leaves_no_state_behind():
    dl, d, du, b = system(6)
    of_d = lambda x: SolveFunction.apply(dl, x, du, b)
    jvp(of_d, (d,), (torch.ones_like(d),))
    close(jacfwd(lambda x: solve(dl, x, du, b))(d), jacrev(lambda x: dense(dl, x, du, b))(d))
    with pytest.raises(ValueError, match="singular"):  # the forward's flag is cleared on an error too
        SolveFunction.apply(dl, torch.zeros_like(d), torch.zeros_like(du), b)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD reached the op"):
        _solve_op(dl, fwAD.make_dual(d, torch.ones_like(d)), du, b)


def test_linearize_is_right_through_solve_and_the_function_and_refused_on_the_op_alone():
    """The kernel skips its tangent check while SolveFunction.forward runs it: the Function's jvp
    rule supplies the tangent, so linearize (make_fx inside a dual level) is right through solve."""
    dl, d, du, b = system(6)
    reference = jacrev(lambda x: dense(dl, x, du, b))(d)
    for f in (solve, SolveFunction.apply):
        _, linear = torch.func.linearize(lambda x: f(dl, x, du, b), d)
        for seed in range(3):
            t = torch.randn(d.shape, dtype=d.dtype, generator=torch.Generator().manual_seed(seed))
            close(linear(t), reference @ t)
    with pytest.raises(NotImplementedError, match="make_fx"):  # the op alone would give zeros
        torch.func.linearize(lambda x: _solve_op(dl, x, du, b), d)


def test_a_complex_system_with_complex_entries():
    g = torch.Generator().manual_seed(3)
    dl, d, du, b = (torch.randn(*s, generator=g, dtype=torch.complex128) for s in ((2, 5), (2, 6), (2, 5), (2, 6)))
    d = d + 3
    x = solve(dl, d, du, b)
    assert x.imag.abs().max() > 0.1  # a solution that is not real up to one scalar
    close(x, dense(dl, d, du, b))
    args = [t[0].clone().requires_grad_() for t in (dl, d, du, b)]
    assert torch.autograd.gradcheck(solve, args, check_forward_ad=True)


def test_meta_tensors_get_the_shape_without_a_solve():
    """The fake kernel serves the Meta key too: shape inference on meta tensors works, while the
    real kernel still refuses a device it cannot run on."""
    dl, d, du, b = (t.to("meta") for t in system(5, batch=(3,)))
    out = _solve_op(dl, d, du, b)
    assert out.device.type == "meta" and out.shape == b.shape and out.dtype == b.dtype
    with pytest.raises(ValueError, match="CPU tensors only"):
        solve(dl, d, du, b)


def test_the_device_error_names_the_tensor_off_the_cpu():
    dl, d, du, b = system(5)
    for i, name in enumerate(["dl", "d", "du", "b"]):
        args = [dl, d, du, b]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=f"CPU tensors only, got {name} on meta$"):
            solve(*args)


def test_solve_is_the_only_public_entry_point():
    assert minimal_op.__all__ == ["solve"]
    assert not [name for name in vars(minimal_op) if name.endswith("_op") and not name.startswith("_")]


class Unchecked(SolveFunction):
    """The Function's rules without its forward-over-forward check."""

    @staticmethod
    def jvp(ctx, tdl, td, tdu, tb):
        return minimal_op._jvp(solve, *ctx.saved_tensors, tdl, td, tdu, tb)


@torch_trap
def test_forward_over_forward_without_the_check_is_silently_wrong():
    """Why the Function's jvp checks the stack: torch runs a Function's jvp with the outer level
    off, so the same rules without the check give a wrong Hessian; with it, both paths refuse."""
    dl, d, du, b = system(6)
    cube = lambda f: (lambda x: f(dl, x, du, b).pow(3).sum())

    wrong = jacfwd(jacfwd(cube(Unchecked.apply)))(d)
    assert (wrong - hessian(cube(dense))(d)).abs().max() > 1e-3
    for f in (solve, SolveFunction.apply):
        with pytest.raises(NotImplementedError, match="forward over forward"):
            jacfwd(jacfwd(cube(f)))(d)


def test_the_refusal_lets_an_unrelated_error_through(monkeypatch):
    """_refuse_tangents turns only the traced-call error into its own message."""
    dl, d, du, b = system(6)

    def unpack_dual(tensor, level=None):
        raise RuntimeError("an unrelated failure")

    monkeypatch.setattr(minimal_op.fwAD, "unpack_dual", unpack_dual)
    with pytest.raises(RuntimeError, match="an unrelated failure") as caught:
        _solve_op(dl, d, du, b)
    assert caught.type is RuntimeError  # not turned into the refusal's NotImplementedError


@pytest.mark.slow
def test_compiled_code_traced_inside_a_dual_level_raises_on_every_call():
    """Chapter 8's table: traced inside a dual level, the fake kernel refuses, with or without
    tangents, on every call (each call traces again). A graph traced outside and run inside without
    recompiling is right without tangents (the op alone), but solve recompiles there: tracing
    unpack_dual makes Dynamo guard on the forward-AD level."""
    from torch._dynamo.utils import guard_failures

    dl, d, du, b = system(6)
    ones = torch.ones_like(d)
    for solver in (solve, _solve_op):
        for with_tangent in (False, True):
            torch.compiler.reset()
            compiled = torch.compile(lambda x: solver(dl, x, du, b), backend="aot_eager", fullgraph=True)
            with fwAD.dual_level():
                x = fwAD.make_dual(d, ones) if with_tangent else d
                for _ in range(2):
                    with pytest.raises(Exception, match="active forward-AD level"):
                        compiled(x)
    failed = {}
    for name, solver in (("solve", solve), ("op", _solve_op)):
        torch.compiler.reset()
        compiled = torch.compile(lambda x: solver(dl, x, du, b), backend="aot_eager", fullgraph=True)
        close(compiled(d), dense(dl, d, du, b))  # traced outside the level
        guard_failures.clear()
        with fwAD.dual_level():
            if name == "op":
                close(compiled(d), dense(dl, d, du, b))  # no recompile: the graph runs the kernel
                with pytest.raises(NotImplementedError, match="forward-mode AD reached the op"):
                    compiled(fwAD.make_dual(d, ones))  # dual numbers reach the kernel's check
            else:
                with pytest.raises(Exception, match="active forward-AD level"):
                    compiled(d)
        failed[name] = [reason for reasons in guard_failures.values() for reason in reasons]
    assert any("_current_level == -1" in reason for reason in failed["solve"]), failed
    assert failed["op"] == [], failed
    torch.compiler.reset()


@pytest.mark.slow
def test_the_function_alone_cannot_compile_a_loss_for_backward_but_solve_can():
    """Why solve gives traced code the op: Dynamo refuses a Function with a jvp under fullgraph."""
    dl, d, du, b = system(6)
    for f in (SolveFunction.apply, solve):
        torch.compiler.reset()
        loss = torch.compile(lambda x: f(dl, x, du, b).pow(3).sum(), backend="aot_eager", fullgraph=True)
        x = d.clone().requires_grad_()
        if f is solve:
            close(torch.autograd.grad(loss(x), x)[0], grad(lambda y: dense(dl, y, du, b).pow(3).sum())(d))
        else:
            with pytest.raises(Exception, match="Unsupported custom jvp"):
                loss(x)
    torch.compiler.reset()


@pytest.mark.slow
def test_torch_export_traces_solve_to_the_op():
    dl, d, du, b = system(6)

    class Solve(torch.nn.Module):
        def forward(self, dl, d, du, b):
            return solve(dl, d, du, b)

    exported = torch.export.export(Solve(), (dl, d, du, b))
    calls = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert calls == [torch.ops.tridiag_minimal.solve.default]
    close(exported.module()(dl, d, du, b), dense(dl, d, du, b))


def test_the_private_torch_names_it_uses_are_the_four_it_names():
    """The module is built on public APIs except four private reads it documents: the text of
    torch's unpack_dual error, functorch's stack of active transforms, the key set below
    ADInplaceOrView and the active forward-AD level."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(minimal_op.__file__).read_text())
    private = sorted({f"{node.module}.{alias.name}" for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module
                      and node.module.startswith("torch") for alias in node.names
                      if any(part.startswith("_") for part in node.module.split("."))})
    assert private == ["torch._C._functorch.TransformType",
                       "torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters"]
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and node.attr.startswith("_") and not node.attr.startswith("__")}
    assert attributes <= {"_solve_op", "_library"} | {"_fw_primal", "_C", "_after_ADInplaceOrView_keyset",
                                                               "_current_level"}, attributes


def test_the_forward_transform_count_also_refuses_an_outer_jacfwd_that_never_reaches_solve():
    """Chapter 8 calls the stack check conservative: jacfwd in a scalar a of a * (a jvp's tangent)
    is refused, though the same rules without the check, which the outer tangent never reaches, are right."""
    dl, d, du, b = system(6)
    ones, a = torch.ones_like(d), torch.tensor(2.0, dtype=F64)
    outer = lambda f: jacfwd(lambda s: s * jvp(lambda x: f(dl, x, du, b), (d,), (ones,))[1])(a)
    for f in (solve, SolveFunction.apply):
        with pytest.raises(NotImplementedError, match="forward over forward"):
            outer(f)

    close(outer(Unchecked.apply), jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1])


def test_the_op_alone_refuses_jvp_even_for_an_input_that_never_reaches_it():
    """Chapter 8: refusal 4 reads only the top of functorch's stack, not the inputs, so jvp in a
    scalar c of op(...) * c is refused, on the op and in an exported module, though eager solve is right."""
    dl, d, du, b = system(6)
    c, one = torch.tensor(2.0, dtype=F64), torch.tensor(1.0, dtype=F64)

    class Scaled(torch.nn.Module):
        def forward(self, dl, d, du, b, c):
            return solve(dl, d, du, b) * c

    exported = torch.export.export(Scaled(), (dl, d, du, b, c)).module()
    for f in (lambda c: _solve_op(dl, d, du, b) * c, lambda c: exported(dl, d, du, b, c)):
        with pytest.raises(NotImplementedError, match="torch.func forward mode"):
            jvp(f, (c,), (one,))
    close(jvp(lambda c: solve(dl, d, du, b) * c, (c,), (one,))[1], dense(dl, d, du, b))


def test_dual_numbers_and_a_torch_func_jvp_nested_either_way_are_refused_by_torch():
    """Chapter 8's refusals leave this nesting to torch: dual numbers around torch.func.jvp through
    solve, and the reverse, raise torch's own error rather than give a silent answer."""
    dl, d, du, b = system(5)
    t_in, t_out = torch.ones_like(d), torch.full_like(d, 0.5)

    def jvp_inside(x):
        return jvp(lambda y: solve(dl, y, du, b), (x,), (t_in,))[1]

    with pytest.raises(RuntimeError, match="Nested forward mode AD is not supported"):
        with fwAD.dual_level():
            jvp_inside(fwAD.make_dual(d, t_out))

    def duals_inside(x):
        with fwAD.dual_level():
            return fwAD.unpack_dual(solve(dl, fwAD.make_dual(x, t_in), du, b)).tangent

    with pytest.raises(RuntimeError, match="Nested forward mode AD is not supported"):
        jvp(duals_inside, (d,), (t_out,))


def test_the_op_alone_refuses_dual_numbers_made_inside_compiled_code():
    """Traced, the op has no forward rule: before the fake kernel refused inside a dual level, dual
    numbers made inside a compiled function came out of the op alone with a zero tangent."""
    dl, d, du, b = system(6)
    ones = torch.ones_like(d)

    def tangent(solver):
        with fwAD.dual_level():
            return fwAD.unpack_dual(solver(dl, fwAD.make_dual(d, ones), du, b)).tangent

    assert jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1].abs().max() > 0.01
    for solver in (_solve_op, solve):
        torch.compiler.reset()
        with pytest.raises(Exception, match="forward-AD level|forward-mode AD"):
            torch.compile(lambda: tangent(solver), backend="aot_eager", fullgraph=True)()
    torch.compiler.reset()
    # outside a dual level the fake kernel traces as before
    close(torch.compile(lambda: _solve_op(dl, d, du, b), backend="aot_eager", fullgraph=True)(), dense(dl, d, du, b))
    torch.compiler.reset()


def test_without_the_fake_kernels_check_dual_numbers_made_inside_compiled_code_lose_their_tangent(monkeypatch):
    """Chapter 8.10's table, the fake kernel's "without it": with a fake kernel that only gives the
    shape, dual numbers made inside compiled code come out of the Function and the op alone with no tangent."""
    dl, d, du, b = system(6)
    ones = torch.ones_like(d)

    def tangent(solver):
        with fwAD.dual_level():
            return fwAD.unpack_dual(solver(dl, fwAD.make_dual(d, ones), du, b)).tangent

    monkeypatch.setattr(_solve_op, "_abstract_fn", lambda dl, d, du, b: torch.empty_like(b))
    for solver in (SolveFunction.apply, _solve_op):
        torch.compiler.reset()
        assert torch.compile(lambda: tangent(solver), backend="aot_eager", fullgraph=True)() is None
    torch.compiler.reset()


def test_without_the_kernels_tangent_check_the_op_alone_loses_the_tangent(monkeypatch):
    """Chapter 8.10's table, _refuse_tangents's "without it": dual numbers come out of the op alone
    with no tangent, and linearize of the op alone gives zeros; the dense tangent is not zero."""
    dl, d, du, b = system(6)
    ones = torch.ones_like(d)
    assert jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1].abs().max() > 0.01
    monkeypatch.setattr(minimal_op, "_refuse_tangents", lambda *tensors: None)
    with fwAD.dual_level():
        assert fwAD.unpack_dual(_solve_op(dl, fwAD.make_dual(d, ones), du, b)).tangent is None
    _, linear = torch.func.linearize(lambda x: _solve_op(dl, x, du, b), d)
    assert torch.equal(linear(ones), torch.zeros_like(d))


def test_under_make_fx_the_kernel_runs_without_ADInplaceOrView_so_unpack_dual_fails(monkeypatch):
    """Chapter 8.6, refusal 3: linearize calls the op once eagerly, then traces it with make_fx in a
    dual level, where torch runs the kernel with ADInplaceOrView excluded; in a dual level,
    unpack_dual then fails on _fw_primal, so the check cannot look for tangents and refuses."""
    dl, d, du, b = system(5)
    key = torch._C.DispatchKey.ADInplaceOrView
    refuse, excluded = minimal_op._refuse_tangents, []

    def spy(*tensors):
        excluded.append(torch._C._dispatch_tls_is_dispatch_key_excluded(key))
        return refuse(*tensors)

    monkeypatch.setattr(minimal_op, "_refuse_tangents", spy)
    with pytest.raises(NotImplementedError, match="make_fx"):
        torch.func.linearize(lambda x: _solve_op(dl, x, du, b), d)
    assert excluded == [False, True]  # the eager call, then the traced one
    with fwAD.dual_level(), torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
        with pytest.raises(RuntimeError, match="_fw_primal"):
            fwAD.unpack_dual(d)
    with fwAD.dual_level():
        assert fwAD.unpack_dual(d).tangent is None  # with the key, the same call answers


def test_a_dual_level_on_one_thread_makes_the_fake_kernel_refuse_on_another():
    """Chapter 8: fwAD's level is a module global, so the fake kernel refuses tracing on every thread."""
    import threading

    from torch._subclasses.fake_tensor import FakeTensorMode

    args, seen = system(5), []

    def trace():
        try:
            with FakeTensorMode() as mode:
                _solve_op(*(mode.from_tensor(t) for t in args))
            seen.append("traced")
        except NotImplementedError as error:
            seen.append(str(error))

    worker = threading.Thread(target=trace)
    worker.start()
    worker.join()
    assert seen == ["traced"]  # no dual level open: the fake kernel gives the shape
    seen.clear()
    with fwAD.dual_level():
        worker = threading.Thread(target=trace)
        worker.start()
        worker.join()
    assert len(seen) == 1 and "traced inside an active forward-AD level" in seen[0], seen


@pytest.mark.slow
def test_is_compiling_is_true_in_the_backend_too():
    """Chapter 8: torch.compiler.is_compiling() holds for the whole compile session, backend included."""
    seen = []

    def backend(graph_module, example_inputs):
        seen.append(torch.compiler.is_compiling())
        return graph_module.forward

    torch.compiler.reset()
    torch.compile(lambda x: x.sin(), backend=backend, fullgraph=True)(torch.ones(3))
    torch.compiler.reset()
    assert seen == [True]
    assert not torch.compiler.is_compiling()


@pytest.mark.slow
def test_compiled_jvp_without_fullgraph_breaks_at_the_interpreter_stack():
    """Chapter 8.9: solve's compiled jvp is right without fullgraph because Dynamo breaks the graph
    at functorch's interpreter stack (read by the forward-over-forward check) and runs the rest eagerly."""
    from torch._dynamo.utils import counters

    dl, d, du, b = system(6)
    ones = torch.ones_like(d)
    torch.compiler.reset()
    counters.clear()
    tangent = torch.compile(lambda: jvp(lambda x: solve(dl, x, du, b), (d,), (ones,))[1], backend="aot_eager")()
    reasons = [str(reason) for reason in counters["graph_break"]]
    torch.compiler.reset()
    close(tangent, jvp(lambda x: dense(dl, x, du, b), (d,), (ones,))[1])
    assert len(reasons) == 1, reasons
    assert "get_interpreter_stack" in reasons[0], reasons
