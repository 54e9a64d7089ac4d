r"""Chapter 8: an operator you can copy, a tridiagonal solve on public torch APIs plus four private
reads: the text of one torch error message, in ``_refuse_tangents``; functorch's private stack of
active transforms, in ``_refuse_forward_over_forward`` and ``_refuse_func_forward``; the private
set of dispatch keys below ``ADInplaceOrView``, in ``_refuse_func_forward``; and the private
active forward-AD level, in the fake kernel.

``solve(dl, d, du, b)`` returns ``x`` with ``A x = b``, where ``A`` has the sub-diagonal ``dl``
``(..., n-1)``, the diagonal ``d`` ``(..., n)`` and the super-diagonal ``du`` ``(..., n-1)``, and
``b`` is ``(..., n)``; all four share one batch shape (no broadcasting) and one dtype. CPU, real or
complex; the kernel is LAPACK's ``?gtsv`` through SciPy.

Two public mechanisms, each with a gap on torch 2.13, and ``solve`` picks between them:

- the custom op ``tridiag_minimal::solve`` (``custom_op``, ``register_fake``,
  ``register_autograd``, ``register_vmap``) is what ``torch.compile`` sees: one opaque node that
  passes ``opcheck`` and compiles with ``fullgraph=True``; but its ``register_autograd`` raises under
  ``torch.func.grad`` and has no forward-mode rule (torch would read the missing tangent as
  zero; the op refuses instead, in its kernel for dual numbers and one key below autograd for
  ``torch.func.jvp`` and ``jacfwd``);
- the ``autograd.Function`` ``SolveFunction`` (``setup_context``, ``backward``, ``jvp``,
  ``generate_vmap_rule``)
  calls the same op and works with the eager ``torch.func`` transforms (``linearize`` included)
  and forward-mode AD, except forward over forward, which torch would get silently wrong; and
  Dynamo refuses a Function with a ``jvp`` under ``fullgraph=True`` when an input requires grad
  and grad mode is on.

So eager code runs the Function and traced code the op. Where neither is right (forward mode
inside ``torch.compile``, tracing inside a dual level, forward over forward), ``solve`` raises
instead of answering wrongly.
The op stays private (``_solve_op``): called alone, or through a ``torch.export`` graph, it
refuses forward mode, which ``solve`` supplies eagerly.
"""

from __future__ import annotations

# [book: minimal-imports]
import threading

import torch
import torch.autograd.forward_ad as fwAD
from scipy.linalg.lapack import get_lapack_funcs
from torch._C._functorch import TransformType  # private, as is the next (functorch's stack)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

# [/book: minimal-imports]

__all__ = ["solve"]  # the only entry point: _solve_op and SolveFunction are its parts


# [book: minimal-op]
_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)  # what ?gtsv takes


def _check(dl, d, du, b, devices=("cpu",)):
    """Clear errors for inputs the kernel cannot take (no broadcasting, one dtype, CPU)."""
    if not dl.dtype == d.dtype == du.dtype == b.dtype or b.dtype not in _DTYPES:
        raise TypeError(f"tridiag_minimal.solve: dl, d, du, b need one dtype of float32/64, complex64/128, got "
                        f"{dl.dtype}, {d.dtype}, {du.dtype}, {b.dtype}")
    n = b.shape[-1] if b.dim() else 0
    if n < 2 or d.shape != b.shape or dl.shape != du.shape or dl.shape != (*b.shape[:-1], n - 1):
        raise ValueError(f"tridiag_minimal.solve: need d and b of shape (..., n) and dl, du of shape "
                         f"(..., n-1), n >= 2, one batch shape; got dl {tuple(dl.shape)}, d {tuple(d.shape)}, "
                         f"du {tuple(du.shape)}, b {tuple(b.shape)}")
    for name, t in zip(("dl", "d", "du", "b"), (dl, d, du, b)):
        if t.device.type not in devices:
            raise ValueError(f"tridiag_minimal.solve: CPU tensors only, got {name} on {t.device}")


