"""Chapter 2's claims, recomputed with the package: the heat-equation step against its exact
eigen-decomposition, the explicit step's blow-up, partial pivoting on the zero- and tiny-pivot
systems, no row swaps under diagonal dominance, SciPy's raw ``?gtsv`` (info, n = 1) and
``solve_banded``, and the periodic (Sherman-Morrison) exercise."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch

import tridiag_tutorial as tt
from tridiag_tutorial.kernels import lapack


def heat_bands(n, r):
    off = np.full(n - 1, -r)
    return off, np.full(n, 1 + 2 * r), off.copy()


def pivot_example(eps):
    """The chapter's 6 x 6 system: ones off the diagonal, diag (eps, 3, ..., 3), x = (1, ..., 6)."""
    lower, upper, diag = np.ones(5), np.ones(5), np.full(6, 3.0)
    diag[0] = eps
    x_true = np.arange(1.0, 7.0)
    A = np.diag(diag) + np.diag(lower, -1) + np.diag(upper, 1)
    return lower, diag, upper, A @ x_true, x_true


def test_backward_euler_steps_match_the_eigen_decomposition():
    n, steps = 99, 100
    h = 1.0 / (n + 1)
    r = 1e-3 / h**2
    x = np.linspace(h, 1 - h, n)
    u = np.sin(np.pi * x) + 0.5 * np.sin(5 * np.pi * x)
    for _ in range(steps):
        u = lapack.gtsv(*heat_bands(n, r), u)
    g = lambda m: 1 / (1 + 4 * r * np.sin(m * np.pi * h / 2) ** 2)  # noqa: E731
    expected = g(1) ** steps * np.sin(np.pi * x) + 0.5 * g(5) ** steps * np.sin(5 * np.pi * x)
    assert np.abs(u - expected).max() < 1e-12
    assert abs(g(1) ** steps - np.exp(-np.pi**2 * 0.1)) < 0.01


def test_the_fast_mode_is_all_but_gone_after_20_steps_and_the_slow_one_is_not():
    h, r = 0.01, 10.0
    g = lambda m: 1 / (1 + 4 * r * np.sin(m * np.pi * h / 2) ** 2)  # noqa: E731
    assert 0.5 * g(5) ** 20 < 0.01 and g(1) ** 20 > 0.8


def test_the_explicit_step_blows_up_at_r_10():
    n, r = 99, 10.0
    x = torch.linspace(0.01, 0.99, n, dtype=torch.float64)
    u = (torch.sin(torch.pi * x) + 0.5 * torch.sin(5 * torch.pi * x))[:, None]
    off = torch.full((n - 1,), r, dtype=torch.float64)
    for _ in range(20):
        u = tt.tridiag_matmul(off, torch.full((n,), 1 - 2 * r, dtype=torch.float64), off, u)
    assert u.abs().max() > 1e10


def test_gtsv_pivots_past_a_zero_pivot():
    lower, diag, upper, rhs, x_true = pivot_example(0.0)
    assert np.abs(lapack.gtsv(lower, diag, upper, rhs) - x_true).max() < 1e-14
    assert lapack.gttrf(lower, diag, upper).ipiv.tolist() == [2, 2, 3, 4, 5, 6]


def eliminate_without_pivoting(lower, diag, upper, rhs):
    """Elimination without pivoting on the 6 x 6 pivot example, as the chapter's thomas, in scalars."""
    c, y = [diag[0]], [rhs[0]]
    for i in range(1, 6):
        w = lower[i - 1] / c[-1]
        c.append(diag[i] - w * upper[i - 1])
        y.append(rhs[i] - w * y[-1])
    x = [0.0] * 6
    x[5] = y[5] / c[5]
    for i in range(4, -1, -1):
        x[i] = (y[i] - upper[i] * x[i + 1]) / c[i]
    return x


def test_a_tiny_pivot_costs_elimination_without_pivoting_its_accuracy_but_not_gtsv():
    lower, diag, upper, rhs, x_true = pivot_example(1e-12)
    x = eliminate_without_pivoting(lower, diag, upper, rhs)
    rel = lambda z: np.linalg.norm(z - x_true) / np.linalg.norm(x_true)  # noqa: E731
    assert rel(np.array(x)) > 1e-6
    assert rel(lapack.gtsv(lower, diag, upper, rhs)) < 1e-14
    assert np.linalg.cond(np.diag(diag) + np.diag(lower, -1) + np.diag(upper, 1)) < 20


