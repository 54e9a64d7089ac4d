r"""The public op, :func:`tridiagonal_solve`: the result of the whole tutorial.

Design (chapter 8 explains it; chapter 5 shows the traps it gets around)::

    tridiagonal_solve(lower, diag, upper, rhs, driver=None)
        |-- driver=None, CPU, no transform, mode or compilation, the automatic choice is the
        |   C++ kernel: its op, directly (with a gradient, in _CppSolve); it checks the inputs,
        |   and where it refuses them, the path below validates them and says why
        |   validate + broadcast (one place); the driver resolved (kernels.resolve_driver)
        |-- nothing observes the call (no grad, no transform, no mode): the kernel, directly
        |-- eager:     _TridiagonalSolve            autograd.Function: backward, jvp, vmap
        |-- compiling: torch.ops.tridiag_tutorial.solve
        |                                           schema in C++ (csrc/tridiag.cpp); fake kernel,
        |                                           an Autograd kernel that works under
        |                                           torch.func, and a vmap rule, from here
        `-- all run the kernel that ``driver`` names (tridiag_tutorial.kernels): LAPACK, the C++
            kernel, or the sequential or partitioned kernel in torch ops

Why two paths? On torch 2.13 (measured in chapter 5):

- a ``custom_op`` with ``register_autograd`` raises under ``torch.func.grad`` and silently returns
  zero tangents under ``torch.func.jvp`` / ``jacfwd``;
- an ``autograd.Function`` with a ``jvp`` staticmethod cannot be traced by Dynamo with
  ``fullgraph=True``.

So eager code (including every ``torch.func`` transform and forward-mode AD) goes through the
``autograd.Function``, which defines ``setup_context``, ``backward``, ``jvp`` and ``vmap``; code
being compiled (``torch.compiler.is_compiling()``) goes through the op ``tridiag_tutorial::solve``,
which Dynamo treats as one opaque node. Its Autograd kernel is ours: a single-level
autograd.Function with ``backward`` and ``jvp`` (the way functorch attaches an autograd.Function
to one transform level), so ``torch.func.grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``,
``vmap`` and forward-mode dual numbers all work inside a compiled function. Both paths use the
rules of :mod:`tridiag_tutorial.rules`.

The ops' schemas are defined in C++, in the extension built at install (``TORCH_LIBRARY``), so
that a compiled or exported graph that holds them loads in a process that has only that library
(chapter 12); this module registers their fake kernels, the Autograd kernel, the vmap rules and
the kernels of each device, as pytorch/extension-cpp's ``ops.py`` does. Where the extension was
not built, this module defines the same schemas (``SCHEMAS``) itself.

What does not compose, and raises instead of answering wrongly (chapter 8's support table):

- nested differentiation (``hessian``, ``jacfwd(jacrev(f))``, ``grad(grad(f))``) *inside*
  ``torch.compile``: a single-level Function differentiates at one level only. The error says so
  and what to do (run that transform eagerly; compiled single-level transforms work);
- forward-over-forward (``jvp`` of ``jvp``, ``jacfwd(jacfwd(f))``), eager or compiled: torch does
  not differentiate an ``autograd.Function``'s ``jvp`` staticmethod at an outer forward level (it
  returns a silently wrong second derivative, for ``torch.linalg.solve`` as well; pytorch
  issue 197867), so the op raises and points to ``hessian`` / ``jacfwd(jacrev(f))``, which work
  eagerly;
- double backward (``create_graph=True``) through a compiled function: torch's AOTAutograd
  raises its own error ("does not currently support double backward").

The kernel is an argument, ``driver`` (:mod:`tridiag_tutorial.kernels`): the public functions
resolve ``driver=None`` to a kernel name before anything else, and every path carries that name
to its backward and ``jvp``.

Factor reuse. On the sequential kernel (every device but the CPU, for n < 64) factoring costs
about twice a solve with the factors, so when a backward pass will follow, the public function
factors ``A = LU`` once (:func:`tridiagonal_lu_factor`'s op) and the backward solves
``A^H v = g`` from the same factors. With LAPACK it does not pay: ``?gtsv`` factors and solves in
one sweep, so ``?gttrf`` + two ``?gttrs`` do nearly the work of two ``?gtsv``, and over a whole
forward and backward keeping the factors was slower in most cases measured and at best about 10%
faster (chapter 11 shows the measurements); the backward calls ``?gtsv`` with ``A^H``.

Factorization as a feature: :func:`tridiagonal_lu_factor` returns :class:`TridiagonalFactors`, and
:func:`tridiagonal_lu_solve` solves with ``A``, ``A^T`` or ``A^H`` from them, for a matrix that
is used many times (implicit time steps). Both paths take the factors as optional inputs: the
forward solves from them, and the backward and ``jvp`` solve with ``A^H`` and ``A`` from them too.
The bands travel beside the factors, so gradients reach them through the same rules.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from . import _compat, kernels, rules
from ._validation import (
    SingularMatrixError,
    validate,
    validate_bands,
    validate_factor_args,
    validate_factors,
    validate_kernel_args,
)
from .kernels import compiled

__all__ = ["tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve",
           "TridiagonalFactors", "SCHEMAS"]


# The kernels (tridiag_tutorial.kernels), called directly: no autograd, no checks, one batch
# shape, rhs (*B, n, k). ``driver`` names the kernel.
_kernel = kernels.solve
_factor_kernel = kernels.factor


def _adjoint(lu, pivots, trans: str):
    """``(lu, pivots, trans)`` that solve with ``M^H``, where ``(lu, pivots, trans)`` solve with
    ``M``. Without factors the rules pass ``M^H``'s bands, and nothing changes."""
    if lu is None:
        return None, None, "N"
    if trans == "N":
        return lu, pivots, "C"
    if trans == "C":
        return lu, pivots, "N"
    # M = A^T, so M^H = conj(A) = conj(L) conj(U): the conjugate factors, with the same pivots
    # (LAPACK's pivoting magnitude |re| + |im| does not change under conjugation).
    return lu.conj().resolve_conj(), pivots, "N"


