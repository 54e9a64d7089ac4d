"""The op's registrations, as pytorch/extension-cpp's ``ops.py`` makes them: for each op of
:mod:`tridiag_tutorial._schemas`, its kernels (one Python kernel per device key), its fake kernel,
its Autograd kernel and its vmap rule. The block at the end of this module is all of them.

- ``solve_kernel(lower, diag, upper, rhs, lu, pivots, trans, driver)``: the kernel alone, what
  compiled graphs call forward and backward; fake kernel, vmap rule;
- ``solve(...)``, the same schema, with an Autograd kernel (:func:`_solve_autograd`, the
  single-level :class:`~tridiag_tutorial.functions._CompiledSolve`): what ``torch.compile`` traces;
- ``lu_factor(lower, diag, upper, driver)``: ``(lu, pivots)``; fake kernel, vmap rule;
- ``cpp_solve``, ``cpp_solve_ex``, ``cpp_solve_backward``: the C++ kernel's ops (CPU kernels in
  C++); fake kernels here.

Every kernel checks its arguments as its fake kernel does, so that a graph or a direct call of
an op cannot crash a kernel.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from . import _compat, kernels
from ._schemas import lu_factor_op as _factor_op
from ._schemas import solve_kernel_op as _kernel_op
from ._schemas import solve_op as _compiled_op
from ._validation import validate_factor_args, validate_kernel_args
from .functions import _batch_rule, _CompiledSolve, _vmap_rule
from .kernels import compiled

_kernel = kernels.solve
_factor_kernel = kernels.factor

# The library fragment that holds this module's registrations (_schemas has its own, which defines
# the schemas where the extension was not built).
_LIB = torch.library.Library("tridiag_tutorial", "FRAGMENT")

# [book: dispatch-keys]
# The dispatch keys of the Python kernels. With the extension, its CompositeExplicitAutograd
# kernel (what a process without Python runs) stays for every other key, and a kernel registered
# for a backend key takes precedence over it; without the extension, ours is the composite one.
_KERNEL_KEYS = (("CPU", "CUDA", "MPS", "XPU") if compiled.is_available()
                else ("CompositeExplicitAutograd",))
# [/book: dispatch-keys]


def _check_op_driver(driver, lu, device, name: str) -> None:
    """What an op checks of its ``driver`` argument (the public functions resolved it)."""
    allowed = kernels.DRIVERS if lu is None else kernels.FACTOR_DRIVERS
    if not isinstance(driver, str) or driver not in allowed:
        raise ValueError(f"{name}: driver must be one of {', '.join(map(repr, allowed))}"
                         f"{'' if lu is None else ' with factors'}, got {driver!r}")
    if driver in kernels._CPU_ONLY and device.type not in ("cpu", "meta"):  # meta: fake kernels
        raise ValueError(f"{name}: driver={driver!r} runs on CPU tensors only, got {device}")


def _solve_kernel(lower, diag, upper, rhs, lu, pivots, trans, driver):
    """The kernel alone (no autograd): the Python kernel of ``solve_kernel`` (and of ``solve``
    below its Autograd kernel). It checks its arguments as its fake kernel does
    (:func:`_validation.validate_kernel_args`), and the kernel checks the pivot values, so a
    graph or a direct call cannot crash it. On the C++ kernel, which checks every tensor itself
    (device, layout, dtype, shapes) before it reads one, the Python checks are skipped: they cost
    more than the solve of a small system, and a compiled graph calls this kernel on every run."""
    if _compat.forward_ad_active():
        _refuse_tangents(lower, diag, upper, rhs)
    if (driver == "cpp" and lu is None and pivots is None and trans == "N"
            and rhs.ndim == diag.ndim + 1):  # the C++ op also takes (*B, n): these ops do not
        return compiled.solve(lower, diag, upper, rhs)
    _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver)
    return _kernel(lower, diag, upper, rhs, lu, pivots, trans, driver)


_TANGENT_DROPPED = (
    "tridiagonal_solve: forward-mode AD (dual numbers) reached the kernel, which has no forward "
    "rule: a graph compiled by torch.compile (or exported) runs the kernel without the op's "
    "autograd, and would drop the tangents (torch.compile does not differentiate dual inputs). "
    "Call tridiagonal_solve uncompiled inside dual_level, or take forward-mode derivatives with "
    "torch.func.jvp / jacfwd inside the compiled function.")


def _refuse_untraced_duals_under_compile(*tensors) -> None:
    """While torch.compile (or export) traces inside a dual level, dual numbers made outside the
    compiled function reach the op without their tangents (AOTAutograd does not trace them), where
    those made inside carry traced ones: refuse where no input (under its functorch wrappers)
    carries one. A torch.func forward transform (its own dual level) and a Function's forward
    (forward AD off) are not refused."""
    if not (_compat.forward_ad_active() and torch.compiler.is_compiling()
            and _compat.forward_grad_enabled() and _compat.forward_transform_depth() == 0
            and _compat.jvp_nesting() == 0):
        return
    for t in map(_compat.innermost, tensors):
        try:
            if t is not None and forward_ad.unpack_dual(t).tangent is not None:
                return
        except RuntimeError:
            continue
    raise NotImplementedError(_DUAL_LEVEL_UNDER_COMPILE)


def _refuse_tangents(*tensors) -> None:
    """A tangent on an input of the kernel would be dropped: raise. Inside an autograd.Function's
    ``forward`` (the eager path), forward AD is off and no tangent shows."""
    try:
        lost = _compat.any_tangent(tensors)
    except RuntimeError:  # where the kernel runs below autograd, unpack_dual may not answer;
        return            # _refuse_untraced_duals_under_compile refuses such traces
    if lost:
        raise NotImplementedError(_TANGENT_DROPPED)


_DUAL_LEVEL_UNDER_COMPILE = (
    "tridiagonal_solve: traced by torch.compile (or torch.export) inside an active forward-AD "
    "level (dual_level) on inputs without a traced tangent: dual numbers made outside the "
    "compiled function lose their tangents there (torch.compile does not differentiate dual "
    "inputs), so the op refuses, with or without tangents. Make the dual numbers inside the "
    "compiled function, use torch.func.jvp / jacfwd inside it, or call it uncompiled.")


def _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver) -> None:
    validate_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, name=_KERNEL_OP_NAME)
    _check_op_driver(driver, lu, diag.device, _KERNEL_OP_NAME)


_KERNEL_OP_NAME = "tridiag_tutorial::solve_kernel"


def _solve_fake(lower, diag, upper, rhs, lu, pivots, trans, driver):
    """The one fake kernel of ``solve`` and ``solve_kernel``: the checks of the real kernel, and
    a new C-contiguous tensor of ``rhs``'s shape, as every kernel returns. While compiling
    inside a dual level (no torch.func forward transform), it refuses, as the Autograd kernel does:
    a graph of the kernel alone would drop tangents."""
    _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver)
    _refuse_untraced_duals_under_compile(lower, diag, upper, rhs)
    return rhs.new_empty(rhs.shape)


def _cpp_solve_fake(lower, diag, upper, rhs):
    """Fake kernel of the C++ kernel ``cpp_solve``: ``(x, info)``, with its checks (``rhs``
    ``(*B, n)`` or ``(*B, n, k)``, one batch shape)."""
    matrix = rhs if rhs.ndim != diag.ndim else rhs.unsqueeze(-1)
    validate_kernel_args(lower, diag, upper, matrix, None, None, "N",
                         name="tridiag_tutorial::cpp_solve")
    return rhs.new_empty(rhs.shape), rhs.new_empty((), dtype=torch.int64)


def _cpp_solve_ex_fake(lower, diag, upper, rhs, pieces_min_n):
    """Fake kernel of ``cpp_solve_ex``: ``cpp_solve``'s and a 0-dim int64 fallback count."""
    x, info = _cpp_solve_fake(lower, diag, upper, rhs)
    return x, info, rhs.new_empty((), dtype=torch.int64)


