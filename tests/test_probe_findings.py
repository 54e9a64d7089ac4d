"""Findings of an adversarial probe, each pinned by a check against LAPACK, the dense reference or
the exception raised.

1. ``driver="partitioned"`` with a singular ``A`` and ``k = 0`` columns raises as the others do.
2. ``driver="partitioned"`` on small systems with two or more batch dimensions (directly, under
   ``torch.func.vmap`` and on DTensors) answers as the dense reference does.
3. :func:`~tridiag_tutorial.distributed.solve.split_solve` with ranks that disagree on
   ``refinement_steps`` or on the function called raises a ``ValueError`` on every rank, neither
   hangs nor aborts.
4. A complex, exactly singular matrix raises on the kernels in torch ops where LAPACK raises.
5. A meta band among CPU tensors on the default path is refused under ``tridiagonal_solve``'s name.
6. ``tridiagonal_lu_solve`` with integer bands names the bands' dtype, not the factors'.
7. ``driver="lapack"`` on a batch (joined ``?gtsv`` / ``?gttrf`` / ``?gttrs`` calls) keeps the sign
   of zeros that each system alone gets.
"""

import numpy as np
import pytest
import torch
from scipy.linalg import lapack as scipy_lapack

from tridiag_tutorial import (
    SingularMatrixError,
    TridiagonalFactors,
    to_dense,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.book.multiprocess import run_on_ranks
from tridiag_tutorial.kernels import lapack
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, make_system

DRIVERS = ["lapack", "cpp", "sequential", "partitioned"]


def _drivers():
    from tridiag_tutorial import cpp_available

    return [d for d in DRIVERS if d != "cpp" or cpp_available()]


def _raised(call):
    """``(type name, pivot, batch_index)`` of the SingularMatrixError that ``call()`` raises, or
    None when it returns."""
    try:
        call()
    except SingularMatrixError as err:
        return type(err).__name__, err.pivot, err.batch_index
    return None


# --------------------------------------------------------------------------------------------
# 1. k = 0 columns, singular A
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [(), (3,)])
@pytest.mark.parametrize("n", [5, 40])
def test_partitioned_singular_with_no_column_raises_as_every_driver(n, batch):
    lower, diag, upper, _ = make_system(n, batch)
    diag[..., 2] = 0  # row 2 is [0, 0, 0]: exactly singular, pivot U[2, 2] is 0
    lower[..., 1] = 0
    upper[..., 2] = 0
    rhs = torch.zeros(*batch, n, 0, dtype=diag.dtype)
    results = {d: _raised(lambda d=d: tridiagonal_solve(lower, diag, upper, rhs, driver=d))
               for d in _drivers()}
    assert results["lapack"] is not None
    assert all(r == results["lapack"] for r in results.values()), results


def test_partitioned_with_no_column_solves_a_regular_system():
    lower, diag, upper, _ = make_system(40, (2,))
    x = tridiagonal_solve(lower, diag, upper, torch.zeros(2, 40, 0, dtype=diag.dtype),
                          driver="partitioned")
    assert x.shape == (2, 40, 0)


# --------------------------------------------------------------------------------------------
# 2. partitioned, small n, two or more batch dimensions
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [(2, 3), (2, 1, 3), (1, 2)])
@pytest.mark.parametrize("n", [2, 6, 10, 11, 40])
@pytest.mark.parametrize("k", [None, 2])
def test_partitioned_with_several_batch_dimensions(n, batch, k):
    args = make_system(n, batch, k)
    assert_close(tridiagonal_solve(*args, driver="partitioned"), dense_solve(*args))


@pytest.mark.parametrize("n", [6, 40])
def test_partitioned_under_vmap_of_a_batch(n):
    args = make_system(n, (4, 3), 2)
    solve = torch.func.vmap(lambda *a: tridiagonal_solve(*a, driver="partitioned"))
    assert_close(solve(*args), dense_solve(*args))