def _direct(*tensors) -> bool:
    """True when the kernels may be called on these tensors directly, skipping the dispatcher:
    no ``torch.func`` transform is active, no dispatch or function mode is installed, and they
    are plain tensors with data (no subclass, no FakeTensor or meta tensor, no functorch wrapper).
    Dispatching a custom op costs tens of microseconds in Python, more than LAPACK needs for
    n = 100. ``None`` entries (absent factors) are skipped."""
    if torch.compiler.is_compiling():  # Dynamo traces the ops, never the kernels
        return False
    if _compat.mode_active() or _compat.transform_active():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.is_meta or _compat.is_functorch_tensor(t):
            return False
    return True


def _register_sharding_for(tensors) -> None:
    """Register DTensor's sharding rules for the ops (:mod:`tridiag_tutorial.distributed.sharding`) the first
    time a DTensor reaches one, so that a caller need not know to import that module. Importing it
    registers them, so they are registered exactly when it is in ``sys.modules``. Where
    ``torch.distributed.tensor`` is not imported, no tensor can be a DTensor, and the package
    does not import it: the check is two dictionary lookups. Not while compiling: import
    :mod:`tridiag_tutorial.distributed.sharding` before compiling a function of DTensors."""
    if torch.compiler.is_compiling() or "tridiag_tutorial.distributed.sharding" in sys.modules:
        return
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in tensors):
        from .distributed import sharding  # noqa: F401  (importing it registers the rules)


def _unobserved(args) -> bool:
    """True when nothing but the result of this call matters: no gradient will be asked for, no
    ``torch.func`` transform or forward-AD level is active, and :func:`_direct` holds. Then the
    public functions call the kernel without ``autograd.Function`` or the op."""
    if _compat.forward_ad_active():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return False
    return _direct(*args)


def _vmap_rule(solve, info, in_dims, *args, out_dims=0):
    """The general batch rule: put the vmapped dimension first on every input.

    The kernels need all inputs to have the same batch shape, so unbatched inputs are expanded
    along the new dimension (a view, no copy) rather than left alone; ``None`` arguments (absent
    optional inputs) stay ``None``.
    """
    args = [
        None if a is None else a.movedim(d, 0) if d is not None
        else a.expand(info.batch_size, *a.shape)
        for a, d in zip(args, in_dims)
    ]
    return solve(*args), out_dims


def _batch_rule(solve, info, in_dims, lower, diag, upper, rhs, lu, pivots):
    """The vmap rule of both paths' solve (``solve`` takes the six tensors).

    When only ``rhs`` is batched (one matrix, many right-hand sides), the vmapped dimension
    becomes more columns of ``rhs``: one solve with ``k * batch`` columns, as JAX's batching rule
    does, instead of copying the matrix to every batch element. Otherwise the vmapped dimension
    goes first on every input, and unbatched inputs are expanded along it (a view)."""
    if in_dims[3] is not None and all(d is None for i, d in enumerate(in_dims) if i != 3):
        b = rhs.movedim(in_dims[3], -1)  # (*B, n, k, batch)
        x = solve(lower, diag, upper, b.reshape(*b.shape[:-2], -1), lu, pivots)
        return x.reshape(b.shape).movedim(-1, 0), 0
    return _vmap_rule(solve, info, in_dims, lower, diag, upper, rhs, lu, pivots)


def _band_grads_and_rhs(solve, needs, lower, diag, upper, x, grad_x):
    """:func:`rules.solve_backward`, computing only the band gradients that ``needs`` asks for
    (``ctx.needs_input_grad`` of the bands); ``v = A^{-H} g`` is the gradient of ``rhs``."""
    if any(needs):
        return rules.solve_backward(solve, lower, diag, upper, x, grad_x)
    v = solve(upper.conj(), diag.conj(), lower.conj(), grad_x)
    return None, None, None, v


def _backward(solve, ctx, saved, grad_x):
    """Both paths' backward: ``solve(lower, diag, upper, rhs, lu, pivots, trans)`` solves with
    ``M^H`` from the saved factors (or from ``M^H``'s bands when there are none); ``saved`` is
    ``ctx.saved_tensors``."""
    lower, diag, upper, x, lu, pivots = saved
    lu, pivots, trans = _adjoint(lu, pivots, ctx.trans)
    grads = _band_grads_and_rhs(lambda l, d, u, r: solve(l, d, u, r, lu, pivots, trans),
                                ctx.needs_input_grad[:3], lower, diag, upper, x, grad_x)
    return (*grads, None, None, None, None)


