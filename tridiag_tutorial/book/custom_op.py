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
  kernel (torch ops, so any device); ``register_kernel("cpu")`` gives CPU tensors LAPACK. The op's
  ``driver`` argument (``None``, or a name of ``tridiag_tutorial.kernels.DRIVERS``) lets a
  caller pick the kernel explicitly, for instance the torch-ops kernels on a CPU: an argument, so
  that ``torch.compile`` sees it and a backward can reuse it.

:func:`tridiagonal_solve_custom_op` is the chapter's version: validation, then the op. It compiles
with ``fullgraph=True`` and passes ``opcheck``, but on torch 2.13 ``torch.func.grad`` raises on it
and ``torch.func.jvp``/``jacfwd`` silently return zero tangents; the final
:func:`tridiag_tutorial.tridiagonal_solve` (:mod:`tridiag_tutorial.api`) wraps the same op to fix
that.
"""

from __future__ import annotations

import torch

from .. import kernels, rules
from .._validation import validate
from ..functions import _vmap_rule  # the general batch rule, shared with the final op

__all__ = ["tridiagonal_solve_op", "tridiagonal_solve_custom_op"]


# One kernel per device, the torch.library way: the function under @custom_op is the default
# kernel, for every device that has none of its own (CUDA, MPS, XPU, ...), and register_kernel
# adds the CPU one; the dispatcher picks by the inputs' device. The kernels themselves live in
# tridiag_tutorial.kernels.
# [book: custom-op-kernels]
@torch.library.custom_op("tridiag_tutorial::tridiagonal_solve", mutates_args=())
def tridiagonal_solve_op(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                         rhs: torch.Tensor, driver: str | None = None) -> torch.Tensor:
    """``x = A^{-1} rhs`` for inputs already validated and broadcast; rhs is ``(*B, n, k)``.

    This default kernel solves in torch ops (the sequential kernel with LAPACK's pivoting, or the
    partitioned one for large ``n``, unless ``driver`` names one), so it runs on any device."""
    return kernels.solve(lower, diag, upper, rhs, None, None, "N",
                         kernels.resolve_driver(driver or _torch_ops_driver(rhs), rhs))


def _torch_ops_driver(rhs) -> str:
    """The automatic choice among the kernels in torch ops (as on a device other than the CPU)."""
    return kernels.choose_driver("other", rhs.dtype, rhs.shape[:-2].numel(), rhs.shape[-2], False)


@tridiagonal_solve_op.register_kernel("cpu")
def _solve_cpu(lower, diag, upper, rhs, driver=None):
    """The CPU kernel: LAPACK ``?gtsv``, or the kernel that ``driver`` names (``"sequential"``,
    say: the torch-ops code that other devices run, on a machine without a GPU)."""
    return kernels.solve(lower, diag, upper, rhs, None, None, "N", driver or "lapack")
# [/book: custom-op-kernels]


# [book: custom-op-fake]
@tridiagonal_solve_op.register_fake
def _solve_fake(lower, diag, upper, rhs, driver=None):
    # The real kernel returns a new C-contiguous tensor, whatever rhs's strides are.
    return rhs.new_empty(rhs.shape)


# [book: custom-op-autograd]
def _solve_setup_context(ctx, inputs, output):
    lower, diag, upper, _, ctx.driver = inputs
    ctx.save_for_backward(lower, diag, upper, output)


def _solve_backward(ctx, grad_x):
    lower, diag, upper, x = ctx.saved_tensors
    def solve(*bands_and_rhs):  # the same kernel as the forward
        return tridiagonal_solve_op(*bands_and_rhs, ctx.driver)
    return (*rules.solve_backward(solve, lower, diag, upper, x, grad_x), None)
# [/book: custom-op-autograd]


# [book: custom-op-vmap]
def _solve_vmap(info, in_dims, lower, diag, upper, rhs, driver=None):
    return _vmap_rule(lambda *t: tridiagonal_solve_op(*t, driver), info, in_dims[:4],
                      lower, diag, upper, rhs)


tridiagonal_solve_op.register_autograd(_solve_backward, setup_context=_solve_setup_context)
tridiagonal_solve_op.register_vmap(_solve_vmap)
# [/book: custom-op-vmap]


def tridiagonal_solve_custom_op(lower, diag, upper, rhs, *, driver=None) -> torch.Tensor:
    """Chapter 5's version: :func:`tridiag_tutorial.tridiagonal_solve`'s arguments and result, but
    calling the custom op directly (no ``torch.func`` support beyond ``vmap``)."""
    p = validate(lower, diag, upper, rhs, name="tridiagonal_solve_custom_op")
    x = tridiagonal_solve_op(p.lower, p.diag, p.upper, p.rhs, driver)
    return x.squeeze(-1) if p.vector_rhs else x
