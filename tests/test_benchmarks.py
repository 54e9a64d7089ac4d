"""Smoke test of the benchmark suite on tiny sizes: it runs and reports; no timing assertions."""

import json

from tridiag_tutorial import benchmarks


def test_quick_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "results.json"
    report = benchmarks.main(["--quick", "--no-compile", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["machine"]["torch"] == report["machine"]["torch"]
    impls = {r["impl"] for r in saved["results"]}
    assert {"dgtsv (raw LAPACK)", "tridiagonal_solve (final)", "ch4 autograd.Function",
            "ch5 custom_op", "torch.linalg.solve (dense)", "scipy solve_banded",
            "pure-torch kernel"} <= impls
    assert {r["mode"] for r in saved["results"]} == {"forward", "backward"}
    assert all(r["seconds"] > 0 for r in saved["results"])
    assert saved["targets"] and all(t["ratio"] is not None for t in saved["targets"])
