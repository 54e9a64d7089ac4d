"""One matrix, every kernel (issue 23): the composition matrix of ``test_compositions.py``,
gradcheck / gradgradcheck, edge inputs, singular and non-finite systems, opcheck and the
factorization path, on each ``driver`` (issue 24): LAPACK, the C++ kernel, the sequential kernel
in torch ops and the partitioned one, at sizes on both sides of every threshold of the automatic
choice.

``driver=None`` (``tridiag_tutorial.kernels.choose_driver``) runs, on the CPU, the C++ kernel for
batches of >= 2 systems, for one real system of any size and for one complex system of
n <= ``CPP_ONE_COMPLEX_SYSTEM_MAX_N`` = 3000, LAPACK for a larger complex one; on other devices the
partitioned kernel for n >= ``PARTITIONED_MIN_N`` = 64, the sequential one below. Inside the C++
kernel, one real system (or each of a batch smaller than a block) of n >= ``PIECES_MIN_N`` =
1024 goes to its solve in pieces, a route of its own: the "cpp" and automatic columns have a
size on each side of it. A driver named explicitly runs whatever the size, so each kernel's sizes
include one on each side of these thresholds; the ``route`` tests check that the kernel named (or
chosen) really ran, forward and backward. The slow compile modes run at one size per kernel.
Factoring runs on
LAPACK or the sequential kernel only (``kernels.FACTOR_DRIVERS``): the factorization tests of the
C++ and partitioned kernels use the factor driver their solves stand beside.

``driver=None`` is a column of the matrix too (``"auto"`` in the test ids): on the CPU it is its
own route, ``api._solve_on_cpp`` (the C++ op called without the Python validation, which it
repeats only where the op refuses the inputs), and the general path to LAPACK for one complex
system above n = 3000.
"""

import functools
import math

import pytest
import test_compositions as comp
import torch
from torch.autograd import forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck

from tridiag_tutorial import (
    kernels,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.kernels import compiled, lapack
from tridiag_tutorial.reference import dense_solve

from conftest import KERNELS, make_system, require_cpp

BIG = kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N + 1  # one complex system this large: LAPACK
SPEC = compiled.PIECES_MIN_N  # one real system this large: the solve in pieces
PMIN = kernels.PARTITIONED_MIN_N
# (n, batch) per kernel: both sides of the thresholds of the automatic choice.
SIZES = {
    "lapack": [(5, ()), (PMIN + 6, (3,))],
    "cpp": [(5, ()), (PMIN + 6, (3,)), (2, (2,)),            # sequential elimination, a batch
            (SPEC + 6, ())],                                 # the solve in pieces
    "sequential": [(5, ()), (PMIN + 6, (2,))],               # n >= 64: named, not chosen
    "partitioned": [(5, ()), (PMIN, ()), (PMIN + 6, (2,))],  # n < 64: named, not chosen
}
# driver=None: the C++ fast path (one system, a batch, one system on the solve in pieces); one
# complex system above n = 3000 runs the general path to LAPACK, the "lapack" column's route
# (test_route_of_the_automatic_choice checks which).
SIZES[None] = [(5, ()), (2, (2,)), (PMIN + 6, (3,)), (SPEC + 6, ())]
COMPILE_SIZE = {"lapack": (5, ()), "cpp": (5, (2,)), "sequential": (5, ()),
                "partitioned": (PMIN + 6, ())}
# The factorization beside each solve driver: LAPACK's on the CPU kernels, the sequential
# kernel's (the one every other device factors with) beside the partitioned kernel.
FACTOR_DRIVER = {"lapack": "lapack", "cpp": "lapack", "sequential": "sequential",
                 "partitioned": "sequential", None: None}
ROUTES = [*KERNELS, None]  # the four drivers and the automatic choice


def ran(driver, n, batch):
    """The kernel that ``driver`` runs on CPU tensors of ``(n, batch)``."""
    if driver is not None:
        return driver
    return kernels.choose_driver("cpu", torch.float64, math.prod(batch), n,
                                 kernels.cpp_available())


@pytest.fixture(params=KERNELS)
def kernel(request):
    """A driver, one of :data:`kernels.DRIVERS`."""
    comp.needs(request.param)
    return request.param


@pytest.fixture(params=ROUTES, ids=lambda k: k or "auto")
def route(request):
    """A driver of :data:`kernels.DRIVERS`, or ``None``."""
    comp.needs(request.param)
    return request.param


def size_ids():
    return [f"{k or 'auto'}-n{n}-b{len(b) and b[0]}" for k in ROUTES for n, b in SIZES[k]]


ALL_SIZES = [(k, n, b) for k in ROUTES for n, b in SIZES[k]]


@pytest.fixture(params=ALL_SIZES, ids=size_ids())
def sized(request):
    """``(driver, n, batch)``."""
    name, n, batch = request.param
    comp.needs(name)
    return name, n, batch


def on(driver):
    """``tridiagonal_solve`` with ``driver``."""
    return functools.partial(tridiagonal_solve, driver=driver)


def factored_on(driver):
    """Factor, then solve from the factors, on the factor driver beside ``driver``."""
    fd = FACTOR_DRIVER[driver]

    def solve(lower, diag, upper, rhs, trans="N"):
        return tridiagonal_lu_solve(tridiagonal_lu_factor(lower, diag, upper, driver=fd), rhs,
                                    trans, driver=fd)
    return solve


def run_composition(mode, name, args, driver):
    lower, diag, upper, rhs = args
    run = comp.MODES[mode](comp.cases(on(driver), lower, diag, upper, rhs)[name])
    # The reference: the dense solve; at the sizes of the solve in pieces, where the dense
    # transforms would need gigabytes (a hessian vmaps the dense solve over n matrices n x n),
    # the same composition on LAPACK's kernel, which the dense reference checks at the others.
    reference_solve = comp.dense if diag.shape[-1] < SPEC else on("lapack")
    reference = comp.cases(reference_solve, lower, diag, upper, rhs)[name]
    expected = comp.EXPECTED[mode].get(name, "ok")
    if expected == "ok":
        out = run()
        assert out is not None, "no tangent or gradient came back"
        torch.testing.assert_close(out, reference(), rtol=1e-8, atol=1e-10)
    else:
        error, words = expected
        with pytest.raises(error) as info:
            run()
        assert "tridiagonal_solve" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("name", list(comp.REFERENCE))
def test_composition_eager(sized, name):
    driver, n, batch = sized
    run_composition("eager", name, make_system(n, batch, seed=n + len(batch)), driver)


@pytest.mark.parametrize("name", list(comp.REFERENCE))
@pytest.mark.parametrize("mode", ["compile", "compile(fullgraph)"])
def test_composition_compiled(kernel, mode, name):
    n, batch = COMPILE_SIZE[kernel]
    run_composition(mode, name, make_system(n, batch, seed=n + len(batch)), kernel)


def test_route(sized, monkeypatch):
    """The kernel named is the one that runs: forward and backward, forward-mode AD, and under a
    torch.func transform."""
    driver, n, batch = sized
    name = ran(driver, n, batch)
    spy = comp.KernelSpy(monkeypatch)
    solve = on(driver)
    args = make_system(n, batch, seed=1, requires_grad=True)
    x = solve(*args)
    assert set(spy.take()) == {name}
    x.sum().backward()
    backward = spy.take()
    assert backward and set(backward) == {name}, backward
    lower, diag, upper, rhs = (t.detach() for t in args)
    with fwAD.dual_level():
        x = solve(lower, fwAD.make_dual(diag, torch.ones_like(diag)), upper, rhs)
        tangent = fwAD.unpack_dual(x).tangent
    assert tangent is not None and set(spy.take()) == {name}
    torch.func.grad(lambda d: solve(lower, d, upper, rhs).sum())(diag)
    assert set(spy.take()) == {name}
    # without autograd (the kernel is called directly)
    torch.testing.assert_close(solve(lower, diag, upper, rhs), dense_solve(lower, diag, upper, rhs))
    assert spy.take() == [name]


# driver=None on the CPU, on both sides of CPP_ONE_COMPLEX_SYSTEM_MAX_N and PIECES_MIN_N:
# (n, batch, dtype, kernel).
AUTOMATIC = [(5, (), torch.float64, "cpp"), (SPEC - 1, (), torch.float64, "cpp"),
             (SPEC, (), torch.float32, "cpp"), (BIG, (), torch.float64, "cpp"),
             (10**5, (), torch.float64, "cpp"), (BIG - 1, (), torch.complex128, "cpp"),
             (BIG, (), torch.complex128, "lapack"), (BIG, (), torch.complex64, "lapack"),
             (BIG, (2,), torch.complex128, "cpp"), (2, (2,), torch.float64, "cpp")]


@pytest.mark.parametrize("n, batch, dtype, expected", AUTOMATIC,
                         ids=[f"n{n}-b{len(b) and b[0]}-{str(d)[6:]}" for n, b, d, _ in AUTOMATIC])
def test_route_of_the_automatic_choice(monkeypatch, n, batch, dtype, expected):
    """driver=None on CPU tensors: the C++ kernel for a batch, for one real system of any size
    and for one complex system of n <= 3000, LAPACK for one larger complex system; the backward
    solves on the same kernel."""
    if expected == "cpp":
        require_cpp()
    args = make_system(n, batch, dtype=dtype, seed=2, dominant=True, requires_grad=True)
    expected_x = lapack_reference(*(t.detach() for t in args[:3]), args[3].detach().unsqueeze(-1))
    spy = comp.KernelSpy(monkeypatch)
    x = tridiagonal_solve(*args)
    assert spy.take() == [expected]
    single = dtype in (torch.float32, torch.complex64)  # (the pieces' rounding is not LAPACK's)
    torch.testing.assert_close(x, expected_x.squeeze(-1), rtol=1e-5 if single else 1e-10,
                               atol=1e-6 if single else 1e-12)
    x.abs().square().sum().backward()
    assert spy.take() == [expected]


def test_one_system_above_the_cpp_threshold_runs_cpp_when_named(monkeypatch):
    """n = 3001, one complex system, driver="cpp": the C++ kernel (the threshold is the automatic
    choice's, not a limit of the kernel)."""
    require_cpp()
    args = make_system(BIG, dtype=torch.complex128, seed=2, dominant=True)
    expected = lapack_reference(*args[:3], args[3].unsqueeze(-1)).squeeze(-1)
    spy = comp.KernelSpy(monkeypatch)
    x = tridiagonal_solve(*args, driver="cpp")
    assert spy.take() == ["cpp"]
    torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12)