def _jvp(solve, ctx, tangents):
    """Both paths' ``jvp``: ``dx = M^{-1} (d_rhs - dM x)``, solving with the saved factors."""
    _check_not_forward_over_forward()
    lower, diag, upper, x, lu, pivots = ctx.saved_tensors
    return rules.solve_jvp(lambda l, d, u, r: solve(l, d, u, r, lu, pivots, ctx.trans),
                           lower, diag, upper, x, *tangents)


# --------------------------------------------------------------------------------------------
# The eager path: an autograd.Function that torch.func and forward-mode AD understand.
# --------------------------------------------------------------------------------------------
class _TridiagonalSolve(torch.autograd.Function):
    """``x = solve(lower, diag, upper, rhs, lu, pivots, trans, driver)`` (see
    :func:`tridiag_tutorial.kernels.solve`). ``driver`` names the kernel; the backward and
    ``jvp`` reuse it, and the factors, when there are any."""

    @staticmethod
    def forward(lower, diag, upper, rhs, lu, pivots, trans, driver):
        if _direct(lower, diag, upper, rhs, lu, pivots):
            return _kernel(lower, diag, upper, rhs, lu, pivots, trans, driver)
        _register_sharding_for((lower, diag, upper, rhs))  # DTensors: the rules, once
        return _kernel_op(lower, diag, upper, rhs, lu, pivots, trans, driver)  # modes, fakes

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, lu, pivots, ctx.trans, ctx.driver = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(lower, diag, upper, output, lu, pivots)
        ctx.save_for_forward(lower, diag, upper, output, lu, pivots)

    @staticmethod
    def backward(ctx, grad_x):
        if grad_x is None:  # grads are not materialised: x was not used by the loss
            return (None,) * 8
        saved = ctx.saved_tensors  # each read unpacks them again: read once
        plain = not torch.is_grad_enabled() and not _compat.forward_ad_active()
        if plain and _direct(grad_x, *saved):
            # First-order backward, not itself differentiated: call the kernels directly.
            return _backward(lambda *a: _kernel(*a, ctx.driver), ctx, saved, grad_x)
        # Solve through the differentiable Function, so higher derivatives work.
        return _backward(lambda *a: _apply(*a, ctx.driver), ctx, saved, grad_x)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, *_):
        return _jvp(lambda *a: _apply(*a, ctx.driver), ctx, (d_lower, d_diag, d_upper, d_rhs))

    @staticmethod
    def vmap(info, in_dims, lower, diag, upper, rhs, lu, pivots, trans, driver):
        def solve(*tensors):
            return _TridiagonalSolve.apply(*tensors, trans, driver)
        return _batch_rule(solve, info, in_dims[:6], lower, diag, upper, rhs, lu, pivots)


def _apply(*args):
    """``_TridiagonalSolve.apply(*args)``. Without a ``torch.func`` transform, through
    :func:`_compat.function_apply`, which skips the :mod:`inspect` binding of the arguments that
    ``Function.apply`` does on every call for a Function with ``setup_context`` (chapter 11
    measures that cost: several times LAPACK's own time at n = 100)."""
    return _compat.function_apply(_TridiagonalSolve, *args)


def _differentiable_solve(lower, diag, upper, rhs, driver: str | None = None):
    """The differentiable solve of validated inputs through :class:`_TridiagonalSolve` (the
    Function that ``torch.func`` needs); chapter 8 compiles it to show what Dynamo does with such
    a Function."""
    return _TridiagonalSolve.apply(lower, diag, upper, rhs, None, None, "N",
                                   kernels.resolve_driver(driver, rhs))


_FORWARD_OVER_FORWARD = (
    "tridiagonal_solve: forward-mode AD nested in forward-mode AD (torch.func.jvp of jvp, "
    "jacfwd(jacfwd(f))) is not supported: torch does not differentiate an autograd.Function's "
    "jvp rule at an outer forward-mode level, so the second derivative would be silently wrong. "
    "Use torch.func.hessian or jacfwd(jacrev(f)) (forward-over-reverse), or jacrev(jacrev(f)), "
    "which work.")


def _check_not_forward_over_forward() -> None:
    if _compat.forward_transform_depth() > 1:
        raise NotImplementedError(_FORWARD_OVER_FORWARD)


# --------------------------------------------------------------------------------------------
# The ops. Their schemas are in C++ (csrc/tridiag.cpp); SCHEMAS defines the same ones where the
# extension was not built. tridiag_tutorial::solve has an Autograd kernel of our own;
# solve_kernel (the kernel alone, what the graphs call forward and backward) and lu_factor have
# fake kernels and vmap rules; cpp_solve (and cpp_solve_ex) is the C++ kernel, and
# cpp_solve_backward its reverse mode in one call.
# --------------------------------------------------------------------------------------------
SCHEMAS = {
    "solve": "solve(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, Tensor? lu, "
             "Tensor? pivots, str trans, str driver) -> Tensor",
    "solve_kernel": "solve_kernel(Tensor lower, Tensor diag, Tensor upper, Tensor rhs, Tensor? lu, "
                    "Tensor? pivots, str trans, str driver) -> Tensor",
    "lu_factor": "lu_factor(Tensor lower, Tensor diag, Tensor upper, str driver) -> (Tensor, Tensor)",
}

_LIB = torch.library.Library("tridiag_tutorial", "FRAGMENT")
if not compiled.is_available():
    for _schema in SCHEMAS.values():
        _LIB.define(_schema)