def test_diagonal_dominance_means_no_row_swaps():
    rng = np.random.default_rng(2)
    n = 10_000
    lower, diag, upper = rng.uniform(-1, 1, n - 1), rng.uniform(2, 3, n), rng.uniform(-1, 1, n - 1)
    ipiv = lapack.gttrf(lower, diag, upper).ipiv
    assert np.array_equal(ipiv, np.arange(1, n + 1))


def test_raw_gtsv_reports_singular_only_through_info_and_the_package_raises():
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (np.ones(3),))
    s_l, s_d, s_u = np.array([1.0, 0.0]), np.ones(3), np.array([1.0, 0.0])
    *_, info = dgtsv(s_l, s_d, s_u, np.array([[1.0], [2.0], [3.0]]))
    assert info == 2
    with pytest.raises(torch.linalg.LinAlgError, match="pivot U\\[1, 1\\] is exactly zero") as caught:
        lapack.gtsv(s_l, s_d, s_u, np.array([1.0, 2.0, 3.0]))
    assert type(caught.value) is tt.SingularMatrixError  # the name the chapter prints


def test_the_singular_systems_garbage_is_not_a_solution():
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (np.ones(3),))
    s_l, s_d, s_u = np.array([1.0, 0.0]), np.ones(3), np.array([1.0, 0.0])
    b = np.array([[1.0], [2.0], [3.0]])
    *_, x, info = dgtsv(s_l, s_d, s_u, b)
    A = np.diag(s_d) + np.diag(s_l, -1) + np.diag(s_u, 1)
    assert info == 2 and np.abs(A @ x - b).max() > 0.5


def test_the_explicit_blow_up_is_the_highest_mode_amplified():
    n, r = 99, 10.0
    h = 1.0 / (n + 1)
    growth = abs(1 - 4 * r * np.sin(n * np.pi * h / 2) ** 2)
    assert 38 < growth < 40
    lower, diag, upper = heat_bands(n, r)
    x = np.linspace(h, 1 - h, n)
    theta = torch.from_numpy((np.sin(np.pi * x) + 0.5 * np.sin(5 * np.pi * x))[:, None])
    for _ in range(20):
        theta = tt.tridiag_matmul(*map(torch.from_numpy, (-lower, 2 - diag, -upper)), theta)
    assert 1e14 < theta.abs().max().item() < 1e18  # round-off (1e-16) times 39**20


def test_column_dominance_means_no_row_swaps():
    rng = np.random.default_rng(4)
    n = 1000
    lower, upper = rng.uniform(-1, 1, n - 1), rng.uniform(-1, 1, n - 1)
    diag = rng.uniform(2.0, 3.0, n)  # > |u_{i-1}| + |l_i|: dominant by columns
    ipiv = lapack.gttrf(lower, diag, upper).ipiv
    assert np.array_equal(ipiv, np.arange(1, n + 1))
    diag[500] = 0.1 * abs(lower[500])  # |d_i| < |l_i|: this column is not dominant, a swap
    assert not np.array_equal(lapack.gttrf(lower, diag, upper).ipiv, np.arange(1, n + 1))


def test_n_equals_1_raw_gtsv_refuses_and_the_package_and_solve_banded_solve():
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (np.ones(3),))
    with pytest.raises(ValueError, match="unexpected array size"):
        dgtsv(np.array([]), np.array([2.0]), np.array([]), np.array([[4.0]]))
    assert lapack.gtsv(np.array([]), np.array([2.0]), np.array([]), np.array([4.0])).tolist() == [2.0]
    ab = np.array([[0.0], [2.0], [0.0]])
    assert scipy.linalg.solve_banded((1, 1), ab, np.array([4.0])).tolist() == [2.0]


def test_solve_banded_is_gtsv_on_the_same_numbers():
    n = 99
    lower, diag, upper = heat_bands(n, 10.0)
    b = np.sin(np.pi * np.linspace(0.01, 0.99, n))
    ab = np.zeros((3, n))
    ab[0, 1:], ab[1], ab[2, :-1] = upper, diag, lower
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (diag,))
    assert np.array_equal(scipy.linalg.solve_banded((1, 1), ab, b), dgtsv(lower, diag, upper, b[:, None])[3].ravel())


