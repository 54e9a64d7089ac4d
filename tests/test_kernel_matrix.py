"""One matrix, every kernel (issue 23): the composition matrix of ``test_compositions.py``,
gradcheck / gradgradcheck, edge inputs, singular and non-finite systems, opcheck and the
factorization path, on LAPACK, the C++ kernel, the sequential torch kernel and the partitioned
one, at sizes on both sides of every threshold that changes the route.

Routes (``tridiag_tutorial.kernels``): the C++ kernel takes batches of >= 2 systems and one system
of n <= ``COMPILED_ONE_SYSTEM_MAX_N`` = 3000; the torch kernels take n >= ``PARTITIONED_MIN_N`` = 64
to the partitioned kernel. Each kernel's sizes include one on each side of its thresholds; the
``route`` test checks that the kernel named really ran. The slow compile modes run at one size
per kernel.
"""

import pytest
import test_compositions as comp
import torch
from torch.autograd import gradcheck, gradgradcheck

from tridiag_tutorial import (
    compiled,
    dense_solve,
    kernels,
    lapack,
    partitioned,
    torch_kernel,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)

from conftest import KERNELS, kernel_selected, load_compiled_or_skip, make_system

BIG = kernels.COMPILED_ONE_SYSTEM_MAX_N + 1
PMIN = kernels.PARTITIONED_MIN_N
# (n, batch) per kernel: both sides of the thresholds that route to it.
SIZES = {
    "lapack": [(5, ()), (PMIN + 6, (3,))],
    "cpp": [(5, ()), (PMIN + 6, (3,)), (2, (2,))],           # one system n <= 3000, a batch
    "torch-sequential": [(5, ()), (PMIN + 6, (2,))],         # n >= 64 with use_partitioned(False)
    "torch-partitioned": [(PMIN, ()), (PMIN + 6, (2,))],
}
COMPILE_SIZE = {"lapack": (5, ()), "cpp": (5, (2,)), "torch-sequential": (5, ()),
                "torch-partitioned": (PMIN + 6, ())}
# What ran: the function each kernel's solve calls.
SPIES = {"lapack": [(lapack, "solve")], "torch-partitioned": [(partitioned, "solve")],
         "torch-sequential": [(torch_kernel, "solve"), (torch_kernel, "lu_solve")]}


@pytest.fixture(params=KERNELS)
def kernel(request):
    if request.param == "cpp":
        load_compiled_or_skip()
    with kernel_selected(request.param):
        yield request.param


def size_ids():
    return [f"{k}-n{n}-b{len(b) and b[0]}" for k in KERNELS for n, b in SIZES[k]]


ALL_SIZES = [(k, n, b) for k in KERNELS for n, b in SIZES[k]]


@pytest.fixture(params=ALL_SIZES, ids=size_ids())
def sized(request):
    """``(kernel, n, batch)``, with the kernel selected."""
    name, n, batch = request.param
    if name == "cpp":
        load_compiled_or_skip()
    with kernel_selected(name):
        yield name, n, batch


def run_composition(mode, name, args):
    lower, diag, upper, rhs = args
    run = comp.MODES[mode](comp.cases(tridiagonal_solve, lower, diag, upper, rhs)[name])
    reference = comp.cases(comp.dense, lower, diag, upper, rhs)[name]
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
    _, n, batch = sized
    run_composition("eager", name, make_system(n, batch, seed=n + len(batch)))


@pytest.mark.parametrize("name", list(comp.REFERENCE))
@pytest.mark.parametrize("mode", ["compile", "compile(fullgraph)"])
def test_composition_compiled(kernel, mode, name):
    n, batch = COMPILE_SIZE[kernel]
    run_composition(mode, name, make_system(n, batch, seed=n + len(batch)))


def test_route(sized, monkeypatch):
    """The kernel named is the one that runs (forward and backward)."""
    name, n, batch = sized
    calls = []
    for tag, spies in SPIES.items():
        for module, attr in spies:
            real = getattr(module, attr)
            monkeypatch.setattr(module, attr, lambda *a, _r=real, _t=tag: calls.append(_t) or _r(*a))
    if compiled.is_loaded():
        real_op = compiled.op
        monkeypatch.setattr(compiled, "op", lambda: calls.append("cpp") or real_op())
    args = make_system(n, batch, seed=1, requires_grad=True)
    tridiagonal_solve(*args).sum().backward()
    # and under a transform (which never takes the C++ autograd op)
    torch.func.grad(lambda d: tridiagonal_solve(args[0], d, args[2], args[3]).sum())(
        args[1].detach())
    assert name in calls, (name, calls)


