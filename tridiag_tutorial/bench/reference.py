"""The reference rows that chapter 12 quotes, shipped with the package.

They are one run of the suite's comparison with JAX (``benchmarks.run_against_jax``: the
candidates of each case timed in alternation, each thread count in a process pinned to that many
cores), in float64, on the machine that the rows' record names. ``extract`` takes them from the
suite's JSON; the chapter reads them with ``load``, so that it runs where the repository's
``notebooks/data`` is absent (a chapter opened alone in Colab)::

    python -m tridiag_tutorial.bench.reference notebooks/data/benchmark_results.json
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

__all__ = ["COLUMNS", "FILE", "IMPLS", "SECTION", "extract", "load", "main"]

FILE = "reference_rows.json"  # beside this module, package data
SECTION = "against_jax"  # the suite's section the rows come from
DTYPE = "float64"
COLUMNS = ("impl", "mode", "n", "batch", "threads", "family", "busy", "seconds")
# the suite's names of the candidates, by the short names of the file and of load()'s rows
IMPLS = {"op": "tridiagonal_solve (final)", "lapack": "tridiagonal_solve (driver='lapack')",
         "jax": "jax tridiagonal_solve", "compiled": "torch.compile(tridiagonal_solve)"}


def _wanted(row: dict) -> bool:
    # float64: every case of the suite's own matrix (quiet and busy, one and two threads, eager and
    # compiled), and one system of each other matrix family, forward, one thread, quiet
    if row["dtype"] != DTYPE or row.get("error") is not None or row.get("seconds") is None:
        return False
    return row["family"] == "dominant" or (
        row["mode"] == "forward" and row["threads"] == 1 and not row["busy"])


def _cell(row: dict, column: str):
    if column == "impl":
        return {v: k for k, v in IMPLS.items()}[row["impl"]]
    if column == "seconds":
        return float(f"{row['seconds']:.4g}")  # four significant figures: far below the spread
    return row[column]


def extract(report: dict) -> dict:
    """The reference rows of ``report`` (the suite's JSON, loaded): its machine record, its
    settings and the wanted rows of ``SECTION``, each a list in the order of ``COLUMNS``
    (``impl``: a key of ``IMPLS``)."""
    return {"section": SECTION, "dtype": DTYPE,
            "machine": report[f"{SECTION}_machine"], "config": report[f"{SECTION}_config"],
            "columns": list(COLUMNS),
            "rows": [[_cell(row, c) for c in COLUMNS] for row in report[SECTION] if _wanted(row)]}


def load() -> dict:
    """The shipped reference: ``machine``, ``config``, ``dtype`` and ``rows``, a list of dicts
    with the keys of ``COLUMNS`` (``impl``: ``"op"`` the op as installed, ``"lapack"`` the op
    with ``driver="lapack"``, ``"jax"``, ``"compiled"`` the op under ``torch.compile``;
    ``seconds``: the median time per call)."""
    data = json.loads(resources.files(__package__).joinpath(FILE).read_text())
    return {**data, "rows": [dict(zip(data["columns"], row)) for row in data["rows"]]}


def _dumps(data: dict) -> str:
    # one row a line, so that a change of the file reads as a change of rows
    head = {k: v for k, v in data.items() if k != "rows"}
    rows = ",\n".join("  " + json.dumps(row) for row in data["rows"])
    return json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + rows + "\n ]\n}\n"


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the suite's JSON (benchmark_results.json)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name(FILE))
    args = parser.parse_args(argv)
    args.out.write_text(_dumps(extract(json.loads(args.results.read_text()))))
    return args.out


if __name__ == "__main__":
    print(main())