# The dispatch keys of the Python kernels. With the extension, its CompositeExplicitAutograd
# kernel (what a process without Python runs) stays for every other key, and a kernel registered
# for a backend key takes precedence over it; without the extension, ours is the composite one.
_KERNEL_KEYS = (("CPU", "CUDA", "MPS", "XPU") if compiled.is_available()
                else ("CompositeExplicitAutograd",))


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
    if (driver == "cpp" and lu is None and pivots is None and trans == "N"
            and rhs.ndim == diag.ndim + 1):  # the C++ op also takes (*B, n): these ops do not
        return compiled.solve(lower, diag, upper, rhs)
    _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver)
    return _kernel(lower, diag, upper, rhs, lu, pivots, trans, driver)


def _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver) -> None:
    validate_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, name=_KERNEL_OP_NAME)
    _check_op_driver(driver, lu, diag.device, _KERNEL_OP_NAME)


_KERNEL_OP_NAME = "tridiag_tutorial::solve_kernel"


def _solve_fake(lower, diag, upper, rhs, lu, pivots, trans, driver):
    """The one fake kernel of ``solve`` and ``solve_kernel``: the checks of the real kernel, and
    a new C-contiguous tensor of ``rhs``'s shape, as every kernel returns."""
    _check_kernel_args(lower, diag, upper, rhs, lu, pivots, trans, driver)
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


for _key in _KERNEL_KEYS:
    _LIB.impl("solve_kernel", _solve_kernel, _key)
    _LIB.impl("solve", _solve_kernel, _key)
    _LIB.impl("lu_factor", _lu_factor_kernel, _key)
torch.library.register_fake("tridiag_tutorial::solve_kernel", _solve_fake, lib=_LIB)
torch.library.register_fake("tridiag_tutorial::solve", _solve_fake, lib=_LIB)
torch.library.register_fake("tridiag_tutorial::lu_factor", _lu_factor_fake, lib=_LIB)
if compiled.is_available():
    torch.library.register_fake("tridiag_tutorial::cpp_solve", _cpp_solve_fake, lib=_LIB)
    torch.library.register_fake("tridiag_tutorial::cpp_solve_ex", _cpp_solve_ex_fake, lib=_LIB)
    torch.library.register_fake("tridiag_tutorial::cpp_solve_backward", _cpp_solve_backward_fake,
                                lib=_LIB)

_kernel_op = torch.ops.tridiag_tutorial.solve_kernel.default
_factor_op = torch.ops.tridiag_tutorial.lu_factor.default
torch.library.register_vmap("tridiag_tutorial::solve_kernel", _vmap_with_kernel(_kernel_op),
                            lib=_LIB)


def _factor_vmap(info, in_dims, lower, diag, upper, driver):
    return _vmap_rule(lambda *bands: _factor_op(*bands, driver), info, in_dims[:3],
                      lower, diag, upper, out_dims=(0, 0))


torch.library.register_vmap("tridiag_tutorial::lu_factor", _factor_vmap, lib=_LIB)


def _factors(lower, diag, upper, driver: str):
    """``(lu, pivots)`` of the bands, through the op unless the kernel may be called directly."""
    bands = tuple(t.detach() for t in (lower, diag, upper))  # factors carry no derivative
    if _direct(*bands):
        return _factor_kernel(*bands, driver)
    _register_sharding_for(bands)
    return _factor_op(*bands, driver)


