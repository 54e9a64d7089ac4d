"""Route trace (issue 24, point 4): which functions of the package's routing layer run, scenario
by scenario, and how many distinct routes and predicates that makes.

A script, not a test (pytest does not collect it: no ``test_`` prefix). Run it from anywhere with
the package to measure on the import path::

    python tests/route_trace.py [--json PATH] [--no-warmup] [--only SUBSTRING] [--coarse]

It prints the fine count (below), then the coarse one; ``--coarse`` prints only the coarse one.
``tests/test_routes.py`` runs it and checks that neither count grows.

It works on the package before the redesign of issue 24 (kernels chosen by the context managers
``kernels.torch_kernel_on_cpu()``, ``kernels.use_partitioned()``, ``kernels.use_compiled()`` and
``compiled.load()``) and after it (a ``driver=`` keyword on the public functions); see
:class:`Kernels`, which detects which API it has.

What is a route
---------------
The *route* of a scenario is the set of routing-layer functions that ran while it ran, recorded
with ``sys.settrace`` (call events only; a local tracer is installed only on the frames whose
return value is recorded, see "Predicates"). The rule that decides which functions count is
:func:`classify`, and it is written so that the same script gives comparable numbers before and
after a redesign that renames or moves functions:

1. Only code whose module is ``tridiag_tutorial`` or one of its submodules counts.
2. Modules that are not the routing layer are left out entirely: ``NOT_ROUTING`` below
   (validation, the private-torch-API shims of ``_compat``, references, chapter versions,
   benchmarks). Every other module of the package (its ``__init__`` included) is routing layer,
   including modules the redesign may add (the output lists which modules contributed).
3. In the kernel modules (``KERNEL_MODULES``: LAPACK, the sequential and the partitioned torch
   kernels) only the *entry points* count: a function of such a module counts when its caller is
   not in a kernel module. A kernel's own helpers (chunking, padding, ``gtsv`` under
   ``lapack.solve``, the sequential kernel's ``factor_unchecked`` and ``lu_solve`` that the
   partitioned kernel uses) are then left out whatever their names. So is the partitioned
   kernel's fallback to ``torch_kernel.solve``: that is a decision on the data inside a kernel,
   not a route of the routing layer (the systems here are well conditioned, so it never runs).
4. Anonymous functions are left out everywhere: lambdas, comprehensions, generator
   expressions, and the resume functions Dynamo makes at a graph break
   (``torch_dynamo_resume_in_*``). They are glue that a redesign can add or remove (a lambda
   becomes a ``functools.partial``) without changing a route.
5. Calls of the package's registered ops from Python count as functions too, named
   ``op <namespace>::<name>``: every call of ``torch._ops.OpOverload.__call__`` or
   ``OpOverloadPacket.__call__`` whose op's namespace starts with ``tridiag_tutorial`` (the C++
   kernels ``tridiag_tutorial_cpp::*``, and the Python custom ops ``tridiag_tutorial::*``).
   A call made by C++ (one op's kernel calling another inside the dispatcher) is not seen.

Functions that Dynamo traces symbolically under ``torch.compile`` do not run as Python frames, so
they are not seen; a compile scenario's route is what runs for real: what Dynamo executes while
tracing (fake kernels, ``assume_constant_result`` functions) and what the compiled graph and its
backward call. A route is a set, so a function that runs many times (or only while tracing)
counts once.

Before the redesign a kernel is selected with context managers; the script enters them outside
the recording (they are the caller's code), so what counts is the reading of the choice inside
the call (``kernels._torch_kernel_on_cpu``), as after the redesign the handling of ``driver=``
inside the call counts.

Scenarios
---------
:func:`scenarios` lists them by name, ``"<kernel> n=<n> <mode>"``: the kernels LAPACK, C++
(skipped, and said so, where it cannot be built or is not installed), sequential and partitioned
(n = 100 only: it is the automatic torch-op kernel from n = 64); n = 5 (one system) and n = 100
(a batch of 4), float64, vector right-hand sides; the modes of ``SOLVE_MODES`` on every kernel,
``FACTOR_MODES`` on the kernels that factor (LAPACK, sequential), and meta tensors on the torch-op
kernels and on the automatic choice.

Each scenario (except the compile ones, which reset Dynamo and compile afresh) is first run once
untraced, so that a function that runs only on a first call (a cache being filled) does not split
a route in two; ``--no-warmup`` turns that off.

Coarse count
------------
Issue 24 counted routes another way: a route as the wrapper the call entered through, the way
its backward solves, and the kernels that ran ("6 entry wrappers, 6 backwards, 6 kernels").
:func:`coarse` classifies each scenario so, as a triple ``(entry, backward, kernel)``, from the
same recording: each recorded call also carries its *context*, the innermost ``backward`` or
``jvp`` method of the package on the Python stack (and which call of it), or none
(:meth:`Tracer._context`).

- **entry**, from the calls outside any derivative method: the first of :data:`ENTRY_WRAPPERS`
  that ran (the compiled op; before the redesign the C++ autograd op; the eager
  ``autograd.Function``, each of the two before the redesign separately); else
  ``"direct kernel"`` when a kernel ran (the public function called it without autograd);
  else ``"meta/fake"`` (only a fake kernel ran).
- **backward**: the kinds of the backward calls that ran (:func:`backward_kind`): ``NumPy``
  (before the redesign), ``compiled`` (the compiled op's Function), ``differentiable`` (the
  backward solved through the Function again), ``direct torch`` (it called the kernel
  directly); several when several ran (a double backward runs a differentiable backward and then
  a plain one), ``none`` when none did. The C++ autograd op of before the redesign runs its
  backward in C++, where Python sees nothing, so a scenario whose route holds it is run once more
  under the autograd profiler (:func:`cpp_backward_kinds`): ``C++ fused`` (the kernel and one
  fused loop) or ``C++ ATen`` (ATen operations, with ``create_graph``). ``jvp`` methods are not
  a component (the issue's count has no forward-mode one), but what they call counts in the
  kernel component.
- **kernel**: the kernel entry points that ran anywhere, as the labels of
  :data:`KERNEL_LABELS` (LAPACK solve; C++; sequential solve; partitioned; LAPACK factor and
  factored solve; sequential factor and factored solve).

It prints the number of distinct triples, of distinct ``(entry, backward)`` pairs, and the
values each component takes (for backward and kernel: both the combinations and the kinds).

Predicates
----------
A *predicate* is a function whose return value decides which way a route goes. The count is an
approximation, made two ways and both printed:

- **by return value** (the headline number): the routing-layer functions (rules 1 to 4, kernel
  entry points excepted) and the ``_compat`` functions that returned a ``bool`` or a ``str`` (a
  choice among names, such as a driver) at least once across all scenarios, e.g.
  ``kernels.compiled_pays``, ``functions._direct``, ``_compat.transform_active``. Of these, the ones
  that returned more than one value are the ones that told scenarios apart here (printed as
  "varying"); a function that always answered the same decided nothing among these scenarios.
- **by name**: the functions that ran and whose name matches ``PREDICATE_NAME`` (``*_pays``,
  ``*_direct``, ``*_unobserved``, ``*_reverse_mode_only``, ``*_active``, ``*_for``, ``*_solves``,
  ``*_allowed``, ``*_on_cpu``, ``is_loaded``, ``*_depth``, ``checkpoint_state``,
  ``choose_driver``, ``cpp_available``), whatever they returned.

Neither counts a decision made inline (an ``if`` on ``torch.is_grad_enabled()``) or in torch
(``torch.compiler.is_compiling``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import re
import sys
import threading
import time
import traceback

import torch
import torch._ops
from torch.autograd import forward_ad as fwAD

PACKAGE = "tridiag_tutorial"
# Rule 2: not the routing layer (module names relative to the package).
NOT_ROUTING = frozenset({"_validation", "_compat", "reference", "book.finite_diff",
                         "bench.benchmarks", "bench.accuracy", "book.autograd_function",
                         "book.custom_op"})
# Rule 3: kernel modules, of which only the entry points count.
KERNEL_MODULES = frozenset({"kernels.lapack", "kernels.sequential", "kernels.partitioned"})
_KERNEL_NAMES = frozenset(f"{PACKAGE}.{m}" for m in KERNEL_MODULES)
# The modules whose bool- or str-returning functions count as predicates besides the routing layer.
PREDICATE_EXTRA_MODULES = frozenset({"_compat"})
ANONYMOUS = ("<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
PREDICATE_NAME = re.compile(
    r"(_pays|_direct|_unobserved|_reverse_mode_only|_active|_for|_solves|_allowed|_on_cpu|"
    r"^is_loaded|_depth|^checkpoint_state|^choose_driver|^cpp_available)$")

# The methods whose callees run in a derivative context (Tracer._context).
DERIVATIVE_METHODS = ("backward", "jvp")

_OP_CALLS = {torch._ops.OpOverload.__call__.__code__: "overload",
             torch._ops.OpOverloadPacket.__call__.__code__: "packet"}

# What classify() returns for a code object (cached per code object).
SKIP, ROUTING, KERNEL, EXTRA, OPCALL = range(5)


def classify(code, module: str) -> int:
    """Rules 1 to 4 for one code object of module ``module`` (rule 3's caller test is made per
    call, in :meth:`Tracer._global`)."""
    if code in _OP_CALLS:
        return OPCALL
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return SKIP
    last = code.co_qualname.rsplit(".", 1)[-1]
    if last in ANONYMOUS or last.startswith("torch_dynamo_resume_in_"):
        return SKIP
    sub = module[len(PACKAGE) + 1:]  # "" for the package's __init__, which counts
    if sub in NOT_ROUTING:
        return EXTRA if sub in PREDICATE_EXTRA_MODULES else SKIP
    return KERNEL if sub in KERNEL_MODULES else ROUTING


class Tracer:
    """Records, while active, the route (rules 1 to 5) and the bool and str return values of the
    predicate candidates."""

    def __init__(self):
        self._kind = {}           # code -> classify() result
        self.route = set()        # names that ran in the current scenario
        self.returns = {}         # name -> set of bool / str values returned (all scenarios)
        self.modules = set()      # routing modules that contributed
        self.calls = set()        # (context, name) pairs of the current scenario (see _context)
        self._derivative = {}     # code -> "module.qualname" of a backward / jvp method, or ""
        self._serial = {}         # id(frame) -> serial of a running derivative method's call
        self._calls_made = 0

    def _context(self, frame) -> str:
        """The innermost derivative method of the package (a ``backward`` or ``jvp`` of a
        Function) on the Python stack above ``frame``, as ``"functions._TridiagonalSolve.backward#7"``
        (the number tells one call of the method from another: a double backward runs the same
        backward twice, once differentiably and once not); ``""`` when there is none (the call
        belongs to the forward computation). The autograd engine calls a backward from C++, so
        its frame's ``f_back`` is the frame that asked for the gradient, and what the backward
        calls has the backward on its stack."""
        cache = self._derivative
        f = frame.f_back
        while f is not None:
            code = f.f_code
            name = cache.get(code)
            if name is None:
                module = f.f_globals.get("__name__", "") or ""
                qual = code.co_qualname
                name = cache[code] = (
                    f"{module[len(PACKAGE) + 1:]}.{qual}"
                    if (module == PACKAGE or module.startswith(PACKAGE + "."))
                    and "." in qual and qual.rsplit(".", 1)[-1] in DERIVATIVE_METHODS else "")
            if name:
                return f"{name}#{self._serial.get(id(f), '?')}"
            f = f.f_back
        return ""

    def _name(self, frame) -> str:
        return f"{frame.f_globals['__name__'][len(PACKAGE) + 1:]}.{frame.f_code.co_qualname}"

    def _global(self, frame, event, arg):
        code = frame.f_code
        kind = self._kind.get(code)
        if kind is None:
            kind = self._kind[code] = classify(code, frame.f_globals.get("__name__", "") or "")
        if kind == SKIP:
            return None
        if kind == OPCALL:
            op = frame.f_locals.get("self")
            name = getattr(op, "_name", None) or getattr(op, "_qualified_op_name", "")
            if name.startswith(PACKAGE):
                self.route.add(f"op {name}")
                self.calls.add((self._context(frame), f"op {name}"))
            return None
        module = frame.f_globals["__name__"]
        if kind == KERNEL:
            caller = frame.f_back
            if caller is not None and caller.f_globals.get("__name__") in _KERNEL_NAMES:
                return None  # a kernel's helper (rule 3)
            self.route.add(self._name(frame))
            self.calls.add((self._context(frame), self._name(frame)))
            self.modules.add(module)
            return None
        name = self._name(frame)
        if code.co_qualname.rsplit(".", 1)[-1] in DERIVATIVE_METHODS:
            # A new call of a derivative method: a new serial for this frame (a frame's id is
            # reused only once it is gone, and the next frame with it comes through here first).
            self._calls_made += 1
            self._serial[id(frame)] = self._calls_made
        if kind == ROUTING:
            self.route.add(name)
            self.calls.add((self._context(frame), name))
            self.modules.add(module)
        frame.f_trace_lines = False
        returns = self.returns

        def local(frame, event, arg):  # sees this frame's "exception" and "return" events
            if event == "return" and isinstance(arg, (bool, str)):
                returns.setdefault(name, set()).add(arg)
            return local
        return local

    @contextlib.contextmanager
    def recording(self):
        self.route = set()
        self.calls = set()
        threading.settrace(self._global)
        sys.settrace(self._global)
        try:
            yield self.route
        finally:
            sys.settrace(None)
            threading.settrace(None)


# ------------------------------------------------------------------------------------------------
# The coarse count: a route as a triple (entry, backward, kernel).
# ------------------------------------------------------------------------------------------------
# Entry wrappers, by the functions (in the forward context) that mark them, in order of
# precedence: a call that goes through a later wrapper on its way to the kernel (the compiled
# op's Autograd kernel applies a Function whose forward calls solve_kernel) is classified by the
# first one that ran.
ENTRY_WRAPPERS = (
    ("compiled op", ("registration._solve_autograd", "functions._CompiledSolve.forward",
                     "op tridiag_tutorial::solve")),
    ("C++ autograd op", ("compiled.autograd_op", "op tridiag_tutorial_cpp::solve_autograd")),
    ("eager Function (_PlainTridiagonalSolve)", ("ops._PlainTridiagonalSolve.forward",)),
    ("eager Function (_TridiagonalSolve)", ("functions._TridiagonalSolve.forward",)),
    ("C++ fast path, Function (_CppSolve)", ("functions._CppSolve.forward",)),
)
# The C++ autograd op of the package before issue 24: its backward runs in C++, so Python sees
# none of it; a scenario whose route holds it is run once more under the autograd profiler
# (cpp_backward_kinds).
CPP_AUTOGRAD_OPS = ("op tridiag_tutorial_cpp::solve_autograd",)
# Kernel entry points (rule 3) and the ops that run a C++ kernel, as the labels of the kernel
# component. A kernel-module entry point not listed here is its own label (so a new one shows).
KERNEL_LABELS = {
    "kernels.lapack.solve": "lapack solve",
    "kernels.lapack.factor": "lapack factor+factored solve",
    "kernels.lapack.factor_solve": "lapack factor+factored solve",
    "kernels.compiled.solve": "cpp",
    "kernels.compiled.solve_backward": "cpp",
    "op tridiag_tutorial::cpp_solve": "cpp",
    "op tridiag_tutorial::cpp_solve_backward": "cpp",
    "op tridiag_tutorial_cpp::solve": "cpp",
    "op tridiag_tutorial_cpp::solve_autograd": "cpp",  # its kernel is called inside C++
    "kernels.sequential.solve": "sequential solve",
    "kernels.sequential.factor": "sequential factor+factored solve",
    "kernels.sequential.lu_solve": "sequential factor+factored solve",
    "kernels.partitioned.solve": "partitioned",
}


def kernel_label(name: str) -> str | None:
    """The kernel component's label of a recorded function, or None if it is not a kernel."""
    if name in KERNEL_LABELS:
        return KERNEL_LABELS[name]
    if name.rsplit(".", 1)[0] in KERNEL_MODULES:
        return name
    return None


