"""Every private torch API the package relies on still exists and still means what it did.

If a torch release removes or renames one, this fails loudly, naming it, before anything
subtler breaks (the compiled support matrix in test_compositions.py)."""

import torch
from torch.func import grad, jvp, vmap

from tridiag_tutorial import _compat, functions


def test_private_names_exist():
    assert issubclass(_compat.SingleLevelFunction, torch._C._FunctionBase)
    assert _compat.SingleLevelFunction is torch.autograd.function._SingleLevelFunction
    assert issubclass(functions._CompiledSolve, torch.autograd.function._SingleLevelFunction)
    assert callable(_compat.enable_single_level_autograd_function)
    for name in ("peek_interpreter_stack", "is_functorch_wrapped_tensor", "is_batchedtensor",
                 "is_legacy_batchedtensor", "get_unwrapped"):
        assert hasattr(torch._C._functorch, name), f"torch._C._functorch.{name} is gone"
    assert hasattr(torch.autograd.forward_ad, "_current_level")
    from torch._functorch.pyfunctorch import GradInterpreter
    assert callable(GradInterpreter.prev_grad_mode)
    assert isinstance(torch._functorch.eager_transforms.JVP_NESTING, int)
    assert torch._C._is_fwd_grad_enabled() is True
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: F401
    assert issubclass(DeviceContext, torch.overrides.TorchFunctionMode)
    assert callable(torch._C._len_torch_function_stack) and callable(torch._C._get_function_stack_at)


def test_transform_depths_are_detected():
    seen = {}

    def record(name):
        def f(x):
            seen[name] = (_compat.differentiation_depth(), _compat.forward_transform_depth())
            return x.sin().sum()
        return f

    x = torch.ones(3)
    record("none")(x)
    grad(record("grad"))(x)
    jvp(record("jvp"), (x,), (x,))
    vmap(grad(record("vmap(grad)")))(x.expand(2, 3))
    jvp(grad(record("jvp(grad)")), (x,), (x,))
    jvp(lambda y: jvp(record("jvp(jvp)"), (y,), (y,))[1], (x,), (x,))
    assert seen == {"none": (0, 0), "grad": (1, 0), "jvp": (1, 1), "vmap(grad)": (1, 0),
                    "jvp(grad)": (2, 1), "jvp(jvp)": (2, 2)}


def test_outer_autograd_records_sees_grad_mode_and_requires_grad_under_the_transforms():
    seen = {}

    def record(name):
        def f(x):
            seen[name] = _compat.outer_autograd_records(x)
            return x.sin().sum()
        return f

    x, leaf = torch.ones(3), torch.ones(3, requires_grad=True)
    grad(record("plain input"))(x)
    grad(record("input requires grad"))(leaf)
    with torch.no_grad():
        grad(record("under no_grad"))(leaf)
    vmap(grad(record("vmap(grad), requires grad")))(leaf.expand(2, 3))
    jvp(record("jvp, requires grad"), (leaf,), (x,))
    assert seen == {"plain input": False, "input requires grad": True, "under no_grad": False,
                    "vmap(grad), requires grad": True, "jvp, requires grad": True}


def test_jvp_nesting_and_forward_grad_mode_are_what_the_dual_level_checks_read():
    seen = {}

    class Peek(torch.autograd.Function):
        @staticmethod
        def forward(x):
            seen["in a Function's forward"] = _compat.forward_grad_enabled()
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def jvp(ctx, t):
            return t

    def f(x):
        seen["jvp nesting"] = _compat.jvp_nesting()
        return Peek.apply(x)

    x = torch.ones(3)
    assert _compat.jvp_nesting() == 0 and _compat.forward_grad_enabled()
    jvp(f, (x,), (x,))
    assert seen == {"jvp nesting": 1, "in a Function's forward": False}
    assert _compat.jvp_nesting() == 0