def test_gradcheck(sized):
    driver, n, batch = sized
    if driver == "partitioned" and batch:
        pytest.skip("finite differences cost 20 s here; the partitioned kernel is checked at n = 64")
    # finite differences: small systems, on the kernel's side of its thresholds (the solve in pieces
    # solve's from n = SPEC: about 6 s here)
    n = min(n, PMIN + 1) if driver == "partitioned" else SPEC if n >= SPEC else min(n, 12)
    args = make_system(n, batch, k=2, seed=3, requires_grad=True)
    assert gradcheck(on(driver), args, check_batched_grad=True, check_forward_ad=True)


def test_gradgradcheck(sized):
    driver, n, batch = sized
    if driver == "partitioned" and batch:
        pytest.skip("finite differences cost 20 s here; the partitioned kernel is checked at n = 64")
    n = min(n, PMIN + 1) if driver == "partitioned" else SPEC if n >= SPEC else min(n, 8)
    args = make_system(n, batch, seed=4, requires_grad=True)
    # at n = SPEC a full second-order check would take minutes: gradcheck's fast mode (a random
    # projection of the Jacobian, against finite differences all the same)
    assert gradgradcheck(on(driver), args, fast_mode=n >= SPEC)


def test_singular_raises(sized):
    driver, n, batch = sized
    lower, diag, upper, rhs = make_system(n, batch, seed=5)
    diag[..., 0], lower[..., 0] = 0.0, 0.0  # column 0 is zero
    with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\]"):
        tridiagonal_solve(lower, diag, upper, rhs, driver=driver)


