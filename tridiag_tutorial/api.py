r"""The public functions, :func:`tridiagonal_solve` and the LU pair: the result of the whole tutorial.

Design (chapter 13 explains it; chapter 5 shows the traps it gets around)::

    tridiagonal_solve(lower, diag, upper, rhs, driver=None)
        |-- driver=None, CPU, no transform, mode or compilation, the automatic choice is the
        |   C++ kernel: its op, directly (with a gradient, in functions._CppSolve); it checks
        |   the inputs, and where it refuses them, the path below validates them and says why
        |   validate + broadcast (one place); the driver resolved (kernels.resolve_driver)
        |-- compiling or exporting: torch.ops.tridiag_tutorial.solve
        |                                           schema in C++ (csrc/tridiag.cpp); fake kernel,
        |                                           an Autograd kernel that works under
        |                                           torch.func, and a vmap rule (registration)
        |-- torch.jit.trace: RuntimeError (the trace would hold the solution as a constant)
        |-- nothing observes the call (no grad, no transform, no mode): the kernel, directly
        |-- eager:     functions._TridiagonalSolve  autograd.Function: backward, jvp, vmap
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
(chapter 14); :mod:`tridiag_tutorial.registration` registers their fake kernels, the Autograd
kernel, the vmap rules and the kernels of each device, as pytorch/extension-cpp's ``ops.py``
does. Where the extension was not built, :mod:`tridiag_tutorial._schemas` defines the same
schemas itself. The two shortcuts (the C++ fast path, the direct kernel call) and two others
inside the Functions each have a switch (:mod:`tridiag_tutorial._routes`), which the benchmark
harness turns off to measure what each one buys.

What does not compose, and raises instead of answering wrongly (chapter 13's support table):

- nested differentiation (``hessian``, ``jacfwd(jacrev(f))``, ``grad(grad(f))``) *inside*
  ``torch.compile``: a single-level Function differentiates at one level only. The error says so
  and what to do (run that transform eagerly; compiled single-level transforms work);
- forward-over-forward (``jvp`` of ``jvp``, ``jacfwd(jacfwd(f))``), eager or compiled: torch does
  not differentiate an ``autograd.Function``'s ``jvp`` staticmethod at an outer forward level (it
  returns a silently wrong second derivative; pytorch issue 197867), so the op raises and points
  to ``hessian`` / ``jacfwd(jacrev(f))``, which work eagerly. ``torch.linalg.solve`` is wrong there
  too, for another reason (chapter 7): its tangent reuses the LU factors of its forward pass,
  which its ``derivatives.yaml`` entry declares non-differentiable (pytorch issue 192540);
- a differentiating ``torch.func`` transform inside ``torch.compile`` (or around the op
  ``tridiag_tutorial::solve`` called directly) while ordinary autograd also records the inputs (a
  gradient penalty): the op's derivative would reach the transform's level only, so the op raises
  (under ``torch.compile`` without ``fullgraph``, Dynamo then runs the frame eagerly, which is
  right);
- dual numbers made outside a compiled function (a ``dual_level`` around compiled code): the
  compiled graph drops their tangents, so the op refuses to be traced inside a dual level unless an
  input carries a traced tangent (duals made inside the compiled function work), and its kernel
  refuses tangents that reach a graph compiled before the level;
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
forward and backward keeping the factors does not pay (the benchmark suite's ``factor_reuse``
rows measured it); the
backward calls ``?gtsv`` with ``A^H``.

Factorization as a feature: :func:`tridiagonal_lu_factor` returns :class:`TridiagonalFactors`, and
:func:`tridiagonal_lu_solve` solves with ``A``, ``A^T`` or ``A^H`` from them, for a matrix that
is used many times (implicit time steps). Both paths take the factors as optional inputs: the
forward solves from them, and the backward and ``jvp`` solve with ``A^H`` and ``A`` from them too.
The bands travel beside the factors, so gradients reach them through the same rules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _compat, _routes, kernels
from . import registration as _registration  # noqa: F401  (the ops' kernels and rules)
from ._schemas import lu_factor_op as _factor_op
from ._schemas import solve_op as _compiled_op
from ._validation import (
    SingularMatrixError,
    validate,
    validate_bands,
    validate_factors,
)
from .functions import (
    _CPP_SOLVE_APPLY,
    _PLAIN,  # the fast path's tensor types: a plain tensor or a Parameter (no other subclass)
    _apply,
    _direct,
    _register_sharding_for,
    _unobserved,
)
from .kernels import compiled

__all__ = ["tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve",
           "TridiagonalFactors"]

_kernel = kernels.solve
_factor_kernel = kernels.factor


# [book: solve-routing]
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


_CPP = kernels.cpp_available()  # the C++ fast path exists (it runs where _routes.ON says)


def _solve_on_cpp(lower, diag, upper, rhs):
    """:func:`tridiagonal_solve` with ``driver=None`` on the C++ kernel without the Python
    validation, for a call that no transform, mode or compiler can observe: ``(x, None)``, or
    ``(None, driver)`` where that does not apply and the general path runs (``driver`` the
    automatic choice when it was made here, else ``None``).

    It applies to plain CPU tensors or Parameters of one batch shape (no broadcasting) when no transform,
    forward-AD level, mode, trace or compilation is active, and the automatic choice is the C++
    kernel. Without a gradient it calls the op; with one, :class:`_CppSolve`, the op with a
    backward and nothing more. The C++ op checks everything that
    :func:`~tridiag_tutorial._validation.validate` checks before it reads a tensor; where it
    refuses the inputs, the general path validates them again and raises the typed error. At
    n = 100 the general path costs twice the fast one (chapter 13's routes table)."""
    if not (type(lower) in _PLAIN and type(diag) in _PLAIN and type(upper) in _PLAIN
            and type(rhs) in _PLAIN and diag.is_cpu):
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
    if driver is None and _CPP and _routes.ON.cpp_fast_path:
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


def _factors(lower, diag, upper, driver: str):
    """``(lu, pivots)`` of the bands, through the op unless the kernel may be called directly."""
    bands = tuple(t.detach() for t in (lower, diag, upper))  # factors carry no derivative
    if _direct(*bands):
        return _factor_kernel(*bands, driver)
    _register_sharding_for(bands)
    return _factor_op(*bands, driver)


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
            and exported graphs), with one read back from the device. Pivots that are in range but were edited (``i + 1`` swapped for ``i + 2``) cannot
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