def _dtensor_worker(rank, world_size, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    args = make_system(n, (2, 3), 2)
    out = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        inputs = [distribute_tensor(t, mesh, [placement]) for t in args]
        x = tridiagonal_solve(*inputs, driver="partitioned")
        assert isinstance(x, DTensor)
        out.append(x.full_tensor())
    return out


@pytest.mark.parametrize("n", [6, 40])
def test_partitioned_on_dtensors_of_a_batch(n):
    args = make_system(n, (2, 3), 2)
    for x in run_on_ranks(_dtensor_worker, 1, n, timeout=120)[0]:
        assert_close(x, dense_solve(*args))


# --------------------------------------------------------------------------------------------
# 3. split_solve: ranks that disagree
# --------------------------------------------------------------------------------------------
def _mismatch_worker(rank, world_size, case):
    from tridiag_tutorial import distributed as ds

    n = 12
    args = make_system(n, (), 1)
    pieces = ds.split_bands(*args, rank, world_size)
    if case == "steps":
        call = lambda: ds.split_solve(*pieces, refinement_steps=2 if rank == 0 else 1)
    elif case == "bad_steps_on_one_rank":
        call = lambda: ds.split_solve(*pieces, refinement_steps=2 if rank == 0 else -1)
    else:  # split_solve on rank 0, gather_solve on the others
        call = lambda: (ds.split_solve(*pieces) if rank == 0 else ds.gather_solve(*pieces))
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 (returned to the test)
        error = (type(e).__name__, str(e))
    # the group is still usable: a solve on which the ranks agree answers as the dense reference
    x = ds.split_solve(*pieces)
    rows = slice(sum(ds.split_sizes(n, world_size)[:rank]), None)
    expected = dense_solve(*args)[rows][: x.shape[0]]
    return error, bool(torch.allclose(x, expected, rtol=1e-10, atol=1e-12))


@pytest.mark.parametrize("case, expected", [
    ("steps", ["refinement_steps", "rank 0: 2", "rank 1: 1"]),
    ("bad_steps_on_one_rank", ["refinement_steps must be an integer >= 0", "-1"]),
    ("function", ["split_solve", "gather_solve", "rank 0: split_solve", "rank 1: gather_solve"]),
])
def test_split_solve_ranks_that_disagree_raise_on_every_rank(case, expected):
    results = run_on_ranks(_mismatch_worker, 2, case, timeout=60)
    for rank, (error, solved) in enumerate(results):
        assert error is not None, f"rank {rank} did not raise"
        assert error[0] == "ValueError", (rank, error)
        for text in expected:
            assert text in error[1], (rank, error)
        assert solved, f"rank {rank}: the next solve was wrong"


# --------------------------------------------------------------------------------------------
# 4. complex, exactly singular
# --------------------------------------------------------------------------------------------
def _equal_columns(dtype, n, j, seed):
    """Random bands whose columns ``j`` and ``j + 1`` are equal: exactly singular."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        if dtype.is_complex:
            x = torch.complex(x, torch.randn(*shape, generator=g, dtype=torch.float64))
        return x.to(dtype)

    lower, diag, upper = randn(n - 1), randn(n), randn(n - 1)
    upper[j - 1] = 0
    lower[j + 1] = 0
    upper[j] = diag[j]
    diag[j + 1] = lower[j]
    dense = to_dense(lower, diag, upper)
    assert torch.equal(dense[:, j], dense[:, j + 1])
    return lower, diag, upper


def test_complex_equal_columns_probe_case_raises():
    """The probe's case: complex128, n = 6, LAPACK raises (pivot U[3, 3]); the kernels in torch
    ops returned max|x| about 1e17."""
    lower, diag, upper = _equal_columns(torch.complex128, 6, 1, 2)
    rhs = torch.ones(6, dtype=torch.complex128)
    expected = _raised(lambda: tridiagonal_solve(lower, diag, upper, rhs, driver="lapack"))
    assert expected is not None
    for driver in ("sequential", "partitioned"):
        assert _raised(lambda: tridiagonal_solve(lower, diag, upper, rhs, driver=driver)) \
            == expected, driver


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float32,
                                   torch.float64])
def test_equal_columns_raise_where_lapack_raises(dtype):
    raised = 0
    for j in (1, 2, 3):
        for seed in range(40):
            lower, diag, upper = _equal_columns(dtype, 6, j, seed)
            rhs = torch.ones(6, dtype=dtype)
            results = {d: _raised(lambda d=d: tridiagonal_solve(lower, diag, upper, rhs, driver=d))
                       for d in _drivers()}
            assert len(set(results.values())) == 1, (j, seed, results)
            factored = _raised(lambda: tridiagonal_lu_factor(lower, diag, upper,
                                                             driver="sequential"))
            assert factored == _raised(lambda: tridiagonal_lu_factor(lower, diag, upper,
                                                                     driver="lapack"))
            raised += results["lapack"] is not None
    assert raised  # the family holds singular cases that LAPACK sees


def test_sequential_factors_of_complex_systems_are_lapacks():
    """The kernel in torch ops writes complex products as LAPACK does: its factors of one complex
    system (the path that small tensors take) equal ?gttrf's, bit for bit."""
    for seed in range(20):
        lower, diag, upper, _ = make_system(7, (), dtype=torch.complex128, seed=seed)
        ours = tridiagonal_lu_factor(lower, diag, upper, driver="sequential")
        theirs = tridiagonal_lu_factor(lower, diag, upper, driver="lapack")
        assert torch.equal(ours.lu, theirs.lu) and torch.equal(ours.pivots, theirs.pivots), seed


# --------------------------------------------------------------------------------------------
# 5. a meta band among CPU tensors, default path
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("meta", ["lower", "upper", "rhs"])
def test_meta_band_among_cpu_tensors_is_refused_by_name(meta):
    args = dict(zip(("lower", "diag", "upper", "rhs"), make_system(5)))
    args[meta] = args[meta].to("meta")
    with pytest.raises(ValueError) as info:
        tridiagonal_solve(*args.values())
    message = str(info.value)
    assert message.startswith("tridiagonal_solve: all inputs must be on the same device"), message
    assert "cpp_solve" not in message and f"{meta} on meta" in message


def test_meta_and_fake_tensors_still_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_system(5, (2,), 3)
    x = tridiagonal_solve(*(t.to("meta") for t in args))
    assert x.device.type == "meta" and x.shape == (2, 5, 3)
    with FakeTensorMode() as mode:
        x = tridiagonal_solve(*(mode.from_tensor(t) for t in args))
    assert x.shape == (2, 5, 3)


# --------------------------------------------------------------------------------------------
# 6. tridiagonal_lu_solve with integer bands
# --------------------------------------------------------------------------------------------
def test_lu_solve_names_the_bands_dtype():
    lower, diag, upper, rhs = make_system(5)
    factors = tridiagonal_lu_factor(lower, diag, upper)
    ints = TridiagonalFactors(lower.long(), diag.long(), upper.long(), factors.lu, factors.pivots)
    with pytest.raises(TypeError) as info:
        tridiagonal_lu_solve(ints, rhs)
    message = str(info.value)
    assert message.startswith("tridiagonal_lu_solve: lower, diag and upper must be floating point "
                              "or complex"), message
    assert message.endswith("got torch.int64"), message
    assert "lu must" not in message


# --------------------------------------------------------------------------------------------
# 7. signed zeros of the joined LAPACK calls
# --------------------------------------------------------------------------------------------
_GTSV = {np.float64: scipy_lapack.dgtsv, np.complex128: scipy_lapack.zgtsv}


def _small_int_systems(seed, count, complex_=False):
    """Batches of 3 small systems with integer entries in [-2, 2], half their zeros -0.0."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(2, 6))

        def draw(*shape):
            a = rng.integers(-2, 3, shape).astype(float)
            if complex_:
                a = a + 1j * rng.integers(-2, 3, shape)
            for part in ((a.real, a.imag) if complex_ else (a,)):
                part[(part == 0) & (rng.random(shape) < 0.5)] = -0.0
            return a

        yield draw(3, n - 1), draw(3, n), draw(3, n - 1), draw(3, n, 2)


def _sign_bits(a):
    a = torch.as_tensor(a)
    return torch.signbit(torch.view_as_real(a) if a.is_complex() else a)


def test_lapack_driver_keeps_the_sign_of_zeros_of_a_known_case():
    """A batch whose second system has a -0.0 in its rhs: alone, ?gtsv returns -0.0 in its first
    row; joined with the first system, +0.0 (the joined call subtracts 0 * x of the block
    before)."""
    lower = torch.tensor([[-1.0, 2.0], [0.0, 1.0], [0.0, -1.0]])
    diag = torch.tensor([[-2.0, -2.0, -2.0], [-2.0, 1.0, 0.0], [1.0, -1.0, -1.0]])
    upper = torch.tensor([[2.0, 2.0], [0.0, 2.0], [0.0, 1.0]])
    rhs = torch.tensor([[-0.0, -1.0, 1.0], [-0.0, 1.0, -0.0], [1.0, 1.0, 1.0]])
    x = tridiagonal_solve(lower, diag, upper, rhs, driver="lapack")
    alone = torch.stack([torch.from_numpy(scipy_lapack.dgtsv(*(t[i].numpy() for t in
                                                               (lower, diag, upper, rhs)))[3])
                         for i in range(3)])
    assert torch.equal(x, alone)
    assert torch.equal(_sign_bits(x), _sign_bits(alone)), (x, alone)


@pytest.mark.parametrize("complex_", [False, True])
def test_lapack_driver_keeps_the_sign_of_zeros(complex_):
    checked = 0
    for dl, d, du, b in _small_int_systems(1, 600, complex_):
        args = [torch.from_numpy(a) for a in (dl, d, du, b)]
        gtsv = _GTSV[np.complex128 if complex_ else np.float64]
        try:
            x = tridiagonal_solve(*args, driver="lapack")
        except SingularMatrixError:
            continue
        alone = torch.from_numpy(np.stack([gtsv(dl[i], d[i], du[i], b[i])[3] for i in range(3)]))
        assert torch.equal(x, alone)
        assert torch.equal(_sign_bits(x), _sign_bits(alone)), (dl, d, du, b)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("complex_", [False, True])
def test_lapack_factors_and_factored_solves_keep_the_sign_of_zeros(complex_):
    checked = 0
    for dl, d, du, b in _small_int_systems(2, 400, complex_):
        try:
            lu, pivots = lapack.factor(dl, d, du)
        except SingularMatrixError:
            continue
        for i in range(3):
            alone_lu, alone_pivots = lapack.factor(dl[i], d[i], du[i])
            assert np.array_equal(_sign_bits(lu[i]), _sign_bits(alone_lu))
            assert np.array_equal(pivots[i], alone_pivots)
        for trans in "NTC":
            x = lapack.factor_solve(lu, pivots, b, trans)
            for i in range(3):
                alone = lapack.factor_solve(lu[i], pivots[i], b[i], trans)
                assert np.array_equal(x[i], alone)
                if trans == "N":  # with A^T and A^H, documented: zeros may differ in sign
                    assert np.array_equal(_sign_bits(x[i]), _sign_bits(alone)), (trans, i)
        checked += 1
    assert checked > 50