def _cpp_solve_backward_fake(lower, diag, upper, x, grad_x):
    """Fake kernel of ``cpp_solve_backward``: the band gradients (the bands' shapes), ``grad_rhs``
    (``grad_x``'s) and ``info``, with its checks (``cpp_solve``'s for ``grad_x`` in place of
    ``rhs``, and ``x`` of ``grad_x``'s shape and dtype)."""
    name = "tridiag_tutorial::cpp_solve_backward"
    matrix = grad_x if grad_x.ndim != diag.ndim else grad_x.unsqueeze(-1)
    validate_kernel_args(lower, diag, upper, matrix, None, None, "N", name=name)
    torch._check(x.shape == grad_x.shape and x.dtype == grad_x.dtype and x.device == grad_x.device,
                 lambda: f"{name}: x and grad_x must have one shape, dtype and device")
    return (lower.new_empty(lower.shape), diag.new_empty(diag.shape), upper.new_empty(upper.shape),
            grad_x.new_empty(grad_x.shape), grad_x.new_empty((), dtype=torch.int64))


def _on_kernel(op, trans: str, driver: str):
    """``op`` as a function of its six tensors, with the last two arguments bound."""
    return lambda *tensors: op(*tensors, trans, driver)


def _vmap_with_kernel(op):
    """The batch rule of an op with the signature of ``solve_kernel``."""
    def rule(info, in_dims, lower, diag, upper, rhs, lu, pivots, trans, driver):
        return _batch_rule(_on_kernel(op, trans, driver), info, in_dims[:6], lower, diag,
                           upper, rhs, lu, pivots)
    return rule


