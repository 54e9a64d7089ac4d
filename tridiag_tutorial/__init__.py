"""tridiag_tutorial: a differentiable tridiagonal solver for PyTorch, and the book that builds it.

The public face is :func:`tridiagonal_solve`, and :func:`tridiagonal_lu_factor` /
:func:`tridiagonal_lu_solve` for a matrix used many times; chapters import the modules that hold each stage:

- :mod:`tridiag_tutorial.kernels.lapack`: LAPACK ``?gtsv``, ``?gttrf``, ``?gttrs`` through SciPy;
- :mod:`tridiag_tutorial.rules`: the backward and forward-mode formulas (chapter 3);
- :mod:`tridiag_tutorial.reference`: dense references for tests and chapters;
- :mod:`tridiag_tutorial.kernels`: the ``driver`` argument: which kernel runs (LAPACK, C++,
  sequential or partitioned torch ops), and the automatic choice;
- :mod:`tridiag_tutorial.kernels.compiled`: the C++ kernel, built at install (chapter 12);
- :mod:`tridiag_tutorial.ops`: the final op.
"""

from ._validation import SingularMatrixError as SingularMatrixError
from .kernels import cpp_available as cpp_available
from .ops import TridiagonalFactors as TridiagonalFactors
from .ops import tridiagonal_lu_factor as tridiagonal_lu_factor
from .ops import tridiagonal_lu_solve as tridiagonal_lu_solve
from .ops import tridiagonal_solve as tridiagonal_solve
from .reference import dense_solve as dense_solve
from .reference import to_dense as to_dense
from .rules import tridiag_matmul as tridiag_matmul

__all__ = ["tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve", "TridiagonalFactors",
           "SingularMatrixError", "cpp_available", "dense_solve", "to_dense", "tridiag_matmul"]
__version__ = "0.1.0"