def test_sherman_morrison_solves_the_periodic_heat_matrix():
    n, r = 50, 10.0
    b = np.random.default_rng(5).standard_normal(n)
    lower, diag, upper = heat_bands(n, r)
    A = np.diag(diag) + np.diag(lower, -1) + np.diag(upper, 1)
    A[0, -1] = A[-1, 0] = -r
    alpha, v = -r, np.zeros(n)
    v[0] = v[-1] = 1.0
    t_diag = diag.copy()
    t_diag[[0, -1]] -= alpha
    y, z = lapack.gtsv(lower, t_diag, upper, b), lapack.gtsv(lower, t_diag, upper, v)
    x = y - alpha * (v @ y) / (1 + alpha * (v @ z)) * z
    assert np.abs(x - np.linalg.solve(A, b)).max() < 1e-12


def test_scipys_gtsv_copies_its_inputs_unless_told_to_overwrite():
    lower, diag, upper, b, _ = pivot_example(1e-3)
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (diag,))
    inputs = [a.copy() for a in (lower, diag, upper)] + [b[:, None].copy()]
    kept = [a.copy() for a in inputs]
    dgtsv(*inputs)
    assert all(np.array_equal(a, k) for a, k in zip(inputs, kept))
    dgtsv(*inputs, overwrite_dl=1, overwrite_d=1, overwrite_du=1, overwrite_b=1)
    assert not np.array_equal(inputs[1], kept[1]) and not np.array_equal(inputs[3], kept[3])


def test_divide_accumulate_is_a_chain_of_divisions_that_stays_near_one():
    rng = np.random.default_rng(3)
    c = rng.uniform(1, 2, 500_000)
    q = np.stack([c, 1 / c], axis=1).ravel()  # the chapter's chain values: c, 1/c, ...
    out = np.divide.accumulate(q)
    assert out[0] == q[0] and out[1] == q[0] / q[1] and out[2] == (q[0] / q[1]) / q[2]
    assert 0.4 < out.min() and out.max() < 2.5  # no overflow, underflow or subnormal numbers
    assert np.all(np.multiply.accumulate(q)[1::2] > 0.99) and np.all(np.multiply.accumulate(q)[1::2] < 1.01)


def test_dgtsv_on_a_dominant_system_does_thomas_arithmetic():
    rng = np.random.default_rng(1)
    n = 300
    lower, diag, upper = rng.uniform(-1, 1, n - 1), rng.uniform(2, 3, n), rng.uniform(-1, 1, n - 1)
    b = rng.standard_normal(n)
    c, y = [diag[0]], [b[0]]  # elimination without pivoting
    for i in range(1, n):
        w = lower[i - 1] / c[-1]
        c.append(diag[i] - w * upper[i - 1])
        y.append(b[i] - w * y[-1])
    x = [0.0] * n
    x[-1] = y[-1] / c[-1]
    for i in range(n - 2, -1, -1):
        x[i] = (y[i] - upper[i] * x[i + 1]) / c[i]
    (dgtsv,) = scipy.linalg.get_lapack_funcs(("gtsv",), (diag,))
    assert np.abs(dgtsv(lower, diag, upper, b[:, None])[3].ravel() - np.array(x)).max() < 1e-14


def test_torch_linalg_has_no_tridiagonal_or_banded_solver():
    names = [name.lower() for name in dir(torch.linalg)]
    assert not [name for name in names if "tridiag" in name or "band" in name or "gtsv" in name]


def test_the_tiny_pivot_error_sits_in_x0_and_the_norm_wise_figure_dilutes_it():
    lower, diag, upper, rhs, x_true = pivot_example(1e-12)
    x = eliminate_without_pivoting(lower, diag, upper, rhs)
    err = np.abs(np.array(x) - x_true)
    assert 5e-5 < err[0] < 2e-4  # |x_0 - 1| about 9e-5: four significant digits right
    assert err[1:].max() < 1e-12  # the other five entries are accurate
    norm_wise = np.linalg.norm(np.array(x) - x_true) / np.linalg.norm(x_true)
    assert abs(norm_wise - err[0] / np.linalg.norm(x_true)) < 1e-3 * norm_wise
    assert abs(np.linalg.norm(x_true) - 9.5) < 0.1