def _is_fake(name: str) -> bool:
    return not name.startswith("op ") and name.rsplit(".", 1)[-1].endswith("_fake")


def backward_kind(context: str, callees: set) -> str:
    """How one backward (``context``, a ``backward`` method) solved, from what it called."""
    if "ops._numpy_backward" in callees:
        return "NumPy"
    if context.endswith("_CompiledSolve.backward") or "op tridiag_tutorial::solve" in callees:
        return "compiled"
    if "functions._apply" in callees or any(
            c.endswith(("TridiagonalSolve.forward", "TridiagonalSolve.apply")) for c in callees):
        return "differentiable"
    if "kernels.compiled.solve_backward" in callees:
        return "C++ fused"
    if "kernels.solve" in callees or any(kernel_label(c) for c in callees):
        return "direct torch"
    return f"other ({context})"


def coarse(calls, cpp_backward=()) -> tuple[str, str, str]:
    """``(entry, backward, kernel)`` of one scenario, from its ``(context, name)`` calls (and the
    kinds of C++ backward the profiler saw, :func:`cpp_backward_kinds`). ``backward`` is the
    kinds that ran, joined by ``", "`` (``"none"`` when none did); ``kernel`` the kernel labels,
    likewise; ``entry`` the first wrapper of :data:`ENTRY_WRAPPERS` that ran in the forward
    context, else ``"direct kernel"`` when a kernel ran, else ``"meta/fake"`` when only a fake
    kernel ran."""
    forward = {name for ctx, name in calls if ctx == ""}
    every = {name for _, name in calls}
    labels = {lab for lab in map(kernel_label, every) if lab}
    entry = next((label for label, marks in ENTRY_WRAPPERS if forward & set(marks)), None)
    if not labels:
        entry = "meta/fake" if any(map(_is_fake, every)) else "none"
    elif entry is None:
        # driver=None's C++ fast path called the kernel itself (api._solve never ran)
        entry = ("C++ fast path, direct" if "api._solve_on_cpp" in forward
                 and "api._solve" not in forward else "direct kernel")
    by_context = {}
    for ctx, name in calls:
        if ctx.rsplit("#", 1)[0].endswith(".backward"):
            by_context.setdefault(ctx, set()).add(name)
    kinds = {backward_kind(ctx.rsplit("#", 1)[0], callees) for ctx, callees in by_context.items()}
    kinds |= {f"C++ {k}" for k in cpp_backward}
    return (entry, ", ".join(sorted(kinds)) or "none", ", ".join(sorted(labels)) or "none")