@torch.library.custom_op("tridiag_minimal::solve", mutates_args=(), device_types="cpu")
def _solve_op(dl: torch.Tensor, d: torch.Tensor, du: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The kernel: LAPACK ``?gtsv`` from SciPy, one system at a time; opaque to the compiler."""
    _check(dl, d, du, b)
    if not getattr(_in_function, "forward", False):  # skipped in SolveFunction: its jvp is in charge
        _refuse_tangents(dl, d, du, b)
    n, rows = b.shape[-1], b.numel() // b.shape[-1]  # one row per system of the batch
    bands = [t.detach().resolve_conj().resolve_neg().reshape(rows, t.shape[-1]).numpy()
             for t in (dl, d, du, b)]
    gtsv = get_lapack_funcs("gtsv", bands)  # sgtsv, dgtsv, cgtsv or zgtsv, from the dtype
    x = torch.empty(rows, n, dtype=b.dtype)
    for i, (l, m, u, r) in enumerate(zip(*bands)):  # gtsv works on copies: inputs stay intact
        *_, xi, info = gtsv(l, m, u, r.reshape(n, 1))
        if info > 0:
            raise ValueError(f"tridiag_minimal.solve: the matrix of system {i} is singular "
                             f"(zero pivot at row {info - 1} of its LU factorisation)")
        x[i] = torch.from_numpy(xi[:, 0])
    return x.reshape(b.shape)


@_solve_op.register_fake
def _(dl, d, du, b):
    _check(dl, d, du, b, devices=("cpu", "meta"))  # the fake kernel also serves meta tensors
    if fwAD._current_level >= 0:  # private: the active forward-AD level, -1 outside dual_level
        raise NotImplementedError(  # traced, the op has no forward rule: any tangent would be lost
            "tridiag_minimal.solve: traced inside an active forward-AD level (dual_level), as by "
            "torch.compile or make_fx, the op refuses, with or without tangents on its inputs; call "
            "compiled code outside dual levels, and use jvp, jacfwd or dual numbers on uncompiled calls")
    return torch.empty_like(b, memory_format=torch.contiguous_format)  # shape, dtype, strides
# [/book: minimal-op]


# [book: minimal-rules]
def _refuse_tangents(*tensors):
    """The op has no forward-mode rule: a tangent that reaches it would be dropped, so raise."""
    try:
        lost = any(fwAD.unpack_dual(t).tangent is not None for t in tensors)
    except RuntimeError as error:  # make_fx (torch.func.linearize) inside a dual level
        if "_fw_primal" not in str(error):  # any other error is not this one: let it through
            raise
        raise NotImplementedError(
            "tridiag_minimal.solve: a call under make_fx (as in torch.func.linearize) inside an active "
            "forward-AD level (dual_level) cannot see tangents, so it "
            "refuses, with or without tangents on its inputs; use jvp, jacfwd or dual numbers on "
            "uncompiled calls") from None
    if lost:
        raise NotImplementedError(
            "tridiag_minimal.solve: forward-mode AD reached the op, which has no forward rule (dual "
            "numbers around compiled code, torch.func.linearize, or the op called directly); use jvp, "
            "jacfwd or dual numbers on uncompiled calls of solve")


def _matmul(dl, d, du, x):
    """``A @ x`` in O(n); a ``None`` band counts as zero."""
    out = torch.zeros_like(x) if d is None else d * x
    pad = x[..., :1] * 0
    if dl is not None:
        out = out + torch.cat([pad, dl * x[..., :-1]], -1)
    if du is not None:
        out = out + torch.cat([du * x[..., 1:], pad], -1)
    return out


def _backward(solve, dl, d, du, x, g):
    """Reverse mode (chapter 3): ``v = A^{-H} g``; ``grad b = v``, ``grad A = -v x^H`` on the bands."""
    v = solve(du.conj(), d.conj(), dl.conj(), g)
    xc = x.conj()
    return -v[..., 1:] * xc[..., :-1], -v * xc, -v[..., :-1] * xc[..., 1:], v


def _jvp(solve, dl, d, du, x, tdl, td, tdu, tb):
    """Forward mode (chapter 3): ``dx = A^{-1} (db - dA x)``; a ``None`` tangent counts as zero."""
    r = -_matmul(tdl, td, tdu, x)
    return solve(dl, d, du, r if tb is None else r + tb)


def _batched(info, in_dims, *args):
    """For the op's vmap rule: every argument with its batch dimension first, of size ``info.batch_size``."""
    return [a.movedim(i, 0) if i is not None else a.expand(info.batch_size, *a.shape)
            for a, i in zip(args, in_dims)]
# [/book: minimal-rules]


# [book: minimal-registrations]
def _setup_context(ctx, inputs, output):
    dl, d, du, _ = inputs
    ctx.save_for_backward(dl, d, du, output)


def _op_backward(ctx, g):
    return _backward(_solve_op, *ctx.saved_tensors, g)  # the op again: double backward works


_solve_op.register_autograd(_op_backward, setup_context=_setup_context)


@_solve_op.register_vmap
def _(info, in_dims, dl, d, du, b):
    return _solve_op(*_batched(info, in_dims, dl, d, du, b)), 0  # the kernel takes any batch


def _refuse_func_forward(keyset, dl, d, du, b):
    """``torch.func.jvp`` and ``jacfwd`` reach the op's kernel on unwrapped tensors, so the
    kernel's check cannot see their tangents, and torch reads the missing rule as a zero tangent.
    Here, one key below autograd, the transform is still on top of functorch's stack: refuse."""
    transforms = retrieve_all_functorch_interpreters()
    if transforms and transforms[-1].key() == TransformType.Jvp:
        raise NotImplementedError(
            "tridiag_minimal.solve: torch.func forward mode (jvp, jacfwd) reached the op, which has no "
            "forward rule (the op called directly, or a torch.export graph); call solve, eagerly")
    below = keyset & torch._C._after_ADInplaceOrView_keyset  # private: the keys under this one
    return torch.ops.tridiag_minimal.solve.default.redispatch(below, dl, d, du, b)


_library = torch.library.Library("tridiag_minimal", "IMPL")  # kept: deleting it unregisters
_library.impl("solve", _refuse_func_forward, "ADInplaceOrView", with_keyset=True)  # below autograd
# [/book: minimal-registrations]


# [book: minimal-function]
_in_function = threading.local()  # set while SolveFunction.forward runs the op, per thread


class SolveFunction(torch.autograd.Function):
    """The op with a forward-mode rule, for eager code (``torch.func`` and dual numbers)."""

    generate_vmap_rule = True  # vmap runs the staticmethods batched: the op has a vmap rule

    @staticmethod
    def forward(dl, d, du, b):
        _in_function.forward = True  # the kernel skips its tangent check: this jvp rule covers it
        try:
            return _solve_op(dl, d, du, b)
        finally:
            _in_function.forward = False

    @staticmethod
    def setup_context(ctx, inputs, output):
        dl, d, du, _ = inputs
        ctx.save_for_backward(dl, d, du, output)
        ctx.save_for_forward(dl, d, du, output)

    @staticmethod
    def backward(ctx, g):
        return _backward(solve, *ctx.saved_tensors, g)  # differentiable again, through solve

    @staticmethod
    def jvp(ctx, tdl, td, tdu, tb):
        _refuse_forward_over_forward()
        dl, d, du, x = ctx.saved_tensors
        return _jvp(solve, dl, d, du, x, tdl, td, tdu, tb)
# [/book: minimal-function]


# [book: minimal-solve]
def _refuse_forward_over_forward():
    """torch skips an outer forward level inside a Function's ``jvp``, so an outer derivative would
    miss how this tangent depends on its inputs: refuse a second ``torch.func`` forward transform
    on the stack (``jvp`` of ``jvp``, ``jacfwd`` of ``jacfwd``). torch has no public API for the
    transforms that are active: this reads functorch's private interpreter stack. Dual numbers
    cannot nest (torch refuses a second ``dual_level``), so the stack sees every case."""
    forward_transforms = sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if forward_transforms > 1:
        raise NotImplementedError(
            "tridiag_minimal.solve: forward over forward (jvp of jvp, jacfwd of jacfwd, jacfwd of a "
            "jvp's tangent) is not supported; make one of the two derivatives reverse mode: "
            "jacrev(jacfwd(f)), or hessian(f), forward over reverse")


def solve(dl: torch.Tensor, d: torch.Tensor, du: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x = A^{-1} b``. Eager: the Function, which the ``torch.func`` transforms accept (forward
    over forward refused). Traced
    (``torch.compile``, ``torch.export``): the op, which Dynamo accepts under ``fullgraph=True``;
    it has no forward-mode rule, so forward mode raises there."""
    _check(dl, d, du, b)
    if torch.compiler.is_compiling():
        if any(fwAD.unpack_dual(t).tangent is not None for t in (dl, d, du, b)):
            raise NotImplementedError(
                "tridiag_minimal.solve: forward-mode AD (jvp, jacfwd, dual numbers) inside "
                "torch.compile is not supported; use forward mode on uncompiled calls of solve")
        return _solve_op(dl, d, du, b)
    return SolveFunction.apply(dl, d, du, b)
# [/book: minimal-solve]
