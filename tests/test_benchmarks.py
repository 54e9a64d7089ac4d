"""Smoke test of the benchmark suite on tiny sizes: it runs and reports; no timing assertions."""

import json

import pytest
import torch

from tridiag_tutorial import benchmarks, lapack, tridiagonal_solve


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    report = benchmarks.main(["--quick", "--no-compile", "--out", str(out)])
    return report, json.loads(out.read_text())


def test_quick_benchmark_runs_and_writes_json(quick):
    report, saved = quick
    assert saved["machine"]["torch"] == report["machine"]["torch"]
    impls = {r["impl"] for r in saved["results"]}
    assert {"dgtsv (raw LAPACK)", "tridiagonal_solve (final)", "ch4 autograd.Function",
            "ch5 custom_op", "torch.linalg.solve (dense)", "scipy solve_banded",
            "pure-torch kernel"} <= impls
    assert {r["mode"] for r in saved["results"]} == {"forward", "backward"}
    assert all(r["seconds"] > 0 for r in saved["results"])
    assert saved["targets"] and all(t["ratio"] is not None for t in saved["targets"])


def test_quick_factor_reuse_experiment_reports_both_strategies_and_the_policy(quick):
    rows = quick[1]["factor_reuse"]
    assert {r["kernel"] for r in rows} == {"LAPACK", "pure-torch kernel"}
    assert {r["dtype"] for r in rows} == {"float64", "complex128"}
    for r in rows:
        assert r["reuse_seconds"] > 0 and r["twice_seconds"] > 0
        assert r["ratio"] == r["reuse_seconds"] / r["twice_seconds"]
    policy = {(r["kernel"], r["dtype"], r["batch"], r["k"]): r["policy_reuses"] for r in rows}
    # the op's measured policy: the torch kernel reuses the factors, LAPACK solves again
    assert policy == {("LAPACK", "float64", 0, 1): False, ("LAPACK", "float64", 16, 2): False,
                      ("LAPACK", "complex128", 0, 1): False, ("LAPACK", "complex128", 16, 2): False,
                      ("pure-torch kernel", "float64", 16, 1): True,
                      ("pure-torch kernel", "complex128", 16, 1): True}


def test_pure_torch_kernel_cases_run_no_lapack_forward_or_backward(monkeypatch):
    """The kernel's context must cover the backward too, or its solve would go to LAPACK."""
    def refuse(*args, **kwargs):
        raise AssertionError("LAPACK was called in a pure-torch kernel case")

    for name in ("solve", "factor_solve", "lu_solve"):
        monkeypatch.setattr(lapack, name, refuse)
    args = benchmarks._problem(8, 4, torch.float64)
    kernel = "pure-torch kernel"
    for mode in ("forward", "backward"):
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[kernel], args, mode,
                                   benchmarks.CONTEXTS[kernel])()
    for reuse in (True, False):
        benchmarks._torch_callable(tridiagonal_solve, args, "backward",
                                   benchmarks._strategy(kernel, reuse))()
