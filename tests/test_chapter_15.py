"""The figures chapter 15 (fast CPU kernels) states in its prose: recomputed from the package's
kernel where the chapter's cells do not print them, and read from the reference results in
notebooks/data where the prose quotes a reference run."""

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.linalg import get_lapack_funcs

from tridiag_tutorial.bench import benchmarks
from tridiag_tutorial.kernels import compiled

from conftest import require_cpp

DATA = Path(__file__).resolve().parents[1] / "notebooks" / "data"
(DGTSV,) = get_lapack_funcs(("gtsv",), (np.zeros(1),))


def random_bands(n, seed=12):
    """The chapter's random bands: a diagonal shifted by 4, one right-hand side."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n - 1, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64) + 4,
            torch.randn(n - 1, generator=g, dtype=torch.float64),
            torch.randn(n, 1, generator=g, dtype=torch.float64)]


def differing_rows(system, **kwargs):
    x, handed_back = compiled.solve_ex(*system, **kwargs)
    x_dgtsv = DGTSV(*(t.numpy() for t in system))[3]
    return np.nonzero(x.numpy().view(np.int64) != x_dgtsv.view(np.int64))[0], handed_back


def test_the_pieces_differ_from_dgtsv_only_near_the_ends_of_pieces():
    """Section 15.3: at n = 1e5 the pieces (448 rows each) differ from dgtsv's bits in a few
    percent of the values, all within 26 rows of a piece's end, none in a piece's middle."""
    require_cpp()
    rows, handed_back = differing_rows(random_bands(100_000))
    assert handed_back == 0
    assert 0.01 < len(rows) / 100_000 < 0.1
    from_end = np.minimum(rows % 448, 447 - rows % 448)
    assert from_end.max() < 26


def test_exercise_one_the_differences_stay_out_of_the_middle_of_a_piece():
    require_cpp()
    g = torch.Generator().manual_seed(1)
    n = 1000
    system = [torch.randn(n - 1, generator=g, dtype=torch.float64),
              torch.randn(n, generator=g, dtype=torch.float64) + 4,
              torch.randn(n - 1, generator=g, dtype=torch.float64),
              torch.randn(n, 1, generator=g, dtype=torch.float64)]
    rows, handed_back = differing_rows(system, pieces_min_n=0)
    assert handed_back == 0 and len(rows) > 0
    assert np.minimum(rows % 128, 127 - rows % 128).max() < 64 - 16


def test_the_poisson_matrix_is_handed_back_and_gets_dgtsvs_bits():
    require_cpp()
    n = 100_000
    rhs = random_bands(n)[3]
    off = torch.full((n - 1,), -1.0, dtype=torch.float64)
    rows, handed_back = differing_rows([off, torch.full((n,), 2.0, dtype=torch.float64), off, rhs])
    assert handed_back == 1 and len(rows) == 0
    _, kept = differing_rows([off, torch.full((n,), 2.1, dtype=torch.float64), off, rhs])
    assert kept == 0


@pytest.fixture(scope="module")
def reference():
    path = DATA / "benchmark_results.json"
    if not path.exists():
        pytest.skip("no reference results")
    return json.loads(path.read_text())


def span(values, digits=2):
    values = list(values)
    return round(min(values), digits), round(max(values), digits)


def test_the_batch_kernel_figures_of_section_15_2(reference):
    rows = reference["compiled_kernel"]
    seconds = {(r["impl"], r["n"], r["batch"], r["threads"]): r["seconds"] for r in rows}
    mine = [r for r in rows if r["impl"] == "compiled kernel"]
    assert span((r["ns_per_unknown"] for r in mine if not r["batch"]), 0) == (19, 21)
    assert span((r["ns_per_unknown"] for r in mine if r["batch"]), 1) == (6.2, 11.7)

    def ratios(impl):
        return [seconds[impl, r["n"], r["batch"], r["threads"]] / r["seconds"] for r in mine
                if r["batch"] and (impl, r["n"], r["batch"], r["threads"]) in seconds]
    low, high = span(ratios("lapack.solve (joined batch)"), 1)
    assert 2.0 <= low and high <= 4.0
    assert span(ratios("jax tridiagonal_solve"), 1) == (1.8, 2.7)
    by_threads = {(r["n"], r["batch"], r["threads"]): r["seconds"] for r in mine}
    changes = [abs(by_threads[n, b, 2] / by_threads[n, b, 1] - 1) for (n, b, t) in by_threads if t == 1]
    assert 0.10 < max(changes) <= 0.15


def test_the_one_system_figures_of_section_15_3(reference):
    one = {}
    for r in benchmarks.with_family_defaults(reference["one_system"]):
        if r["mode"] == "forward":
            one[r["impl"], r["family"], r["dtype"], r["threads"], r["busy"], r["n"]] = r

    def back(family, dtype, threads, busy, n):
        return bool(one[benchmarks.LARGE_KERNEL, family, dtype, threads, busy, n]["kernel_fallbacks"])

    conditions = [(d, t, b) for d in ("float32", "float64") for t in (1, 2) for b in (False, True)]
    group = {c: [one[benchmarks.FINAL, f, *c, n] for f in benchmarks.FAMILIES
                 for n in benchmarks.ONE_SYSTEM_CASES] for c in conditions}
    pieces = {c: [r for r in group[c] if not back(r["family"], *c, r["n"])] for c in conditions}
    handed = {c: [r for r in group[c] if back(r["family"], *c, r["n"])] for c in conditions}
    assert all(r["vs_gtsv"] < 1 for rs in pieces.values() for r in rs)
    quiet64 = ("float64", 1, False)
    assert span(r["vs_gtsv"] for r in pieces[quiet64] if r["n"] == 10**5) == (0.33, 0.36)
    assert span(r["vs_gtsv"] for r in pieces[quiet64] if r["n"] == 10**6) == (0.36, 0.43)
    medians = {c: statistics.median(r["vs_gtsv"] for r in group[c]) for c in conditions}
    assert span(medians[c] for c in conditions if c[0] == "float32") == (0.28, 0.30)
    assert span(medians[c] for c in conditions if c[0] == "float64") == (0.38, 0.42)
    for d in ("float32", "float64"):
        for t in (1, 2):
            assert abs(medians[d, t, True] - medians[d, t, False]) < 0.04
        for b in (False, True):
            assert medians[d, 2, b] > medians[d, 1, b] - 0.01  # a second thread gains nothing
    assert all({(r["family"], r["n"]) for r in handed[c]} == {("poisson", 10**5), ("poisson", 10**6)}
               for c in conditions)
    assert span(r["vs_gtsv"] for c in conditions for r in handed[c]) == (1.03, 1.07)
    largest = [max(pieces[c], key=lambda r: r["vs_gtsv"]) for c in conditions]
    assert all(r["n"] == 4096 for r in largest) and span(r["vs_gtsv"] for r in largest) == (0.57, 0.60)
    assert all(30e-6 < r["seconds"] < 45e-6 for c in conditions for r in pieces[c] if r["n"] == 4096)


def test_the_accuracy_figures_of_section_15_4():
    path = DATA / "accuracy_results.json"
    if not path.exists():
        pytest.skip("no reference results")
    rows = json.loads(path.read_text())["kernels"]["pieces"]["rows"]
    compared = [r for r in rows if "ratios" in r]
    singular = [r for r in rows if "ratios" not in r]
    ratios = [x for r in compared for x in r["ratios"]]
    assert len(ratios) == 306 and statistics.median(ratios) == 1.0
    assert round(max(ratios), 1) == 11.8
    by = {(r["family"], r["dtype"], r["n"]): r for r in compared}
    worst = max(compared, key=lambda r: r["max_ratio"] or 0)
    assert (worst["family"], worst["dtype"], worst["n"]) == ("random", "float64", 1000)
    above_ten = {k for k, r in by.items() if (r["max_ratio"] or 0) > 10}
    assert above_ten == {("random", "float64", 1000), ("nearly_singular_block", "float64", 1000)}
    reversed_not_larger = {k for k, r in by.items()
                           if r["compared"] and r["reversed_max_ratio"] <= r["max_ratio"]}
    assert len(reversed_not_larger) == 2
    assert all(by["random", d, 1000]["reversed_max_ratio"] > 10 for d in ("float32", "float64"))
    assert by["badly_scaled_rows", "float64", 1000]["reversed_max_ratio"] > 1e9
    assert all(by["heat", d, n]["median_ratio"] < 1 for d in ("float32", "float64")
               for n in (1000, 10**5))
    assert round(by["poisson", "float64", 1000]["max_ratio"], 1) == 5.9
    assert all(by["poisson", d, 10**5]["fallbacks"] == 2 for d in ("float32", "float64"))
    assert sum(r["disagreements"] for r in singular) == 0
    assert sum(r["raised"] for r in singular) == sum(r["lapack_raised"] for r in singular)
    assert sum(r["fallbacks"] for r in singular) == sum(r["systems"] for r in singular)