def _with_primal_layout(dx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The tangent ``dx`` of the solution ``x``, laid out as ``x`` is.

    Forward-mode AD gives an output's tangent its primal's layout: where the strides differ it
    copies the tangent through ``aten::_new_zeros_with_same_feature_meta``, which reads the
    primal's ``storage_offset()`` and so raises "Cannot call storage_offset() on tensor with
    symbolic sizes/strides" under ``torch.compile(..., dynamic=True)`` (torch 2.13). They differ
    when a ``vmap`` batches the tangent's right-hand side but not the primal's (``jacfwd`` is
    such a ``vmap`` of ``jvp``): :func:`_batch_rule` solves that as more columns, so the vmapped
    dimension comes back innermost in memory, while ``x`` is C-contiguous. Where the primal is
    vmapped in the same way, the strides agree and nothing is copied."""
    if dx.stride() == x.stride():
        return dx
    return dx.contiguous()  # the copy that torch would make, here without storage_offset()


class _CompiledSolve(_compat.SingleLevelFunction):
    """The Autograd kernel of ``tridiag_tutorial::solve``: one autograd node at the current level."""

    @staticmethod
    def forward(lower, diag, upper, rhs, lu, pivots, trans, driver):
        return _kernel_op(lower, diag, upper, rhs, lu, pivots, trans, driver)

    @staticmethod
    def setup_context(ctx, inputs, output):
        lower, diag, upper, _, lu, pivots, ctx.trans, ctx.driver = inputs
        ctx.save_for_backward(lower, diag, upper, output, lu, pivots)
        ctx.save_for_forward(lower, diag, upper, output, lu, pivots)

    @staticmethod
    def backward(ctx, grad_x):
        return _backward(lambda *a: _compiled_op(*a, ctx.driver), ctx, ctx.saved_tensors, grad_x)

    @staticmethod
    def jvp(ctx, d_lower, d_diag, d_upper, d_rhs, *_):
        dx = _jvp(lambda *a: _compiled_op(*a, ctx.driver), ctx, (d_lower, d_diag, d_upper, d_rhs))
        return _with_primal_layout(dx, ctx.saved_tensors[3])


_NESTED_UNDER_COMPILE = (
    "tridiagonal_solve: nested differentiation inside torch.compile (torch.func.hessian, "
    "jacfwd(jacrev(f)), grad(grad(f)), a transform of a transform that both differentiate) is not "
    "supported: the compiled op attaches its derivative to one transform level only. Run the "
    "nested transform eagerly (without torch.compile), where it works; inside torch.compile, one "
    "level of grad, vjp, jacrev, jvp or jacfwd (optionally under vmap) works.")


def _solve_autograd(lower, diag, upper, rhs, lu, pivots, trans, driver):
    if _compat.differentiation_depth() > 1:
        raise NotImplementedError(_NESTED_UNDER_COMPILE)
    with _compat.enable_single_level_autograd_function():
        return _CompiledSolve.apply(lower, diag, upper, rhs, lu, pivots, trans, driver)


_LIB.impl("solve", _solve_autograd, "Autograd")
_compiled_op = torch.ops.tridiag_tutorial.solve.default
torch.library.register_vmap("tridiag_tutorial::solve", _vmap_with_kernel(_compiled_op), lib=_LIB)


# --------------------------------------------------------------------------------------------
# The public face.
# --------------------------------------------------------------------------------------------
def _solve(lower, diag, upper, rhs, lu, pivots, trans: str, driver: str) -> torch.Tensor:
    """Route one validated solve: compiled op, direct kernel or the eager Function."""
    args = (lower, diag, upper, rhs, lu, pivots)
    if torch.compiler.is_compiling():
        return _compiled_op(*args, trans, driver)
    if torch.jit.is_tracing():
        raise RuntimeError(
            "tridiagonal_solve: torch.jit.trace cannot record this op (it calls LAPACK through "
            "NumPy, so the trace would hold the solution as a constant). Use torch.compile, or "
            "torch.export.export for a graph to save.")
    if _unobserved(args):  # no autograd, transform or mode can see the call: skip dispatch
        return _kernel(*args, trans, driver)
    return _apply(*args, trans, driver)


_CPP = kernels.cpp_available()  # the fast path's switch (the routes benchmark turns it off)


class _CppSolve(torch.autograd.Function):
    """The C++ kernel with reverse-mode autograd and nothing else, for :func:`_solve_on_cpp`: a
    gradient is asked for, but no transform, forward-AD level or mode can see the call, so the
    ``jvp`` and ``vmap`` rules of :class:`_TridiagonalSolve` are not needed, nor its factors,
    ``trans`` or driver argument, nor the reshaping of a vector ``rhs`` (the op takes it as it
    is). The backward is one call of the C++ op ``cpp_solve_backward``
    (:func:`compiled.solve_backward`: the solve with ``A^H`` on the same kernel, and the band
    gradients formed in C++ in one pass, not four torch ops), or the solve alone where only
    ``rhs`` needs a gradient; where it is itself differentiated (``create_graph=True``) or runs
    under a transform (``torch.autograd.functional.jacobian(..., vectorize=True)`` vmaps it), it
    takes the general path's differentiable rules instead."""

    @staticmethod
    def forward(ctx, lower, diag, upper, rhs):
        x = compiled.solve(lower, diag, upper, rhs)
        ctx.save_for_backward(lower, diag, upper, x)
        return x

    @staticmethod
    def backward(ctx, grad_x):
        lower, diag, upper, x = ctx.saved_tensors
        need_lower, need_diag, need_upper, _ = ctx.needs_input_grad
        if not (torch.is_grad_enabled() or _compat.forward_ad_active() or not _direct(grad_x)):
            # (Written flat on purpose: at n = 1e4 the kernel evicts the interpreter from the
            # caches, and every Python step around it costs several times its usual time.)
            if not (need_lower or need_diag or need_upper):  # rhs alone: the solve with A^H
                return None, None, None, compiled.solve(upper.conj(), diag.conj(), lower.conj(),
                                                        grad_x)
            grad_lower, grad_diag, grad_upper, grad_rhs = compiled.solve_backward(
                lower, diag, upper, x, grad_x)  # one call, in C++
            return (grad_lower if need_lower else None, grad_diag if need_diag else None,
                    grad_upper if need_upper else None, grad_rhs)
        needs = (need_lower, need_diag, need_upper)

        def solve(lower, diag, upper, rhs):  # differentiable, and it knows transforms
            return _apply(lower, diag, upper, rhs, None, None, "N", "cpp")

        column = (lambda t: t.unsqueeze(-1)) if x.dim() == diag.dim() else (lambda t: t)
        grads = _band_grads_and_rhs(solve, needs, lower, diag, upper, column(x), column(grad_x))
        return (*grads[:3], grads[3].reshape(x.shape))


_CPP_SOLVE_APPLY = _compat.base_apply(_CppSolve)  # _CppSolve.apply without its Python layer


def _solve_on_cpp(lower, diag, upper, rhs):
    """:func:`tridiagonal_solve` with ``driver=None`` on the C++ kernel without the Python
    validation, for a call that no transform, mode or compiler can observe: ``(x, None)``, or
    ``(None, driver)`` where that does not apply and the general path runs (``driver`` the
    automatic choice when it was made here, else ``None``).

    It applies to plain CPU tensors of one batch shape (no broadcasting) when no transform,
    forward-AD level, mode, trace or compilation is active, and the automatic choice is the C++
    kernel. Without a gradient it calls the op; with one, :class:`_CppSolve`, the op with a
    backward and nothing more. The C++ op checks everything that
    :func:`~tridiag_tutorial._validation.validate` checks before it reads a tensor; where it
    refuses the inputs, the general path validates them again and raises the typed error. At
    n = 100 the general path costs twice the fast one (chapter 11's routes table)."""
    if not (type(lower) is type(diag) is type(upper) is type(rhs) is torch.Tensor and diag.is_cpu):
        return None, None
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or _compat.forward_ad_active()
            or _compat.transform_active() or _compat.mode_active()):
        return None, None
    try:
        shape = diag.shape  # (a nested tensor has no shape: RuntimeError)
        if not shape or lower.shape != upper.shape or lower.shape[:-1] != shape[:-1] \
                or rhs.shape[:len(shape) - 1] != shape[:-1] or not shape[-1]:
            return None, None  # broadcasting, or inputs the general path refuses
        n = shape[-1]
        driver = kernels.choose_driver("cpu", diag.dtype, diag.numel() // n, n, True)
        if driver != "cpp":
            return None, driver
        if torch.is_grad_enabled() and (lower.requires_grad or diag.requires_grad
                                        or upper.requires_grad or rhs.requires_grad):
            # Function.apply less its Python layer (no transform is active here, and _CppSolve
            # has no setup_context): what it does then, in one call.
            return _CPP_SOLVE_APPLY(*_compat.unwrap_dead_wrappers((lower, diag, upper, rhs))), None
        return compiled.solve(lower, diag, upper, rhs), None
    except SingularMatrixError:
        raise
    except (RuntimeError, ValueError, TypeError):
        # inputs the op refuses (a meta tensor among CPU ones reaches the op's fake kernel, which
        # raises under the op's own name): the general path says what is wrong with them
        return None, None


def tridiagonal_solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                      rhs: torch.Tensor, *, driver: str | None = None) -> torch.Tensor:
    r"""Solve ``A x = rhs`` for a tridiagonal ``A``, differentiably, in O(n).

    Args:
        lower: ``(..., n-1)``, the subdiagonal: ``lower[..., i] = A[i+1, i]``.
        diag: ``(..., n)``, the diagonal: ``diag[..., i] = A[i, i]``.
        upper: ``(..., n-1)``, the superdiagonal: ``upper[..., i] = A[i, i+1]``.
        rhs: ``(..., n)`` for one right-hand side per system (``rhs.ndim == diag.ndim``), or
            ``(..., n, k)`` for ``k`` of them (``rhs.ndim == diag.ndim + 1``).

        driver: the kernel: ``None`` (the default) chooses
            (:func:`tridiag_tutorial.kernels.choose_driver`); ``"lapack"`` (LAPACK ``?gtsv``
            through SciPy, CPU), ``"cpp"`` (the C++ kernel built at install, CPU; see
            :func:`tridiag_tutorial.cpp_available`), ``"sequential"`` or ``"partitioned"`` (the
            kernels in torch ops that other devices use; on the CPU they run the same code).

    The batch dimensions ``...`` of the four arguments broadcast. All four must have the same
    dtype (float32, float64, complex64 or complex128) and device.

    Returns:
        ``x`` with ``rhs``'s broadcast shape, ``(*batch, n)`` or ``(*batch, n, k)``, and dtype.

    Raises:
        TypeError: mixed or unsupported dtypes, or an argument that is not a tensor.
        ValueError: mixed devices, band lengths that do not fit ``n``, batch shapes that do not
            broadcast, or an unknown driver (or ``"lapack"`` / ``"cpp"`` off the CPU).
        tridiag_tutorial.SingularMatrixError: ``A`` is singular (an exactly zero pivot in LU with
            partial pivoting); a :class:`torch.linalg.LinAlgError` whose ``pivot`` and
            ``batch_index`` say where, as its message does.
        RuntimeError: ``driver="cpp"`` where the C++ kernel was not built.

    With ``driver=None``, a CPU solve runs on the C++ kernel (the same arithmetic as LAPACK's
    ``?gtsv``, bit for bit, on many systems at once; one large real system is cut into pieces
    whose eliminations run side by side, with other rounding, and handed back to ``?gtsv``'s
    arithmetic where its answer cannot be vouched for), except one complex system of more than
    3000 unknowns,
    and where the C++ kernel was not built: those run on LAPACK ``?gtsv``. A backward solves
    again with ``A^H`` on the same kernel. On other devices kernels in torch ops run: for ``n < 64`` the
    sequential kernel (the same pivoting), which, when a backward will follow, factors once and
    lets the backward reuse the factors; for ``n >= 64`` the partitioned kernel
    (:mod:`tridiag_tutorial.kernels.partitioned`, O(log n) operations; it checks its answer and solves
    again with the sequential kernel where the check fails), whose backward solves with ``A^H``.
    Gradients flow to all four inputs, to any order; ``torch.compile(fullgraph=True)`` traces it
    with no graph break. Inputs are never modified. To solve many times with one matrix, see
    :func:`tridiagonal_lu_factor`.

    Example:
        >>> import torch
        >>> from tridiag_tutorial import tridiagonal_solve
        >>> lower = torch.tensor([1.0, 1.0])            # A = [[2, 1, 0],
        >>> diag = torch.tensor([2.0, 2.0, 2.0])        #      [1, 2, 1],
        >>> upper = torch.tensor([1.0, 1.0])            #      [0, 1, 2]]
        >>> rhs = torch.tensor([4.0, 8.0, 8.0], requires_grad=True)
        >>> x = tridiagonal_solve(lower, diag, upper, rhs)
        >>> x.detach().round(decimals=6)
        tensor([1., 2., 3.])
        >>> x.sum().backward()                          # rhs.grad = A^{-T} @ ones
        >>> rhs.grad.round(decimals=6)
        tensor([0.5000, 0.0000, 0.5000])
    """
    chosen = None
    if driver is None and _CPP:
        x, chosen = _solve_on_cpp(lower, diag, upper, rhs)
        if x is not None:
            return x
    p = validate(lower, diag, upper, rhs)
    driver = chosen or kernels.resolve_driver(driver, p.rhs)
    lu = pivots = None
    if (driver == "sequential" and torch.is_grad_enabled()
            and any(t.requires_grad for t in (p.lower, p.diag, p.upper, p.rhs))):
        # The sequential kernel: factor once, and the backward solves with A^H from the factors.
        lu, pivots = _factors(p.lower, p.diag, p.upper, driver)
    x = _solve(p.lower, p.diag, p.upper, p.rhs, lu, pivots, "N", driver)
    return x.squeeze(-1) if p.vector_rhs else x


