"""The kernels and the ``driver`` that picks one: the automatic choice as a table, the errors of a
driver that cannot run, the driver passed through every public function, SingularMatrixError on
every kernel, joined-batch LAPACK, LU factors, the sequential kernel, singular/non-finite input."""

import functools
import pickle
import types

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import tridiag_tutorial
from tridiag_tutorial import (
    SingularMatrixError,
    kernels,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.book import custom_op
from tridiag_tutorial.kernels import compiled, lapack, partitioned, sequential
from tridiag_tutorial.reference import dense_solve

from conftest import (
    ALL_DTYPES,
    KERNELS,
    assert_close,
    assert_grads_match_dense,
    driver_for,
    make_system,
    require_cpp,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def runnable(driver):
    """``driver``, after skipping (or failing, see conftest.require_cpp) where it is "cpp" and
    the C++ kernel was not built."""
    if driver == "cpp":
        require_cpp()
    return driver


def numpy_args(*tensors):
    return [t.numpy() for t in tensors]


# ---------------------------------------------------------------------------------------------
# The automatic choice (driver=None): kernels.choose_driver against its documented rule.
# ---------------------------------------------------------------------------------------------
# Written out by hand from choose_driver's docstring, not computed by it: on the CPU the C++
# kernel, where installed, for every batch of two or more systems, for one real system of any
# size and for one complex system of n <= CPP_ONE_COMPLEX_SYSTEM_MAX_N = 3000, LAPACK otherwise;
# on every other device the partitioned kernel for n >= PARTITIONED_MIN_N = 64, the sequential
# one below. Only the kind of dtype (real or complex) is read: each row holds for both dtypes of
# its kind.
EXPECTED_CHOICE = """
device  cpp    batch   kind    n=1         n=63        n=64        n=3000      n=3001
cpu     True   1       real    cpp         cpp         cpp         cpp         cpp
cpu     True   1       complex cpp         cpp         cpp         cpp         lapack
cpu     True   2       real    cpp         cpp         cpp         cpp         cpp
cpu     True   2       complex cpp         cpp         cpp         cpp         cpp
cpu     True   1000    real    cpp         cpp         cpp         cpp         cpp
cpu     True   1000    complex cpp         cpp         cpp         cpp         cpp
cpu     False  1       real    lapack      lapack      lapack      lapack      lapack
cpu     False  1       complex lapack      lapack      lapack      lapack      lapack
cpu     False  2       real    lapack      lapack      lapack      lapack      lapack
cpu     False  2       complex lapack      lapack      lapack      lapack      lapack
cpu     False  1000    real    lapack      lapack      lapack      lapack      lapack
cpu     False  1000    complex lapack      lapack      lapack      lapack      lapack
cuda    True   1       real    sequential  sequential  partitioned partitioned partitioned
cuda    True   1       complex sequential  sequential  partitioned partitioned partitioned
cuda    True   2       real    sequential  sequential  partitioned partitioned partitioned
cuda    True   2       complex sequential  sequential  partitioned partitioned partitioned
cuda    True   1000    real    sequential  sequential  partitioned partitioned partitioned
cuda    True   1000    complex sequential  sequential  partitioned partitioned partitioned
cuda    False  1       real    sequential  sequential  partitioned partitioned partitioned
cuda    False  1       complex sequential  sequential  partitioned partitioned partitioned
cuda    False  2       real    sequential  sequential  partitioned partitioned partitioned
cuda    False  2       complex sequential  sequential  partitioned partitioned partitioned
cuda    False  1000    real    sequential  sequential  partitioned partitioned partitioned
cuda    False  1000    complex sequential  sequential  partitioned partitioned partitioned
mps     True   1       real    sequential  sequential  sequential  sequential  sequential
mps     True   1       complex sequential  sequential  sequential  sequential  sequential
mps     True   2       real    sequential  sequential  sequential  sequential  sequential
mps     True   2       complex sequential  sequential  sequential  sequential  sequential
mps     True   1000    real    sequential  sequential  sequential  sequential  sequential
mps     True   1000    complex sequential  sequential  sequential  sequential  sequential
mps     False  1       real    sequential  sequential  sequential  sequential  sequential
mps     False  1       complex sequential  sequential  sequential  sequential  sequential
mps     False  2       real    sequential  sequential  sequential  sequential  sequential
mps     False  2       complex sequential  sequential  sequential  sequential  sequential
mps     False  1000    real    sequential  sequential  sequential  sequential  sequential
mps     False  1000    complex sequential  sequential  sequential  sequential  sequential
"""


def expected_choices():
    """``{(device, cpp, batch, kind, n): driver}`` from the table above."""
    header, *rows = EXPECTED_CHOICE.strip().splitlines()
    sizes = [int(column[2:]) for column in header.split()[4:]]
    table = {}
    for row in rows:
        device, cpp, batch, kind, *drivers = row.split()
        assert len(drivers) == len(sizes) and cpp in ("True", "False")
        assert kind in ("real", "complex")
        for n, driver in zip(sizes, drivers):
            table[device, cpp == "True", int(batch), kind, n] = driver
    return table


CHOICES = expected_choices()


def test_the_expected_table_is_complete():
    """Every device, installed or not, batch 1 / 2 / 1000, real and complex, and n = 1, 63, 64,
    3000, 3001; only names of kernels.DRIVERS."""
    assert len(CHOICES) == 3 * 2 * 3 * 2 * 5
    assert set(CHOICES.values()) <= set(kernels.DRIVERS)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_choose_driver_follows_the_documented_rule(device, dtype):
    kind = "complex" if dtype.is_complex else "real"
    wrong = [(key, expected, got) for key, expected in CHOICES.items()
             if key[0] == device and key[3] == kind
             for got in [kernels.choose_driver(device, dtype, key[2], key[4], key[1])]
             if got != expected]
    assert not wrong, f"(device, cpp, batch, kind, n), expected, got: {wrong}"


def test_the_documented_thresholds():
    """The table's columns sit on either side of the constants the docstring names."""
    assert kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N == 3000
    assert kernels.PARTITIONED_MIN_N == 64


@pytest.mark.parametrize("device, expected", [("cpu", "lapack"), ("cuda", "sequential"),
                                              ("mps", "sequential"), ("meta", "sequential")])
def test_choose_factor_driver(device, expected):
    """LAPACK on the CPU, the sequential kernel (the same pivots and factors) elsewhere."""
    assert kernels.choose_factor_driver(device) == expected


def test_resolve_driver_none_is_the_automatic_choice_of_the_shape(monkeypatch):
    """driver=None: the batch is the product of the batch dimensions and n the rows of rhs
    (*B, n, k), and whether the C++ kernel is installed is kernels._CPP."""
    for cpp in (True, False):
        monkeypatch.setattr(kernels, "_CPP", cpp)
        for batch, n in ((1, 3001), (2, 3001), (1, 63), (1000, 64)):
            for dtype, kind in ((torch.float64, "real"), (torch.complex128, "complex")):
                shape = (batch // 2, 2) if batch > 1 else ()
                rhs = torch.empty(*shape, n, 3, dtype=dtype)
                expected = CHOICES["cpu", cpp, batch, kind, n]
                assert kernels.resolve_driver(None, rhs) == expected, (cpp, batch, n, kind)
    meta = torch.empty(2, 5, 64, 1, device="meta")
    assert kernels.resolve_driver(None, meta) == "partitioned"
    assert kernels.resolve_factor_driver(None, torch.device("cpu"), "f") == "lapack"
    assert kernels.resolve_factor_driver(None, torch.device("meta"), "f") == "sequential"


# ---------------------------------------------------------------------------------------------
# A driver that cannot run: each error names the problem and the alternative.
# ---------------------------------------------------------------------------------------------
def on(device_type):
    """What resolve_driver reads of rhs, on a device this machine may not have."""
    return types.SimpleNamespace(device=torch.device(device_type), dtype=torch.float64,
                                 shape=torch.Size([2, 70, 1]))


@pytest.mark.parametrize("bad", ["magma", "LAPACK", "", 1, True])
def test_unknown_driver(bad):
    rhs = torch.ones(3, 1, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        kernels.resolve_driver(bad, rhs)
    message = str(err.value)
    assert f"got {bad!r}" in message
    assert "driver must be None or one of" in message
    assert all(repr(name) in message for name in kernels.DRIVERS)
    with pytest.raises(ValueError) as err:
        kernels.resolve_factor_driver(bad, torch.device("cpu"), "tridiagonal_lu_factor")
    assert f"got {bad!r}" in str(err.value)
    assert all(repr(name) in str(err.value) for name in kernels.FACTOR_DRIVERS)


@pytest.mark.parametrize("driver", ["lapack", "cpp"])
@pytest.mark.parametrize("device", ["meta", "cuda", "mps"])
def test_cpu_drivers_refuse_other_devices(driver, device):
    """"lapack" and "cpp" need CPU tensors: the error names the driver and the device, and the
    drivers that run there."""
    with pytest.raises(ValueError) as err:
        kernels.resolve_driver(driver, on(device), "tridiagonal_solve")
    message = str(err.value)
    assert message.startswith("tridiagonal_solve: ")
    assert f"driver={driver!r} runs on CPU tensors only" in message
    assert f"tensors on {device}" in message
    assert "use driver=None, 'sequential' or 'partitioned'" in message
    if driver == "lapack":
        with pytest.raises(ValueError, match=f"driver='lapack' runs on CPU tensors only, got "
                                             f"tensors on {device}"):
            kernels.resolve_factor_driver(driver, torch.device(device), "tridiagonal_lu_factor")


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_factor_functions_off_the_cpu_suggest_only_drivers_that_factor(device):
    with pytest.raises(ValueError) as err:
        kernels.resolve_factor_driver("lapack", torch.device(device), "tridiagonal_lu_factor")
    message = str(err.value)
    assert "driver='lapack' runs on CPU tensors only" in message
    assert "driver=None" in message and "'sequential'" in message
    assert "'partitioned'" not in message and "'cpp'" not in message


def test_cpu_drivers_refuse_meta_tensors_in_the_public_functions():
    args = [t.to("meta") for t in make_system(6, (2,), 1)]
    for driver in ("lapack", "cpp"):
        with pytest.raises(ValueError, match=f"tridiagonal_solve: driver={driver!r} runs on CPU "
                                             "tensors only, got tensors on meta"):
            tridiagonal_solve(*args, driver=driver)
    with pytest.raises(ValueError, match="tridiagonal_lu_factor: driver='lapack' runs on CPU"):
        tridiagonal_lu_factor(*args[:3], driver="lapack")


@pytest.mark.parametrize("driver", ["cpp", "partitioned"])
def test_factor_functions_refuse_drivers_without_factors(driver):
    """The C++ and partitioned kernels solve without factors only: the error says so and names
    the drivers that factor."""
    expected = (rf"driver={driver!r} solves without factors only; the factorization runs on "
                r"'lapack' or 'sequential' \(or driver=None\)")
    for name in ("tridiagonal_lu_factor", "tridiagonal_lu_solve"):
        with pytest.raises(ValueError, match=f"{name}: {expected}"):
            kernels.resolve_factor_driver(driver, torch.device("cpu"), name)
    lower, diag, upper, rhs = make_system(6, (2,), 1)
    with pytest.raises(ValueError, match=f"tridiagonal_lu_factor: {expected}"):
        tridiagonal_lu_factor(lower, diag, upper, driver=driver)
    factors = tridiagonal_lu_factor(lower, diag, upper)
    with pytest.raises(ValueError, match=f"tridiagonal_lu_solve: {expected}"):
        tridiagonal_lu_solve(factors, rhs, driver=driver)


@pytest.mark.parametrize("driver", kernels.DRIVERS)
def test_solving_leaves_the_inputs_storage_resizable(driver):
    """FSDP2 frees a parameter's memory by resizing its storage to 0 (and back) between steps. A
    solve must not pin its inputs' storage: ``Tensor.numpy()`` on the LAPACK path did, and FSDP2
    training through the op then failed with "Trying to resize storage that is not resizable"."""
    if driver == "cpp":
        require_cpp()
    lower, diag, upper, rhs = (t.requires_grad_() for t in make_system(8, (2,), 3))
    x = tridiagonal_solve(lower, diag, upper, rhs, driver=driver)
    torch.autograd.grad(x.square().sum(), (lower, diag, upper, rhs))
    factors = tridiagonal_lu_factor(lower, diag, upper, driver="lapack")
    tridiagonal_lu_solve(factors, rhs, driver="lapack")
    for t in (lower, diag, upper, rhs):
        size = t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)  # what FSDP2's free_storage does
        t.untyped_storage().resize_(size)


def test_cpp_driver_where_the_kernel_was_not_built(monkeypatch):
    """driver="cpp" without the C++ kernel: RuntimeError saying why and how to fix it
    (the package installed again without touching torch) or what to use instead; driver=None
    goes to LAPACK."""
    monkeypatch.setattr(kernels, "_CPP", False)
    monkeypatch.setattr(compiled, "BUILD_ERROR", "ImportError: no module named _C (the test)")
    assert not tridiag_tutorial.cpp_available()
    args = make_system(6, (2,), 1)
    for call in (lambda: kernels.resolve_driver("cpp", args[3]),
                 lambda: tridiagonal_solve(*args, driver="cpp")):
        with pytest.raises(RuntimeError) as err:
            call()
        message = str(err.value)
        assert message.startswith("tridiagonal_solve: driver='cpp': ")
        assert "the C++ kernel is not available" in message
        assert "ImportError: no module named _C (the test)" in message
        assert "To build it, run " in message  # how to fix it: the package again, torch kept
        assert "-m pip install --force-reinstall --no-deps " in message
        assert "driver='lapack'" in message
    assert kernels.resolve_driver(None, args[3]) == "lapack"


# ---------------------------------------------------------------------------------------------
# The public functions pass their driver through: spies on the kernels that run.
# ---------------------------------------------------------------------------------------------
SPIED = {lapack: ("solve", "factor", "factor_solve"), compiled: ("solve",),
         partitioned: ("solve",), sequential: ("solve", "factor", "lu_solve")}


@pytest.fixture
def ran(monkeypatch):
    """The outermost kernel calls, in order, as "module.function" (a kernel's own calls of
    another, such as the partitioned kernel's of sequential.lu_solve, are not listed)."""
    calls, depth = [], [0]
    for module, names in SPIED.items():
        for name in names:
            def spy(*a, _f=getattr(module, name), _label=f"{module.__name__.split('.')[-1]}.{name}",
                    **k):
                if depth[0] == 0:
                    calls.append(_label)
                depth[0] += 1
                try:
                    return _f(*a, **k)
                finally:
                    depth[0] -= 1
            monkeypatch.setattr(module, name, spy)
    return calls


SOLVE_RUNS = {"lapack": "lapack.solve", "cpp": "compiled.solve",
              "sequential": "sequential.solve", "partitioned": "partitioned.solve"}


@pytest.mark.parametrize("driver", KERNELS)
def test_tridiagonal_solve_runs_its_driver(ran, driver):
    """Forward alone, and forward and backward: the backward solves on the forward's kernel
    (the sequential kernel factors once and solves from the factors both ways)."""
    runnable(driver)
    args = make_system(70, (2,), 2, seed=1, dominant=True)
    x = tridiagonal_solve(*args, driver=driver)
    assert ran == [SOLVE_RUNS[driver]]
    assert_close(x, dense_solve(*args))
    ran.clear()
    args = [t.requires_grad_() for t in args]
    grads = torch.autograd.grad(tridiagonal_solve(*args, driver=driver).square().sum(), args)
    if driver == "sequential":
        assert ran == ["sequential.factor", "sequential.lu_solve", "sequential.lu_solve"]
    else:
        assert ran == [SOLVE_RUNS[driver]] * 2
    assert_grads_match_dense(grads, args, lambda x: x.square().sum())


@pytest.mark.parametrize("driver", KERNELS)
def test_automatic_choice_is_what_runs(ran, monkeypatch, driver):
    """driver=None runs exactly what kernels.choose_driver returns for the call."""
    runnable(driver)
    seen = []

    def choose(*a):
        seen.append(a)
        return driver

    monkeypatch.setattr(kernels, "choose_driver", choose)
    args = make_system(70, (2, 3), 2, seed=2, dominant=True)
    tridiagonal_solve(*args)
    assert seen == [("cpu", torch.float64, 6, 70, kernels.cpp_available())]
    assert ran == [SOLVE_RUNS[driver]]


@pytest.mark.parametrize("driver", ["lapack", "sequential"])
def test_factor_functions_run_their_driver(ran, driver):
    args = make_system(8, (3,), 2, seed=3, requires_grad=True)
    factors = tridiagonal_lu_factor(*args[:3], driver=driver)
    assert ran == [{"lapack": "lapack.factor", "sequential": "sequential.factor"}[driver]]
    ran.clear()
    solve_runs = {"lapack": "lapack.factor_solve", "sequential": "sequential.lu_solve"}[driver]
    for trans in ("N", "T", "C"):
        x = tridiagonal_lu_solve(factors, args[3], trans, driver=driver)
        grads = torch.autograd.grad(x.square().sum(), args)
        assert ran == [solve_runs, solve_runs], trans
        ran.clear()
        if trans == "N":
            assert_grads_match_dense(grads, args, lambda x: x.square().sum())
    tridiagonal_lu_factor(*args[:3])
    assert ran == ["lapack.factor"]  # driver=None on the CPU


def test_factors_of_either_driver_solve_on_either():
    """The two factor drivers make the same factors, so each solves from the other's."""
    lower, diag, upper, rhs = make_system(9, (2,), 2, seed=4)
    diag[:, 0] = 0.0  # an interchange
    for made, used in (("lapack", "sequential"), ("sequential", "lapack")):
        factors = tridiagonal_lu_factor(lower, diag, upper, driver=made)
        assert_close(tridiagonal_lu_solve(factors, rhs, driver=used),
                     dense_solve(lower, diag, upper, rhs))


def test_compiled_function_recompiles_for_another_driver(ran):
    """The driver is an argument of the op in the graph: Dynamo guards on it, so one compiled
    function runs the kernel of each call's driver, forward and backward."""
    @torch.compile(fullgraph=True)
    def loss(lower, diag, upper, rhs, driver):
        return tridiagonal_solve(lower, diag, upper, rhs, driver=driver).square().sum()

    args = make_system(70, (2,), 1, seed=5, dominant=True, requires_grad=True)
    for driver in ("lapack", "partitioned", "lapack"):
        ran.clear()
        grads = torch.autograd.grad(loss(*args, driver), args)
        assert ran == [SOLVE_RUNS[driver]] * 2, driver
        assert_grads_match_dense(grads, args, lambda x: x.square().sum())


# ---------------------------------------------------------------------------------------------
# SingularMatrixError: one error, the same pivot and batch element on every kernel.
# ---------------------------------------------------------------------------------------------
def singular_batch(dtype, n=70):
    """A (2, 3) batch of systems of n = 70 (the partitioned kernel partitions them) where
    system (1, 0) has a zero column 40 and system (1, 2) a zero column 5: the first singular
    system in C order is (1, 0), flat index 3, with pivot U[40, 40], although (1, 2) has the
    smaller pivot."""
    lower, diag, upper, rhs = make_system(n, (2, 3), 2, dtype=dtype, seed=31)
    for system, column in (((1, 0), 40), ((1, 2), 5)):
        diag[system][column], lower[system][column], upper[system][column - 1] = 0.0, 0.0, 0.0
    return lower, diag, upper, rhs


def assert_singular(err, pivot, batch_index):
    assert type(err) is SingularMatrixError and isinstance(err, torch.linalg.LinAlgError)
    assert err.pivot == pivot and err.batch_index == batch_index
    where = f", in batch element {batch_index}" if batch_index else ""
    assert str(err) == (f"the tridiagonal matrix is singular: pivot U[{pivot}, {pivot}] is "
                        f"exactly zero{where}")
    restored = pickle.loads(pickle.dumps(err))
    assert type(restored) is SingularMatrixError
    assert (restored.pivot, restored.batch_index) == (pivot, batch_index)
    assert str(restored) == str(err)


def test_singular_matrix_error_is_exported():
    assert tridiag_tutorial.SingularMatrixError is SingularMatrixError
    assert issubclass(SingularMatrixError, torch.linalg.LinAlgError)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward", "with-grad"])
@pytest.mark.parametrize("driver", KERNELS)
def test_singular_batch_raises_on_every_driver(driver, path, dtype):
    runnable(driver)
    lower, diag, upper, rhs = singular_batch(dtype)
    if path == "with-grad":  # the sequential kernel then factors first, for the backward
        diag.requires_grad_()
    with pytest.raises(SingularMatrixError) as err:
        tridiagonal_solve(lower, diag, upper, rhs, driver=driver)
    assert_singular(err.value, 40, (1, 0))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("driver", [None, "lapack", "sequential"])
def test_singular_batch_raises_in_tridiagonal_lu_factor(driver, dtype):
    with pytest.raises(SingularMatrixError) as err:
        tridiagonal_lu_factor(*singular_batch(dtype)[:3], driver=driver)
    assert_singular(err.value, 40, (1, 0))


@pytest.mark.parametrize("driver", KERNELS)
def test_singular_single_system_and_one_dimensional_batch(driver):
    """batch_index is () for one system and (i,) for a batch of one dimension."""
    runnable(driver)
    lower, diag, upper, rhs = singular_batch(torch.float64)
    one = [t[1, 0] for t in (lower, diag, upper, rhs)]
    with pytest.raises(SingularMatrixError) as err:
        tridiagonal_solve(*one, driver=driver)
    assert_singular(err.value, 40, ())
    flat = [t.reshape(6, *t.shape[2:]) for t in (lower, diag, upper, rhs)]
    with pytest.raises(SingularMatrixError) as err:
        tridiagonal_solve(*flat, driver=driver)
    assert_singular(err.value, 40, (3,))


def test_singular_matrix_error_is_a_linalg_error_to_catch():
    """``except torch.linalg.LinAlgError`` (what code written for torch.linalg catches)."""
    try:
        tridiagonal_solve(torch.zeros(1), torch.zeros(2), torch.zeros(1), torch.ones(2))
    except torch.linalg.LinAlgError as err:
        assert err.pivot == 0 and err.batch_index == ()
    else:
        pytest.fail("no error")


# ---------------------------------------------------------------------------------------------
# LAPACK joined batches, factors, and the sequential kernel.
# ---------------------------------------------------------------------------------------------
def test_joined_batch_equals_one_call_per_system():
    """One ?gtsv call on the block-diagonal system gives bit-identical results to a loop."""
    args = make_system(9, (4, 5), 3, seed=1)
    args[1][1, 2, 0] = 0.0  # a pivot that forces a row interchange
    joined = lapack.solve(*numpy_args(*args))
    loop = np.stack([lapack.gtsv(*(a.reshape(20, *a.shape[2:])[i] for a in numpy_args(*args)))
                     for i in range(20)]).reshape(joined.shape)
    np.testing.assert_array_equal(joined, loop)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 6])
@pytest.mark.parametrize("trans", ["N", "T", "C"])
def test_lu_factors_solve_every_transpose(dtype, n, trans):
    """LAPACK's batched factors solve with A, A^T and A^H, on both kernels' solves."""
    lower, diag, upper, rhs = make_system(n, (3,), 2, dtype=dtype, seed=n)
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    assert lu.shape == (3, 4, n) and pivots.shape == (3, n) and pivots.dtype == np.int32
    a = {"N": (lower, diag, upper), "T": (upper, diag, lower),
         "C": (upper.conj(), diag.conj(), lower.conj())}[trans]
    y = lapack.factor_solve(lu, pivots, rhs.numpy(), trans)
    assert_close(torch.from_numpy(y), dense_solve(*a, rhs))
    lu_t, pivots_t = torch.from_numpy(lu), torch.from_numpy(pivots)
    assert_close(sequential.lu_solve(lu_t, pivots_t, rhs, trans), dense_solve(*a, rhs))


def test_batched_factors_equal_one_call_per_system():
    """gttrf on the joined system gives each system's own factors and 1-based pivots."""
    lower, diag, upper, _ = make_system(7, (2, 3), seed=2)
    diag[0, 1, 0] = 0.0  # forces a row interchange
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    for i, j in np.ndindex(2, 3):
        f = lapack.gttrf(*(t[i, j].numpy() for t in (lower, diag, upper)))
        np.testing.assert_array_equal(lu[i, j, 0, :6], f.dl)
        np.testing.assert_array_equal(lu[i, j, 1], f.d)
        np.testing.assert_array_equal(lu[i, j, 2, :6], f.du)
        np.testing.assert_array_equal(lu[i, j, 3, :5], f.du2)
        np.testing.assert_array_equal(pivots[i, j], f.ipiv)
    assert pivots[0, 1, 0] == 2  # the interchange is recorded, relative to its own system


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_torch_kernel_factors_equal_lapack_factors(n):
    """Same algorithm, same pivots: on real inputs the factors agree bit for bit."""
    lower, diag, upper, _ = make_system(n, (4,), 2, seed=20 + n)
    if n > 1:
        diag[:, 0] = 0.0
    lu, pivots = lapack.factor(*numpy_args(lower, diag, upper))
    lu_t, pivots_t = sequential.factor(lower, diag, upper)
    torch.testing.assert_close(lu_t, torch.from_numpy(lu), rtol=0, atol=0)
    torch.testing.assert_close(pivots_t, torch.from_numpy(pivots), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [None, 3])
def test_torch_kernel_path_matches_dense(dtype, n, k):
    args = make_system(n, (2, 3), k, dtype=dtype, seed=n)
    x = tridiagonal_solve(*args, driver=driver_for("torch", n))
    wide = torch.complex128 if dtype.is_complex else torch.float64
    assert_close(x, dense_solve(*(a.to(wide) for a in args)).to(dtype), dtype)


def test_torch_kernel_path_gradients():
    args = make_system(5, (2,), 2, requires_grad=True, seed=30)
    solve = functools.partial(tridiagonal_solve, driver="sequential")
    assert gradcheck(solve, args, check_forward_ad=True)
    assert gradgradcheck(solve, args)


def test_torch_kernel_needs_no_diagonal_dominance():
    """It pivots: the zero-diagonal system Thomas cannot solve (A x = [4, 10, 5], x = [1, 2, 3])."""
    lower = torch.tensor([1.0, 1.0], dtype=torch.float64)
    diag = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    upper = torch.tensor([2.0, 3.0], dtype=torch.float64)
    rhs = torch.tensor([4.0, 10.0, 5.0], dtype=torch.float64)
    x = tridiagonal_solve(lower, diag, upper, rhs, driver="sequential")
    torch.testing.assert_close(x, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("kernel", KERNELS)
def test_singular_real_valued_complex_matrix_raises_on_every_kernel(kernel):
    """Row 4 is exactly half of row 3, stored as complex numbers: the elimination's multiplier
    0.5 d / d must come out exactly 0.5 (Smith's division, as LAPACK's), or the zero pivot
    becomes round-off and the torch kernels return garbage where LAPACK raises."""
    runnable(kernel)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        lower, diag, upper = (torch.randn(m, generator=g, dtype=torch.float64) + 3 for m in (9, 10, 9))
        lower[2], upper[4] = 0.0, 0.0
        lower[3], diag[4] = 0.5 * diag[3], 0.5 * upper[3]
        args = [t.to(torch.complex128) for t in (lower, diag, upper, torch.ones(10))]
        with pytest.raises(SingularMatrixError, match="singular"):
            tridiagonal_solve(*args, driver=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_stays_in_its_own_system(kernel, bad):
    runnable(kernel)
    n = 70 if kernel == "partitioned" else 5
    args = make_system(n, (4,), 2, seed=32)
    args[3][1, 2, 0] = bad
    x = tridiagonal_solve(*args, driver=kernel)
    assert not torch.isfinite(x[1]).all()
    others = [0, 2, 3]
    assert torch.isfinite(x[others]).all()
    assert_close(x[others], dense_solve(*(a[others] for a in args)))


def squared_norm(x):
    return x.abs().pow(2).sum()


def count_calls(monkeypatch, module, names):
    """Record, in order, the calls to ``module.<name>`` (with ``trans`` for the solves with
    factors, ``factor_solve`` and ``lu_solve``)."""
    calls = []
    for name in names:
        original = getattr(module, name)

        def counting(*a, _f=original, _n=name, **k):
            if _n in ("factor_solve", "lu_solve"):
                calls.append(f"{_n}({k.get('trans', a[3] if len(a) > 3 else 'N')})")
            else:
                calls.append(_n)
            return _f(*a, **k)

        monkeypatch.setattr(module, name, counting)
    return calls


LAPACK_ENTRY_POINTS = ("solve", "factor", "factor_solve")


@pytest.mark.parametrize(
    "dtype, n, batch, k",
    [(torch.float64, 6, (), None), (torch.float64, 6, (3,), 2),
     (torch.complex128, 6, (), None), (torch.complex128, 6, (3,), 2)],
    ids=["real", "real-batch", "complex", "complex-batch"])
def test_lapack_backward_solves_again_with_the_adjoint(monkeypatch, dtype, n, batch, k):
    """With LAPACK, ?gtsv factors and solves in one sweep: the backward calls it on A^H."""
    calls = count_calls(monkeypatch, lapack, LAPACK_ENTRY_POINTS)
    args = make_system(n, batch, k, dtype=dtype, requires_grad=True, seed=33)
    grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args, driver="lapack")), args)
    assert calls == ["solve", "solve"]
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_torch_kernel_backward_reuses_the_forward_factors(monkeypatch, dtype):
    """The sequential kernel factors once and solves with A (forward) then A^T or A^H (backward)."""
    calls = count_calls(monkeypatch, sequential, ("factor", "lu_solve"))
    args = make_system(6, (2,), 2, dtype=dtype, requires_grad=True, seed=34)
    grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args, driver="sequential")), args)
    assert calls == ["factor", "lu_solve(N)", "lu_solve(C)"]  # A^H (A^T for real dtypes)
    assert_grads_match_dense(grads, args, squared_norm, dtype)
    calls.clear()
    with torch.no_grad():
        tridiagonal_solve(*args, driver="sequential")
    assert calls == ["factor", "lu_solve(N)"]  # sequential.solve: no factors kept


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backward_matches_dense_on_every_kernel(kernel, dtype):
    runnable(kernel)
    n = 70 if kernel == "partitioned" else 7
    args = make_system(n, (2, 3), 2, dtype=dtype, requires_grad=True, seed=35)
    grads = torch.autograd.grad(squared_norm(tridiagonal_solve(*args, driver=kernel)), args)
    assert_grads_match_dense(grads, args, squared_norm, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_direct_backward_with_broadcast_bands_and_an_expanded_gradient(kernel):
    """x.sum() sends a stride-0 gradient; shared bands get gradients summed over the batch."""
    runnable(kernel)
    n = 70 if kernel == "partitioned" else 6
    lower, diag, upper, _ = make_system(n, (1,), seed=37)  # one matrix for the batch of 4
    rhs = torch.randn(4, n, dtype=torch.float64, generator=torch.Generator().manual_seed(38))
    args = [t.requires_grad_() for t in (lower, diag, upper, rhs)]
    grads = torch.autograd.grad(tridiagonal_solve(*args, driver=kernel).sum(), args)
    assert_grads_match_dense(grads, args, torch.sum)


@pytest.mark.parametrize("driver", [None, "lapack", "sequential"])
def test_lu_solve_with_factors_runs_no_factorisation(monkeypatch, driver):
    """Solving with factors, forward and backward, solves from them only: nothing factors again."""
    args = make_system(6, (2,), 2, requires_grad=True, seed=39)
    factors = tridiagonal_lu_factor(*args[:3], driver=driver)
    if driver == "sequential":
        module, names, solve = sequential, ("factor", "solve", "lu_solve"), "lu_solve"
    else:
        module, names, solve = lapack, LAPACK_ENTRY_POINTS, "factor_solve"
    calls = count_calls(monkeypatch, module, names)
    x = tridiagonal_lu_solve(factors, args[3], driver=driver)
    grads = torch.autograd.grad(squared_norm(x), args)
    assert calls == [f"{solve}(N)", f"{solve}(C)"]
    assert_grads_match_dense(grads, args, squared_norm)


@CUDA
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_matches_dense(dtype):
    args = [a.cuda() for a in make_system(33, (4,), 2, dtype=dtype, seed=40)]
    x = tridiagonal_solve(*args)
    assert x.device.type == "cuda"
    assert_close(x.cpu(), dense_solve(*(a.cpu() for a in args)), dtype)


@CUDA
def test_cuda_gradients_and_compile():
    args = [a.cuda().requires_grad_() for a in make_system(6, (2,), 2, seed=41)]
    assert gradcheck(tridiagonal_solve, args, check_forward_ad=True)
    loss = lambda *a: tridiagonal_solve(*a).pow(2).sum()
    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    for g, e in zip(grads, torch.autograd.grad(loss(*args), args)):
        assert_close(g, e)


@CUDA
def test_cuda_refuses_the_cpu_drivers():
    args = [a.cuda() for a in make_system(6, (2,), 2, seed=42)]
    for driver in ("lapack", "cpp"):
        with pytest.raises(ValueError, match=f"driver={driver!r} runs on CPU tensors only"):
            tridiagonal_solve(*args, driver=driver)


# ---- Chapter 5's op: one kernel per device (torch.library's register_kernel) ----------------
def test_chapter5_op_registers_a_default_and_a_cpu_kernel():
    """The op's CPU kernel is its own registration; every other device gets the default one."""
    name = "tridiag_tutorial::tridiagonal_solve"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(name, "CPU") and has(name, "CompositeExplicitAutograd")
    assert not has(name, "CUDA")  # CUDA falls through to the default (CompositeExplicitAutograd)


@pytest.mark.parametrize("driver, runs", [(None, "lapack"), ("lapack", "lapack"),
                                          ("sequential", "sequential"),
                                          ("partitioned", "partitioned")])
def test_chapter5_op_cpu_kernel_runs_lapack_unless_told(monkeypatch, driver, runs):
    seen = []
    original = kernels.solve
    monkeypatch.setattr(kernels, "solve", lambda *a: seen.append(a[7]) or original(*a))
    lower, diag, upper, rhs = make_system(7, (3,), 2, seed=4)
    x = custom_op.tridiagonal_solve_op(lower, diag, upper, rhs, driver)
    assert seen == [runs]  # the driver argument: None means LAPACK on the CPU
    assert_close(x, dense_solve(lower, diag, upper, rhs))
    seen.clear()
    custom_op.tridiagonal_solve_custom_op(lower, diag, upper, rhs, driver=driver)
    assert seen == [runs]


@pytest.mark.parametrize("n, runs", [(9, "sequential"), (70, "partitioned")])
def test_chapter5_op_default_kernel_solves_in_torch_ops(monkeypatch, n, runs):
    """The default kernel (the function under @custom_op, which CUDA and other devices get) asks
    for the torch-op kernels by size, and its answer equals the dense solve; shown on CPU
    tensors."""
    calls = count_calls(monkeypatch, lapack, ["solve"])
    seen = []
    original = kernels.solve
    monkeypatch.setattr(kernels, "solve", lambda *a: seen.append(a[7]) or original(*a))
    lower, diag, upper, rhs = make_system(n, (2,), 3, seed=5, dominant=True)
    x = custom_op.tridiagonal_solve_op._init_fn(lower, diag, upper, rhs)
    assert calls == [] and seen == [runs]  # no LAPACK call
    assert_close(x, dense_solve(lower, diag, upper, rhs))


@CUDA
def test_chapter5_op_on_cuda_uses_the_default_kernel():
    lower, diag, upper, rhs = (t.cuda() for t in make_system(9, (2,), 3, seed=6))
    x = custom_op.tridiagonal_solve_op(lower, diag, upper, rhs)
    assert x.device.type == "cuda"
    assert_close(x.cpu(), dense_solve(*(t.cpu() for t in (lower, diag, upper, rhs))))
