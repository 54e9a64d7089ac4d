"""Chapter 16 (kernels for other devices): the claims the chapter's text makes from its cells,
recomputed with the package, so that the chapter itself shows values and not asserts."""

import contextlib
import functools
from unittest import mock

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import tridiag_tutorial
from tridiag_tutorial import kernels, to_dense, tridiag_matmul, tridiagonal_solve
from tridiag_tutorial.bench import accuracy, reference
from tridiag_tutorial.kernels import choose_driver, lapack, partitioned, sequential
from tridiag_tutorial.reference import dense_solve

F64 = torch.float64


def random_system(n, batch=(), k=None, seed=0):
    """The chapter's recipe: off-diagonals N(0, 1), diagonal (1.5 + |N(0, 1)|) * random sign."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    sign = torch.where(torch.rand(*batch, n, generator=g) < 0.5, -1.0, 1.0).to(F64)
    diag = (1.5 + randn(*batch, n).abs()) * sign
    rhs = randn(*batch, n) if k is None else randn(*batch, n, k)
    return [randn(*batch, n - 1), diag, randn(*batch, n - 1), rhs]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.views = self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.compute += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn, lower, diag, upper, rhs):
    with CountOps() as counter:
        fn(lower, diag, upper, rhs[..., None])
    return counter


def sequential_calls(fn):
    """(fn(), calls of sequential.solve, calls of partitioned.solve)."""
    with contextlib.ExitStack() as stack:
        seq = stack.enter_context(mock.patch.object(sequential, "solve", wraps=sequential.solve))
        part = stack.enter_context(mock.patch.object(partitioned, "solve", wraps=partitioned.solve))
        result = fn()
    return result, seq.call_count, part.call_count


def _bits(t):
    """The 64-bit patterns of a float64 or complex128 tensor's numbers (real and imaginary parts)."""
    return (torch.view_as_real(t) if t.is_complex() else t).contiguous().view(torch.int64)


def test_sequential_factors_are_lapacks_bit_for_bit():
    l0, d0, u0 = torch.ones(5, dtype=F64), torch.tensor([0.0, 3, 3, 3, 3, 3], dtype=F64), torch.ones(5, dtype=F64)
    lu, piv = sequential.factor(l0, d0, u0)
    lu_l, piv_l = map(torch.from_numpy, lapack.factor(l0.numpy(), d0.numpy(), u0.numpy()))
    assert torch.equal(_bits(lu), _bits(lu_l)) and torch.equal(piv, piv_l) and piv[0] == 2
    lb, db, ub, _ = random_system(40, batch=(16,), seed=10)
    db[db.abs() < 2.0] = 0.0
    lu, piv = sequential.factor(lb, db, ub)
    lu_l, piv_l = map(torch.from_numpy, lapack.factor(lb.numpy(), db.numpy(), ub.numpy()))
    assert torch.equal(_bits(lu), _bits(lu_l)) and torch.equal(piv, piv_l)  # signed zeros included
    assert torch.signbit(lu_l[lu_l == 0]).any()  # there are -0.0s to get right
    assert (piv != torch.arange(1, 41, dtype=piv.dtype)).sum() > 100  # it does pivot


def test_sequential_solves_match_the_dense_solve():
    l0, d0, u0 = torch.ones(5, dtype=F64), torch.tensor([0.0, 3, 3, 3, 3, 3], dtype=F64), torch.ones(5, dtype=F64)
    x_true = torch.arange(1.0, 7.0, dtype=F64)
    b0 = tridiag_matmul(l0, d0, u0, x_true[:, None])[:, 0]
    torch.testing.assert_close(tridiagonal_solve(l0, d0, u0, b0, driver="sequential"), x_true)
    lb, db, ub, bb = random_system(40, batch=(16,), seed=10)
    db[db.abs() < 2.0] = 0.0
    x = tridiagonal_solve(lb, db, ub, bb, driver="sequential")
    x_dense = dense_solve(lb, db, ub, bb)
    assert (x - x_dense).abs().max() / x_dense.abs().max() < 1e-12


def test_sequential_kernel_launches_about_30_operations_per_row_whatever_the_batch():
    per_row = {}
    for n, systems in [(100, 1), (1000, 1), (100, 64)]:
        c = count_ops(sequential.solve, *random_system(n, batch=(systems,), seed=n))
        per_row[n, systems] = (c.compute / n, c.views / n)
    assert all(25 < c < 35 and 5 < v < 10 for c, v in per_row.values())
    assert per_row[100, 1] == per_row[100, 64]