def test_scaled_row_raises(sized):
    """Row i + 1 = row i / 2 (with the sub-diagonal making them overlap): exactly singular."""
    driver, n, batch = sized
    lower, diag, upper, rhs = make_system(n, batch, seed=6)
    i = n // 2 - 1 if n > 2 else 0
    if n < 3:
        pytest.skip("needs three columns")
    lower[..., i - 1] = 0.0 if i > 0 else lower[..., i - 1]
    diag[..., i], upper[..., i] = 2.0, 4.0
    if i > 0:
        lower[..., i - 1] = 0.0
    lower[..., i], diag[..., i + 1], upper[..., i + 1] = 1.0, 2.0, 0.0
    with pytest.raises(torch.linalg.LinAlgError):
        tridiagonal_solve(lower, diag, upper, rhs, driver=driver)


def lapack_reference(lower, diag, upper, rhs):
    """LAPACK ``?gtsv`` itself (``tridiag_tutorial.kernels.lapack``), for ``rhs`` ``(*B, n, k)``."""
    return torch.from_numpy(lapack.solve(*(t.numpy() for t in (lower, diag, upper, rhs))))


def test_nan_stays_in_its_column_and_system(sized):
    """A NaN in one column of one system: the other columns and systems equal LAPACK's answer."""
    driver, n, batch = sized
    lower, diag, upper, rhs = make_system(n, (2, *batch), k=3, seed=7)
    system = (1,) + (0,) * len(batch)
    rhs[system][n // 2, 1] = float("nan")
    x = tridiagonal_solve(lower, diag, upper, rhs, driver=driver)
    expected = lapack_reference(lower, diag, upper, rhs)
    finite = torch.isfinite(expected)
    assert torch.isnan(x[system][:, 1]).any() and finite.sum() >= rhs.numel() - n
    torch.testing.assert_close(x[finite], expected[finite], rtol=1e-10, atol=1e-12)


def test_edge_inputs(route):
    """n = 1 and 2, an empty batch, k = 0, broadcasting, non-contiguous inputs."""
    solve = on(route)
    for n in (1, 2):
        args = make_system(n, (3,), seed=n)
        torch.testing.assert_close(solve(*args), dense_solve(*args))
    lower, diag, upper, rhs = make_system(5, (0,), seed=8)
    assert solve(lower, diag, upper, rhs).shape == (0, 5)
    lower, diag, upper, _ = make_system(5, (2,), seed=9)
    assert solve(lower, diag, upper, torch.empty(2, 5, 0, dtype=torch.float64)).shape == (2, 5, 0)
    lower, diag, upper, rhs = make_system(70, (4, 3), seed=10)
    x = solve(lower[0], diag, upper[:1], rhs)  # bands broadcast
    torch.testing.assert_close(x, dense_solve(lower[0].expand(4, 3, 69), diag,
                                              upper[:1].expand(4, 3, 69), rhs))
    big = make_system(70, (3, 4), seed=11)
    views = [t.transpose(0, 1) for t in big]  # non-contiguous
    torch.testing.assert_close(solve(*views), dense_solve(*[v.contiguous() for v in views]))
    before = [t.clone() for t in views]
    solve(*views)
    assert all(torch.equal(a, b) for a, b in zip(views, before))  # never modified


def test_opcheck(kernel):
    """The ops with ``str driver``: solve without factors on ``kernel``, with factors and
    lu_factor on its factor driver, and the C++ kernel's own op ``cpp_solve``."""
    fd = FACTOR_DRIVER[kernel]
    n = PMIN + 6 if kernel == "partitioned" else 6
    lower, diag, upper, rhs = make_system(n, (2,), k=2, seed=12, requires_grad=True)
    ops = torch.ops.tridiag_tutorial
    torch.library.opcheck(ops.solve.default, (lower, diag, upper, rhs, None, None, "N", kernel))
    torch.library.opcheck(ops.solve_kernel.default,
                          (lower.detach(), diag.detach(), upper.detach(), rhs.detach(), None, None,
                           "N", kernel))
    f = tridiagonal_lu_factor(lower.detach(), diag.detach(), upper.detach(), driver=fd)
    torch.library.opcheck(ops.solve.default, (lower, diag, upper, rhs, f.lu, f.pivots, "T", fd))
    torch.library.opcheck(ops.lu_factor.default,
                          (lower.detach(), diag.detach(), upper.detach(), fd))
    if kernel == "cpp":
        bands = [t.detach() for t in (lower, diag, upper, rhs)]
        torch.library.opcheck(ops.cpp_solve.default, bands)
        x, info = ops.cpp_solve(*bands)
        assert int(info) == -1
        torch.testing.assert_close(x, dense_solve(*bands))


@pytest.mark.parametrize("trans", ["N", "T", "C"])
def test_factorization(sized, trans):
    driver, n, batch = sized
    solve = factored_on(driver)
    lower, diag, upper, rhs = make_system(n, batch, k=2, seed=13, requires_grad=True)
    x = solve(lower, diag, upper, rhs, trans)
    dense = torch.linalg.inv(comp.to_dense(lower, diag, upper))
    m = {"N": dense, "T": dense.mT, "C": dense.mH}[trans]
    torch.testing.assert_close(x, m @ rhs, rtol=1e-9, atol=1e-11)
    grads = torch.autograd.grad(x.pow(2).sum(), (lower, diag, upper, rhs))
    expected = torch.autograd.grad((m @ rhs).pow(2).sum(), (lower, diag, upper, rhs))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-10)
    if n <= 8:
        assert gradcheck(lambda *a: solve(*a, trans), (lower, diag, upper, rhs),
                         check_forward_ad=True, check_batched_grad=True)


