"""Smoke test of the benchmark suite on tiny sizes: it runs and reports; no timing assertions."""

import contextlib
import importlib.util
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.utils.benchmark

from tridiag_tutorial import _compat, _routes, api, functions, kernels, rules, tridiagonal_solve
from tridiag_tutorial.bench import benchmarks
from tridiag_tutorial.kernels import compiled, lapack

from conftest import require_cpp

ONLY_SWITCHES = ["--steps-only", "--compiled-only", "--jax-only", "--cliffs-only",
                 "--routes-only", "--torch-kernels-only", "--one-system-only",
                 "--thread-budget-only"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    report = benchmarks.main(["--quick", "--no-compile", "--out", str(out)])
    return report, json.loads(out.read_text())


def has_jax() -> bool:
    return importlib.util.find_spec("jax") is not None


def has_cpp() -> bool:
    return kernels.cpp_available()


def can_pin() -> bool:
    """Whether this platform can set a process's CPU affinity and show its threads' names."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def test_help_lists_every_experiment_switch(capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmarks.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for switch in ONLY_SWITCHES + ["--quick", "--merge", "--no-compile", "--no-jax", "--no-cpp",
                                   "--families", "--busy", "--dtypes"]:
        assert switch in text


def test_quick_benchmark_runs_and_writes_json(quick):
    report, saved = quick
    assert saved["machine"]["torch"] == report["machine"]["torch"]
    assert saved["machine"]["cpp_kernel"] == has_cpp()
    impls = {r["impl"] for r in saved["results"]}
    assert {"dgtsv (raw LAPACK)", "tridiagonal_solve (final)", "tridiagonal_solve (driver='lapack')",
            "ch4 autograd.Function", "ch5 custom_op", "torch.linalg.solve (dense)",
            "scipy solve_banded", "pure-torch kernel"} <= impls
    assert (benchmarks.JAX_IMPL in impls) == has_jax()
    assert (benchmarks.FINAL_CPP in impls) == has_cpp()
    assert not impls & set(benchmarks.RETIRED_IMPLS)
    assert {r["mode"] for r in saved["results"]} == {"forward", "backward"}
    for r in saved["results"]:  # torch.utils.benchmark's blocks, summarised
        assert r["seconds"] > 0 and r["blocks"] >= 1 and r["calls_per_block"] >= 1
        low, q25, q75, high = r["extremes"][0], *r["quartiles"], r["extremes"][1]
        assert low <= q25 <= r["seconds"] <= q75 <= high
    assert saved["targets"] and all(t["ratio"] is not None for t in saved["targets"])


def pinned(row, threads):
    """The process that timed ``row`` ran on ``threads`` cores, and torch and XLA's CPU pool each
    had ``threads`` threads."""
    return (row["threads"] == threads and len(row["affinity"]) == threads
            and row["torch_threads"] == threads and row["xla_threads"] == threads)


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
def test_quick_benchmark_ends_with_the_interleaved_comparison_with_jax(quick):
    saved = quick[1]
    rows = saved["against_jax"]
    assert saved["against_jax_machine"]["jax"] and saved["results"]  # merged, not replaced
    impls = {benchmarks.FINAL, benchmarks.FINAL_LAPACK, benchmarks.JAX_IMPL}  # --no-compile
    cases = {(r["n"], r["batch"], r["dtype"], r["mode"], r["family"], r["busy"]) for r in rows}
    assert {(8, 16), (100, 0)} == {case[:2] for case in cases}
    # --quick: the quick families for one system, the batch labelled dominant; quiet only;
    # backward for the dominant family only
    assert {case[4:] for case in cases} == {(f, False) for f in benchmarks.QUICK_FAMILIES}
    assert {(case[1], case[4]) for case in cases if case[3] == "backward"} == {
        (16, "dominant"), (0, "dominant")}
    assert {case[4] for case in cases if case[1]} == {"dominant"}
    for case in cases:
        same = {r["impl"]: r for r in rows
                if (r["n"], r["batch"], r["dtype"], r["mode"], r["family"], r["busy"]) == case}
        assert set(same) == impls
        assert same[benchmarks.JAX_IMPL]["ratio"] == 1.0
        for r in same.values():
            assert r["seconds"] > 0 and r["compiled"] is False and r["vs_eager"] is None
            assert r["ratio"] == r["seconds"] / same[benchmarks.JAX_IMPL]["seconds"]
            assert pinned(r, 1) or not can_pin()


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
@pytest.mark.skipif(not can_pin(), reason="no CPU affinity or /proc on this platform")
def test_against_jax_pins_each_thread_count_to_as_many_cores():
    """JAX sizes its CPU thread pool when it starts: each thread count must run in a process of
    its own on that many cores, or the '1 thread' rows would time JAX on all of them."""
    cores = len(os.sched_getaffinity(0))
    lines = []
    rows = benchmarks.run_against_jax(cases=[(8, 4)], dtypes=(torch.float64,),
                                      threads=(1, None), min_time=0.001, repeats=1,
                                      compiled_cases=(), log=lines.append)
    assert {r["threads"] for r in rows} == {1, cores}
    for r in rows:
        assert pinned(r, r["threads"]), r
    assert any("pinned to cores" in line for line in lines)  # the child's log reaches ours
    skipped = []
    assert benchmarks.run_against_jax(threads=(cores + 1,), log=skipped.append) == []
    assert "no rows" in skipped[0]


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
def test_quick_jax_experiment_has_compiled_rows_next_to_eager(tmp_path):
    saved = run_merged_experiment(tmp_path, "--jax-only")
    rows = saved["against_jax"]
    compiled_rows = [r for r in rows if r["compiled"]]
    assert {r["impl"] for r in compiled_rows} == {benchmarks.COMPILED_FINAL}
    assert {(r["n"], r["batch"], r["dtype"], r["mode"]) for r in compiled_rows} == {
        (100, 0, dtype, mode) for dtype in ("float32", "float64") for mode in ("forward", "backward")}
    for r in compiled_rows:
        eager = next(e for e in rows if (e["impl"], e["n"], e["batch"], e["dtype"], e["mode"]) == (
            benchmarks.FINAL, r["n"], r["batch"], r["dtype"], r["mode"]))
        assert r["vs_eager"] == r["seconds"] / eager["seconds"]
    assert float(saved["against_jax_config"]["wall_seconds"]) > 0


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
@pytest.mark.parametrize("n, batch", [(7, 0), (5, 3)])
def test_jax_rows_compute_what_ours_compute(n, batch):
    """The timed JAX calls solve the same system, and differentiate the same loss w.r.t. all
    four inputs, as the rows of the final op they are compared with."""
    args = benchmarks.problem(n, batch, torch.float64)
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
        m = benchmarks.time_call(lambda: calls.append(1), min_time=0.001, repeats=3)
    assert m.task_spec.num_threads == 1 and len(m.times) >= 1
    # two warm-up calls, then blocked_autorange's calibration and its timed blocks
    assert len(calls) > 2 + m.number_per_run * len(m.times)
    assert min(m.times) <= m.median <= max(m.times)


def test_interleaved_contexts_hold_only_around_their_own_calls():
    state = {"inside": False}
    seen = {"a": set(), "b": set()}

    class Inside:
        def __enter__(self):
            state["inside"] = True

        def __exit__(self, *exc):
            state["inside"] = False

    fns = {key: (lambda key=key: seen[key].add(state["inside"])) for key in seen}
    medians = benchmarks._time_interleaved(fns, 0.0001, 4, contexts={"a": Inside})
    assert seen == {"a": {True}, "b": {False}} and not state["inside"]
    assert set(medians) == {"a", "b"}


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


def test_merge_replaces_the_rows_of_cases_measured_again_and_drops_retired_names(tmp_path):
    quick_case = dict(impl="dgtsv (raw LAPACK)", mode="forward", compiled=False, n=8, batch=0,
                      dtype="float64", threads=1, seconds=123.0)
    other_case = dict(quick_case, n=10**9)
    retired = dict(other_case, impl="tridiagonal_solve (final, C++ kernel)")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [quick_case, other_case, retired]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--quick", "--no-compile", "--no-steps", "--no-jax", "--no-cpp",
                     "--merge", str(old), "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert other_case in rows and quick_case not in rows and retired not in rows
    assert len([r for r in rows if benchmarks._case(r) == benchmarks._case(quick_case)]) == 1


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernels that run, in order: 'cpp' (compiled.solve, or compiled.solve_backward in a
    backward) or 'lapack' (lapack.solve)."""
    calls = []
    for name, module, function in (("cpp", compiled, "solve"), ("cpp", compiled, "solve_backward"),
                                   ("lapack", lapack, "solve")):
        real = getattr(module, function)
        monkeypatch.setattr(module, function,
                            lambda *a, _name=name, _real=real: calls.append(_name) or _real(*a))
    return calls


@pytest.mark.parametrize("n, batch", [(8, 4), (200, 0)])
def test_final_op_rows_run_the_package_as_installed(kernel_calls, n, batch):
    """The rows of the final op run the kernel that driver=None chooses: with the C++ kernel
    built, a batch or one system of n <= 3000 runs on it, forward and backward; the LAPACK and
    C++ rows run their own kernel whatever the automatic choice."""
    args = benchmarks.problem(n, batch, torch.float64)
    installed = "cpp" if has_cpp() else "lapack"
    expected = {benchmarks.FINAL: installed, benchmarks.FINAL_LAPACK: "lapack"}
    if has_cpp():
        expected[benchmarks.FINAL_CPP] = "cpp"
    impls = {**benchmarks.TORCH_IMPLS, **benchmarks.CPP_IMPLS}
    for impl, kernel in expected.items():
        for mode, count in (("forward", 1), ("backward", 2)):
            kernel_calls.clear()
            benchmarks._torch_callable(impls[impl], args, mode)()
            assert kernel_calls == [kernel] * count, (impl, mode)


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


def test_pure_torch_kernel_cases_run_no_lapack_or_cpp_forward_or_backward(monkeypatch):
    """The kernel's driver must reach the backward too, or its solve would go to LAPACK / C++."""
    def refuse(*args, **kwargs):
        raise AssertionError("LAPACK or the C++ kernel was called in a pure-torch kernel case")

    for name in ("solve", "factor", "factor_solve"):
        monkeypatch.setattr(lapack, name, refuse)
    monkeypatch.setattr(compiled, "solve", refuse)
    args = benchmarks.problem(8, 4, torch.float64)
    kernel = "pure-torch kernel"
    for mode in ("forward", "backward"):
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[kernel], args, mode)()
    for once in (True, False):
        for mode in ("forward", "backward"):
            benchmarks._stepper(8, 4, torch.float64, 2, once, mode, kernel)()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads")
