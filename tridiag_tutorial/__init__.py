"""tridiag_tutorial: a differentiable tridiagonal solver for PyTorch, and the book that builds it.

The solver: :func:`tridiagonal_solve`, and :func:`tridiagonal_lu_factor` /
:func:`tridiagonal_lu_solve` for a matrix used many times, with :class:`TridiagonalFactors` and
:class:`SingularMatrixError`; :func:`cpp_available` says whether the install built the C++
kernel; :func:`to_dense` and :func:`tridiag_matmul` turn bands into a matrix and multiply by one.
``dense_solve`` (:mod:`tridiag_tutorial.reference`), the dense reference that the chapters and
tests check against, is importable from here too, outside ``__all__``.

The package, top down (the arrows point down only):

- :mod:`tridiag_tutorial.api`: the public functions; :mod:`tridiag_tutorial.functions`: their
  autograd Functions; :mod:`tridiag_tutorial.registration`: the ops' kernels, fake kernels,
  autograd and vmap rules; :mod:`tridiag_tutorial.rules`: the derivative formulas (chapter 3);
- :mod:`tridiag_tutorial.kernels`: which kernel runs (the ``driver`` argument), and the kernels:
  LAPACK, the C++ kernel built at install, the sequential and partitioned kernels in torch ops;
- :mod:`tridiag_tutorial.distributed`: one system split across processes, and DTensor's rules;
- :mod:`tridiag_tutorial.book`: what only the chapters use; :mod:`tridiag_tutorial.bench`: the
  benchmark and accuracy harness. ``import tridiag_tutorial`` imports neither, nor
  :mod:`~tridiag_tutorial.distributed`.
"""

from ._validation import SingularMatrixError as SingularMatrixError
from .api import TridiagonalFactors as TridiagonalFactors
from .api import tridiagonal_lu_factor as tridiagonal_lu_factor
from .api import tridiagonal_lu_solve as tridiagonal_lu_solve
from .api import tridiagonal_solve as tridiagonal_solve
from .kernels import cpp_available as cpp_available
from .reference import dense_solve as dense_solve  # the dense reference of the chapters' checks
from .reference import to_dense as to_dense
from .rules import tridiag_matmul as tridiag_matmul

__all__ = ["tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve", "TridiagonalFactors",
           "SingularMatrixError", "cpp_available", "to_dense", "tridiag_matmul"]
__version__ = "0.1.0"
