"""The schemas of the package's ops, ``torch.ops.tridiag_tutorial.*``.

The C++ extension built at install defines them (``TORCH_LIBRARY`` in ``csrc/``), so that a
compiled or exported graph that holds them loads in a process with only that library (chapter 14).
Where the extension was not built, this module defines the same schemas, ``SCHEMAS``. The
kernels, fake kernels, autograd and vmap rules are registered in
:mod:`tridiag_tutorial.registration`.
"""

from __future__ import annotations

import torch

from .kernels import compiled

__all__ = ["SCHEMAS"]

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

solve_op = torch.ops.tridiag_tutorial.solve.default  # with its Autograd kernel: what graphs hold
solve_kernel_op = torch.ops.tridiag_tutorial.solve_kernel.default  # the kernel alone
lu_factor_op = torch.ops.tridiag_tutorial.lu_factor.default
