r"""Chapter 5: the solver as a ``torch.library.custom_op``, ``torch.ops.tridiag_tutorial.tridiagonal_solve``.

To PyTorch the op is one opaque node with a schema. What makes it a first-class citizen:

- ``register_fake``: how to compute the output's shape, dtype and strides without data (for
  ``torch.compile``, FakeTensors and meta tensors). The real kernel returns a new C-contiguous
  tensor, so the fake kernel must too. ``empty_like(rhs)`` copies ``rhs``'s strides instead, and
  SciPy's output, returned as is, is Fortran-ordered: the two disagree whenever ``rhs`` is
  C-ordered (chapter 5 shows ``opcheck`` catching that);
- ``register_autograd``: ``setup_context`` saves what the backward needs, and the backward calls the
  op itself on ``A^H`` (:func:`tridiag_tutorial.rules.solve_backward`), so double backward works;
- ``register_vmap``: a batch rule, since the kernel handles any number of batch dimensions;
- ``register_kernel``: one kernel per device. The function under ``@custom_op`` is the default
  kernel (torch ops, so any device); ``register_kernel("cpu")`` gives CPU tensors LAPACK.

:func:`tridiagonal_solve_custom_op` is the chapter's version: validation, then the op. It compiles
with ``fullgraph=True`` and passes ``opcheck``, but on torch 2.13 ``torch.func.grad`` raises on it
and ``torch.func.jvp``/``jacfwd`` silently return zero tangents; the final
:func:`tridiag_tutorial.tridiagonal_solve` (:mod:`tridiag_tutorial.ops`) wraps the same op to fix
that.
"""

from __future__ import annotations

import torch

from . import kernels, rules
from ._validation import validate
from .kernels import torch_kernel_on_cpu as torch_kernel_on_cpu  # where chapters import it from

__all__ = ["tridiagonal_solve_op", "tridiagonal_solve_custom_op", "torch_kernel_on_cpu"]


# One kernel per device, the torch.library way: the function under @custom_op is the default
# kernel, for every device that has none of its own (CUDA, MPS, XPU, ...), and register_kernel
# adds the CPU one; the dispatcher picks by the inputs' device. The kernels themselves live in
# tridiag_tutorial.kernels.
@torch.library.custom_op("tridiag_tutorial::tridiagonal_solve", mutates_args=())
def tridiagonal_solve_op(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                         rhs: torch.Tensor) -> torch.Tensor:
    """``x = A^{-1} rhs`` for inputs already validated and broadcast; rhs is ``(*B, n, k)``.

    This default kernel solves in torch ops (the pure-torch kernel with LAPACK's pivoting, or the
    partitioned one for large ``n``), so it runs on any device."""
    return kernels.solve(lower, diag, upper, rhs, None, None, "N", True)


@tridiagonal_solve_op.register_kernel("cpu")
def _solve_cpu(lower, diag, upper, rhs):
    """The CPU kernel: LAPACK ``?gtsv`` (or the compiled kernel, once loaded, where it measured
    faster); inside :func:`torch_kernel_on_cpu`, the default kernel's torch ops instead, so that
    a machine without a GPU can run the code that other devices run."""
    return kernels.solve(lower, diag, upper, rhs, None, None, "N", kernels._torch_kernel_on_cpu())


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
    """Batch rule of this op, and the general case of the other ops' rules: put the vmapped
    dimension first on every input.

    The kernel needs all inputs to have the same batch shape, so unbatched inputs are expanded
    along the new dimension (a view, no copy) rather than left alone; ``None`` arguments (absent
    optional inputs) stay ``None``.
    """
    args = [
        None if a is None else a.movedim(d, 0) if d is not None
        else a.expand(info.batch_size, *a.shape)
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
