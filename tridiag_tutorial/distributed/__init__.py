"""The solve past one machine (chapter 14).

- :mod:`tridiag_tutorial.distributed.solve`: one system split by rows across the ranks of a
  process group, solved in pieces with a reduced system on every rank (:func:`split_solve`), or
  gathered to one rank (:func:`gather_solve`);
- :mod:`tridiag_tutorial.distributed.sharding`: DTensor's sharding rules for the package's ops.
  The public functions import it the first time a DTensor reaches them.

``import tridiag_tutorial`` imports neither; this package loads ``torch.distributed``.
"""

from .solve import (
    MIN_ROWS,
    REFINEMENT_STEPS,
    SolveRecord,
    communication,
    gather_solve,
    record,
    split_bands,
    split_sizes,
    split_solve,
)

__all__ = ["MIN_ROWS", "REFINEMENT_STEPS", "split_solve", "gather_solve", "split_bands",
           "split_sizes", "communication", "record", "SolveRecord"]
