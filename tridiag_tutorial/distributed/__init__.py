"""The solve past one machine (chapter 17).

- :mod:`tridiag_tutorial.distributed.solve`: one system split by rows across the ranks of a
  process group, solved in pieces with a reduced system on every rank (:func:`~tridiag_tutorial.distributed.solve.split_solve`),
  or gathered to one rank (:func:`~tridiag_tutorial.distributed.solve.gather_solve`);
- :mod:`tridiag_tutorial.distributed.sharding`: DTensor's sharding rules for the package's ops.
  The public functions import it the first time a DTensor reaches them.

``import tridiag_tutorial`` imports neither; this package loads ``torch.distributed``.
"""

__all__ = ["MIN_ROWS", "REFINEMENT_STEPS", "split_solve", "gather_solve", "split_bands",
           "split_sizes", "communication", "record", "SolveRecord"]


def __getattr__(name: str):
    """The names of :mod:`tridiag_tutorial.distributed.solve`, imported on first use, so that
    importing :mod:`tridiag_tutorial.distributed.sharding` alone (which the public functions do
    when a DTensor first reaches them) does not import the split solve and the library above it."""
    if name in __all__:
        from . import solve
        return getattr(solve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
