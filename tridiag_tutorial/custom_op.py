r"""Chapter 5: the solver as a ``torch.library.custom_op``, ``torch.ops.tridiag_tutorial.tridiagonal_solve``.

To PyTorch the op is one opaque node with a schema. What makes it a first-class citizen:

- ``register_fake``: how to compute the output's shape, dtype and strides without data (for
  ``torch.compile``, FakeTensors and meta tensors). The real kernel returns a new C-contiguous
  tensor, so the fake kernel must too. ``empty_like(rhs)`` copies ``rhs``'s strides instead, and
  SciPy's output, returned as is, is Fortran-ordered: the two disagree whenever ``rhs`` is
  C-ordered (chapter 5 shows ``opcheck`` catching that);
- ``register_autograd``: ``setup_context`` saves what the backward needs, and the backward calls the
  op itself on ``A^H`` (:func:`tridiag_tutorial.rules.solve_backward`), so double backward works;
- ``register_vmap``: a batch rule, since the kernel handles any number of batch dimensions.

:func:`tridiagonal_solve_custom_op` is the chapter's version: validation, then the op. It compiles
with ``fullgraph=True`` and passes ``opcheck``, but on torch 2.13 ``torch.func.grad`` raises on it
and ``torch.func.jvp``/``jacfwd`` silently return zero tangents; the final
:func:`tridiag_tutorial.tridiagonal_solve` (:mod:`tridiag_tutorial.ops`) wraps the same op to fix
that.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import lapack, rules, torch_kernel
from ._validation import validate

__all__ = ["tridiagonal_solve_op", "tridiagonal_solve_custom_op", "torch_kernel_on_cpu"]


# --------------------------------------------------------------------------------------------
# The kernel (no autograd, no checks): four tensors of one batch shape, rhs of shape (*B, n, k).
# --------------------------------------------------------------------------------------------
# Which kernel a CPU tensor goes to is context-local state (a ContextVar: each thread, and each
# asyncio task, has its own), never a module global: a block in one thread cannot change the kernel
# that another thread's solve runs. The ops that the final function calls save the choice made in
# the forward and restore it around their backward (see tridiag_tutorial.ops).
_TORCH_KERNEL_ON_CPU = contextvars.ContextVar("tridiag_tutorial_torch_kernel_on_cpu", default=False)


def _kernel_choice(torch_kernel: bool):
    """Within the block, CPU tensors go to the pure-torch kernel if ``torch_kernel``, else LAPACK.

    A no-op (``nullcontext``) when that is already the choice, which is also what lets Dynamo
    trace code that states its choice (it cannot trace setting a ``ContextVar``)."""
    if torch_kernel == _torch_kernel_on_cpu():
        return contextlib.nullcontext()
    return _set_kernel_choice(torch_kernel)


@contextlib.contextmanager
def _set_kernel_choice(torch_kernel: bool):
    token = _TORCH_KERNEL_ON_CPU.set(torch_kernel)
    try:
        yield
    finally:
        _TORCH_KERNEL_ON_CPU.reset(token)


def torch_kernel_on_cpu():
    """Within this block, CPU tensors go to the pure-torch kernel instead of LAPACK.

    The pure-torch kernel is the one other devices (CUDA) use; this lets the tests and the book
    run that exact code path, through the custom ops, on a machine without a GPU. The choice is
    local to the calling thread (and asyncio task); a solve made inside the block runs its backward
    on the same kernel even when the backward runs after the block has ended.
    """
    return _set_kernel_choice(True)


@torch.compiler.assume_constant_result
def _torch_kernel_on_cpu() -> bool:
    """True inside :func:`torch_kernel_on_cpu` (in this thread or task). Dynamo reads it once,
    when it traces, and bakes the answer into the graph (so a compiled forward and its backward
    agree; a later call of the compiled function keeps the kernel it was traced with)."""
    return _TORCH_KERNEL_ON_CPU.get()


def _use_lapack(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not _TORCH_KERNEL_ON_CPU.get()


def _numpy(*tensors):
    """NumPy views of the tensors' data (a copy only for a lazily conjugated or negated tensor:
    ``.numpy()`` refuses tensors whose conjugate or negative bit is set)."""
    return [t.detach().resolve_conj().resolve_neg().numpy() for t in tensors]


def _solve_kernel(lower, diag, upper, rhs):
    """LAPACK ``?gtsv`` on CPU, the pure-torch kernel with the same pivoting on other devices."""
    if _use_lapack(rhs):
        return torch.from_numpy(lapack.solve(*_numpy(lower, diag, upper, rhs)))
    return torch_kernel.solve(lower, diag, upper, rhs)


@torch.library.custom_op("tridiag_tutorial::tridiagonal_solve", mutates_args=())
def tridiagonal_solve_op(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                         rhs: torch.Tensor) -> torch.Tensor:
    """``x = A^{-1} rhs`` for inputs already validated and broadcast; rhs is ``(*B, n, k)``."""
    return _solve_kernel(lower, diag, upper, rhs)


@tridiagonal_solve_op.register_fake
def _solve_fake(lower, diag, upper, rhs):
    # The real kernel returns a new C-contiguous tensor, whatever rhs's strides are.
    return rhs.new_empty(rhs.shape)


def _solve_setup_context(ctx, inputs, output):
    lower, diag, upper, _ = inputs
    ctx.save_for_backward(lower, diag, upper, output)


def _solve_backward(ctx, grad_x):
    lower, diag, upper, x = ctx.saved_tensors
    return rules.solve_backward(tridiagonal_solve_op, lower, diag, upper, x, grad_x)


def _vmap_rule(solve, info, in_dims, *args, out_dims=0):
    """Batch rule shared by both paths: put the vmapped dimension first on every input.

    The kernel needs all four inputs to have the same batch shape, so unbatched inputs are expanded
    along the new dimension (a view, no copy) rather than left alone.
    """
    args = [
        a.movedim(d, 0) if d is not None else a.expand(info.batch_size, *a.shape)
        for a, d in zip(args, in_dims)
    ]
    return solve(*args), out_dims


def _solve_vmap(info, in_dims, lower, diag, upper, rhs):
    return _vmap_rule(tridiagonal_solve_op, info, in_dims, lower, diag, upper, rhs)


tridiagonal_solve_op.register_autograd(_solve_backward, setup_context=_solve_setup_context)
tridiagonal_solve_op.register_vmap(_solve_vmap)


def tridiagonal_solve_custom_op(lower, diag, upper, rhs) -> torch.Tensor:
    """Chapter 5's version: :func:`tridiag_tutorial.tridiagonal_solve`'s arguments and result, but
    calling the custom op directly (no ``torch.func`` support beyond ``vmap``)."""
    p = validate(lower, diag, upper, rhs, name="tridiagonal_solve_custom_op")
    x = tridiagonal_solve_op(p.lower, p.diag, p.upper, p.rhs)
    return x.squeeze(-1) if p.vector_rhs else x