class TridiagonalFactors(NamedTuple):
    """The LU factorization of a (batch of) tridiagonal matrices, from :func:`tridiagonal_lu_factor`.

    Its fields:

    - ``lower``, ``diag``, ``upper``: the bands the factors were made from, broadcast to one batch
      shape (kept so that gradients reach them: the tensors the caller passed, or views of them);
    - ``lu``: ``(*batch, 4, n)``, LAPACK ``?gttrf``'s output in its rows: the multipliers of ``L``
      (``dl``), and the diagonal and two superdiagonals of ``U`` (``d``, ``du``, ``du2``), each
      zero-padded to ``n``;
    - ``pivots``: ``(*batch, n)`` int32, ``?gttrf``'s 1-based ``ipiv`` for each system: row ``i``
      was interchanged with row ``pivots[i] - 1`` (``i`` or ``i + 1``), the convention of
      :func:`torch.linalg.lu_factor`.

    ``batch_shape``, ``n``, ``device`` and ``dtype`` describe the matrix.

    It is a named tuple of tensors, so it can be passed into and returned from functions that
    ``torch.compile`` or ``torch.func.vmap`` transform.
    """

    lower: torch.Tensor
    diag: torch.Tensor
    upper: torch.Tensor
    lu: torch.Tensor
    pivots: torch.Tensor

    @property
    def batch_shape(self) -> torch.Size:
        return self.diag.shape[:-1]

    @property
    def n(self) -> int:
        return self.diag.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.diag.device

    @property
    def dtype(self) -> torch.dtype:
        return self.diag.dtype