def test_heat_and_spline_matrices_are_dominant_for_any_data():
    def margins(lower, diag, upper):
        off = np.zeros(len(diag))
        off[1:] += np.abs(lower)
        off[:-1] += np.abs(upper)
        return np.abs(diag) - off

    for r in (1e-3, 0.5, 10.0, 1e4):
        m = margins(*heat_bands(50, r))
        assert np.allclose(m[1:-1], 1.0) and np.all(m[[0, -1]] >= 1.0)
    rng = np.random.default_rng(11)
    for _ in range(20):
        hs = np.diff(np.sort(rng.uniform(0, 1, 12)))
        off, diag = hs[1:-1], 2 * (hs[:-1] + hs[1:])
        assert np.all(margins(off, diag, off) >= (hs[:-1] + hs[1:]) * (1 - 1e-12))


def test_solve_banded_does_not_check_a_1x1_system_for_zero_but_the_package_raises():
    with np.errstate(divide="ignore"):
        x = scipy.linalg.solve_banded((1, 1), np.zeros((3, 1)), np.array([4.0]))
    assert np.isinf(x).all()
    with pytest.raises(tt.SingularMatrixError):
        lapack.gtsv(np.array([]), np.array([0.0]), np.array([]), np.array([4.0]))


NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_tridiagonal_problem.ipynb"


def stored_output(marker):
    """The stored text output of the one code cell of chapter 2 whose output contains `marker`."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    texts = ["".join("".join(out.get("text", "")) for out in cell.get("outputs", []))
             for cell in cells if cell["cell_type"] == "code"]
    (text,) = [text for text in texts if marker in text]
    return text


def prose():
    """Chapter 2's Markdown, with every run of whitespace made one space."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def test_the_timings_section_2_5_quotes_are_the_stored_run():
    """The timing cells are nbval-ignore-output: a new run changes their figures, and this fails until
    the prose quotes the new ones."""
    text = prose()
    fit = stored_output("Python loop / dgtsv =")
    ratio = int(re.search(r"Python loop / dgtsv = (\d+)x", fit).group(1))
    per_row = re.search(r"(\d+) ns at n = 100,000", fit).group(1)
    flop_time = re.search(r"would take ([\d.]+) ns", fit).group(1)
    assert f"trails `dgtsv` only {ratio}-fold at $n = 10^5$" in text
    assert f"`dgtsv` takes {per_row} ns a row" in text and f"would take {flop_time} ns" in text
    assert "about 20-fold in the run shown" in text and abs(ratio - 20) <= 2

    latency = stored_output("chained divisions")
    median = lambda label, column: float(  # noqa: E731
        re.search(rf"{label} +([\d.]+) \([^)]*\) +([\d.]+)", latency).group(column))
    assert f"a chained division took about {round(median('chained divisions', 1))} ns" in text
    assert median("independent divisions", 1) < 1 and "an independent one under 1 ns" in text
    model = float(re.search(r"2 chained multiplications\) = ([\d.]+)", latency).group(1))
    assert 0.9 < model < 1.1  # "the printed ratio near 1", yet only the order of magnitude counts

    table = stored_output("LAPACK dgtsv, median ms per solve")
    dgtsv_row = table.split("LAPACK dgtsv, median ms per solve")[1].splitlines()
    sizes = [int(s.replace(",", "")) for s in dgtsv_row[1].split()]
    ms = dict(zip(sizes, map(float, dgtsv_row[2].split())))
    longer = [median("dgtsv \\(one solve\\)", col) / (ms[n] * 1e6 / n) - 1
              for col, n in ((1, 10_000), (2, 1_000_000))]
    assert all(0.10 <= x <= 0.15 for x in longer) and "took 10 to 15 % longer" in text
    assert abs(model - 1) < min(longer)  # dgtsv drifts between cells more than the model's gap


def test_the_tiny_pivot_figures_section_2_3_quotes_are_printed_there():
    text, out = prose(), stored_output("Thomas:  x =")
    assert "x = [1.0001 2.     3.     4.     5.     6.    ], relative error 9e-06" in out
    assert "Thomas returns $x_0 = 1.0001$" in text and "norm-wise 9e-06" in text
    norm_wise = float(re.search(r"relative error ([0-9.e+-]+)", out).group(1))
    assert abs(norm_wise * np.sqrt(91) - 9e-5) < 0.5e-5  # the |x_0 - 1| the prose derives from it