def test_one_system_above_the_cpp_threshold_runs_lapack(monkeypatch):
    """n = 3001, one system: LAPACK, even with the C++ kernel loaded and allowed."""
    load_compiled_or_skip()
    args = make_system(BIG, seed=2, dominant=True)
    monkeypatch.setattr(compiled, "op", lambda: pytest.fail("the C++ kernel ran"))
    with kernels.use_compiled(True):
        x = tridiagonal_solve(*args)
    torch.testing.assert_close(x, dense_solve(*args), rtol=1e-10, atol=1e-12)


def test_gradcheck(sized):
    if sized[0] == "torch-partitioned" and sized[2]:
        pytest.skip("finite differences cost 20 s here; the partitioned kernel is checked at n = 64")
    _, n, batch = sized
    n = min(n, PMIN + 1) if sized[0] == "torch-partitioned" else min(n, 12)  # finite differences
    args = make_system(n, batch, k=2, seed=3, requires_grad=True)
    assert gradcheck(tridiagonal_solve, args, check_batched_grad=True, check_forward_ad=True)


def test_gradgradcheck(sized):
    if sized[0] == "torch-partitioned" and sized[2]:
        pytest.skip("finite differences cost 20 s here; the partitioned kernel is checked at n = 64")
    _, n, batch = sized
    n = min(n, PMIN + 1) if sized[0] == "torch-partitioned" else min(n, 8)
    args = make_system(n, batch, seed=4, requires_grad=True)
    assert gradgradcheck(tridiagonal_solve, args)


def test_singular_raises(sized):
    _, n, batch = sized
    lower, diag, upper, rhs = make_system(n, batch, seed=5)
    diag[..., 0], lower[..., 0] = 0.0, 0.0  # column 0 is zero
    with pytest.raises(torch.linalg.LinAlgError, match=r"U\[0, 0\]"):
        tridiagonal_solve(lower, diag, upper, rhs)


def test_scaled_row_raises(sized):
    """Row i + 1 = row i / 2 (with the sub-diagonal making them overlap): exactly singular."""
    _, n, batch = sized
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
        tridiagonal_solve(lower, diag, upper, rhs)


def lapack_reference(lower, diag, upper, rhs):
    with kernels.use_compiled(False):
        return torch.from_numpy(lapack.solve(*(t.numpy() for t in (lower, diag, upper, rhs))))