def test_dense_batches_are_not_timed_on_several_threads(monkeypatch):
    """oneMKL's batched getrf fails on several threads (a hang on some CPUs): such a case is a row
    with its reason and no timing, the dense solve never called; one thread and one system run."""
    def refuse(*args):
        raise AssertionError("the dense solve ran on a batch with several threads")

    monkeypatch.setattr(benchmarks, "TORCH_IMPLS", {"torch.linalg.solve (dense)": refuse})
    rows = benchmarks.run(sizes=[8], batches=[(4, 8)], dtypes=(torch.float64,), threads=(1, 2),
                          compile=False, jax=False, cpp=False, min_time=0.001, repeats=1,
                          log=lambda *a: None)
    skipped = [r for r in rows if r["impl"] == "torch.linalg.solve (dense)"
               and r["batch"] and r["threads"] == 2]
    assert {r["mode"] for r in skipped} == {"forward", "backward"}
    assert all(r["seconds"] is None and r["error"] == benchmarks.DENSE_BATCH_THREADS
               for r in skipped)
    failed = {(r["batch"], r["threads"]) for r in rows
              if r["impl"] == "torch.linalg.solve (dense)" and r["error"]
              and r["error"] != benchmarks.DENSE_BATCH_THREADS}
    assert failed == {(0, 1), (4, 1), (0, 2)}  # these called it (and met the refusal)


