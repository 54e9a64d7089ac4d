"""The partitioned kernel against LAPACK on the same systems: forward errors within 10x LAPACK's
(where LAPACK's is below 1e-2) for every family of tridiagonal_tutorial.accuracy, in float32 and
float64, on both sides of PARTITIONED_MIN_N and above 3000 unknowns; every singular construction
raises where LAPACK does; a non-finite column or system never weakens the check of another; and
the accuracy benchmark's JSON and its --quick run."""

import json
import pathlib

import numpy as np
import pytest
import torch
from torch.func import vmap

from tridiag_tutorial import SingularMatrixError, kernels, tridiagonal_solve
from tridiag_tutorial.bench import accuracy
from tridiag_tutorial.kernels import compiled, lapack, partitioned

from conftest import make_system, torch_ops_driver

MIN_N = kernels.PARTITIONED_MIN_N
SIZES = [MIN_N - 1, MIN_N, 200, 3001]  # below the threshold (sequential), at it, above, large
DTYPES = [np.float32, np.float64]
RESULTS = pathlib.Path(__file__).parent.parent / "notebooks" / "data" / "accuracy_results.json"


def errors(system, x):
    """``(kernel's forward error, LAPACK's)`` of one system, against the longdouble reference."""
    x_ref = accuracy.reference(*system)
    return accuracy.forward_error(x, x_ref), accuracy.forward_error(lapack.gtsv(*system), x_ref)


def assert_within_ten_times_lapack(system, x, what):
    error, lapack_error = errors(system, x)
    if lapack_error < 1e-2:
        assert error <= 10 * lapack_error, (what, error, lapack_error)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("family", accuracy.FAMILIES)
def test_forward_error_within_ten_times_lapack(family, n, dtype):
    """A batch of seeded systems of one family through the public op on the torch kernels (the
    partitioned kernel from PARTITIONED_MIN_N on), each system against LAPACK's error."""
    n += n % 2 if family == "zero_diagonal" else 0
    systems = [accuracy.make(family, n, dtype, seed) for seed in range(3 if n < 1000 else 2)]
    batch = [torch.from_numpy(np.stack(parts)) for parts in zip(*systems)]
    x = tridiagonal_solve(*batch, driver=torch_ops_driver(n)).numpy()
    for seed, system in enumerate(systems):
        assert_within_ten_times_lapack(system, x[seed], (family, n, seed))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [64, 200])