def tridiagonal_lu_factor(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, *,
                          driver: str | None = None) -> TridiagonalFactors:
    r"""Factor ``A = P L U`` once (LU with partial pivoting), to solve with it many times.

    The bands follow :func:`tridiagonal_solve`'s conventions and broadcast. On CPU this is LAPACK
    ``?gttrf``; on other devices the sequential pure-torch kernel, which makes the same pivot
    choices. There, factoring and solving from the factors dispatch O(n) torch operations, so for
    systems of ``n >= 64`` on a GPU :func:`tridiagonal_solve` (the partitioned kernel, O(log n)
    operations) is likely the faster way to solve repeatedly; measure both.
    Pass the result to :func:`tridiagonal_lu_solve`. Works eagerly, under ``torch.compile`` and
    under ``torch.func`` transforms.

    ``driver`` is ``None`` (LAPACK ``?gttrf`` on the CPU, the sequential kernel elsewhere),
    ``"lapack"`` or ``"sequential"``.

    Raises:
        TypeError, ValueError: as :func:`tridiagonal_solve`, for the bands.
        tridiag_tutorial.SingularMatrixError: ``A`` is singular (a ``torch.linalg.LinAlgError``
            with ``pivot`` and ``batch_index``).
        RuntimeError: under ``torch.jit.trace`` (the trace would hold the factors of the example
            as constants) and ``torch.jit.script``; use ``torch.compile`` or
            ``torch.export.export``.

    Example:
        >>> import torch
        >>> from tridiag_tutorial import tridiagonal_lu_factor, tridiagonal_lu_solve
        >>> factors = tridiagonal_lu_factor(torch.ones(2), torch.full((3,), 2.0), torch.ones(2))
        >>> x = tridiagonal_lu_solve(factors, torch.tensor([4.0, 8.0, 8.0]))
        >>> x.round(decimals=6)
        tensor([1., 2., 3.])
    """
    lower, diag, upper = validate_bands(lower, diag, upper, name="tridiagonal_lu_factor")
    driver = kernels.resolve_factor_driver(driver, diag.device, "tridiagonal_lu_factor")
    if torch.jit.is_tracing():
        raise RuntimeError(
            "tridiagonal_lu_factor: torch.jit.trace cannot record this op (it calls LAPACK through "
            "NumPy, so the trace would hold the factors of the example as constants). Use "
            "torch.compile, or torch.export.export for a graph to save.")
    lu, pivots = _factors(lower, diag, upper, driver)  # the op under compile
    return TridiagonalFactors(lower, diag, upper, lu, pivots)