@pytest.mark.parametrize("driver", ["cpp", "partitioned"])
def test_factoring_refuses_a_driver_that_does_not_factor(driver):
    """The C++ and partitioned kernels solve without factors only: the factor functions say so."""
    lower, diag, upper, rhs = make_system(5, seed=13)
    with pytest.raises(ValueError, match="tridiagonal_lu_factor.*solves without factors"):
        tridiagonal_lu_factor(lower, diag, upper, driver=driver)
    f = tridiagonal_lu_factor(lower, diag, upper)
    with pytest.raises(ValueError, match="tridiagonal_lu_solve.*solves without factors"):
        tridiagonal_lu_solve(f, rhs, driver=driver)


# The probe's cases of issue 23 that each kernel must handle as LAPACK does.
def test_nan_column_does_not_weaken_another_columns_check(route):
    """n = 70, d[3] = 1e-20, l[2] = 0 (cond about 1e2), a NaN in column 1: column 0 as LAPACK's
    (the partitioned kernel returned a relative error of 3.9e2)."""
    lower, diag, upper, rhs = make_system(70, k=2, seed=14)
    diag[3], lower[2] = 1e-20, 0.0
    rhs[5, 1] = float("nan")
    x = tridiagonal_solve(lower, diag, upper, rhs, driver=route)
    torch.testing.assert_close(x[:, 0], lapack_reference(lower, diag, upper, rhs)[:, 0],
                               rtol=1e-10, atol=1e-12)


def test_nan_on_the_diagonal_above_a_zero_subdiagonal(sized):
    """One system of the batch has diag[0] = NaN and lower[0] = 0: LAPACK returns NaN for it and
    the others' answers (the C++ kernel raised "singular ... in batch element (2,)")."""
    driver, n, batch = sized
    if n < 2:
        pytest.skip("needs a sub-diagonal")
    lower, diag, upper, rhs = make_system(n, (4, *batch), seed=15)
    system = (2,) + (0,) * len(batch)
    diag[system][0], lower[system][0] = float("nan"), 0.0
    expected = lapack_reference(lower, diag, upper, rhs.unsqueeze(-1)).squeeze(-1)
    x = tridiagonal_solve(lower, diag, upper, rhs, driver=driver)
    torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("row", [9, 10, 31, 32])
def test_scaled_row_at_a_block_boundary_raises(route, row):
    """n = 64, row ``row + 1`` = -0.7 row ``row``: LAPACK finds an exactly zero pivot (the
    partitioned kernel answered max|x| = 1.1e15 with residual 0.44)."""
    lower, diag, upper, rhs = make_system(64, seed=16 + row)
    lower[row - 1], upper[row + 1] = 0.0, 0.0
    lower[row], diag[row + 1] = -0.7 * diag[row], -0.7 * upper[row]
    try:
        lapack_reference(lower, diag, upper, rhs.unsqueeze(-1))
    except torch.linalg.LinAlgError:
        pass
    else:
        pytest.skip("LAPACK does not find an exact zero pivot for this draw")
    with pytest.raises(torch.linalg.LinAlgError):
        tridiagonal_solve(lower, diag, upper, rhs, driver=route)