def test_schur_complement_of_the_blocks_is_tridiagonal():
    m, n = partitioned.BLOCK, 23
    p = -(-(n + 1) // (m + 1))
    lower, diag, upper, _ = random_system(n, seed=3)
    A = torch.eye(p * (m + 1), dtype=F64)
    A[:n, :n] = to_dense(lower, diag, upper)
    rows = torch.arange(p * (m + 1))
    sep = rows % (m + 1) == m
    order = torch.cat([rows[~sep], rows[sep]])
    Ap = A[order][:, order]
    nb = int((~sep).sum())
    S = Ap[nb:, nb:] - Ap[nb:, :nb] @ torch.linalg.solve(Ap[:nb, :nb], Ap[:nb, nb:])
    off = S - torch.diag_embed(S.diagonal()) - torch.diag_embed(S.diagonal(-1), -1) - torch.diag_embed(S.diagonal(1), 1)
    assert S.shape == (5, 5) and off.abs().max() < 1e-12
    assert S.diagonal(1)[:-1].abs().min() > 0  # coupled, but for the padding separator


def test_partitioned_operations_grow_like_log_n_and_not_with_the_batch():
    small = count_ops(partitioned.solve, *random_system(10**3, seed=1)).compute
    large = count_ops(partitioned.solve, *random_system(10**4, seed=1)).compute
    batch = count_ops(partitioned.solve, *random_system(10**3, batch=(20,), seed=1)).compute
    assert large / small < 1.4 and large < 2500
    assert batch == small
    assert partitioned.levels(1000) == [1000, 201, 41, 9]


@pytest.mark.slow
def test_partitioned_operations_at_a_million_unknowns():
    c4 = count_ops(partitioned.solve, *random_system(10**4, seed=10**4)).compute
    c6 = count_ops(partitioned.solve, *random_system(10**6, seed=10**6)).compute
    assert c6 / c4 < 1.5 and c6 < 2500


@pytest.mark.slow
def test_partitioned_matches_lapack_on_a_large_system():
    large = random_system(10**5, seed=5)
    xp = tridiagonal_solve(*large, driver="partitioned")
    xl = tridiagonal_solve(*large, driver="lapack")
    assert (xp - xl).abs().max() / xl.abs().max() < 1e-10


@pytest.mark.slow
def test_the_large_system_is_ill_conditioned_and_the_refined_kernel_is_not_fooled():
    """Section 16.5: LAPACK, backward stable, is far from the extended-precision reference
    (the system amplifies round-off); the refined partitioned kernel is within a few eps."""
    large = random_system(10**5, seed=5)
    x_ref = accuracy.reference(*(t.numpy() for t in large[:3]), large[3][:, None].numpy())
    eps = torch.finfo(F64).eps
    err = {d: accuracy.forward_error(tridiagonal_solve(*large, driver=d)[:, None].numpy(), x_ref)
           for d in ("lapack", "partitioned")}
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:  # an extended-precision reference
        assert err["lapack"] > 100 * eps
        assert err["partitioned"] < 10 * eps


@pytest.mark.slow
def test_partitioned_gradients_pass_gradcheck_in_both_modes():
    system = [t.requires_grad_() for t in random_system(70, k=2, seed=6)]
    assert gradcheck(functools.partial(tridiagonal_solve, driver="partitioned"), system, check_forward_ad=True)


@pytest.mark.parametrize("block", [0, 2])
def test_a_singular_block_falls_back_to_lapacks_answer(block):
    lower, diag, upper, rhs = random_system(70, seed=7)
    last = 5 * block + 3  # the last row of the block
    lower[last - 1], diag[last] = 0.0, 0.0
    assert torch.linalg.matrix_rank(to_dense(lower[last - 3:last], diag[last - 3:last + 1], upper[last - 3:last])) == 3
    assert torch.linalg.matrix_rank(to_dense(lower, diag, upper)) == 70
    x, seq, part = sequential_calls(lambda: tridiagonal_solve(lower, diag, upper, rhs, driver="partitioned"))
    assert (seq, part) == (1, 1)
    assert (x - tridiagonal_solve(lower, diag, upper, rhs, driver="lapack")).abs().max() < 1e-10


def test_partitioned_matches_lapack_and_its_derivatives():
    system = random_system(2000, k=2, seed=5)
    xp = tridiagonal_solve(*system, driver="partitioned")
    xl = tridiagonal_solve(*system, driver="lapack")
    assert (xp - xl).abs().max() / xl.abs().max() < 1e-10
    weights = torch.randn(2000, 2, dtype=F64, generator=torch.Generator().manual_seed(1))

    def grads(driver):
        inputs = [t.clone().requires_grad_() for t in system]
        return torch.autograd.grad((tridiagonal_solve(*inputs, driver=driver) * weights).sum(), inputs)

    for gp, gl in zip(grads("partitioned"), grads("lapack")):
        assert (gp - gl).abs().max() <= 1e-10 * gl.abs().max()


def test_a_singular_matrix_raises_on_every_driver():
    lower, diag, upper, _ = random_system(64, seed=8)
    lower[3], upper[5] = 0.0, 0.0
    lower[4], diag[5] = 0.5 * diag[4], 0.5 * upper[4]
    ones = torch.ones(64, 1, dtype=F64)
    unchecked = partitioned.solve_unchecked(lower, diag, upper, ones)
    assert not torch.isfinite(unchecked).all() or unchecked.abs().max() > 1e12
    drivers = ["lapack", "partitioned"] + (["cpp"] if tridiag_tutorial.cpp_available() else [])
    for driver in drivers:
        with pytest.raises(tridiag_tutorial.SingularMatrixError) as info:
            tridiagonal_solve(lower, diag, upper, ones[:, 0], driver=driver)
        assert info.value.pivot == 63


class CountBytes(TorchDispatchMode):
    """The bytes written by the operations that compute (not views); reads are not counted."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            leaves = out if isinstance(out, (tuple, list)) else [out]
            self.bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out


def _bytes(fn, lower, diag, upper, rhs):
    with CountBytes() as counter:
        fn(lower, diag, upper, rhs[..., None])
    return counter.bytes


@pytest.mark.parametrize("systems, n", [(1024, 16), (1024, 64), (1, 1024)])
def test_partitioned_writes_18_to_20_times_the_sequential_bytes(systems, n):
    system = random_system(n, batch=(systems,), seed=n)
    ratio = _bytes(partitioned.solve, *system) / _bytes(sequential.solve, *system)
    assert 17.5 <= ratio < 20.5


def test_blocks_of_4_dispatch_the_fewest_operations():
    system = random_system(1000, seed=1)
    counts = {m: count_ops(functools.partial(partitioned.solve, block=m), *system).compute for m in (4, 8, 16)}
    assert counts[4] < counts[8] < counts[16]


def test_complex_factors_are_zgttrfs_and_a_singular_complex_matrix_raises_at_the_last_pivot():
    c128 = torch.complex128
    g = torch.Generator().manual_seed(12)
    lc, dc, uc = (torch.randn(16, size, dtype=c128, generator=g) for size in (39, 40, 39))
    dc[dc.abs() < 1.2] = 0.0
    lu, piv = sequential.factor(lc, dc, uc)
    lu_l, piv_l = map(torch.from_numpy, lapack.factor(lc.numpy(), dc.numpy(), uc.numpy()))
    assert torch.equal(lu, lu_l) and torch.equal(piv, piv_l)  # equal as numbers
    differ = _bits(lu) != _bits(lu_l)  # as bits, only zeros of opposite sign, and no pivot among them
    assert differ.any() and (torch.view_as_real(lu)[differ] == 0).all()
    assert torch.equal(_bits(lu[..., 1, :]), _bits(lu_l[..., 1, :]))
    assert (piv != torch.arange(1, 41, dtype=piv.dtype)).sum() > 100
    ls = torch.tensor([1 - 2j, 0, 0.5 + 0.5j, 1, 2], dtype=c128)
    ds = torch.tensor([2 + 1j, 3 - 1j, 1 + 1j, 0.5, 4 - 2j, 1], dtype=c128)
    us = torch.tensor([3 + 1j, 1 + 1j, 1, 0, 1], dtype=c128)
    assert torch.linalg.matrix_rank(to_dense(ls, ds, us)) == 5
    for driver in ("lapack", "sequential"):
        with pytest.raises(torch.linalg.LinAlgError) as caught:
            tridiagonal_solve(ls, ds, us, torch.ones(6, dtype=c128), driver=driver)
        assert caught.value.pivot == 5
    assert sequential.factor_unchecked(ls, ds, us)[0][1, -1] == 0


def test_a_nearly_singular_block_is_refined_to_lapacks_answer_or_falls_back():
    fell = {}
    for delta in (1e-2, 1e-6, 1e-10, 1e-12, 1e-14):
        lower, diag, upper, rhs = random_system(70, seed=7)
        lower[2], diag[3] = 0.0, delta
        x, fell[delta] = partitioned.solve_ex(lower, diag, upper, rhs[:, None])
        x_lapack = tridiagonal_solve(lower, diag, upper, rhs, driver="lapack")
        assert (x[:, 0] - x_lapack).abs().max() / x_lapack.abs().max() < 1e-14
    assert not any(fell[d] for d in (1e-2, 1e-6, 1e-10)) and fell[1e-14]


# Section 16.8: the reference rows shipped with the package, and the badly scaled systems.

def _partitioned_reference():
    rows = reference.load()["partitioned_accuracy"]["rows"]
    return {variant: [r for r in rows if r["variant"] == variant] for variant in ("check only", "refine + check")}


def test_the_reference_rows_back_what_section_16_8_reads_from_them():
    tables = _partitioned_reference()
    ratios = {variant: [x for r in rows if r["ratios"] is not None for x in r["ratios"]]
              for variant, rows in tables.items()}
    assert ratios["refine + check"] and max(ratios["refine + check"]) <= 1.0  # at most LAPACK's error
    assert max(ratios["check only"]) > 100  # hundreds of times LAPACK's through the check alone
    singular = [r for r in tables["refine + check"] if r["ratios"] is None]
    assert singular and sum(r["disagreements"] for r in singular) == 0
    assert sum(r["raised"] for r in singular) == sum(r["lapack_raised"] for r in singular)
    scaled = {variant: [r for r in rows if r["family"] == "badly_scaled_rows"] for variant, rows in tables.items()}
    assert all(r["fallbacks"] == r["systems"] for r in scaled["check only"])  # every one falls back
    fell = sum(r["fallbacks"] for r in scaled["refine + check"]) / sum(r["systems"] for r in scaled["refine + check"])
    assert 0.3 < fell < 0.5  # "about 4 in 10"


def test_refinement_cuts_the_float64_fallbacks_of_a_nearly_singular_block_but_not_the_float32_ones():
    """Section 16.8 quotes the fallbacks of both dtypes: refinement helps float64, costs float32."""
    tables = _partitioned_reference()

    def fallbacks(variant, family, dtype):
        return sum(r["fallbacks"] for r in tables[variant] if r["family"] == family and r["dtype"] == dtype)

    block = "nearly_singular_block"
    assert fallbacks("refine + check", block, "float64") < fallbacks("check only", block, "float64")
    assert fallbacks("refine + check", block, "float32") > fallbacks("check only", block, "float32")
    assert fallbacks("refine + check", "zero_diagonal", "float64") > fallbacks("check only", "zero_diagonal", "float64")


def test_where_nothing_fell_back_the_refined_kernel_is_at_most_lapacks_error_and_mostly_below():
    # a fallback returns LAPACK's answer (ratio 1): rows without one show the kernel's own errors
    kept = [x for r in _partitioned_reference()["refine + check"]
            if r["ratios"] is not None and not r["fallbacks"] for x in r["ratios"]]
    assert len(kept) > 100 and max(kept) <= 1.0
    assert sum(x == 1.0 for x in kept) < 0.05 * len(kept)  # "on a few systems"


def _badly_scaled(seed):
    lower, diag, upper, rhs = map(torch.from_numpy, accuracy.make("badly_scaled_rows", 64, np.float64, seed))
    row_max = to_dense(lower, diag, upper).abs().amax(-1)
    z = 2 * torch.rand(64, 1, dtype=F64, generator=torch.Generator().manual_seed(seed)) - 1
    eps = torch.finfo(F64).eps
    unscaled = eps * row_max.max() * partitioned.solve_unchecked(lower, diag, upper, z).abs().max()
    scaled = eps * partitioned.solve_unchecked(lower, diag, upper, row_max[:, None] * z).abs().max()
    x = partitioned.solve_unchecked(lower, diag, upper, rhs)
    x_max = x.abs().max()
    residual = (tridiag_matmul(lower, diag, upper, x) - rhs).abs()
    backward = ((residual / x_max) / (row_max[:, None] + rhs.abs() / x_max)).max() / eps
    return (lower, diag, upper, rhs), float(unscaled), float(scaled), float(backward)


@pytest.mark.parametrize("seed", range(6))
def test_the_unscaled_probe_rejects_every_badly_scaled_system_and_the_scaled_one_none(seed):
    _, unscaled, scaled, _ = _badly_scaled(seed)
    assert unscaled > 1e200  # eps max|A| max|A^-1 z|: about eps * 1e300
    assert scaled <= 1 / partitioned.SINGULAR_MARGIN


def test_a_good_badly_scaled_answer_is_kept_and_a_wrong_one_falls_back():
    system, _, _, backward = _badly_scaled(1)
    assert backward < 1000 and not partitioned.solve_ex(*system)[1]
    system, _, _, backward = _badly_scaled(0)
    assert backward > 1000 and partitioned.solve_ex(*system)[1]
    x = tridiagonal_solve(*system, driver="partitioned")  # the fallback's answer: the sequential kernel's
    assert torch.equal(x, tridiagonal_solve(*system, driver="sequential"))


# Section 16.9: what MPS, which has no float64, would get.

class CountDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            leaves = out if isinstance(out, (tuple, list)) else [out]
            self.dtypes.update(t.dtype for t in leaves if isinstance(t, torch.Tensor))
        return out


def test_on_mps_the_automatic_choice_stays_off_the_partitioned_kernel_which_writes_float64():
    for n in (16, 64, 10**6):
        assert choose_driver("mps", torch.float32, 1, n, False) == "sequential"
        assert choose_driver("mps", torch.float32, 4096, n, False) == "sequential"
    assert choose_driver("cuda", torch.float32, 1, 64, False) == "partitioned"  # CUDA is unchanged
    lower, diag, upper, rhs = (t.float() for t in random_system(100, seed=2))
    written = {}
    for name, kernel in (("sequential", sequential.solve), ("partitioned", partitioned.solve),
                         ("unchecked", partitioned.solve_unchecked)):
        with CountDtypes() as counter:
            kernel(lower, diag, upper, rhs[:, None])
        written[name] = counter.dtypes
    assert torch.float64 not in written["sequential"] and torch.float32 in written["sequential"]
    assert torch.float64 in written["partitioned"]
    assert torch.float64 not in written["unchecked"] and torch.float32 in written["unchecked"]


class CountReads(TorchDispatchMode):
    """Reads of a tensor's value back to the host (bool(), int(), .item()): aten._local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_only_the_unchecked_solves_read_nothing_back_so_only_they_can_be_captured():
    lower, diag, upper, rhs = random_system(100, seed=3)
    b = rhs[:, None]
    solves = {"partitioned.solve_unchecked": lambda: partitioned.solve_unchecked(lower, diag, upper, b),
              "factor_unchecked + lu_solve": lambda: sequential.lu_solve(
                  *sequential.factor_unchecked(lower, diag, upper), b),
              "sequential.solve": lambda: sequential.solve(lower, diag, upper, b),
              "partitioned.solve": lambda: partitioned.solve(lower, diag, upper, b)}
    reads = {}
    for name, solve in solves.items():
        with CountReads() as counter:
            solve()
        reads[name] = counter.reads
    assert reads["partitioned.solve_unchecked"] == 0 and reads["factor_unchecked + lu_solve"] == 0
    assert reads["sequential.solve"] >= 1 and reads["partitioned.solve"] >= 1


def test_naming_the_partitioned_kernel_on_mps_is_refused_with_the_reason():
    mps = torch.device("mps")  # a device object: no MPS hardware needed to check the refusal
    with pytest.raises(ValueError, match="driver='partitioned' computes its check in float64, which "
                                         "MPS lacks; use driver=None or 'sequential'"):
        kernels._check_driver("partitioned", kernels.DRIVERS, mps, "tridiagonal_solve")
    assert kernels._check_driver("sequential", kernels.DRIVERS, mps, "tridiagonal_solve") == "sequential"
    assert kernels._check_driver("partitioned", kernels.DRIVERS, torch.device("cpu"), "x") == "partitioned"


# Added claims: counts near the switch, the unchecked kernel, the condition estimate, which test
# of the check rejects an answer, and the refusal on MPS through the public driver check.

def test_one_systems_operation_counts_cross_between_16_and_32_below_the_switch():
    counts = {n: (count_ops(sequential.solve, *random_system(n, seed=n)).compute,
                  count_ops(partitioned.solve, *random_system(n, seed=n)).compute) for n in (16, 32, 64, 128)}
    assert counts[16][0] < counts[16][1]
    assert all(counts[n][0] > counts[n][1] for n in (32, 64, 128))
    assert 2 * counts[64][1] < counts[64][0]  # "under half the sequential kernel's" at the switch
    assert kernels.PARTITIONED_MIN_N == 64


def test_refinement_and_check_are_about_half_the_partitioned_operations():
    for n in (10**3, 10**4):
        system = random_system(n, seed=n)
        checked = count_ops(partitioned.solve, *system).compute
        unchecked = count_ops(partitioned.solve_unchecked, *system).compute
        assert 0.35 < unchecked / checked < 0.65


@pytest.mark.slow
def test_the_condition_estimate_times_eps_is_the_size_of_lapacks_error():
    large = random_system(10**5, seed=5)
    eps = torch.finfo(F64).eps
    z = 2 * torch.rand(10**5, 1, dtype=F64, generator=torch.Generator().manual_seed(0)) - 1
    a_max = max(t.abs().max() for t in large[:3])
    condition = float(a_max * tridiagonal_solve(*large[:3], z, driver="lapack").abs().max() / z.abs().max())
    x_ref = accuracy.reference(*(t.numpy() for t in large[:3]), large[3][:, None].numpy())
    error = accuracy.forward_error(tridiagonal_solve(*large, driver="lapack")[:, None].numpy(), x_ref)
    assert condition * eps > 100 * eps  # ill conditioned
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:
        assert 0.01 < error / (condition * eps) < 10


def _systems_for_the_check():
    for seed in range(6):
        yield [torch.from_numpy(a) for a in accuracy.make("badly_scaled_rows", 64, np.float64, seed)]
    for delta in (1e-2, 1e-6, 1e-10, 1e-12, 1e-14, 0.0):
        lower, diag, upper, rhs = random_system(70, seed=7)
        lower[2], diag[3] = 0.0, delta
        yield [lower, diag, upper, rhs[:, None]]
    yield [t[..., None] if i == 3 else t for i, t in enumerate(random_system(300, batch=(3,), seed=4))]


def test_check_values_fail_exactly_where_the_kernel_falls_back():
    from tridiag_tutorial.book.partitioned_check import check_values, failed
    outcomes = set()
    for system in _systems_for_the_check():
        fell_back = partitioned.solve_ex(*system)[1]
        assert bool(failed(check_values(*system))) == fell_back
        outcomes.add(fell_back)
    assert outcomes == {True, False}  # both verdicts are exercised


def test_only_the_growth_test_rejects_the_nearly_singular_block_of_exercise_1():
    from tridiag_tutorial.book.partitioned_check import check_values, failed
    eps = torch.finfo(F64).eps
    for delta, rejected in ((1e-12, []), (1e-14, ["growth"])):
        lower, diag, upper, rhs = random_system(70, seed=7)
        lower[2], diag[3] = 0.0, delta
        values = check_values(lower, diag, upper, rhs[:, None])
        assert failed(values) == rejected
        assert 0.1 / delta < values["growth"] / eps < 1e3 / delta  # spikes grow like 1 / delta


def test_resolve_driver_refuses_the_partitioned_kernel_for_an_mps_device():
    import types
    stand_in = types.SimpleNamespace(device=torch.device("mps"))
    with pytest.raises(ValueError, match="driver='partitioned' computes its check in float64"):
        kernels.resolve_driver("partitioned", stand_in)
    assert kernels.resolve_driver("sequential", stand_in) == "sequential"


@pytest.mark.parametrize("systems, n", [(1024, 16), (1024, 64), (1, 1024)])
def test_without_refinement_and_check_the_partitioned_kernel_writes_about_twice_the_sequential_bytes(systems, n):
    system = random_system(n, batch=(systems,), seed=n)
    ratio = _bytes(partitioned.solve_unchecked, *system) / _bytes(sequential.solve, *system)
    assert 1.5 < ratio < 2.5


def test_the_probe_test_rejects_the_singular_matrix_of_section_16_7():
    from tridiag_tutorial.book.partitioned_check import check_values, failed
    lower, diag, upper, _ = random_system(64, seed=8)
    lower[3], upper[5] = 0.0, 0.0
    lower[4], diag[5] = 0.5 * diag[4], 0.5 * upper[4]
    assert "probe" in failed(check_values(lower, diag, upper, torch.ones(64, 1, dtype=F64)))


def test_on_cuda_the_automatic_choice_switches_at_64_unknowns_whatever_the_batch():
    for batch in (1, 10**5):
        assert choose_driver("cuda", F64, batch, kernels.PARTITIONED_MIN_N - 1, False) == "sequential"
        assert choose_driver("cuda", F64, batch, kernels.PARTITIONED_MIN_N, False) == "partitioned"
    assert kernels.PARTITIONED_MIN_N == 64


def test_the_partitioned_derivatives_at_n_70_come_from_the_kernel_not_its_fallback():
    system = random_system(70, k=2, seed=6)
    weights = torch.randn(70, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    tangents = [torch.randn(t.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) for t in system]

    def derivatives():
        inputs = [t.clone().requires_grad_() for t in system]
        torch.autograd.grad((tridiagonal_solve(*inputs, driver="partitioned") * weights).sum(), inputs)
        torch.func.jvp(lambda *t: tridiagonal_solve(*t, driver="partitioned"), tuple(system), tuple(tangents))

    _, seq, part = sequential_calls(derivatives)
    assert seq == 0 and part >= 3  # forward, backward and tangent solves, none through the fallback
    lower, diag, upper, rhs = system
    assert partitioned.solve_ex(lower, diag, upper, rhs)[1] is False
    assert partitioned.solve_ex(upper, diag, lower, weights)[1] is False


def test_none_of_the_timed_partitioned_cases_falls_back():
    cases = [(1, n) for n in (16, 32, 64, 128, 256, 1024)] + [(1024, n) for n in (16, 32, 64)]
    for systems, n in cases:
        lower, diag, upper, rhs = random_system(n, batch=(systems,), seed=n)
        assert partitioned.solve_ex(lower, diag, upper, rhs[..., None])[1] is False, (systems, n)


def test_each_accuracy_row_has_82_systems_and_only_scaled_rows_escape_the_singular_error():
    tables = _partitioned_reference()
    for rows in tables.values():
        regular = [r for r in rows if r["ratios"] is not None or r["family"] in accuracy.FAMILIES]
        by_n = {}
        for r in regular:
            by_n.setdefault(r["n"], set()).add(r["systems"])
        assert by_n == {64: {60}, 1000: {20}, 100_000: {2}}
    singular = [r for r in tables["refine + check"] if r["ratios"] is None]
    escaped = {r["family"] for r in singular if r["lapack_raised"] < r["systems"]}
    assert escaped == {"scaled_row"}
    assert all(r["raised"] == r["lapack_raised"] and r["disagreements"] == 0 for r in singular)


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no such tag")
def test_the_packages_ops_carry_no_cudagraph_unsafe_tag():
    for op in (torch.ops.tridiag_tutorial.solve.default, torch.ops.tridiag_tutorial.solve_kernel.default):
        assert torch.Tag.cudagraph_unsafe not in op.tags


def test_the_checked_kernel_reads_back_once_and_a_fallback_once_more():
    singular_block = random_system(70, seed=7)
    singular_block[0][2], singular_block[1][3] = 0.0, 0.0
    reads = {}
    for system in (random_system(100, seed=3), singular_block):
        with CountReads() as counter:
            fell = partitioned.solve_ex(*system[:3], system[3][:, None])[1]
        reads[fell] = counter.reads
    assert reads == {False: 1, True: 2}


def test_the_switch_rule_is_a_judgement_from_operation_counts_not_a_gpu_measurement():
    doc = " ".join(kernels.choose_driver.__doc__.split())
    assert ("a judgement from the operation counts for few systems, where launches dominate, "
            "not a GPU measurement") in doc


def test_the_checked_kernel_writes_about_ten_times_the_unchecked_bytes():
    for systems, n in [(1024, 16), (1024, 64), (1, 1024)]:
        system = random_system(n, batch=(systems,), seed=n)
        ratio = _bytes(partitioned.solve, *system) / _bytes(partitioned.solve_unchecked, *system)
        assert 8.5 < ratio < 11.5


def test_refinement_and_the_check_write_90_percent_of_the_partitioned_bytes():
    """Sections 16.6 and 16.10: the share of the checked kernel's bytes that the unchecked one does not write."""
    for systems, n in [(1024, 16), (1024, 64), (1, 1024)]:
        system = random_system(n, batch=(systems,), seed=n)
        share = 1 - _bytes(partitioned.solve_unchecked, *system) / _bytes(partitioned.solve, *system)
        assert f"{share:.0%}" == "90%"


def test_a_device_other_than_mps_gets_the_partitioned_kernel_whatever_its_float64_support():
    for device in ("xpu", "cuda"):
        assert choose_driver(device, torch.float32, 1, kernels.PARTITIONED_MIN_N, False) == "partitioned"


def test_the_recursion_stops_at_systems_of_at_most_2_m_plus_1_unknowns():
    """Section 16.4: the reduced systems shrink until one has at most 2 (m + 1) = 10 unknowns."""
    assert partitioned.BLOCK == 4
    assert partitioned.levels(10) == [10] and len(partitioned.levels(11)) > 1
    for n in (11, 64, 1000, 12345, 10**6):
        sizes = partitioned.levels(n)
        assert sizes[-1] <= 10 and all(size > 10 for size in sizes[:-1])


def test_one_bad_system_hands_its_neighbours_lapacks_answer_instead_of_the_refined_one():
    """Section 16.7: the fallback solves the whole batch again, so a good system's answer
    depends on whether a neighbour in the batch failed the check."""
    good = random_system(70, seed=3)
    bad = random_system(70, seed=7)
    bad[0][2], bad[1][3] = 0.0, 0.0  # the singular block of section 16.7
    batch = [torch.stack([g, b]) for g, b in zip(good, bad)]
    x_alone, fell_alone = partitioned.solve_ex(*good[:3], good[3][:, None])
    x_batch, fell_batch = partitioned.solve_ex(*batch[:3], batch[3][..., None])
    assert not fell_alone and fell_batch
    assert torch.equal(x_batch[0], sequential.solve(*good[:3], good[3][:, None]))
    assert not torch.equal(x_batch[0], x_alone)


class CountTraffic(TorchDispatchMode):
    """Operations that compute, and the bytes they write and read, counted as chapter 16's CountOps
    counts them (an input broadcast along a dimension counted once along it)."""

    def __init__(self):
        super().__init__()
        self.compute = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.compute += 1
            leaves = torch.utils._pytree.tree_leaves
            self.bytes += sum(t.numel() * t.element_size() for t in leaves(out) if isinstance(t, torch.Tensor))
            self.bytes += sum(int(np.prod([size for size, step in zip(t.shape, t.stride()) if step]))
                              * t.element_size() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        return out


def test_the_batch_where_the_kernels_break_even_is_about_1300_systems_per_microsecond_and_tb_per_s():
    """Section 16.6: with t a launch's cost and beta the bandwidth, the partitioned kernel saves
    1902 - 793 launches at 1024 x 64 but moves about 0.88 MB more per system of 64, so the kernels
    break even near 1109 t beta / 0.88 MB, about 1300 systems for t = 1 us and beta = 1 TB/s."""
    system = random_system(64, batch=(1024,), seed=64)
    counts = {}
    for name, kernel in (("sequential", sequential.solve), ("partitioned", partitioned.solve)):
        with CountTraffic() as counter:
            kernel(*system[:3], system[3][..., None])
        counts[name] = counter
    saved = counts["sequential"].compute - counts["partitioned"].compute
    extra_mb = (counts["partitioned"].bytes - counts["sequential"].bytes) / 1024 / 1e6
    assert (counts["sequential"].compute, counts["partitioned"].compute) == (1902, 793)
    assert round(extra_mb, 2) == 0.88
    assert 1250 <= saved * 1e-6 * 1e12 / 1e6 / extra_mb < 1350  # systems of 64 for t = 1 us, beta = 1 TB/s


def test_the_factors_lu_are_four_rows_dl_d_du_du2_of_each_system():
    """Section 16.2 states lu's layout: (*B, 4, n), rows dl, d, du, du2, with U's diagonal in row 1."""
    lower, diag, upper, _ = random_system(40, batch=(16,), seed=10)
    lu, pivots = sequential.factor(lower, diag, upper)
    assert lu.shape == (16, 4, 40) and pivots.shape == (16, 40)
    determinant = torch.linalg.det(to_dense(lower, diag, upper))
    torch.testing.assert_close(lu[..., 1, :].prod(-1).abs(), determinant.abs())  # row 1: U's diagonal
    assert torch.equal(lu[..., 3, -2:], torch.zeros(16, 2, dtype=F64))  # du2: n - 2 entries, zero-padded


def test_a_dispatch_mode_sees_one_pad_where_the_profiler_sees_a_fill_and_a_copy():
    """Section 16.3: an operation counted is only roughly one launch; F.pad runs a fill and a copy."""
    x = torch.randn(100, dtype=F64)
    with CountOps() as counter:
        torch.nn.functional.pad(x, (0, 3))
    with torch.profiler.profile() as prof:
        torch.nn.functional.pad(x, (0, 3))
    names = [event.name for event in prof.events()]
    assert counter.compute == 1
    assert "aten::fill_" in names and "aten::copy_" in names


def test_off_cuda_and_mps_the_choice_reads_the_device_type_not_float64_support():
    """Section 16.9: on 'xpu' the automatic choice picks the partitioned kernel, which needs
    float64, from n = 64 on, for float32 and for any batch."""
    for batch in (1, 10**5):
        assert choose_driver("xpu", torch.float32, batch, 63, False) == "sequential"
        assert choose_driver("xpu", torch.float32, batch, 64, False) == "partitioned"


def test_both_the_correction_and_the_probe_tests_reject_the_singular_matrix_of_section_16_7():
    from tridiag_tutorial.book.partitioned_check import check_values, failed
    lower, diag, upper, _ = random_system(64, seed=8)
    lower[3], upper[5] = 0.0, 0.0
    lower[4], diag[5] = 0.5 * diag[4], 0.5 * upper[4]
    assert set(failed(check_values(lower, diag, upper, torch.ones(64, 1, dtype=F64)))) == {"correction", "probe"}
