"""The reference rows that chapters 12 and 15 quote, shipped with the package.

Chapter 12's rows are one run of the suite's comparison with JAX (``benchmarks.run_against_jax``: the
candidates of each case timed in alternation, each thread count in a process pinned to that many
cores), in float64, on the machine that the rows' record names. ``extract`` takes them from the
suite's JSON; the chapter reads them with ``load``, so that it runs where the repository's
``notebooks/data`` is absent (a chapter opened alone in Colab)::

    python -m tridiag_tutorial.bench.reference notebooks/data/benchmark_results.json \\
        --accuracy notebooks/data/accuracy_results.json

Chapter 15 reads two more sections: ``one_system`` (the suite's one-system run, forward: for each
family, dtype, thread count, load and size, the median seconds of ``?gtsv`` and of the op, and the
systems the kernel handed back) and ``accuracy`` (the accuracy benchmark's rows of the kernel in
pieces). Without ``--accuracy`` the accuracy rows already shipped are kept.

The same two runs, against JAX and one system, were also made on a second CPU: ``--second`` names
that run's JSON, and ``load(cpu)`` gives its rows (``other_runs`` in the file; the rows of a run
made with quartiles carry them, ``None`` elsewhere)::

    python -m tridiag_tutorial.bench.reference notebooks/data/benchmark_results.json \
        --second notebooks/data/benchmark_results_intel.json

Each run's machine record says what the C++ kernel's pieces did with spikes that decay below the
normal range (``pieces_spikes``, as ``kernels.compiled.PIECES_SPIKES`` says for the kernel
installed): the records of runs made before the kernel cut them were given the value
"computed to the end of each piece" by hand. Likewise ``pieces_last_tile`` says how it loaded
the last tile of a system (``kernels.compiled.PIECES_LAST_TILE``): the records of runs made
before it loaded that tile like the others were given "loaded one value at a time" by hand.

Chapter 16 reads ``partitioned_accuracy``: the accuracy benchmark's rows of the partitioned torch
kernel, with its check alone (``variant`` "check only") and with refinement ("refine + check").

Chapter 13 reads ``routes``: the suite's run of the op's shortcuts (``benchmarks.run_routes``, the
variants timed in alternation), one thread, float64: for each route, mode and case, the median
seconds per call and each round's (``rounds``: the routes of a case share their rounds, so a ratio
can be taken round by round).
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from . import benchmarks

__all__ = ["ACCURACY_COLUMNS", "COLUMNS", "FILE", "IMPLS", "ONE_SYSTEM_COLUMNS", "PARTITIONED_COLUMNS",
           "PARTS", "ROUTES_COLUMNS", "SECTION", "cpus", "extract", "load", "main"]

FILE = "reference_rows.json"  # beside this module, package data
SECTION = "against_jax"  # the suite's section the rows come from
DTYPE = "float64"
COLUMNS = ("impl", "mode", "n", "batch", "threads", "family", "busy", "seconds", "quartiles")
# the suite's names of the candidates, by the short names of the file and of load()'s rows
IMPLS = {"op": benchmarks.FINAL, "lapack": benchmarks.FINAL_LAPACK, "jax": benchmarks.JAX_IMPL,
         "compiled": benchmarks.COMPILED_FINAL}


# chapter 15's one-system rows: seconds of raw ?gtsv and of the op as installed, and how many
# systems the large-system kernel handed back to the sequential elimination
ONE_SYSTEM_COLUMNS = ("family", "dtype", "threads", "busy", "n", "gtsv_seconds", "op_seconds",
                      "handed_back", "gtsv_quartiles", "op_quartiles")
_GTSV, _OP, _KERNEL = benchmarks.RAW_GTSV, benchmarks.FINAL, benchmarks.LARGE_KERNEL
# chapter 15's accuracy rows (the kernel in pieces): forward error over ?gtsv's; ratios rounded to
# three figures by the benchmark itself; None where a column does not apply (singular systems)
ACCURACY_COLUMNS = ("family", "dtype", "n", "systems", "compared", "fallbacks", "raised",
                    "lapack_raised", "disagreements", "max_ratio", "reversed_max_ratio", "ratios")


# chapter 13's route rows: the median seconds of the op as installed and of each variant
ROUTES_COLUMNS = ("route", "mode", "n", "batch", "seconds", "rounds")
# chapter 16's accuracy rows (the partitioned torch kernel): the accuracy benchmark's two variants
PARTITIONED_COLUMNS = ("variant",) + ACCURACY_COLUMNS
_VARIANTS = {"before": "check only", "after": "refine + check"}
PARTS = ("one_system", "accuracy", "routes", "partitioned_accuracy")  # beside chapter 12's rows


def _figures(values):
    return None if values is None else [float(f"{v:.4g}") for v in values]


def _route_value(row: dict, column: str):
    """A route row's value in the file: seconds to four figures, and so each round's seconds
    (``None`` for a run that kept medians only)."""
    if column == "seconds":
        return float(f"{row['seconds']:.4g}")
    if column == "rounds":
        return _figures(row.get("rounds"))
    return row[column]


def _routes(report: dict) -> dict:
    rows = [[_route_value(r, c) for c in ROUTES_COLUMNS]
            for r in report["routes"] if r["threads"] == 1 and r.get("seconds") is not None]
    return {"machine": report["routes_machine"], "config": report["routes_config"],
            "columns": list(ROUTES_COLUMNS), "rows": rows}


def _one_system(report: dict) -> dict:
    rows = {(r["impl"], r.get("family", "dominant"), r["dtype"], r["threads"],
             r.get("busy", False), r["n"]): r
            for r in report["one_system"] if r["mode"] == "forward"}
    out = []
    for (impl, *case), row in rows.items():
        if impl == _OP:
            gtsv, kernel = rows[(_GTSV, *case)], rows[(_KERNEL, *case)]
            out.append([*case, float(f"{gtsv['seconds']:.4g}"), float(f"{row['seconds']:.4g}"),
                        kernel["kernel_fallbacks"], _figures(gtsv.get("quartiles")),
                        _figures(row.get("quartiles"))])
    return {"machine": report["one_system_machine"], "config": report["one_system_config"],
            "columns": list(ONE_SYSTEM_COLUMNS), "rows": out}


def _accuracy_row(row: dict) -> list:
    # ratios rounded to six figures; None where a column does not apply
    return [row.get(c) if c not in ("max_ratio", "reversed_max_ratio") or row.get(c) is None
            else float(f"{row[c]:.6g}") for c in ACCURACY_COLUMNS]


def _accuracy(accuracy: dict) -> dict:
    entry = accuracy["kernels"]["pieces"]
    return {"machine": entry["machine"], "columns": list(ACCURACY_COLUMNS),
            "rows": [_accuracy_row(row) for row in entry["rows"]]}


def _partitioned(accuracy: dict) -> dict:
    rows = [[label] + _accuracy_row(row)
            for key, label in _VARIANTS.items() for row in accuracy["kernels"][key]["rows"]]
    return {"machine": accuracy["machine"], "columns": list(PARTITIONED_COLUMNS), "rows": rows}


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
    if column == "quartiles":
        return _figures(row.get("quartiles"))
    return row[column]


def _run(report: dict) -> dict:
    return {"machine": report[f"{SECTION}_machine"], "config": report[f"{SECTION}_config"],
            "columns": list(COLUMNS),
            "rows": [[_cell(row, c) for c in COLUMNS] for row in report[SECTION] if _wanted(row)]}


def extract(report: dict, accuracy: dict | None = None, second: dict | None = None) -> dict:
    """The reference rows of ``report`` (the suite's JSON, loaded): its machine record, its
    settings and the wanted rows of ``SECTION``, each a list in the order of ``COLUMNS``
    (``impl``: a key of ``IMPLS``); then ``one_system``, chapter 15's rows of the suite's
    one-system run, and ``accuracy``, those of ``accuracy`` (the accuracy benchmark's JSON,
    loaded; without it, the accuracy rows already shipped); ``routes``, chapter 13's rows of
    the suite's run of the op's shortcuts; ``partitioned_accuracy``, chapter 16's rows; and
    ``other_runs``: the same rows of ``second`` (another machine's run of the comparison with JAX
    and of one system; without it, those already shipped)."""
    shipped = json.loads(resources.files(__package__).joinpath(FILE).read_text())
    return {"section": SECTION, "dtype": DTYPE, **_run(report),
            "one_system": _one_system(report),
            "routes": _routes(report),
            "accuracy": _accuracy(accuracy) if accuracy is not None else shipped["accuracy"],
            "partitioned_accuracy": (_partitioned(accuracy) if accuracy is not None
                                     else shipped["partitioned_accuracy"]),
            "other_runs": ([{**_run(second), "one_system": _one_system(second)}]
                           if second is not None else shipped.get("other_runs", []))}


def _as_dicts(data: dict) -> dict:
    for part in PARTS:  # chapters 13, 15 and 16: rows as dicts too
        if part in data:
            data[part] = {**data[part], "rows": [dict(zip(data[part]["columns"], row))
                                                 for row in data[part]["rows"]]}
    return {**data, "rows": [dict(zip(data["columns"], row)) for row in data["rows"]]}


def cpus() -> list:
    """The CPU of each shipped run, the first that of :func:`load`'s default."""
    data = json.loads(resources.files(__package__).joinpath(FILE).read_text())
    return [run["machine"]["cpu"] for run in [data, *data["other_runs"]]]


def load(cpu: str | None = None) -> dict:
    """The shipped reference: ``machine``, ``config``, ``dtype`` and ``rows``, a list of dicts
    with the keys of ``COLUMNS`` (``impl``: ``"op"`` the op as installed, ``"lapack"`` the op
    with ``driver="lapack"``, ``"jax"``, ``"compiled"`` the op under ``torch.compile``;
    ``seconds``: the median time per call; ``quartiles``: its 25th and 75th percentile, or
    ``None`` where the run kept medians only). ``cpu``: the run of the machine whose CPU name
    contains it (case aside; :func:`cpus` lists them); by default the first. Another machine's
    run has the rows of the comparison with JAX and ``one_system`` only."""
    data = json.loads(resources.files(__package__).joinpath(FILE).read_text())
    runs = [data, *data.pop("other_runs")]
    if cpu is not None:
        found = [run for run in runs if cpu.lower() in run["machine"]["cpu"].lower()]
        if not found:
            raise ValueError(f"no reference run on a CPU named like {cpu!r}; the runs: "
                             + ", ".join(run["machine"]["cpu"] for run in runs))
        data = {"section": data["section"], "dtype": data["dtype"], **found[0]}
    return _as_dicts(data)


def _dumps(data: dict) -> str:
    # one row a line, so that a change of the file reads as a change of rows
    def rows(block: list, pad: str) -> str:
        return "[\n" + ",\n".join(pad + json.dumps(row) for row in block) + "\n" + pad[:-2] + "]"

    def value(key: str, v, pad: str) -> str:
        if key == "rows":
            return rows(v, pad + "  ")
        if key in PARTS:
            inner = ",\n".join(f'{pad}  "{k}": {value(k, w, pad + " ")}' for k, w in v.items())
            return "{\n" + inner + "\n" + pad + "}"
        if key == "other_runs":
            runs = [",\n".join(f'{pad}  "{k}": {value(k, w, pad + " ")}' for k, w in run.items())
                    for run in v]
            return "[\n" + (",\n").join(pad + " {\n" + r + "\n" + pad + " }" for r in runs) + "\n" + pad + "]"
        return json.dumps(v)

    return "{\n" + ",\n".join(f' "{k}": {value(k, v, " ")}' for k, v in data.items()) + "\n}\n"


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the suite's JSON (benchmark_results.json)")
    parser.add_argument("--accuracy", type=Path, default=None,
                        help="the accuracy benchmark's JSON (accuracy_results.json)")
    parser.add_argument("--second", type=Path, default=None,
                        help="another machine's run of the comparison with JAX and of one system")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name(FILE))
    args = parser.parse_args(argv)
    accuracy = json.loads(args.accuracy.read_text()) if args.accuracy else None
    second = json.loads(args.second.read_text()) if args.second else None
    args.out.write_text(_dumps(extract(json.loads(args.results.read_text()), accuracy, second)))
    return args.out


if __name__ == "__main__":
    print(main())
