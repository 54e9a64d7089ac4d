r"""How accurate the partitioned kernel is, against LAPACK on the same systems.

For each family of systems below, in float32 and float64 and for a few sizes from 64 to 1e5
unknowns, this module solves seeded random systems with :func:`tridiag_tutorial.kernels.partitioned.solve`
and with LAPACK's ``?gtsv`` (:func:`tridiag_tutorial.kernels.lapack.gtsv`) in the same dtype, and reports
the ratio of their forward errors, ``max|x - x_ref| / max|x_ref|``: the median, the largest, and
how many systems the partitioned kernel handed to its fallback (the sequential kernel). The
reference ``x_ref`` is LAPACK's float64 solution refined with residuals in NumPy's ``longdouble``
(80-bit extended precision on x86), so it is far more accurate than either solve in float64.
Ratios are taken only where LAPACK's error is below ``1e-2`` (elsewhere neither answer has
digits to compare). Each row also gives the same ratio for LAPACK on the reversed system (the
rows and unknowns numbered from the other end, :func:`reversed_gtsv`): how far from LAPACK's error
an elimination as backward stable as LAPACK's, rounding in another order, lands on the same systems. Singular constructions (a zero row, a row that is a multiple of the next,
a rank-1 2 x 2 block) are counted apart: how many raise
:class:`~tridiag_tutorial.SingularMatrixError` on LAPACK and on the kernel, and how many disagree.

``python -m tridiag_tutorial.bench.accuracy --out notebooks/data/accuracy_results.json`` measures the
kernel as it is (``after``), and with ``--before FILE`` the kernel before refinement was added as
well (``before``: the source of that ``partitioned.py``, which git gives from a clone, ``git show
93bdc29:tridiag_tutorial/partitioned.py > before.py``; the harness never runs git), and writes
both with the machine's description; ``--quick`` runs a small sample. Chapter 16 renders the
table.

The same families, and the 1-D Poisson matrix ``tridiag(-1, 2, -1)`` and an implicit heat step
``I + 1e4 tridiag(-1, 2, -1)`` besides, measure the C++ kernel's solve of one large system in
pieces (``pieces``, where the C++ kernel is built): :func:`tridiag_tutorial.kernels.compiled.solve_ex`
with ``pieces_min_n=0``, so that n = 1000 runs it as well as 1e5. Its fallbacks are the systems it
handed to the sequential elimination (``?gtsv``'s operations), as ``solve_ex`` counts them.
``--kernels pieces --merge FILE`` measures it alone and adds it to an earlier file. Chapter 14
renders its rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

from .._validation import SingularMatrixError
from ..kernels import compiled, lapack, partitioned

__all__ = ["FAMILIES", "SINGULAR_FAMILIES", "KERNELS", "make", "reference", "reversed_gtsv", "forward_error",
           "measure", "main"]

FAMILIES = ("random", "zero_diagonal", "dominant", "nearly_singular_block", "badly_scaled_rows")
SINGULAR_FAMILIES = ("zero_row", "half_row", "scaled_row", "rank1_block")
SIZES = (64, 1000, 100_000)
SYSTEMS = {64: 60, 1000: 20, 100_000: 2}  # per family, dtype and size
QUICK_SYSTEMS = {64: 4, 1000: 2}
PIECES_SYSTEMS = {1000: 20, 100_000: 2}  # sizes where the C++ kernel solves one system in pieces
QUICK_PIECES_SYSTEMS = {1000: 2}
PIECES_FAMILIES = FAMILIES + ("poisson", "heat")
KERNELS = ("before", "after", "pieces")
BEFORE = "93bdc291639554c9d498c6a6c61db8788cd152a7"  # the last commit whose kernel had a check alone, no refinement
SINGULAR_MAX_N = 1000  # singular families are measured up to this size
SCALE_EXPONENT = {np.float32: 30, np.float64: 150}  # badly scaled rows: 10^U(-e, e)


def make(family: str, n: int, dtype, seed: int, row: int | None = None):
    """``(lower, diag, upper, rhs)``: NumPy arrays of ``dtype`` for one system, ``rhs`` ``(n, 1)``.

    - ``random``: diagonal ``±(1.5 + |N(0, 1)|)``, off-diagonals ``N(0, 1)`` (pivoting needed;
      the recipe of ``tests/conftest.make_system``);
    - ``zero_diagonal``: zero diagonal, off-diagonals ``±(1 + 0.1 |N|)`` (``n`` even), so that every
      elimination step must swap rows;
    - ``dominant``: the random recipe with 4 added to the diagonal's magnitude;
    - ``nearly_singular_block``: the random recipe with one block of ``partitioned.BLOCK`` rows
      (at a random block position) made singular and then perturbed by a relative ``10^U(-15, -3)``;
    - ``badly_scaled_rows``: the random recipe with row ``i`` (and its right-hand side) scaled by
      ``10^(t_i + U(-1, 1))``, ``t_i`` going evenly from ``-e`` to ``e`` (or back) down the rows,
      ``e`` = 150 in float64 and 30 in float32 (where adjacent rows differ by more than a few
      decades, at n = 64, LAPACK's own error is often above 1e-2, and no ratio is taken);
    - ``poisson``: ``tridiag(-1, 2, -1)``; ``heat``: ``I + 1e4 tridiag(-1, 2, -1)`` (an implicit
      heat step), both with a random right-hand side;
    - ``zero_row``, ``half_row`` (row ``i + 1`` = row ``i`` / 2), ``scaled_row`` (row ``i + 1`` =
      ``-0.7`` row ``i``, rounded), ``rank1_block`` (a decoupled 2 x 2 block of rank 1): singular
      (``scaled_row`` up to round-off), the row ``i`` drawn at random unless ``row`` gives it.
    """
    g = np.random.default_rng(seed)
    lower, upper = g.standard_normal(n - 1), g.standard_normal(n - 1)
    sign = np.where(g.random(n) < 0.5, -1.0, 1.0)
    diag = (1.5 + np.abs(g.standard_normal(n))) * sign
    rhs = g.standard_normal((n, 1))
    i = int(g.integers(2, n - 3)) if row is None else row
    if family == "zero_diagonal":
        n_even = n - n % 2
        diag = np.zeros(n)
        if n_even < n:
            diag[-1] = 1.0
        lower = (1 + 0.1 * np.abs(lower)) * np.where(g.random(n - 1) < 0.5, -1.0, 1.0)
        upper = (1 + 0.1 * np.abs(upper)) * np.where(g.random(n - 1) < 0.5, -1.0, 1.0)
    elif family == "dominant":
        diag = diag + 4 * sign
    elif family == "nearly_singular_block":
        m = partitioned.BLOCK
        a = (m + 1) * int(g.integers(0, max(1, (n - m) // (m + 1))))  # first row of a block
        f_prev, f = 1.0, diag[a]  # continuants: determinants of the block's leading submatrices
        for r in range(a + 1, a + m - 1):
            f_prev, f = f, diag[r] * f - lower[r - 1] * upper[r - 1] * f_prev
        last = a + m - 1
        diag[last] = lower[last - 1] * upper[last - 1] * f_prev / f  # the block's det is 0
        diag[last] *= 1 + 10.0 ** g.uniform(-15, -3) * (1 if g.random() < 0.5 else -1)
    elif family == "poisson":
        lower, diag, upper = -np.ones(n - 1), np.full(n, 2.0), -np.ones(n - 1)
    elif family == "heat":
        lower, diag, upper = np.full(n - 1, -1e4), np.full(n, 1 + 2e4), np.full(n - 1, -1e4)
    elif family == "badly_scaled_rows":
        e = SCALE_EXPONENT[dtype]
        ramp = np.linspace(-e, e, n) * (1 if g.random() < 0.5 else -1) + g.uniform(-1, 1, n)
        scale = 10.0 ** np.clip(ramp, -e, e)
        diag, rhs = diag * scale, rhs * scale[:, None]
        lower, upper = lower * scale[1:], upper * scale[:-1]
    elif family == "zero_row":
        lower[i - 1], diag[i], upper[i] = 0.0, 0.0, 0.0
    elif family in ("half_row", "scaled_row"):  # rows i and i + 1 only in columns i, i + 1
        factor = 0.5 if family == "half_row" else -0.7
        lower[i - 1], upper[i + 1] = 0.0, 0.0
        lower[i], diag[i + 1] = factor * diag[i], factor * upper[i]
    elif family == "rank1_block":  # rows and columns i, i + 1 decoupled, [[a, b], [2a, 2b]]
        lower[i - 1], upper[i - 1], lower[i + 1], upper[i + 1] = 0.0, 0.0, 0.0, 0.0
        lower[i], diag[i + 1] = 2 * diag[i], 2 * upper[i]
    elif family != "random":
        raise ValueError(f"unknown family {family!r}")
    return tuple(np.asarray(t, dtype=dtype) for t in (lower, diag, upper, rhs))


def _residual_long(lower, diag, upper, rhs, x):
    """``rhs - A x`` in ``longdouble``."""
    lo, d, up, b = (np.asarray(t, dtype=np.longdouble) for t in (lower, diag, upper, rhs))
    r = b - d[:, None] * x
    r[1:] -= lo[:, None] * x[:-1]
    r[:-1] -= up[:, None] * x[1:]
    return r


def reference(lower, diag, upper, rhs, steps: int = 6):
    """``A^{-1} rhs`` in ``longdouble``: LAPACK's float64 solve refined with ``longdouble``
    residuals (``A`` and ``rhs`` as given, converted exactly). Raises
    :class:`~tridiag_tutorial.SingularMatrixError` where float64 LAPACK meets an exact zero
    pivot."""
    lo, d, up = (np.asarray(t, dtype=np.float64) for t in (lower, diag, upper))
    x = lapack.gtsv(lo, d, up, np.asarray(rhs, dtype=np.float64)).astype(np.longdouble)
    for _ in range(steps):
        r = _residual_long(lower, diag, upper, rhs, x)
        # scale so that the float64 correction neither overflows nor underflows
        scale = np.max(np.abs(r)) if np.all(np.isfinite(r)) else 0
        if not scale:
            break
        x = x + lapack.gtsv(lo, d, up, (r / scale).astype(np.float64)).astype(np.longdouble) * scale
    return x


def reversed_gtsv(lower, diag, upper, rhs):
    """LAPACK's ``?gtsv`` on the same system with its rows and unknowns numbered from the other
    end (row ``i`` becomes row ``n - 1 - i``): an elimination as backward stable as ``?gtsv``,
    whose rounding happens in another order. Its answer, in the original order."""
    flip = [np.ascontiguousarray(t[::-1]) for t in (upper, diag, lower, rhs)]
    return lapack.gtsv(*flip)[::-1]


def forward_error(x, x_ref) -> float:
    """``max|x - x_ref| / max|x_ref|``, in ``longdouble``."""
    x = np.asarray(x, dtype=np.longdouble)
    with np.errstate(all="ignore"):
        return float(np.max(np.abs(x - x_ref)) / np.max(np.abs(x_ref)))


def _torch(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _kernel_solve(module, system):
    """``(x, fell_back)`` of a partitioned kernel (``module``: :mod:`tridiag_tutorial.kernels.
    partitioned`, or an earlier one from :func:`kernel_from_file`) on one system; raises
    :class:`~tridiag_tutorial.SingularMatrixError`."""
    x, fell_back = module.solve_ex(*_torch(*system))
    return x.numpy(), bool(fell_back)


def _pieces_solve(system):
    """``(x, fell_back)`` of the C++ kernel's solve in pieces of one system, from any size
    (``pieces_min_n=0``); raises :class:`~tridiag_tutorial.SingularMatrixError`."""
    x, fallbacks = compiled.solve_ex(*_torch(*system), pieces_min_n=0)
    return x.numpy(), fallbacks > 0


def _ratio(error, lapack_error):
    return error / lapack_error if lapack_error > 0 else (1.0 if error == 0 else math.inf)


def measure(kernel, families=FAMILIES, singular=SINGULAR_FAMILIES, systems=None, log=None,
            run=None):
    """Rows for ``kernel`` (a partitioned kernel's module, with ``solve_ex``), or for ``run`` (``run(system)``
    gives ``(x, fell_back)``, as :func:`_pieces_solve`): one per family, dtype and size, with
    ``median_ratio``, ``max_ratio`` (kernel error / LAPACK error where LAPACK's is below 1e-2),
    ``compared``, ``fallbacks``, ``raised``, ``max_lapack_error`` and every ``ratios`` (3
    significant digits), and the same for LAPACK on the reversed system (:func:`reversed_gtsv`)
    over LAPACK: ``reversed_ratios`` and ``reversed_max_ratio``, how far apart two backward-stable
    eliminations of the same systems come; singular families with
    ``lapack_raised``, ``kernel_raised`` and ``disagreements``."""
    systems = systems or SYSTEMS
    run = run or (lambda system: _kernel_solve(kernel, system))
    rows = []
    for family in tuple(families) + tuple(singular):
        for dtype in (np.float32, np.float64):
            for n, count in systems.items():
                if family in singular and n > SINGULAR_MAX_N:
                    continue  # every one falls back to the sequential kernel: slow, and like n = 1000
                ratios, reversed_ratios = [], []
                fallbacks, raised, lapack_raised, disagree, worst = 0, 0, 0, 0, 0.0
                for seed in range(count):
                    system = make(family, n + (n % 2 if family == "zero_diagonal" else 0), dtype, seed)
                    try:
                        x_lapack = lapack.gtsv(*system)
                        lapack_error = None
                    except SingularMatrixError:
                        lapack_error = "raised"
                    try:
                        x, fell_back = run(system)
                        kernel_error = None
                    except SingularMatrixError:
                        kernel_error, fell_back = "raised", True
                    fallbacks += fell_back
                    raised += kernel_error is not None
                    lapack_raised += lapack_error is not None
                    if (lapack_error is None) != (kernel_error is None):
                        disagree += 1
                        continue
                    if lapack_error is not None or family in singular:
                        continue
                    x_ref = reference(*system)
                    e_lapack = forward_error(x_lapack, x_ref)
                    if e_lapack < 1e-2:
                        e_kernel = forward_error(x, x_ref)
                        ratios.append(_ratio(e_kernel, e_lapack))
                        e_reversed = forward_error(reversed_gtsv(*system), x_ref)
                        reversed_ratios.append(_ratio(e_reversed, e_lapack))
                        worst = max(worst, e_lapack)
                row = dict(family=family, dtype=np.dtype(dtype).name, n=n, systems=count,
                           fallbacks=fallbacks, raised=raised, lapack_raised=lapack_raised,
                           disagreements=disagree)
                if family not in singular:
                    row.update(compared=len(ratios),
                               median_ratio=float(np.median(ratios)) if ratios else None,
                               max_ratio=float(np.max(ratios)) if ratios else None,
                               max_lapack_error=worst,
                               ratios=[float(f"{r:.3g}") for r in ratios],
                               reversed_max_ratio=(float(np.max(reversed_ratios))
                                                   if reversed_ratios else None),
                               reversed_ratios=[float(f"{r:.3g}") for r in reversed_ratios])
                rows.append(row)
                if log:
                    log(json.dumps(row))
    return rows


def _load_module(source: str, name: str):
    """A module made from ``source`` (the text of a ``partitioned.py``), importing its
    relative imports from this package's kernels (``torch_kernel``: the sequential kernel's
    earlier name)."""
    source = source.replace("from . import torch_kernel",
                            "from tridiag_tutorial.kernels import sequential as torch_kernel")
    source = source.replace("from . import", "from tridiag_tutorial.kernels import")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name + ".py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


class _CountingFallback:
    """The sequential kernel as an earlier kernel's module sees it: ``solve`` counted."""

    def __init__(self, kernel):
        self._kernel, self.calls = kernel, 0

    def solve(self, *args):
        self.calls += 1
        return self._kernel.solve(*args)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def kernel_from_file(path: str):
    """The partitioned kernel whose source is the file ``path`` (an earlier ``partitioned.py``),
    with a ``solve_ex`` that says, as the current kernel's does, whether it fell back to the
    sequential kernel (counted on the copy's own reference to it, not on the package)."""
    with open(path) as f:
        source = f.read()
    module = _load_module(source, "_partitioned_before")
    if not hasattr(module, "solve_ex"):
        name = "torch_kernel" if hasattr(module, "torch_kernel") else "sequential"
        counting = _CountingFallback(getattr(module, name))
        setattr(module, name, counting)

        def solve_ex(*args):
            before = counting.calls
            x = module.solve(*args)
            return x, counting.calls > before

        module.solve_ex = solve_ex
    return module


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="a few systems of n = 64 and 1000")
    parser.add_argument("--before", default="",
                        help="the source file of an earlier partitioned.py to measure as 'before' "
                             f"(the last one without refinement: git show {BEFORE[:7]}:"
                             "tridiag_tutorial/partitioned.py > before.py); default: none")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="which to measure, of " + ", ".join(KERNELS) + " (default: all; "
                             "pieces only where the C++ kernel is built)")
    parser.add_argument("--merge", help="start from this earlier results file (its other "
                                        "kernels' rows are kept)")
    args = parser.parse_args(argv)
    from .benchmarks import machine_info

    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(wanted) - set(KERNELS))
    if unknown:
        parser.error(f"unknown kernels {unknown}; choose from {', '.join(KERNELS)}")
    systems = QUICK_SYSTEMS if args.quick else SYSTEMS
    kernels = {}
    old = kernel_from_file(args.before) if args.before and "before" in wanted else None
    if old is not None:
        kernels["before"] = dict(run=None, solve=old, systems=systems)
    if "after" in wanted:
        kernels["after"] = dict(run=None, solve=partitioned, systems=systems)
    if "pieces" in wanted and compiled.is_available():
        kernels["pieces"] = dict(
            run=_pieces_solve, solve=None, families=PIECES_FAMILIES,
            systems=QUICK_PIECES_SYSTEMS if args.quick else PIECES_SYSTEMS)
    results = {"machine": machine_info(), "quick": args.quick,
               "block": partitioned.BLOCK, "kernels": {}}
    if args.merge:
        with open(args.merge) as f:
            results = json.load(f)
        results["kernels"].pop("speculative", None)  # the C++ kernel's solve before the pieces
    for label, how in kernels.items():
        start = time.perf_counter()
        print(f"{label}:", file=sys.stderr)
        rows = measure(how["solve"], families=how.get("families", FAMILIES),
                       systems=how["systems"], run=how["run"],
                       log=lambda s: print("  " + s, file=sys.stderr))
        results["kernels"][label] = dict(rows=rows, seconds=round(time.perf_counter() - start, 1),
                                         machine=machine_info())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