def test_lapack_time_stepping_runs_lapack_only(monkeypatch):
    """The time-stepping rows labelled LAPACK solve on LAPACK, although driver=None would pick
    the C++ kernel for the solves from the bands."""
    monkeypatch.setattr(compiled, "solve", lambda *a: pytest.fail("the C++ kernel ran"))
    for once in (True, False):
        benchmarks._stepper(8, 4, torch.float64, 2, once, "backward", "LAPACK")()


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
    """--compiled-only times the C++ kernel built at install beside raw dgtsv and the joined
    LAPACK solve (and JAX, when installed), merged into an existing results file."""
    require_cpp()
    saved = run_merged_experiment(tmp_path, "--compiled-only")
    assert saved["compiled_kernel_machine"]
    rows = saved["compiled_kernel"]
    assert {"compiled kernel", "dgtsv (raw LAPACK)", "lapack.solve (joined batch)"} <= {
        r["impl"] for r in rows}
    for r in rows:
        assert r["seconds"] > 0
        if r["impl"] == "dgtsv (raw LAPACK)":
            assert r["ratio"] == 1.0


def test_quick_one_system_experiment(tmp_path):
    """--one-system-only times one large system: raw ?gtsv, the memory floor, the final op, the
    C++ large-system kernel (where built) and JAX (where installed), forward and forward +
    backward (the dominant family), each ratio against a baseline timed in the same alternation;
    --quick: the quick families, quiet."""
    saved = run_merged_experiment(tmp_path, "--one-system-only")
    assert saved["one_system_machine"]
    rows = saved["one_system"]
    impls = {r["impl"] for r in rows}
    assert {benchmarks.RAW_GTSV, benchmarks.FLOOR, benchmarks.FINAL} <= impls
    assert (benchmarks.LARGE_KERNEL in impls) == compiled.is_available()
    assert {r["mode"] for r in rows} == {"forward", "backward"}
    assert {(r["family"], r["busy"]) for r in rows} == {
        (f, False) for f in benchmarks.QUICK_FAMILIES}
    assert {r["family"] for r in rows if r["mode"] == "backward"} == {"dominant"}
    for r in rows:
        assert r["seconds"] > 0 and r["floor_ns_per_unknown"] > 0
        assert r["ns_per_unknown"] == pytest.approx(r["seconds"] / r["n"] * 1e9)
        if r["impl"] == benchmarks.RAW_GTSV:
            assert r["vs_gtsv"] == 1.0
        if r["mode"] == "backward":
            assert r["vs_gtsv"] is None
            assert r["impl"] not in (benchmarks.RAW_GTSV, benchmarks.FLOOR)


def test_quick_thread_budget_experiment(tmp_path):
    """--thread-budget-only times one thread against two on the same inputs, quiet and with a
    core busy (where one can be made busy): a row per thread count, the one-thread row the
    baseline of the same case and condition; --quick: the dominant family, float64."""
    require_cpp()
    saved = run_merged_experiment(tmp_path, "--thread-budget-only")
    assert saved["thread_budget_machine"]
    rows = saved["thread_budget"]
    assert {(r["batch"], r["n"]) for r in rows} == {(64, 4096), (2, 10**5)}
    assert {r["family"] for r in rows} == {"dominant"} and {r["dtype"] for r in rows} == {
        "float64"}
    assert {r["busy"] for r in rows} == {False, True}
    for key in {(r["batch"], r["n"], r["busy"]) for r in rows}:
        case = {r["threads"]: r for r in rows if (r["batch"], r["n"], r["busy"]) == key}
        assert set(case) == {1, 2}
        assert case[1]["vs_one_thread"] == 1.0
        assert case[2]["vs_one_thread"] == pytest.approx(case[2]["seconds"] / case[1]["seconds"])
        assert all(r["seconds"] > 0 and r["stalled_regions"] >= 0 for r in case.values())
    text = benchmarks.format_thread_budget(rows)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "2 x 100000" in text and "64 x 4096" in text


def test_large_kernel_rows_compute_the_gradients_of_the_final_op():
    """The large-system kernel's f+b row computes what the final op's backward computes: the
    gradients of all four inputs for a cotangent of ones."""
    require_cpp()
    n = benchmarks._kernel_min_n() + 500
    args = benchmarks.problem(n, 0, torch.float64)
    grads = benchmarks._large_kernel_callable(args, "backward")()
    leaves = [a.clone().requires_grad_() for a in args]
    expected = torch.autograd.grad(tridiagonal_solve(*leaves), leaves,
                                   torch.ones(n, dtype=torch.float64))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.reshape(want.shape), want)


# The one-system experiment's matrices (families) and its busy core