def _check_factor_args(lower, diag, upper, driver) -> None:
    """What the real and the fake kernel of ``lu_factor`` check."""
    validate_factor_args(lower, diag, upper, name="tridiag_tutorial::lu_factor")
    _check_op_driver(driver, True, diag.device, "tridiag_tutorial::lu_factor")


def _lu_factor_kernel(lower, diag, upper, driver):
    """``(lu, pivots)`` of a batch; not differentiable (the bands carry the gradients)."""
    _check_factor_args(lower, diag, upper, driver)
    return _factor_kernel(lower, diag, upper, driver)


def _lu_factor_fake(lower, diag, upper, driver):
    _check_factor_args(lower, diag, upper, driver)
    batch, n = diag.shape[:-1], diag.shape[-1]
    return diag.new_empty(*batch, 4, n), diag.new_empty(*batch, n, dtype=torch.int32)


def _factor_vmap(info, in_dims, lower, diag, upper, driver):
    return _vmap_rule(lambda *bands: _factor_op(*bands, driver), info, in_dims[:3],
                      lower, diag, upper, out_dims=(0, 0))


_NESTED_UNDER_COMPILE = (
    "tridiagonal_solve: nested differentiation inside torch.compile (torch.func.hessian, "
    "jacfwd(jacrev(f)), grad(grad(f)), a transform of a transform that both differentiate) is not "
    "supported: the compiled op attaches its derivative to one transform level only. Run the "
    "nested transform eagerly (without torch.compile), where it works; inside torch.compile, one "
    "level of grad, vjp, jacrev, jvp or jacfwd (optionally under vmap) works.")


_TRANSFORM_INSIDE_AUTOGRAD = (
    "tridiagonal_solve: a torch.func transform that differentiates (grad, vjp, jacrev, jvp, "
    "jacfwd) inside torch.compile, or around the op tridiag_tutorial::solve called directly, "
    "while ordinary autograd also records the inputs (one requires grad, grad mode on) is not "
    "supported: the op attaches its derivative to the transform's level only, so the outer "
    "gradient (a gradient penalty's, a Hessian-vector product's) would miss its term. Call "
    "tridiagonal_solve eagerly (without torch.compile), where it works; or take the outer "
    "derivative with torch.func too; or detach the inputs if no outer gradient is wanted.")


# [book: autograd-kernel]
def _solve_autograd(lower, diag, upper, rhs, lu, pivots, trans, driver):
    depth = _compat.differentiation_depth()
    if depth > 1:
        raise NotImplementedError(_NESTED_UNDER_COMPILE)
    if depth == 1 and _compat.outer_autograd_records(lower, diag, upper, rhs):
        raise NotImplementedError(_TRANSFORM_INSIDE_AUTOGRAD)
    _refuse_untraced_duals_under_compile(lower, diag, upper, rhs)
    with _compat.enable_single_level_autograd_function():
        return _CompiledSolve.apply(lower, diag, upper, rhs, lu, pivots, trans, driver)


# --------------------------------------------------------------------------------------------
# The registrations.
# --------------------------------------------------------------------------------------------
# [book: registrations]
for _key in _KERNEL_KEYS:
    _LIB.impl("solve_kernel", _solve_kernel, _key)
    _LIB.impl("solve", _solve_kernel, _key)
    _LIB.impl("lu_factor", _lu_factor_kernel, _key)
_LIB.impl("solve", _solve_autograd, "Autograd")
torch.library.register_fake("tridiag_tutorial::solve_kernel", _solve_fake, lib=_LIB)
torch.library.register_fake("tridiag_tutorial::solve", _solve_fake, lib=_LIB)
torch.library.register_fake("tridiag_tutorial::lu_factor", _lu_factor_fake, lib=_LIB)
if compiled.is_available():
    torch.library.register_fake("tridiag_tutorial::cpp_solve", _cpp_solve_fake, lib=_LIB)
    torch.library.register_fake("tridiag_tutorial::cpp_solve_ex", _cpp_solve_ex_fake, lib=_LIB)
    torch.library.register_fake("tridiag_tutorial::cpp_solve_backward", _cpp_solve_backward_fake,
                                lib=_LIB)
torch.library.register_vmap("tridiag_tutorial::solve_kernel", _vmap_with_kernel(_kernel_op),
                            lib=_LIB)
torch.library.register_vmap("tridiag_tutorial::solve", _vmap_with_kernel(_compiled_op), lib=_LIB)
torch.library.register_vmap("tridiag_tutorial::lu_factor", _factor_vmap, lib=_LIB)
# [/book: registrations]