def test_nearly_singular_blocks_within_ten_times_lapack(n, dtype):
    """Forty systems, each with one block singular up to a relative 1e-15 to 1e-3, one call per
    system (a fallback of one must not hide another's error): the kernel once passed its own
    check with errors up to 700 times LAPACK's here."""
    for seed in range(40):
        system = accuracy.make("nearly_singular_block", n, dtype, seed)
        x = partitioned.solve(*(torch.from_numpy(t) for t in system)).numpy()
        assert_within_ten_times_lapack(system, x, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("family", accuracy.SINGULAR_FAMILIES)
def test_singular_constructions_raise_where_lapack_does(family, dtype):
    """Every row position of n = 64 (so every block boundary) and a few of n = 300: where LAPACK
    meets an exact zero pivot the kernel raises too, and where LAPACK answers (``scaled_row``,
    singular only up to round-off) the kernel answers within 10x LAPACK's error or raises not."""
    for n, rows in ((64, range(2, 61)), (300, range(2, 297, 23))):
        for row in rows:
            system = accuracy.make(family, n, dtype, seed=row, row=row)
            try:
                lapack.gtsv(*system)
            except SingularMatrixError:
                with pytest.raises(SingularMatrixError, match="singular"):
                    partitioned.solve(*(torch.from_numpy(t) for t in system))
                continue
            assert family == "scaled_row", (family, n, row)
            x = partitioned.solve(*(torch.from_numpy(t) for t in system)).numpy()
            assert_within_ten_times_lapack(system, x, (family, n, row))


def issue_system(seed=0):
    """n = 70, d[3] = 1e-20 with l[2] = 0 (block 0 nearly singular, cond(A) about 1e2), two
    columns, a NaN in column 1."""
    lower, diag, upper, rhs = make_system(70, (), 2, seed=seed)
    diag[3], lower[2] = 1e-20, 0.0
    rhs[5, 1] = float("nan")
    return lower, diag, upper, rhs


@pytest.mark.parametrize("seed", range(4))
def test_a_nan_column_does_not_switch_off_the_check_of_another(seed):
    """Once unchecked, column 0 came back with errors of 30 to 1,700 (against LAPACK's 1e-16)."""
    lower, diag, upper, rhs = issue_system(seed)
    x = tridiagonal_solve(lower, diag, upper, rhs, driver=torch_ops_driver(70))
    assert torch.isnan(x[:, 1]).all()
    system = [t.numpy() for t in (lower, diag, upper, rhs[:, :1])]
    assert_within_ten_times_lapack(system, x[:, :1].numpy(), seed)


def test_a_nan_sample_under_vmap_does_not_corrupt_the_others():
    """vmap over the right-hand side folds the samples into columns of one solve."""
    lower, diag, upper, _ = issue_system()
    samples = torch.randn(8, 70, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    samples[3, 5] = float("nan")
    x = vmap(lambda b: tridiagonal_solve(lower, diag, upper, b, driver=torch_ops_driver(70)))(samples)
    assert torch.isnan(x[3]).all()
    for i in (0, 1, 2, 4, 5, 6, 7):
        system = [t.numpy() for t in (lower, diag, upper, samples[i, :, None])]
        assert_within_ten_times_lapack(system, x[i, :, None].numpy(), i)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_singular_matrix_with_a_nan_column_raises(dtype):
    """Row i + 1 = row i / 2 (exactly singular) and a NaN in the second column, at every row
    position of n = 60 + 4 = 64 (once answered with values of 1e20 in 11 of 60 positions)."""
    n = 64
    for row in range(2, n - 3):
        lower, diag, upper, rhs = accuracy.make("half_row", n, dtype, seed=row, row=row)
        rhs = np.concatenate([rhs, rhs], axis=1)
        rhs[n // 2, 1] = np.nan
        with pytest.raises(SingularMatrixError, match="singular"):
            tridiagonal_solve(*(torch.from_numpy(t) for t in (lower, diag, upper, rhs)),
                              driver=torch_ops_driver(n))


def test_a_non_finite_system_does_not_switch_off_the_check_of_another():
    """System 1 of the batch has a NaN band entry; system 0 (the nearly singular block of the
    issue) must still be checked, so it comes back as accurate as LAPACK's."""
    lower, diag, upper, rhs = (torch.stack([t, t]) for t in issue_system())
    rhs = rhs[..., :1].clone()
    diag[1, 40] = float("nan")
    x = partitioned.solve(lower, diag, upper, rhs)
    assert torch.isnan(x[1]).any()
    system = [t[0].numpy() for t in (lower, diag, upper, rhs)]
    assert_within_ten_times_lapack(system, x[0].numpy(), "system 0")


def test_accuracy_results_have_the_expected_structure():
    results = json.loads(RESULTS.read_text())
    assert {"cpu", "torch"} <= set(results["machine"])
    assert set(results["kernels"]) == {"before", "after", "pieces"}
    for label, entry in results["kernels"].items():
        rows = entry["rows"]
        seen = {(r["family"], r["dtype"]) for r in rows}
        families = (accuracy.PIECES_FAMILIES if label == "pieces" else accuracy.FAMILIES)
        assert seen == {(f, d) for f in families + accuracy.SINGULAR_FAMILIES
                        for d in ("float32", "float64")}
        for r in rows:
            assert {"n", "systems", "fallbacks", "raised", "lapack_raised", "disagreements"} <= set(r)
            if r["family"] in families:
                assert {"median_ratio", "max_ratio", "compared"} <= set(r)
    for label in ("after", "pieces"):  # the kernels the package runs
        rows = results["kernels"][label]["rows"]
        compared = [r for r in rows if r["family"] not in accuracy.SINGULAR_FAMILIES]
        above_ten = [(r["family"], r["dtype"], r["n"], sum(x > 10 for x in r["ratios"]))
                     for r in compared if r["max_ratio"] is not None and r["max_ratio"] > 10]
        # The pieces kernel's one known excess: one random float64 system at n = 1000 (seed 17),
        # and the same system in the family that adds a nearly singular block to the random
        # family's systems, at 11.8 times ?gtsv's error. "Within 10 times" is not a bound the
        # pieces keep in general: on 800 random systems at n = 1024 two exceeded it (at most
        # 11.1), with the third step solving every piece again as well as with the combination
        # (chapter 14 says so). Any other excess, or a larger one, fails here.
        known = ({("random", "float64", 1000, 1), ("nearly_singular_block", "float64", 1000, 1)}
                 if label == "pieces" else set())
        assert set(above_ten) <= known, (label, above_ten)
        assert all(r["max_ratio"] is None or r["max_ratio"] < 12 for r in compared), label
        assert all(r["disagreements"] == 0 for r in rows), label
    pieces = results["kernels"]["pieces"]["rows"]
    assert {r["n"] for r in pieces} == set(accuracy.PIECES_SYSTEMS)
    # ?gtsv on the reversed systems, measured in the same run: the baseline chapter 14 shows
    compared = [r for r in pieces if "ratios" in r]
    assert all(len(r["reversed_ratios"]) == r["compared"] for r in compared)
    assert any(r["reversed_max_ratio"] > 10 for r in compared if r["compared"])
    assert sum(r["compared"] for r in pieces if "ratios" in r) > 100
    # solved in pieces (not handed back) on every family with a regular matrix at n = 1000
    assert all(r["fallbacks"] < r["systems"] for r in pieces
               if r["n"] == 1000 and r["family"] in accuracy.PIECES_FAMILIES)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reversed_gtsv_solves_the_system_in_another_order(dtype):
    """The baseline of the accuracy rows: the same answer as a dense solve, up to rounding, but
    not ?gtsv's bits on every value (its rounding happens in another order); inputs untouched."""
    system = accuracy.make("random", 300, dtype, seed=3)
    before = [t.copy() for t in system]
    x = accuracy.reversed_gtsv(*system)
    lower, diag, upper, rhs = (t.astype(np.float64) for t in system)
    dense = np.diag(diag) + np.diag(lower, -1) + np.diag(upper, 1)
    tol = 1e-3 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(x, np.linalg.solve(dense, rhs), rtol=tol, atol=tol)
    assert x.shape == rhs.shape and x.dtype == dtype
    assert (x != lapack.gtsv(*system)).any()
    assert all((a == b).all() for a, b in zip(system, before))


def test_quick_run(tmp_path):
    out = tmp_path / "accuracy.json"
    results = accuracy.main(["--quick", "--before", "", "--out", str(out)])
    assert json.loads(out.read_text())["kernels"]["after"]["rows"] == results["kernels"]["after"]["rows"]
    assert results["quick"] and "before" not in results["kernels"]
    if compiled.is_available():  # the solve in pieces: within 10x LAPACK, singular where it is
        rows = results["kernels"]["pieces"]["rows"]
        assert {r["n"] for r in rows} == set(accuracy.QUICK_PIECES_SYSTEMS)
        assert all(r["disagreements"] == 0 for r in rows)
        assert all(x <= 10 for r in rows if "ratios" in r for x in r["ratios"])
        assert sum(r["lapack_raised"] for r in rows) == sum(r["raised"] for r in rows) > 0


def test_merge_keeps_the_other_kernels(tmp_path):
    """--kernels and --merge: one kernel measured again, the others' rows kept as they were."""
    first = tmp_path / "first.json"
    accuracy.main(["--quick", "--before", "", "--kernels", "after", "--out", str(first)])
    merged = tmp_path / "merged.json"
    results = accuracy.main(["--quick", "--kernels", "pieces", "--merge", str(first),
                             "--out", str(merged)])
    kept = json.loads(first.read_text())["kernels"]["after"]
    assert results["kernels"]["after"] == kept
    assert ("pieces" in results["kernels"]) == compiled.is_available()
    with pytest.raises(SystemExit):
        accuracy.main(["--quick", "--kernels", "nonsense"])


def test_before_kernel_from_a_source_file(tmp_path):
    """--before FILE measures an earlier partitioned.py from its source (never by running git):
    here the current kernel written as the earlier ones imported the sequential kernel
    (``from . import torch_kernel``), which must give the current kernel's answers."""
    source = pathlib.Path(partitioned.__file__).read_text()
    assert "from . import sequential" in source
    earlier = source.replace("from . import sequential", "from . import torch_kernel")
    earlier = earlier.replace("sequential.", "torch_kernel.")
    path = tmp_path / "before.py"
    path.write_text(earlier)
    old = accuracy.kernel_from_file(str(path))
    system = [torch.from_numpy(t) for t in accuracy.make("random", 300, np.float64, seed=5)]
    torch.testing.assert_close(old.solve(*system), partitioned.solve(*system), rtol=0, atol=0)
    results = accuracy.main(["--quick", "--before", str(path), "--kernels", "before"])
    rows = results["kernels"]["before"]["rows"]
    assert rows and all(r["disagreements"] == 0 for r in rows)