def test_nan_stays_in_its_column_and_system(sized):
    """A NaN in one column of one system: the other columns and systems equal LAPACK's answer."""
    _, n, batch = sized
    lower, diag, upper, rhs = make_system(n, (2, *batch), k=3, seed=7)
    system = (1,) + (0,) * len(batch)
    rhs[system][n // 2, 1] = float("nan")
    x = tridiagonal_solve(lower, diag, upper, rhs)
    expected = lapack_reference(lower, diag, upper, rhs)
    finite = torch.isfinite(expected)
    assert torch.isnan(x[system][:, 1]).any() and finite.sum() >= rhs.numel() - n
    torch.testing.assert_close(x[finite], expected[finite], rtol=1e-10, atol=1e-12)


def test_edge_inputs(kernel):
    """n = 1 and 2, an empty batch, k = 0, broadcasting, non-contiguous inputs."""
    for n in (1, 2):
        args = make_system(n, (3,), seed=n)
        torch.testing.assert_close(tridiagonal_solve(*args), dense_solve(*args))
    lower, diag, upper, rhs = make_system(5, (0,), seed=8)
    assert tridiagonal_solve(lower, diag, upper, rhs).shape == (0, 5)
    lower, diag, upper, _ = make_system(5, (2,), seed=9)
    assert tridiagonal_solve(lower, diag, upper, torch.empty(2, 5, 0, dtype=torch.float64)
                             ).shape == (2, 5, 0)
    lower, diag, upper, rhs = make_system(70, (4, 3), seed=10)
    x = tridiagonal_solve(lower[0], diag, upper[:1], rhs)  # bands broadcast
    torch.testing.assert_close(x, dense_solve(lower[0].expand(4, 3, 69), diag,
                                              upper[:1].expand(4, 3, 69), rhs))
    big = make_system(70, (3, 4), seed=11)
    views = [t.transpose(0, 1) for t in big]  # non-contiguous
    torch.testing.assert_close(tridiagonal_solve(*views), dense_solve(*[v.contiguous() for v in views]))
    before = [t.clone() for t in views]
    tridiagonal_solve(*views)
    assert all(torch.equal(a, b) for a, b in zip(views, before))  # never modified


def test_opcheck(kernel):
    tk = kernel.startswith("torch")
    n = PMIN + 6 if kernel == "torch-partitioned" else 6
    lower, diag, upper, rhs = make_system(n, (2,), k=2, seed=12, requires_grad=True)
    torch.library.opcheck(torch.ops.tridiag_tutorial.solve.default,
                          (lower, diag, upper, rhs, None, None, "N", tk))
    f = tridiagonal_lu_factor(lower.detach(), diag.detach(), upper.detach())
    torch.library.opcheck(torch.ops.tridiag_tutorial.solve.default,
                          (lower, diag, upper, rhs, f.lu, f.pivots, "T", tk))
    torch.library.opcheck(torch.ops.tridiag_tutorial.lu_factor.default,
                          (lower.detach(), diag.detach(), upper.detach(), tk))


@pytest.mark.parametrize("trans", ["N", "T", "C"])
def test_factorization(sized, trans):
    _, n, batch = sized
    lower, diag, upper, rhs = make_system(n, batch, k=2, seed=13, requires_grad=True)
    f = tridiagonal_lu_factor(lower, diag, upper)
    x = tridiagonal_lu_solve(f, rhs, trans)
    dense = torch.linalg.inv(comp.to_dense(lower, diag, upper))
    m = {"N": dense, "T": dense.mT, "C": dense.mH}[trans]
    torch.testing.assert_close(x, m @ rhs, rtol=1e-9, atol=1e-11)
    grads = torch.autograd.grad(x.pow(2).sum(), (lower, diag, upper, rhs))
    expected = torch.autograd.grad((m @ rhs).pow(2).sum(), (lower, diag, upper, rhs))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-10)
    if n <= 8:
        assert gradcheck(lambda *a: tridiagonal_lu_solve(tridiagonal_lu_factor(*a[:3]), a[3], trans),
                         (lower, diag, upper, rhs), check_forward_ad=True, check_batched_grad=True)


# The probe's cases of issue 23 that each kernel must handle as LAPACK does.
def test_nan_column_does_not_weaken_another_columns_check(kernel):
    """n = 70, d[3] = 1e-20, l[2] = 0 (cond about 1e2), a NaN in column 1: column 0 as LAPACK's
    (the partitioned kernel returned a relative error of 3.9e2)."""
    lower, diag, upper, rhs = make_system(70, k=2, seed=14)
    diag[3], lower[2] = 1e-20, 0.0
    rhs[5, 1] = float("nan")
    x = tridiagonal_solve(lower, diag, upper, rhs)
    torch.testing.assert_close(x[:, 0], lapack_reference(lower, diag, upper, rhs)[:, 0],
                               rtol=1e-10, atol=1e-12)


def test_nan_on_the_diagonal_above_a_zero_subdiagonal(sized):
    """One system of the batch has diag[0] = NaN and lower[0] = 0: LAPACK returns NaN for it and
    the others' answers (the C++ kernel raised "singular ... in batch element (2,)")."""
    _, n, batch = sized
    if n < 2:
        pytest.skip("needs a sub-diagonal")
    lower, diag, upper, rhs = make_system(n, (4, *batch), seed=15)
    system = (2,) + (0,) * len(batch)
    diag[system][0], lower[system][0] = float("nan"), 0.0
    expected = lapack_reference(lower, diag, upper, rhs.unsqueeze(-1)).squeeze(-1)
    x = tridiagonal_solve(lower, diag, upper, rhs)
    torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("row", [9, 10, 31, 32])
def test_scaled_row_at_a_block_boundary_raises(kernel, row):
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
        tridiagonal_solve(lower, diag, upper, rhs)