def cpp_backward_kinds(fn) -> list:
    """Run ``fn`` under the autograd profiler and return the kinds of the C++ autograd op's
    backward that ran: ``"fused"`` (the kernel and one fused loop) or ``"ATen"`` (the solve and
    the band products as ATen operations, which autograd records: ``create_graph``, batched
    gradients), told apart by an ``aten::mul`` under the node's event."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    kinds = set()

    def names(event):
        for child in event.cpu_children:
            yield child.name
            yield from names(child)
    for event in prof.function_events:
        if event.name.startswith("torch::autograd::CppNode<") and "Tridiagonal" in event.name:
            kinds.add("ATen" if "aten::mul" in set(names(event)) else "fused")
    return sorted(kinds)


# ------------------------------------------------------------------------------------------------
# Which kernel: the API before the redesign (context managers) or after it (driver=).
# ------------------------------------------------------------------------------------------------
class Kernels:
    """Selects a kernel on the API the installed package has.

    ``api`` is ``"driver"`` when ``tridiagonal_solve`` takes a ``driver`` keyword (after
    issue 24), ``"context"`` when ``kernels.torch_kernel_on_cpu`` exists (before it).
    """

    def __init__(self):
        import tridiag_tutorial as tt
        from tridiag_tutorial import kernels
        self.tt = tt
        self.kernels = kernels
        if "driver" in inspect.signature(tt.tridiagonal_solve).parameters:
            self.api = "driver"
        elif hasattr(kernels, "torch_kernel_on_cpu"):
            self.api = "context"
        else:
            raise SystemExit("route_trace: neither a driver= keyword on tridiagonal_solve nor "
                             "kernels.torch_kernel_on_cpu: unknown API")
        self.unavailable = {}  # kernel -> why

    def prepare_cpp(self) -> bool:
        """Make the C++ kernel usable (build or load it before tracing); False if it is not."""
        try:
            if self.api == "driver":
                ok = bool(self.tt.cpp_available())
                if not ok:
                    self.unavailable["cpp"] = "tridiag_tutorial.cpp_available() is False"
                return ok
            from tridiag_tutorial.kernels import compiled
            compiled.load()
            return True
        except Exception as err:  # no compiler, no ninja, a failed build
            self.unavailable["cpp"] = f"{type(err).__name__}: {err}"
            return False

    def context(self, kernel: str):
        """The block to run a scenario of ``kernel`` in (before the redesign)."""
        stack = contextlib.ExitStack()
        if self.api == "driver" or kernel == "auto":
            return stack
        k = self.kernels
        if kernel == "lapack":
            stack.enter_context(k.use_compiled(False))
        elif kernel == "cpp":
            stack.enter_context(k.use_compiled(True))
        elif kernel == "sequential":
            stack.enter_context(k.torch_kernel_on_cpu())
            stack.enter_context(k.use_partitioned(False))
        elif kernel == "partitioned":
            stack.enter_context(k.torch_kernel_on_cpu())
            stack.enter_context(k.use_partitioned(True))
        else:
            raise ValueError(kernel)
        return stack

    def functions(self, kernel: str):
        """``(solve, lu_factor, lu_solve)`` for ``kernel`` (after the redesign: with ``driver``)."""
        tt = self.tt
        if self.api == "context" or kernel == "auto":
            return tt.tridiagonal_solve, tt.tridiagonal_lu_factor, tt.tridiagonal_lu_solve
        solve = functools.partial(tt.tridiagonal_solve, driver=kernel)
        factor_driver = kernel if kernel in ("lapack", "sequential") else None
        return (solve, functools.partial(tt.tridiagonal_lu_factor, driver=factor_driver),
                functools.partial(tt.tridiagonal_lu_solve, driver=factor_driver))


# ------------------------------------------------------------------------------------------------
# Scenarios.
# ------------------------------------------------------------------------------------------------
def system(n: int, requires_grad=False, device="cpu"):
    """A well-conditioned float64 system (diagonally dominant, so the partitioned kernel's check
    passes): one system for n = 5, a batch of 4 for n = 100; vector right-hand sides."""
    batch = () if n < 64 else (4,)
    g = torch.Generator().manual_seed(n)
    lower = torch.rand(*batch, n - 1, generator=g, dtype=torch.float64) - 0.5
    upper = torch.rand(*batch, n - 1, generator=g, dtype=torch.float64) - 0.5
    diag = 3.0 + torch.rand(*batch, n, generator=g, dtype=torch.float64)
    rhs = torch.randn(*batch, n, generator=g, dtype=torch.float64)
    return [t.to(device).requires_grad_(requires_grad) for t in (lower, diag, upper, rhs)]


def _stacked(ts, copies=2):
    return [torch.stack([t] * copies) for t in ts]


def m_nograd(S, F, L, n):
    S(*system(n))


def m_backward(S, F, L, n):
    S(*system(n, True)).square().sum().backward()


def m_double_backward(S, F, L, n):
    args = system(n, True)
    grads = torch.autograd.grad(S(*args).square().sum(), args, create_graph=True)
    sum(g.square().sum() for g in grads).backward()


def m_forward_ad(S, F, L, n):
    lower, diag, upper, rhs = system(n)
    with fwAD.dual_level():
        x = S(lower, fwAD.make_dual(diag, torch.ones_like(diag)), upper,
              fwAD.make_dual(rhs, torch.ones_like(rhs)))
        fwAD.unpack_dual(x).tangent


def _of_diag_rhs(S, n):
    lower, diag, upper, rhs = system(n)
    return (lambda d, r: S(lower, d, upper, r)), diag, rhs


def m_func_grad(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    torch.func.grad(lambda d, r: f(d, r).square().sum(), argnums=(0, 1))(d, r)


def m_func_vjp(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    out, vjp_fn = torch.func.vjp(f, d, r)
    vjp_fn(torch.ones_like(out))


def m_func_jvp(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    torch.func.jvp(f, (d, r), (torch.ones_like(d), torch.ones_like(r)))


def m_jacrev(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    torch.func.jacrev(f, argnums=(0, 1))(d, r)


def m_jacfwd(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    torch.func.jacfwd(f, argnums=(0, 1))(d, r)


def m_hessian(S, F, L, n):
    f, d, r = _of_diag_rhs(S, n)
    torch.func.hessian(lambda d: f(d, r).square().sum())(d)


def m_vmap(S, F, L, n):
    torch.func.vmap(S)(*_stacked(system(n)))


def m_vmap_grad(S, F, L, n):
    def loss(lower, diag, upper, rhs):
        return S(lower, diag, upper, rhs).square().sum()
    torch.func.vmap(torch.func.grad(loss, argnums=(1, 3)))(*_stacked(system(n)))


def m_meta(S, F, L, n):
    S(*system(n, device="meta"))


def m_compile_forward(S, F, L, n):
    torch._dynamo.reset()  # a fresh trace: a compiled function keeps the kernel it was traced with
    torch.compile(lambda *a: S(*a), backend="eager")(*system(n))


def m_compile_backward(S, F, L, n):
    torch._dynamo.reset()
    torch.compile(lambda *a: S(*a).square().sum(), backend="eager")(*system(n, True)).backward()


def m_factor_solve(S, F, L, n):
    lower, diag, upper, rhs = system(n)
    L(F(lower, diag, upper), rhs)


def m_factor_solve_backward(S, F, L, n):
    lower, diag, upper, rhs = system(n, True)
    L(F(lower, diag, upper), rhs).square().sum().backward()


SOLVE_MODES = {
    "nograd": m_nograd, "backward": m_backward, "double_backward": m_double_backward,
    "forward_ad": m_forward_ad, "func.grad": m_func_grad, "func.vjp": m_func_vjp,
    "func.jvp": m_func_jvp, "func.jacrev": m_jacrev, "func.jacfwd": m_jacfwd,
    "func.hessian": m_hessian, "func.vmap": m_vmap, "func.vmap(grad)": m_vmap_grad,
    "compile_forward": m_compile_forward, "compile_backward": m_compile_backward,
}
FACTOR_MODES = {"factor+lu_solve": m_factor_solve,
                "factor+lu_solve_backward": m_factor_solve_backward}
MODES = {**SOLVE_MODES, **FACTOR_MODES, "meta": m_meta}

# kernel -> sizes. The partitioned kernel is the automatic choice from n = 64 only; "auto" is
# driver=None on the CPU (the C++ kernel where it is built, by its fast path).
KERNEL_SIZES = {"lapack": (5, 100), "cpp": (5, 100), "sequential": (5, 100), "partitioned": (100,),
                "auto": (5, 100)}


def scenarios():
    """``[(name, kernel, n, mode)]``: every solve mode on every kernel and size, and on the
    automatic choice (``driver=None``) on the CPU; the factor modes on the kernels that factor
    (LAPACK, sequential) and on the automatic choice; meta tensors on the automatic choice and on
    the torch-op kernels (LAPACK and C++ need CPU tensors)."""
    out = []
    for kernel, sizes in KERNEL_SIZES.items():
        for n in sizes:
            modes = list(SOLVE_MODES)
            if kernel in ("lapack", "sequential", "auto"):
                modes += list(FACTOR_MODES)
            if kernel in ("sequential", "partitioned", "auto"):
                modes.append("meta")
            out += [(f"{kernel} n={n} {mode}", kernel, n, mode) for mode in modes]
    return out


# ------------------------------------------------------------------------------------------------
def run(args):
    sel = Kernels()
    has_cpp = sel.prepare_cpp()
    tracer = Tracer()
    results = []
    started = time.perf_counter()
    for name, kernel, n, mode in scenarios():
        if args.only and args.only not in name:
            continue
        if kernel == "cpp" and not has_cpp:
            continue
        S, F, L = sel.functions(kernel)
        fn = MODES[mode]
        error = None
        t0 = time.perf_counter()
        if args.warmup and not mode.startswith("compile"):
            try:
                with sel.context(kernel):
                    fn(S, F, L, n)
            except Exception:
                pass  # the traced run reports it
        # The kernel's block is entered outside the recording: the context managers that select
        # a kernel before the redesign are the caller's code, not a route (what they set is read
        # inside the call, and that reading counts).
        route = set()
        try:
            with sel.context(kernel), tracer.recording() as route:
                fn(S, F, L, n)
        except Exception as err:
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        functions = sorted(route)
        calls = sorted(tracer.calls)
        cpp_backward = []
        if error is None and set(CPP_AUTOGRAD_OPS) & route:
            with sel.context(kernel):
                cpp_backward = cpp_backward_kinds(lambda: fn(S, F, L, n))
        if error is not None:
            functions.append(f"!raised {error.split(':')[0]}")
            if args.verbose:
                traceback.print_exc()
        results.append(dict(name=name, kernel=kernel, n=n, mode=mode, functions=functions,
                            calls=calls, cpp_backward=cpp_backward,
                            coarse=list(coarse(calls, cpp_backward)),
                            error=error, seconds=round(time.perf_counter() - t0, 3)))
        if args.verbose:
            print(f"{results[-1]['seconds']:7.2f} s  {name}: {len(functions)} functions",
                  file=sys.stderr)
    total = time.perf_counter() - started

    routes = {}  # frozenset -> [scenario names], in order of first appearance
    for r in results:
        routes.setdefault(frozenset(r["functions"]), []).append(r["name"])
    route_ids = {fs: f"R{i + 1}" for i, fs in enumerate(routes)}
    for r in results:
        r["route"] = route_ids[frozenset(r["functions"])]

    triples = {}  # (entry, backward, kernel) -> [scenario names]
    for r in results:
        triples.setdefault(tuple(r["coarse"]), []).append(r["name"])

    def values(i):
        return sorted({t[i] for t in triples})

    def parts(i):
        return sorted({p for t in triples for p in t[i].split(", ")} - {"none"})
    coarse_summary = dict(
        triples=len(triples), paths=len({t[:2] for t in triples}), entries=values(0), backwards=values(1), kernels=values(2),
        backward_kinds=parts(1), kernel_labels=parts(2),
        table=[dict(entry=t[0], backward=t[1], kernel=t[2], scenarios=names)
               for t, names in triples.items()])

    ran = set().union(*routes) if routes else set()
    returned = {f: sorted(map(repr, v)) for f, v in sorted(tracer.returns.items())}
    varying = [f for f, v in returned.items() if len(v) > 1]
    by_name = sorted({f for f in ran | set(tracer.returns)
                      if not f.startswith(("op ", "!"))
                      and PREDICATE_NAME.search(f.rsplit(".", 1)[-1])})
    summary = dict(
        api=sel.api, torch=torch.__version__, seconds=round(total, 1),
        scenarios=len(results), routes=len(routes), functions_that_ran=len(ran),
        routing_modules=sorted(m[len(PACKAGE) + 1:] for m in tracer.modules),
        unavailable=sel.unavailable,
        predicates=dict(by_return_value=len(returned), varying=len(varying),
                        by_name=len(by_name), return_values=returned,
                        varying_names=varying, by_name_names=by_name),
        coarse=coarse_summary,
        route_table=[dict(id=route_ids[fs], functions=sorted(fs), scenarios=names)
                     for fs, names in routes.items()],
        results=results)
    return summary


def report(s) -> None:
    p = s["predicates"]
    print(f"API: {s['api']} (torch {s['torch']}), {s['seconds']} s")
    for kernel, why in s["unavailable"].items():
        print(f"kernel {kernel} not measured: {why}")
    print(f"scenarios: {s['scenarios']}")
    print(f"distinct routes: {s['routes']}")
    print(f"routing-layer functions that ran: {s['functions_that_ran']} "
          f"(modules: {', '.join(s['routing_modules'])})")
    print(f"predicates: {p['by_return_value']} returned a bool or str ({p['varying']} of them "
          f"more than one value here); {p['by_name']} by name")
    for f, v in p["return_values"].items():
        print(f"  {f}: {'/'.join(v)}")
    extra = sorted(set(p["by_name_names"]) - set(p["return_values"]))
    if extra:
        print(f"  by name only: {', '.join(extra)}")
    errors = [r for r in s["results"] if r["error"]]
    if errors:
        print(f"scenarios that raised: {len(errors)}")
        for r in errors:
            print(f"  {r['name']}: {r['error']}")
    # The grid: mode x (kernel, n) -> route id.
    columns = list(dict.fromkeys((r["kernel"], r["n"]) for r in s["results"]))
    rows = list(dict.fromkeys(r["mode"] for r in s["results"]))
    cell = {(r["mode"], r["kernel"], r["n"]): r["route"] for r in s["results"]}
    width = max(len(m) for m in rows)
    heads = [f"{k[:5]}{n}" for k, n in columns]
    print(f"\n{'route of':<{width}} " + " ".join(f"{h:>8}" for h in heads))
    for m in rows:
        print(f"{m:<{width}} " + " ".join(f"{cell.get((m, k, n), '-'):>8}" for k, n in columns))
    # The table: functions common to every route once, then each route's own functions.
    table = s["route_table"]
    common = set.intersection(*(set(r["functions"]) for r in table)) if table else set()
    print(f"\nin every route: {', '.join(sorted(common)) or '(none)'}")
    for r in table:
        own = [f for f in r["functions"] if f not in common]
        print(f"\n{r['id']} ({len(r['functions'])} functions, {len(r['scenarios'])} scenarios)")
        print(f"  functions: {', '.join(own)}")
        print(f"  scenarios: {'; '.join(r['scenarios'])}")


def report_coarse(s) -> None:
    c = s["coarse"]
    print(f"\ncoarse routes (entry, backward, kernel): {c['triples']} distinct triples over "
          f"{s['scenarios']} scenarios; {c['paths']} distinct (entry, backward) pairs")
    print(f"  entry wrappers: {len(c['entries'])} ({'; '.join(c['entries'])})")
    print(f"  backward: {len(c['backwards'])} values ({'; '.join(c['backwards'])}); "
          f"{len(c['backward_kinds'])} kinds ({'; '.join(c['backward_kinds'])})")
    print(f"  kernel: {len(c['kernels'])} values ({'; '.join(c['kernels'])}); "
          f"{len(c['kernel_labels'])} entry points ({'; '.join(c['kernel_labels'])})")
    for i, t in enumerate(c["table"]):
        print(f"\nC{i + 1}: {t['entry']} | {t['backward']} | {t['kernel']} "
              f"({len(t['scenarios'])} scenarios)")
        print(f"  scenarios: {'; '.join(t['scenarios'])}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="do not run each scenario once untraced first")
    parser.add_argument("--only", metavar="SUBSTRING", help="run the scenarios whose name has it")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="per-scenario times and tracebacks on stderr")
    parser.add_argument("--coarse", action="store_true",
                        help="print only the coarse count (entry, backward, kernel); by default "
                        "it follows the fine table")
    args = parser.parse_args(argv)
    summary = run(args)
    if args.coarse:
        print(f"API: {summary['api']} (torch {summary['torch']}), {summary['seconds']} s")
        for kernel, why in summary["unavailable"].items():
            print(f"kernel {kernel} not measured: {why}")
        print(f"scenarios: {summary['scenarios']}; distinct (fine) routes: {summary['routes']}")
    else:
        report(summary)
    report_coarse(summary)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
