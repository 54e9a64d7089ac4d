"""The bytes that one distributed solve hands to its collectives, counted by
:func:`~tridiag_tutorial.distributed.solve.record` on gloo processes beside the formula of
:func:`tridiag_tutorial.distributed.solve.communication` (a count, not a measurement of the wire)::

    python -m tridiag_tutorial.bench.communication [--n N] [--world-sizes 2 4]

Each route (``gather_solve``, ``split_solve`` with and without refinement) solves the same seeded
system on every rank; rank 0 prints one JSON row per route and world size: the bytes contributed
and sent, the collectives, and for information the time of that one call and the largest
difference from the gathered LAPACK answer (one call each: not a benchmark).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.solve import communication, gather_solve, record, split_bands, split_solve

__all__ = ["main"]


def _measure_worker(rank: int, world_size: int, n: int) -> dict:
    """One rank of :func:`main` (run by :func:`~tridiag_tutorial.book.multiprocess.run_on_ranks`,
    which joins the gloo group): every route on the same seeded system, its bytes counted."""
    import time

    g = torch.Generator().manual_seed(0)
    lower, upper = torch.randn(n - 1, generator=g), torch.randn(n - 1, generator=g)
    diag = 4 + torch.rand(n, generator=g)
    rhs = torch.randn(n, generator=g)
    pieces = split_bands(lower.double(), diag.double(), upper.double(), rhs.double(), rank,
                         world_size)
    measured, answers = {}, {}
    for name, solve in (("gather_solve", lambda: gather_solve(*pieces)),
                        ("split_solve", lambda: split_solve(*pieces)),
                        ("split_solve_no_refinement",
                         lambda: split_solve(*pieces, refinement_steps=0))):
        with record() as r:
            start = time.perf_counter()
            answers[name] = solve()
            seconds = time.perf_counter() - start
        difference = (answers[name] - answers["gather_solve"]).abs().max()  # vs LAPACK's
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)  # over the ranks
        measured[name] = dict(contributed=r.bytes_contributed, sent=r.bytes_sent,
                              collectives=len(r.collectives), fallbacks=r.fallbacks,
                              seconds=round(seconds, 4),
                              max_difference_from_lapack=float(difference))
    return measured


def main(argv=None) -> list:
    """Measure the bytes per rank of one solve on gloo processes and print them beside
    :func:`communication`'s formula (and, for information, each route's time on rank 0 and its
    largest difference from the gathered LAPACK answer; one call each, not a benchmark)."""
    import argparse
    import json

    # Under ``python -m`` this module is ``__main__``, which a spawned rank cannot import: the
    # ranks run the worker of the module imported under its own name.
    from ..book import multiprocess
    from .communication import _measure_worker as worker

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    rows = []
    for world_size in args.world_sizes:
        measured = multiprocess.run_on_ranks(worker, world_size, args.n)[0]
        formula = communication(args.n, world_size)
        for name, m in measured.items():
            rows.append(dict(n=args.n, world_size=world_size, route=name, **m,
                             formula_sent=formula[name]["sent"],
                             matches=m["sent"] == formula[name]["sent"]))
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
