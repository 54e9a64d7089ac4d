"""Smoke test of the benchmark suite on tiny sizes: it runs and reports; no timing assertions."""

import json

import pytest
import torch

from tridiag_tutorial import benchmarks, kernels, lapack


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


def test_quick_time_stepping_experiment_reports_both_strategies(quick):
    rows = quick[1]["time_stepping"]
    assert {(r["kernel"], r["batch"], r["mode"]) for r in rows} == {
        (kernel, batch, mode) for kernel, batch in
        [("LAPACK", 0), ("LAPACK", 16), ("pure-torch kernel", 4)]
        for mode in ("forward", "backward")}
    for r in rows:
        assert r["factor_once_seconds"] > 0 and r["every_step_seconds"] > 0
        assert r["ratio"] == r["factor_once_seconds"] / r["every_step_seconds"]


def test_merge_keeps_keys_the_suite_no_longer_produces(tmp_path):
    """Committed measurements of an earlier suite (factor_reuse) survive a --merge re-run."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [], "factor_reuse": [{"ratio": 1.25}]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--quick", "--no-compile", "--steps-only", "--merge", str(old),
                     "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["factor_reuse"] == [{"ratio": 1.25}] and saved["time_stepping"]


def test_pure_torch_kernel_cases_run_no_lapack_forward_or_backward(monkeypatch):
    """The kernel's context must cover the backward too, or its solve would go to LAPACK."""
    def refuse(*args, **kwargs):
        raise AssertionError("LAPACK was called in a pure-torch kernel case")

    for name in ("solve", "factor", "factor_solve"):
        monkeypatch.setattr(lapack, name, refuse)
    args = benchmarks._problem(8, 4, torch.float64)
    kernel = "pure-torch kernel"
    for mode in ("forward", "backward"):
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[kernel], args, mode,
                                   benchmarks.CONTEXTS[kernel])()
    for once in (True, False):
        for mode in ("forward", "backward"):
            benchmarks._stepper(8, 4, torch.float64, 2, once, mode, kernel)()


def test_quick_compiled_kernel_experiment(tmp_path):
    """--compiled-only builds the C++ kernel and times it beside raw dgtsv and the joined LAPACK
    solve (and JAX, when installed), merged into an existing results file."""
    from tridiag_tutorial import compiled

    if compiled._missing_tools():
        pytest.skip(f"no C++ tool chain here: {compiled._missing_tools()}")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"kept": True}]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--compiled-only", "--quick", "--merge", str(old), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == [{"kept": True}] and saved["compiled_kernel_machine"]
    rows = saved["compiled_kernel"]
    assert {"compiled kernel", "dgtsv (raw LAPACK)", "lapack.solve (joined batch)"} <= {
        r["impl"] for r in rows}
    for r in rows:
        assert r["seconds"] > 0
        if r["impl"] == "dgtsv (raw LAPACK)":
            assert r["ratio"] == 1.0


def test_pure_torch_kernel_cases_time_the_sequential_kernel(monkeypatch):
    """The suite's "pure-torch kernel" is the sequential pivoting kernel, also at n >= 64."""
    from tridiag_tutorial import partitioned

    monkeypatch.setattr(partitioned, "solve", lambda *a: pytest.fail("the partitioned kernel ran"))
    args = benchmarks._problem(kernels.PARTITIONED_MIN_N, 0, torch.float64)
    kernel = "pure-torch kernel"
    for mode in ("forward", "backward"):
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[kernel], args, mode,
                                   benchmarks.CONTEXTS[kernel])()


def test_quick_torch_kernels_experiment(tmp_path):
    """--torch-kernels-only times the sequential and partitioned kernels beside dgtsv, counts
    their operations, and merges into an existing results file."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"kept": True}]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--torch-kernels-only", "--quick", "--merge", str(old), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == [{"kept": True}] and saved["torch_kernels_machine"]
    rows = {(r["impl"], r["n"], r["batch"]): r for r in saved["torch_kernels"]}
    assert set(rows) == {(impl, n, batch) for n, batch in [(16, 4), (100, 0)] for impl in (
        "sequential torch kernel", "partitioned torch kernel", "dgtsv (raw LAPACK)")}
    for (impl, n, batch), r in rows.items():
        assert r["seconds"] > 0
        if impl == "dgtsv (raw LAPACK)":
            assert r["ratio"] == 1.0 and r["operations"] is None
        else:
            assert r["operations"] > 0
    # at n = 100 the sequential kernel dispatches O(n) operations, the partitioned one fewer
    assert rows[("sequential torch kernel", 100, 0)]["operations"] > 30 * 100
    assert (rows[("partitioned torch kernel", 100, 0)]["operations"]
            < rows[("sequential torch kernel", 100, 0)]["operations"] / 3)
    assert rows[("partitioned torch kernel", 100, 0)]["vs_sequential"] == pytest.approx(
        rows[("partitioned torch kernel", 100, 0)]["seconds"]
        / rows[("sequential torch kernel", 100, 0)]["seconds"])
