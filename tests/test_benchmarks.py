"""Smoke test of the benchmark suite on tiny sizes: it runs and reports; no timing assertions."""

import importlib.util
import json

import numpy as np
import pytest
import torch
import torch.utils.benchmark

from tridiag_tutorial import benchmarks, kernels, lapack, tridiagonal_solve


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    report = benchmarks.main(["--quick", "--no-compile", "--out", str(out)])
    return report, json.loads(out.read_text())


def has_jax() -> bool:
    return importlib.util.find_spec("jax") is not None


def has_cpp() -> bool:
    from tridiag_tutorial import compiled

    return not compiled._missing_tools()


def test_quick_benchmark_runs_and_writes_json(quick):
    report, saved = quick
    assert saved["machine"]["torch"] == report["machine"]["torch"]
    impls = {r["impl"] for r in saved["results"]}
    assert {"dgtsv (raw LAPACK)", "tridiagonal_solve (final)", "ch4 autograd.Function",
            "ch5 custom_op", "torch.linalg.solve (dense)", "scipy solve_banded",
            "pure-torch kernel"} <= impls
    assert (benchmarks.JAX_IMPL in impls) == has_jax()
    assert (benchmarks.FINAL_CPP in impls) == has_cpp()
    assert {r["mode"] for r in saved["results"]} == {"forward", "backward"}
    for r in saved["results"]:  # torch.utils.benchmark's blocks, summarised
        assert r["seconds"] > 0 and r["blocks"] >= 1 and r["calls_per_block"] >= 1
        low, q25, q75, high = r["extremes"][0], *r["quartiles"], r["extremes"][1]
        assert low <= q25 <= r["seconds"] <= q75 <= high
    assert saved["targets"] and all(t["ratio"] is not None for t in saved["targets"])


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
def test_quick_benchmark_ends_with_the_interleaved_comparison_with_jax(quick):
    saved = quick[1]
    rows = saved["against_jax"]
    assert saved["against_jax_machine"]["jax"] and saved["results"]  # merged, not replaced
    impls = {"tridiagonal_solve (final)", benchmarks.JAX_IMPL} | (
        {benchmarks.FINAL_CPP} if has_cpp() else set())
    cases = {(r["n"], r["batch"], r["dtype"], r["mode"]) for r in rows}
    assert {(8, 16), (100, 0)} == {(n, batch) for n, batch, _, _ in cases}
    for n, batch, dtype, mode in cases:
        same = {r["impl"]: r for r in rows
                if (r["n"], r["batch"], r["dtype"], r["mode"]) == (n, batch, dtype, mode)}
        assert set(same) == impls
        assert same[benchmarks.JAX_IMPL]["ratio"] == 1.0
        for r in same.values():
            assert r["seconds"] > 0
            assert r["ratio"] == r["seconds"] / same[benchmarks.JAX_IMPL]["seconds"]


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
@pytest.mark.parametrize("n, batch", [(7, 0), (5, 3)])
def test_jax_rows_compute_what_ours_compute(n, batch):
    """The timed JAX calls solve the same system, and differentiate the same loss w.r.t. all
    four inputs, as the rows of the final op they are compared with."""
    args = benchmarks._problem(n, batch, torch.float64)
    x = np.asarray(benchmarks._jax_callable(args, "forward")())[..., 0]
    assert np.allclose(x, tridiagonal_solve(*args).numpy(), rtol=1e-12, atol=1e-12)
    leaves = [a.detach().requires_grad_() for a in args]
    ours = torch.autograd.grad(tridiagonal_solve(*leaves), leaves, torch.ones_like(args[3]))
    dl, d, du, b = (np.asarray(g) for g in benchmarks._jax_callable(args, "backward")())
    for theirs, mine in zip((dl[..., 1:], d, du[..., :-1], b[..., 0]), ours):
        assert np.allclose(theirs, mine.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
def test_jax_cpu_calls_name_the_lapack_routine():
    calls = benchmarks.jax_cpu_calls()
    assert any("sgtsv" in c for c in calls["float32"]) and any("dgtsv" in c for c in calls["float64"])


def test_time_is_torch_utils_benchmark_at_the_current_thread_count():
    calls = []
    with torch.utils.benchmark.utils.common.set_torch_threads(1):
        m = benchmarks._time(lambda: calls.append(1), min_time=0.001, repeats=3)
    assert m.task_spec.num_threads == 1 and len(m.times) >= 1
    # two warm-up calls, then blocked_autorange's calibration and its timed blocks
    assert len(calls) > 2 + m.number_per_run * len(m.times)
    assert min(m.times) <= m.median <= max(m.times)


def test_merge_without_steps_keeps_the_time_stepping_rows_and_their_machine(tmp_path):
    old = tmp_path / "old.json"
    row = dict(kernel="LAPACK", dtype="float64", threads=1, n=8, batch=0, k=1, steps=20,
               mode="forward", factor_once_seconds=1.0, every_step_seconds=2.0, ratio=0.5)
    old.write_text(json.dumps({"results": [], "time_stepping": [row],
                               "time_stepping_machine": {"cpu": "x"},
                               "time_stepping_config": {"steps": "20"}}))
    out = tmp_path / "new.json"
    benchmarks.main(["--quick", "--no-compile", "--no-steps", "--no-jax", "--no-cpp",
                     "--merge", str(old), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["time_stepping"] == [row]
    assert saved["time_stepping_machine"] == {"cpu": "x"}
    assert saved["time_stepping_config"] == {"steps": "20"}


def test_merge_replaces_the_rows_of_cases_measured_again(tmp_path):
    quick_case = dict(impl="dgtsv (raw LAPACK)", mode="forward", compiled=False, n=8, batch=0,
                      dtype="float64", threads=1, seconds=123.0)
    other_case = dict(quick_case, n=10**9)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [quick_case, other_case]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--quick", "--no-compile", "--no-steps", "--no-jax", "--no-cpp",
                     "--merge", str(old), "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert other_case in rows and quick_case not in rows
    assert len([r for r in rows if benchmarks._case(r) == benchmarks._case(quick_case)]) == 1


@pytest.mark.skipif(not has_cpp(), reason="no C++ tool chain here")
def test_final_op_rows_run_on_lapack_and_the_cpp_rows_on_the_kernel(monkeypatch):
    """Once the suite has loaded the C++ kernel, the final op's rows still time LAPACK, and the
    rows "final, C++ kernel" time the op with its backward in C++."""
    from tridiag_tutorial import compiled

    compiled.load()
    calls = []
    for name, module in (("_autograd_op", compiled), ("_op", compiled), ("solve", lapack)):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    args = benchmarks._problem(8, 4, torch.float64)
    final = "tridiagonal_solve (final)"
    for impl, expected in ((final, ["solve", "solve"]), (benchmarks.FINAL_CPP, ["_autograd_op"])):
        calls.clear()
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[final], args, "backward",
                                   benchmarks.CONTEXTS.get(impl, benchmarks._lapack_kernel))()
        assert calls == expected, impl


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


def run_merged_experiment(tmp_path, flag):
    """Run ``--quick`` with ``flag`` merged into a file with one result row; that row must stay.
    Returns the written report."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"kept": True}]}))
    out = tmp_path / "new.json"
    benchmarks.main([flag, "--quick", "--merge", str(old), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == [{"kept": True}]
    return saved


def test_quick_compiled_kernel_experiment(tmp_path):
    """--compiled-only builds the C++ kernel and times it beside raw dgtsv and the joined LAPACK
    solve (and JAX, when installed), merged into an existing results file."""
    from tridiag_tutorial import compiled

    if compiled._missing_tools():
        pytest.skip(f"no C++ tool chain here: {compiled._missing_tools()}")
    saved = run_merged_experiment(tmp_path, "--compiled-only")
    assert saved["compiled_kernel_machine"]
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
    saved = run_merged_experiment(tmp_path, "--torch-kernels-only")
    assert saved["torch_kernels_machine"]
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
            < rows[("sequential torch kernel", 100, 0)]["operations"] / 2)
    assert rows[("partitioned torch kernel", 100, 0)]["vs_sequential"] == pytest.approx(
        rows[("partitioned torch kernel", 100, 0)]["seconds"]
        / rows[("sequential torch kernel", 100, 0)]["seconds"])


def test_quick_cliffs_experiment(tmp_path):
    """--cliffs-only times a clean batch against one NaN and one overflowing system, for solve,
    factor and factored solve, on every kernel (issue 23), merged into an existing results file;
    each row has its dirty/clean ratio, and the bad systems' calls succeed (no row is an error)."""
    saved = run_merged_experiment(tmp_path, "--cliffs-only")
    assert saved["cliffs_machine"] and saved["cliffs_config"]
    rows = saved["cliffs"]
    kernels_run = {r["kernel"] for r in rows}
    assert {"LAPACK", "sequential torch kernel", "partitioned torch kernel"} <= kernels_run
    assert ("C++ kernel" in kernels_run) == has_cpp()
    inputs = {"clean", "one NaN system", "one overflowing system"}
    for kernel in kernels_run:
        shapes = {(r["batch"], r["n"]) for r in rows if r["kernel"] == kernel}
        # the partitioned kernel runs only at n >= 64; the others at both quick shapes
        assert shapes == ({(8, 64)} if kernel == "partitioned torch kernel" else {(16, 8), (8, 64)})
        for batch, n in shapes:
            for op in ("solve", "factor", "factored solve"):
                case = {r["input"]: r for r in rows
                        if (r["kernel"], r["op"], r["batch"], r["n"]) == (kernel, op, batch, n)}
                assert set(case) == inputs
                assert case["clean"]["ratio"] == 1.0
                for r in case.values():
                    assert r["error"] is None and r["seconds"] > 0
                    assert r["ratio"] == r["seconds"] / case["clean"]["seconds"]