def tridiagonal_lu_solve(factors: TridiagonalFactors, rhs: torch.Tensor, trans: str = "N", *,
                         driver: str | None = None) -> torch.Tensor:
    r"""Solve ``A x = rhs`` (``trans='N'``), ``A^T x = rhs`` (``'T'``) or ``A^H x = rhs``
    (``'C'``) with the factors of :func:`tridiagonal_lu_factor`, in O(n) per right-hand side.

    ``rhs`` is ``(..., n)`` or ``(..., n, k)`` as for :func:`tridiagonal_solve`; its batch
    dimensions broadcast with the factors'. On CPU this is LAPACK ``?gttrs``.

    Differentiable with respect to ``rhs``, and with respect to the bands when the factors were
    made from bands that require grad (the derivative of ``A^{-1} rhs`` is the same as for
    :func:`tridiagonal_solve`; its backward solves with ``A^H`` from the same factors). It works
    with forward-mode AD, every ``torch.func`` transform, ``vmap`` (a ``vmap`` over the
    right-hand side alone is one solve with more columns) and ``torch.compile``, with the same
    limits as :func:`tridiagonal_solve`.

    ``driver`` is ``None`` (LAPACK ``?gttrs`` on the CPU, the sequential kernel elsewhere),
    ``"lapack"`` or ``"sequential"``: either solves from the factors of either, which are the same.

    Raises:
        TypeError: ``factors`` is not a :class:`TridiagonalFactors` of dense tensors; ``lu``'s
            dtype is not the bands' (a float32 ``lu`` beside float64 bands, a complex ``lu``
            beside real ones) or ``pivots`` is not int32; ``rhs`` has another dtype.
        ValueError: ``trans`` is not ``'N'``, ``'T'`` or ``'C'``; ``lu`` is not
            ``(*batch, 4, n)`` or ``pivots`` not ``(*batch, n)`` for the bands' batch shape;
            the factors, the bands and ``rhs`` are not all on one device (a meta tensor among
            CPU tensors included); ``rhs``'s shape does not fit; a pivot value is not one that
            ``?gttrf`` produces (1-based: ``pivots[..., i]`` is ``i + 1`` or ``i + 2``, the last
            one ``n``). The pivot values are checked where the kernel runs (also inside compiled
            and exported graphs), with one read back from the device. Measured on the CPU (one
            system, one thread, LAPACK, a loaded 2-core machine): the check took 4 to 9 µs at
            n = 100, beside a 32 to 46 µs solve, and 41 to 88 µs at n = 1e5, beside 1.6 ms.
            Pivots that are in range but were edited (``i + 1`` swapped for ``i + 2``) cannot
            be told apart from real ones and give a wrong answer: pass them unmodified.
        RuntimeError: under ``torch.jit.trace`` or ``torch.jit.script``; use ``torch.compile``
            or ``torch.export.export``.
    """
    if not isinstance(factors, TridiagonalFactors):
        raise TypeError("tridiagonal_lu_solve: factors must be the TridiagonalFactors returned by "
                        f"tridiagonal_lu_factor, got {type(factors).__name__}")
    if trans not in ("N", "T", "C"):
        raise ValueError(f"tridiagonal_lu_solve: trans must be 'N' (A), 'T' (A^T) or 'C' (A^H), "
                         f"got {trans!r}")
    lower, diag, upper, lu, pivots = factors
    for arg, t in zip(TridiagonalFactors._fields[:3], (lower, diag, upper)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tridiagonal_lu_solve: factors.{arg} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    validate_factors(lu, pivots, diag, name="tridiagonal_lu_solve")
    batch, n = diag.shape[:-1], diag.shape[-1]
    if trans == "T":  # the bands of M = A^T or A^H, for the derivative rules
        lower, upper = upper, lower
    elif trans == "C":
        lower, diag, upper = upper.conj(), diag.conj(), lower.conj()
    p = validate(lower, diag, upper, rhs, name="tridiagonal_lu_solve")
    driver = kernels.resolve_factor_driver(driver, p.diag.device, "tridiagonal_lu_solve")
    if p.diag.shape[:-1] != batch:  # rhs brought more batch dimensions: the factors follow
        lu = lu.expand(*p.diag.shape[:-1], 4, n)
        pivots = pivots.expand(*p.diag.shape[:-1], n)
    x = _solve(p.lower, p.diag, p.upper, p.rhs, lu, pivots, trans, driver)
    return x.squeeze(-1) if p.vector_rhs else x


def _refuse_torch_jit_script(fn) -> None:
    """Make ``torch.jit.script(fn)`` (and the scripting of a function that calls ``fn``) raise an
    error that names ``fn`` and says what to use instead. ``torch.jit.script`` raises
    ``RuntimeError("TorchScript error: " + fn.__script_unsupported)`` for a function with that
    attribute (the hook torch's own ``torch.autocast`` decorator uses); without it, TorchScript
    fails deep inside the validation code with an unrelated complaint (keyword-only arguments,
    f-strings, ``try`` blocks)."""
    fn.__script_unsupported = (  # set from outside a class: the name is not mangled
        f"{fn.__name__}: torch.jit.script cannot compile this function (it calls LAPACK through "
        "NumPy and checks its inputs in Python). Use torch.compile, or torch.export.export for a "
        "graph to save.")


for _public in (tridiagonal_solve, tridiagonal_lu_factor, tridiagonal_lu_solve):
    _refuse_torch_jit_script(_public)
del _public