def test_a_default_device_is_no_mode_for_the_fast_path(monkeypatch):
    """torch.set_default_device and ``with torch.device(...)`` install torch's DeviceContext, a
    TorchFunctionMode that only redirects factory functions: the fast path ignores it (without
    this a call there took the general path, about ten times as long at n = 100), but not a mode
    entered inside it. The solve of CPU tensors stays on the CPU, right, with its gradient."""
    import tridiag_tutorial
    from tridiag_tutorial import api

    g = torch.Generator().manual_seed(0)
    lower, upper = (torch.randn(4, 99, generator=g, dtype=torch.float64) for _ in range(2))
    diag = torch.randn(4, 100, generator=g, dtype=torch.float64) + 4
    rhs = torch.randn(4, 100, generator=g, dtype=torch.float64)
    dense = torch.diag_embed(diag) + torch.diag_embed(lower, -1) + torch.diag_embed(upper, 1)
    expected = torch.linalg.solve(dense, rhs)
    expected_grad = torch.linalg.solve(dense.mT, torch.ones_like(rhs))  # of x.sum() in rhs
    # the general path: api._solve where the C++ fast path exists, else the dispatcher's
    spied, name = (api, "_solve") if tridiag_tutorial.cpp_available() else (functions, "_apply")
    general = []
    real = getattr(spied, name)
    monkeypatch.setattr(spied, name, lambda *a: general.append(name) or real(*a))
    for device in ("cpu", "meta"):
        with torch.device(device):
            assert not _compat.mode_active()
            with torch.overrides.TorchFunctionMode():
                assert _compat.mode_active()
            x = tridiag_tutorial.tridiagonal_solve(lower, diag, upper, rhs)
            assert general == [], general  # the fast path (or the direct kernel) ran
            b = rhs.clone().requires_grad_()
            tridiag_tutorial.tridiagonal_solve(lower, diag, upper, b).sum().backward()
        assert x.device.type == "cpu" and b.grad.device.type == "cpu"
        torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.grad, expected_grad, rtol=1e-12, atol=1e-12)
        general.clear()
    torch.set_default_device("cpu")
    try:
        assert not _compat.mode_active()
    finally:
        torch.set_default_device(None)
    assert not _compat.mode_active()


def test_fast_path_detectors_see_what_they_name():
    """Each check the fast path relies on answers True exactly where it says it does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.ones(3)
    assert not _compat.mode_active()
    with Passthrough():
        assert _compat.mode_active()
    with torch.overrides.TorchFunctionMode():
        assert _compat.mode_active()

    assert not _compat.transform_active()
    seen = []
    vmap(lambda t: seen.append((_compat.transform_active(), _compat.is_functorch_tensor(t))) or t)(
        x.expand(2, 3))
    grad(lambda t: seen.append((_compat.transform_active(), _compat.is_functorch_tensor(t)))
         or t.sum())(x)
    assert seen == [(True, True), (True, True)]
    assert not _compat.is_functorch_tensor(x)

    assert not _compat.forward_ad_active()
    with torch.autograd.forward_ad.dual_level():
        assert _compat.forward_ad_active()
    assert not _compat.forward_ad_active()


def test_function_apply_records_the_node_without_binding_the_arguments(monkeypatch):
    """``function_apply`` is ``Function.apply`` without its per-call :mod:`inspect` binding: the
    same autograd node (gradients flow), ``inspect.signature`` never called; under a
    ``torch.func`` transform it is ``Function.apply`` itself (which binds)."""
    import inspect

    from torch.func import vmap

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return 2 * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

        @staticmethod
        def vmap(info, in_dims, x):
            return 2 * x, in_dims[0]

    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.ones(3, requires_grad=True)
    y = _compat.function_apply(Double, x)
    binds = bool(calls)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "DoubleBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full((3,), 2.0))
    calls.clear()
    Double.apply(x)
    if _compat.PYTHON_FUNCTION_APPLY:  # torch 2.13: apply binds, function_apply does not
        assert calls and not binds
    else:  # torch 2.14 and later: apply is the C++ method, and function_apply is apply
        assert binds == bool(calls)
    calls.clear()
    assert torch.equal(vmap(lambda t: _compat.function_apply(Double, t))(torch.ones(2, 3)),
                       torch.full((2, 3), 2.0))
    assert calls, "under vmap, function_apply must be Function.apply (which binds)"