def dense_of(lower, diag, upper):
    return (np.diag(diag.numpy()) + np.diag(lower.numpy(), -1) + np.diag(upper.numpy(), 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_system_families_are_what_they_say(dtype):
    from tridiag_tutorial.bench import accuracy
    from tridiag_tutorial.kernels import partitioned

    n = 64
    made = {f: benchmarks.one_system_family(f, n, dtype) for f in benchmarks.FAMILIES}
    assert tuple(made) == ("dominant", "pivoting", "poisson", "heat_r1", "heat_r1e2",
                           "heat_r1e4", "scaled_rows", "nearly_singular_block", "near_toeplitz")
    shapes = [tuple(t.shape) for t in benchmarks.problem(n, 0, dtype)]
    for family, args in made.items():
        assert [tuple(t.shape) for t in args] == shapes, family
        assert all(t.dtype == dtype and torch.isfinite(t).all() for t in args), family
    rhs = torch.from_numpy(np.random.default_rng(0).standard_normal(n)).to(dtype)

    def constant(family, d, off):
        lower, diag, upper, b = made[family]
        assert (diag == torch.tensor(d, dtype=dtype)).all(), family
        assert (lower == off).all() and (upper == off).all(), family
        assert torch.equal(b, rhs), family

    constant("poisson", 2.0, -1.0)
    constant("near_toeplitz", 2.001, -1.0)
    for family, r in (("heat_r1", 1.0), ("heat_r1e2", 1e2), ("heat_r1e4", 1e4)):
        constant(family, 1 + 2 * r, -r)
    for family, recipe in (("dominant", "dominant"), ("pivoting", "random"),
                           ("nearly_singular_block", "nearly_singular_block")):
        want = accuracy.make(recipe, n, np.float64, 0)
        for got, expected in zip(made[family], want):
            assert torch.equal(got, torch.from_numpy(expected.reshape(got.shape)).to(dtype))
    lower, diag, upper, _ = (t.double() for t in made["pivoting"])
    off = torch.zeros(n, dtype=torch.float64)
    off[1:] += lower.abs()
    off[:-1] += upper.abs()
    assert (diag.abs() < off).any()  # not diagonally dominant: LAPACK must pivot

    # one 4 x 4 block (the partitioned kernel's) nearly singular, none in the pivoting family
    def smallest_block_det(args):
        a = dense_of(*(t.double() for t in args[:3]))
        m = partitioned.BLOCK
        return min(abs(np.linalg.det(a[i:i + m, i:i + m]))
                   / np.prod(np.linalg.norm(a[i:i + m, i:i + m], axis=1))
                   for i in range(0, n - m + 1, m + 1))

    assert smallest_block_det(made["nearly_singular_block"]) < 1e-3 * (
        1 if dtype == torch.float64 else 100)
    assert smallest_block_det(made["pivoting"]) > 1e-2

    # scaled rows: row i and rhs[i] of the pivoting system times 10^t_i, t_i from -e to e
    e = 100 if dtype == torch.float64 else 30
    pivoting = benchmarks.one_system_family("pivoting", n, torch.float64)
    scaled = [t.double() for t in made["scaled_rows"]]
    row_scale = (scaled[1] / pivoting[1]).numpy()
    exponents = np.log10(row_scale)
    assert np.allclose(exponents, np.linspace(-e, e, n), atol=1e-3 if dtype == torch.float32
                       else 1e-9)
    assert exponents[0] == pytest.approx(-e, abs=1e-3) and exponents[-1] == pytest.approx(e,
                                                                                      abs=1e-3)
    np.testing.assert_allclose((scaled[3] / pivoting[3]).numpy(), row_scale, rtol=1e-6)
    np.testing.assert_allclose((scaled[0] / pivoting[0]).numpy(), row_scale[1:], rtol=1e-6)
    np.testing.assert_allclose((scaled[2] / pivoting[2]).numpy(), row_scale[:-1], rtol=1e-6)


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown family 'toeplitz'"):
        benchmarks.one_system_family("toeplitz", 8)
    with pytest.raises(SystemExit):
        benchmarks._parser().parse_args(["--families", "poisson,toeplitz"])
    opts = benchmarks._parser().parse_args(["--families", "poisson,heat_r1", "--busy", "busy"])
    assert benchmarks._family_options(opts) == dict(families=("poisson", "heat_r1"),
                                                    busy=(True,))
    quick = benchmarks._parser().parse_args(["--quick"])
    assert benchmarks._family_options(quick) == dict(families=benchmarks.QUICK_FAMILIES,
                                                     busy=(False,))
    full = benchmarks._parser().parse_args([])
    assert benchmarks._family_options(full) == dict(families=benchmarks.FAMILIES,
                                                    busy=(False, True))


def test_dtypes_option_reaches_the_comparison_with_jax():
    with pytest.raises(SystemExit):
        benchmarks._parser().parse_args(["--dtypes", "float16"])
    with pytest.raises(SystemExit):
        benchmarks._parser().parse_args(["--dtypes", ","])
    opts = benchmarks._parser().parse_args(["--jax-only", "--dtypes", "float64"])
    assert benchmarks._against_jax_options(opts)["extra"]["dtypes"] == (torch.float64,)
    both = benchmarks._parser().parse_args(["--dtypes", "float64,float32,float64"])
    assert both.dtypes == (torch.float64, torch.float32)
    default = benchmarks._parser().parse_args(["--jax-only", "--no-compile"])
    assert "dtypes" not in benchmarks._against_jax_options(default)["extra"]


@pytest.mark.skipif(not has_jax(), reason="jax is not installed (it is optional)")
def test_quick_jax_experiment_with_one_dtype(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"kept": True}]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--jax-only", "--quick", "--no-compile", "--dtypes", "float64",
                     "--families", "dominant", "--merge", str(old), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == [{"kept": True}]
    assert {r["dtype"] for r in saved["against_jax"]} == {"float64"}
    assert "float64" in saved["against_jax_config"]["dtypes"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gone(pid: int) -> bool:
    """The process ``pid`` no longer exists (not even as a zombie)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.skipif(not can_pin() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity, /proc and two cores")
@pytest.mark.parametrize("leave", ["normally", "exception", "interrupt"])
def test_busy_core_spins_another_process_on_the_last_core_and_ends_it(leave):
    last = sorted(os.sched_getaffinity(0))[-1]
    pid = None

    class Leave(Exception):
        pass

    raised = {"normally": None, "exception": Leave, "interrupt": KeyboardInterrupt}[leave]
    with contextlib.suppress(Leave, KeyboardInterrupt):
        with benchmarks.busy_core() as spinner:
            pid = spinner.pid
            assert spinner.core == last and pid != os.getpid()
            assert os.sched_getaffinity(pid) == {last}
            before, deadline = cpu_seconds(pid), time.monotonic() + 10
            # it spins: 0.1 s of CPU time, which takes 0.1 s of wall time on a free core and more
            # where other processes share it (a loaded CI machine); a spinner that sleeps or
            # has ended never gets there
            while cpu_seconds(pid) - before <= 0.1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cpu_seconds(pid) - before > 0.1
            if raised:
                raise raised
    assert pid is not None and gone(pid)


def spinning_or_ended(pid: int) -> str:
    """``"ended"`` where ``pid`` is gone or a zombie (dead, not yet reaped by its new parent),
    else ``"running"``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "ended"
    return "ended" if state in ("Z", "X") else "running"


@pytest.mark.skipif(not can_pin() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity, /proc and two cores")
def test_busy_core_spinner_ends_when_its_parent_is_killed():
    """A process killed inside busy_core runs no clean-up (SIGKILL here, SIGTERM alike): its
    spinner must end by itself, or every later measurement would run with a core busy."""
    code = ("import time\nfrom tridiag_tutorial.bench import benchmarks\n"
            "with benchmarks.busy_core(settle=0.05) as spinner:\n"
            "    print(spinner.pid, flush=True)\n"
            "    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        before = cpu_seconds(pid)
        time.sleep(0.3)
        assert cpu_seconds(pid) - before > 0.1  # it spins
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while spinning_or_ended(pid) == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    state = spinning_or_ended(pid)
    if state == "running":
        os.kill(pid, signal.SIGKILL)
    assert state == "ended"


def test_busy_core_starts_nothing_on_one_core(monkeypatch):
    monkeypatch.setattr(benchmarks, "_cpu_cores", lambda: [0])
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    with benchmarks.busy_core() as spinner:
        assert spinner is None


def test_one_system_and_jax_units_are_keyed_by_family_and_condition(tmp_path):
    """--merge continues by unit: a row of another family or condition is not the same unit;
    rows stored before the families count as the dominant family, quiet."""
    assert {"family", "busy"} <= set(benchmarks.UNIT_FIELDS["one_system"])
    assert {"family", "busy"} <= set(benchmarks.UNIT_FIELDS["against_jax"])
    report = benchmarks._Report(str(tmp_path / "r.json"), {})
    report._machine = {"cpu": "x"}
    suite = report.suite("one_system", {})
    old = dict(dtype="float64", threads=1, n=4096)
    assert suite.unit(old) == suite.unit(dict(old, family="dominant", busy=False))
    assert suite.unit(old) != suite.unit(dict(old, family="poisson", busy=False))
    assert suite.unit(old) != suite.unit(dict(old, family="dominant", busy=True))
    assert benchmarks.with_family_defaults([old]) == [dict(old, family="dominant", busy=False)]
    assert benchmarks.with_family_defaults([dict(old, family="poisson", busy=True)])[0][
        "family"] == "poisson"


def test_tiny_one_system_run_has_family_and_busy_rows():
    """A tiny run_one_system (one dtype, one thread, quiet and busy) returns a row per
    implementation, mode, family and condition, and format_one_system prints them all and its
    summary. No timing assertion."""
    families = ("dominant", "poisson")
    lines = []
    rows = benchmarks.run_one_system(cases=[2048], families=families, dtypes=(torch.float64,),
                                     threads=(1,), busy=(False, True), min_time=1e-4, repeats=2,
                                     log=lines.append)
    keys = {(r["family"], r["busy"], r["mode"]) for r in rows}
    assert keys == {(f, b, "forward") for f in families for b in (False, True)} | {
        ("dominant", b, "backward") for b in (False, True)}
    busy_cores = {r["busy_core"] for r in rows if r["busy"]}
    can_busy = can_pin() and len(os.sched_getaffinity(0)) >= 2
    assert busy_cores == ({sorted(os.sched_getaffinity(0))[-1]} if can_busy else {None})
    assert {r["busy_core"] for r in rows if not r["busy"]} == {None}
    impls = {r["impl"] for r in rows}
    assert {benchmarks.RAW_GTSV, benchmarks.FLOOR, benchmarks.FINAL,
            benchmarks.FINAL_LAPACK} <= impls
    assert (benchmarks.LARGE_KERNEL in impls) == compiled.is_available()
    for r in rows:
        assert r["n"] == 2048 and r["threads"] == 1 and r["error"] is None
        assert r["seconds"] > 0
        if r["mode"] == "forward":
            gtsv = next(g for g in rows if (g["impl"], g["family"], g["busy"]) == (
                benchmarks.RAW_GTSV, r["family"], r["busy"]))
            assert r["vs_gtsv"] == pytest.approx(r["seconds"] / gtsv["seconds"])
        else:
            assert r["vs_gtsv"] is None
    assert any("busy" in line for line in lines)
    text = benchmarks.format_one_system(rows)
    assert max(len(line) for line in text.splitlines()) <= 100
    body = text.split("\n\n")[0].splitlines()
    assert len(body) == 1 + len(rows)  # a header and a line per row
    assert sum(" busy " in line for line in body) == sum(r["busy"] for r in rows) or not can_busy
    for family in families:
        assert family in text
    assert "median" in text and "One thread, quiet" in text


def test_pure_torch_kernel_cases_time_the_sequential_kernel(monkeypatch):
    """The suite's "pure-torch kernel" is the sequential pivoting kernel, also at n >= 64."""
    from tridiag_tutorial.kernels import partitioned

    monkeypatch.setattr(partitioned, "solve", lambda *a: pytest.fail("the partitioned kernel ran"))
    args = benchmarks.problem(kernels.PARTITIONED_MIN_N, 0, torch.float64)
    kernel = "pure-torch kernel"
    for mode in ("forward", "backward"):
        benchmarks._torch_callable(benchmarks.TORCH_IMPLS[kernel], args, mode)()


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


def test_cliffs_rows_run_the_kernel_they_name(kernel_calls):
    """The C++ kernel's cliff rows solve on it, LAPACK's on LAPACK."""
    found = benchmarks._cliff_kernels(print)
    args = benchmarks.problem(8, 4, torch.float64)
    for name, kernel in (("LAPACK", "lapack"), ("C++ kernel", "cpp")):
        if name not in found:
            continue
        kernel_calls.clear()
        tridiagonal_solve(*args, driver=found[name][0])
        assert kernel_calls == [kernel]


def test_quick_routes_experiment(tmp_path):
    """--routes-only times the final op against itself with one route removed, chapter 4's
    Function and the LAPACK (and C++) driver, merged into an existing results file."""
    saved = run_merged_experiment(tmp_path, "--routes-only")
    assert saved["routes_machine"] and saved["routes_config"]
    rows = saved["routes"]
    routes = set(benchmarks.ROUTES) | (set(benchmarks.CPP_ROUTES) if has_cpp() else set())
    assert {(r["route"], r["n"], r["batch"], r["mode"]) for r in rows} == {
        (route, n, batch, mode) for route in routes for n, batch in [(100, 0), (8, 16)]
        for mode in ("forward", "backward")}
    for r in rows:
        base = next(b for b in rows if (b["route"], b["n"], b["batch"], b["mode"]) == (
            benchmarks.ROUTE_AS_INSTALLED, r["n"], r["batch"], r["mode"]))
        assert r["seconds"] > 0 and r["dtype"] == "float64" and r["threads"] == 1
        assert r["ratio"] == r["seconds"] / base["seconds"]
        # each round's time, as many as the rounds, in the same rounds as the base's; the median
        # of the rounds is the row's median, within its quartiles
        assert len(r["rounds"]) == len(base["rounds"]) == int(saved["routes_config"]["repeats"])
        assert r["seconds"] == statistics.median(r["rounds"])
        assert r["quartiles"][0] <= r["seconds"] <= r["quartiles"][1]


@pytest.fixture
def dispatched(monkeypatch):
    """Which ways the final op's Function ran: 'op' (the dispatched solve_kernel),
    'function_apply' (_compat's) and 'Function.apply'."""
    calls = []
    real_op, real_function_apply = functions._kernel_op, _compat.function_apply
    real_apply = functions._TridiagonalSolve.apply
    monkeypatch.setattr(functions, "_kernel_op", lambda *a: calls.append("op") or real_op(*a))
    monkeypatch.setattr(_compat, "function_apply",
                        lambda *a: calls.append("function_apply") or real_function_apply(*a))
    monkeypatch.setattr(functions._TridiagonalSolve, "apply",
                        staticmethod(lambda *a: calls.append("Function.apply") or real_apply(*a)))
    return calls


def test_route_switches_change_the_route_and_restore_it(dispatched):
    args = benchmarks.problem(8, 4, torch.float64)
    plain = benchmarks.ROUTES[benchmarks.ROUTE_AS_INSTALLED][0]
    switch = {name: benchmarks.ROUTES[name][1] for name in (
        "without direct kernel calls", "Function.apply instead of _compat.function_apply",
        "without the C++ fast path")}
    validated = []
    real_validate = api.validate

    def run(mode, name=None):
        dispatched.clear()
        validated.clear()
        with (switch[name] if name else contextlib.nullcontext)():
            benchmarks._torch_callable(plain, args, mode)()
        return list(dispatched)

    # function_apply is Function.apply itself on torch releases whose apply is the C++ method
    applied = ["function_apply"] + ([] if _compat.PYTHON_FUNCTION_APPLY else ["Function.apply"])
    api.validate = lambda *a, **k: validated.append(1) or real_validate(*a, **k)
    try:
        assert run("forward") == []  # no Function, no solve_kernel ...
        assert validated == ([] if has_cpp() else [1])  # ... and, on the C++ fast path, no validate
        # with gradients: functions._CppSolve on the C++ kernel (no general Function), else the
        # general path's Function with its kernels called directly
        assert run("backward") == ([] if has_cpp() else applied)
        assert run("backward", "without the C++ fast path") == applied
        assert run("forward", "without direct kernel calls") == [*applied, "op"]
        assert run("backward", "without direct kernel calls").count("op") == 2  # both dispatched
        assert run("backward", "Function.apply instead of _compat.function_apply") == [
            "Function.apply"]
        assert run("forward", "without the C++ fast path") == []  # the general path's shortcut
        assert validated == [1]
    finally:
        api.validate = real_validate
    assert all(getattr(_routes.ON, route) for route in _routes.ROUTES)  # all on again
    with pytest.raises(ValueError, match="unknown routes"):
        with _routes.disabled("fast_path"):
            pass


def test_route_without_the_fused_backward_runs_the_band_products_in_torch_ops(monkeypatch):
    """The route "without the fused C++ backward" keeps the C++ fast path but turns the switch
    ``fused_backward`` off: a solve on the C++ kernel and rules.solve_backward in torch ops in
    place of compiled.solve_backward, with the same gradients; on again afterwards."""
    require_cpp()
    calls = []
    real_rules, real_fused = rules.solve_backward, compiled.solve_backward
    monkeypatch.setattr(rules, "solve_backward",
                        lambda *a: calls.append("rules") or real_rules(*a))
    monkeypatch.setattr(compiled, "solve_backward",
                        lambda *a: calls.append("fused") or real_fused(*a))
    switch = benchmarks.ROUTES["without the fused C++ backward"][1]
    for n in (8, benchmarks._kernel_min_n() + 5):
        args = benchmarks.problem(n, 0, torch.float64)
        leaves = [a.clone().requires_grad_() for a in args]
        expected = torch.autograd.grad(tridiagonal_solve(*leaves).sum(), leaves)
        assert calls == ["fused"]  # as installed: the fused op
        calls.clear()
        with switch():
            assert not _routes.ON.fused_backward
            got = torch.autograd.grad(tridiagonal_solve(*leaves).sum(), leaves)
        assert calls == ["rules"] and _routes.ON.fused_backward
        calls.clear()
        for g, want in zip(got, expected):
            torch.testing.assert_close(g, want)


# The command line: --help, the summary's width, rows written as measured, interrupts, --merge
# continuing a run, progress on a terminal.

QUICK_MAIN = ["--quick", "--no-compile", "--no-jax", "--no-cpp", "--no-steps"]  # main rows only
COMMITTED = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "data",
                         "benchmark_results.json")


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def timed(rows):
    return [r for r in rows if r["seconds"] is not None]


def test_help_is_plain_text_under_the_command_s_real_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmarks.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m tridiag_tutorial.bench.benchmarks ")
    for markup in ("``", ":func:", ":data:", ":class:", "::"):
        assert markup not in text, markup
    assert "--merge" in text.split("options:")[0]  # the description says how to continue a run
    for action in benchmarks._parser()._actions:  # every option explained
        assert action.help and "``" not in action.help, action.option_strings


def load_committed():
    with open(COMMITTED) as f:
        return json.load(f)


def test_summary_tables_fit_in_100_columns_on_the_committed_rows():
    """Every table that the command prints, on the rows of the book's results file (read only)."""
    data = load_committed()
    tables = {"results": benchmarks.format_results(data["results"]),
              "against_jax": benchmarks.format_against_jax(data["against_jax"]),
              "time_stepping": benchmarks.format_steps_table(data["time_stepping"]),
              "routes": benchmarks.format_routes(data["routes"]),
              "one_system": benchmarks.format_one_system(data["one_system"])}
    for key, text in tables.items():
        widest = max(text.splitlines(), key=len)
        assert len(widest) <= 100, (key, widest)
    # nothing left out: a table per mode, dtype and thread count, every case and implementation
    results, text = data["results"], tables["results"]
    groups = {(r["mode"], r["dtype"], r["threads"]) for r in results}
    assert all(f"{m}, {d}, {t} thread(s)" in text for m, d, t in groups)
    for shown in ("n=100", "n=1e6", "1024x256", "1e5x8", "final op [compiled]",
                  "final op, lapack", "torch.linalg.solve (dense)", "jax tridiagonal_solve"):
        assert shown in text, shown
    cells = sum(len(line.split()) - 2 for line in text.splitlines() if line.startswith("ch4"))
    assert cells == sum(r["impl"] == "ch4 autograd.Function" for r in results)


def test_summary_splits_the_cases_into_narrower_tables():
    rows = [dict(impl=benchmarks.FINAL_LAPACK, mode="forward", compiled=True, n=n, batch=b,
                 dtype="float64", threads=1, seconds=1.234e-5, error=None)
            for n in (10, 10**3, 10**5, 123456789) for b in (0, 100000)]
    text = benchmarks.format_results(rows, width=60)
    assert max(len(line) for line in text.splitlines()) <= 60
    assert "(1/" in text and "(2/" in text  # split, not cut
    assert text.count("12.3us") == len(rows) and "123456789" in text


def test_results_file_is_replaced_atomically(tmp_path, monkeypatch):
    """An interrupt in the middle of a write leaves the previous file whole, and no temporary
    file."""
    out = tmp_path / "r.json"
    benchmarks._write_json(str(out), {"rows": [1]})
    real_dump = json.dump

    def interrupted_dump(data, f, **kwargs):
        f.write('{"rows": [1, 2')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted_dump)
    with pytest.raises(KeyboardInterrupt):
        benchmarks._write_json(str(out), {"rows": [1, 2]})
    monkeypatch.setattr(json, "dump", real_dump)
    assert json.loads(out.read_text()) == {"rows": [1]}
    assert os.listdir(tmp_path) == ["r.json"]


@pytest.fixture
def fast_timer(monkeypatch):
    """``time_call`` with a tiny budget, recording each call; ``interrupt_at``: the call (from 1)
    that raises KeyboardInterrupt instead; ``before``: called first, with the call's number."""
    real = benchmarks.time_call
    state = dict(calls=[], interrupt_at=None, before=lambda count: None)

    def fast(fn, min_time, repeats, **labels):
        state["calls"].append(labels)
        state["before"](len(state["calls"]))
        if len(state["calls"]) == state["interrupt_at"]:
            raise KeyboardInterrupt
        return real(fn, 1e-4, 1, **labels)

    monkeypatch.setattr(benchmarks, "time_call", fast)
    return state


def test_rows_are_written_as_measured_kept_after_an_interrupt_and_merge_continues(
        tmp_path, monkeypatch, capsys, fast_timer):
    out = tmp_path / "r.json"
    args = [*QUICK_MAIN, "--out", str(out)]
    on_disk = []
    fast_timer["before"] = lambda count: on_disk.append(len(timed(
        json.loads(out.read_text())["results"])))
    fast_timer["interrupt_at"] = 6
    with pytest.raises(KeyboardInterrupt):
        benchmarks.main(args)
    assert on_disk == [0, 1, 2, 3, 4, 5]  # each row in the file before the next is timed
    err = capsys.readouterr().err
    assert "\r" not in err and "main suite: " in err and " rows to measure" in err  # no terminal
    assert "Interrupted (main suite: 5 of " in err and f"--merge {out}" in err
    saved = json.loads(out.read_text())
    kept = timed(saved["results"])
    assert len(kept) == 5 and "results" in saved[benchmarks.UNFINISHED]

    # continue, on a terminal: only the other rows are measured, the kept ones stay as they were
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    fast_timer.update(calls=[], interrupt_at=None, before=lambda count: None)
    report = benchmarks.main([*args, "--merge", str(out)])
    final = json.loads(out.read_text())
    assert final == report and benchmarks.UNFINISHED not in final
    rows = final["results"]
    assert all(r in rows for r in kept)  # the very rows, not measured again
    assert len({benchmarks._case(r) for r in rows}) == len(rows)
    assert len(fast_timer["calls"]) == len(timed(rows)) - 5
    status = terminal.getvalue()
    left = len(timed(rows)) - 5
    assert "(5 measured before, kept)" in status
    assert f"\r\x1b[K[1/{left}] main suite: float64 1 thr " in status and " left" in status
    assert f"\r\x1b[K[{left}/{left}] main suite: " in status
    printed = capsys.readouterr().out
    assert "Median time per call" in printed
    assert max(len(line) for line in printed.splitlines()) <= 100


def test_merge_of_a_finished_run_or_other_settings_measures_again(tmp_path):
    """Only a run that did not finish, with the same settings on the same machine, is
    continued."""
    machine = {"cpu": "x", "cores": 2, "date": "today", "load_average": [1.0]}

    def resumed(merged, config):
        report = benchmarks._Report(str(tmp_path / "r.json"), merged)
        report._machine = dict(machine, date="tomorrow", load_average=[2.0])
        suite = report.suite("results", config)
        suite.begin([dict(impl="a", mode="forward", compiled=False, n=8, batch=0,
                          dtype="float64", threads=1)])
        return suite.done(dict(impl="a", mode="forward", compiled=False, n=8, batch=0,
                               dtype="float64", threads=1))

    row = dict(impl="a", mode="forward", compiled=False, n=8, batch=0, dtype="float64",
               threads=1, seconds=1.0)
    config = dict(min_time=0.1, repeats=4)
    marker = dict(settings={k: str(v) for k, v in config.items()},
                  machine={"cpu": "x", "cores": 2})
    assert resumed({"results": [row], benchmarks.UNFINISHED: {"results": marker}}, config)
    assert not resumed({"results": [row]}, config)  # finished
    assert not resumed({"results": [row], benchmarks.UNFINISHED: {"results": marker}},
                       dict(config, repeats=5))
    other = dict(marker, machine={"cpu": "y", "cores": 2})
    assert not resumed({"results": [row], benchmarks.UNFINISHED: {"results": other}}, config)
    failed = dict(row, seconds=None, error="RuntimeError: x")
    assert not resumed({"results": [failed], benchmarks.UNFINISHED: {"results": marker}}, config)


def test_progress_on_a_terminal_redraws_one_status_line_with_the_time_left():
    now = [0.0]
    terminal, out = FakeTerminal(), io.StringIO()
    progress = benchmarks.Progress(stream=terminal, out=out, clock=lambda: now[0], width=60)
    progress.begin("main suite", 4)
    now[0] = 10.0
    progress.advance("first")
    now[0] = 20.0
    progress.advance("second, with a label far too long to fit in the sixty columns")
    progress.log("a line of the log")
    now[0] = 40.0
    progress.advance("third")
    text = terminal.getvalue()
    assert "\r\x1b[K[1/4] main suite: first ~30 s left" in text
    assert "\r\x1b[K[3/4] main suite: third ~13 s left" in text
    statuses = [part for part in text.split("\r\x1b[K") if part.startswith("[")]
    assert max(len(s) for s in statuses) <= 59  # never wraps
    assert any(s.startswith("[2/4]") and "..." in s and s.endswith("~20 s left")
               for s in statuses)
    assert out.getvalue() == "a line of the log\n"
    progress.end()
    assert terminal.getvalue().endswith("\r\x1b[Kmain suite: 3 measured in 40 s\n")


def test_progress_elsewhere_is_plain_lines_now_and_then():
    now = [0.0]
    stream = io.StringIO()
    progress = benchmarks.Progress(stream=stream, out=io.StringIO(), clock=lambda: now[0])
    progress.begin("main suite", 10)
    for _ in range(10):
        now[0] += 15.0
        progress.advance("row")
    progress.end()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == ["main suite: 10 rows to measure",
                                 "[4/10] main suite: row ~2 min left",
                                 "[8/10] main suite: row ~30 s left",
                                 "main suite: 10 measured in 2 min"]


# python -m tridiag_tutorial.bench.benchmarks, with Python's SIGINT handler even where this process was
# started with SIGINT ignored (a background job), which the child would inherit
CLI_WITH_SIGINT = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('tridiag_tutorial.bench.benchmarks', run_name='__main__', "
                   "alter_sys=True)")


def test_a_sigint_that_a_library_swallows_still_interrupts_after_the_unit(tmp_path, fast_timer):
    """Python raises a SIGINT's KeyboardInterrupt wherever the main thread is; inside a gc callback
    (JAX registers one) it is printed as ignored and lost. main's handler also records the signal,
    so the run stops after the unit being measured, with the rows kept, and the handler before the
    run is restored."""
    out = tmp_path / "r.json"
    before = signal.getsignal(signal.SIGINT)
    fast_timer["before"] = lambda count: (benchmarks._SIGINT_SEEN.append(signal.SIGINT)
                                          if count == 3 else None)  # received, its exception lost
    with pytest.raises(KeyboardInterrupt):
        benchmarks.main([*QUICK_MAIN, "--out", str(out)])
    assert signal.getsignal(signal.SIGINT) is before
    assert 1 <= len(timed(json.loads(out.read_text())["results"])) <= 3
    assert len(fast_timer["calls"]) <= 4  # stopped at the end of the unit, not at the end of the run


def test_sigint_keeps_the_rows_and_exits_130_without_a_traceback(tmp_path, fast_timer):
    """The command itself, in a process of its own, interrupted (SIGINT) once rows are in its
    file; then continued with --merge, which measures only the rows not in the file."""
    out = tmp_path / "r.json"
    args = [*QUICK_MAIN, "--min-time", "0.02", "--repeats", "2", "--out", str(out)]
    child = subprocess.Popen([sys.executable, "-c", CLI_WITH_SIGINT, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while child.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if timed(json.loads(out.read_text())["results"]):
                break
        time.sleep(0.02)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err and "\r" not in err
    assert "Interrupted (main suite: " in err
    saved = json.loads(out.read_text())
    kept = timed(saved["results"])
    assert kept and "results" in saved[benchmarks.UNFINISHED]
    benchmarks.main([*args, "--merge", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert all(r in rows for r in kept)
    assert len(fast_timer["calls"]) == len(timed(rows)) - len(kept)


def test_full_run_with_merge_replaces_the_time_stepping_rows_it_measures_again(tmp_path,
                                                                               fast_timer):
    """The merged file's time-stepping row of a case the run measures is replaced, not kept
    beside the new one; a row of another case stays."""
    quick = dict(kernel="LAPACK", dtype="float64", threads=1, n=8, batch=0, k=1, steps=3,
                 mode="forward", factor_once_seconds=1.0, every_step_seconds=2.0, ratio=0.5)
    other = dict(quick, n=10**6)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [], "time_stepping": [quick, other]}))
    out = tmp_path / "new.json"
    benchmarks.main(["--quick", "--no-compile", "--no-jax", "--no-cpp", "--merge", str(old),
                     "--out", str(out)])
    rows = json.loads(out.read_text())["time_stepping"]
    assert other in rows and quick not in rows
    case = ("LAPACK", "float64", 1, 8, 0, 1, 3, "forward")
    assert [tuple(r[k] for k in benchmarks.UNIT_FIELDS["time_stepping"]) for r in rows].count(
        case) == 1
