"""The partitioned kernel: dense references (pivoting included), its breakdowns and their fallback,
the operation count that pins O(log n), and the op's compositions on it."""

import functools

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from tridiag_tutorial import (
    SingularMatrixError,
    functions,
    kernels,
    tridiag_matmul,
    tridiagonal_solve,
)
from tridiag_tutorial.kernels import partitioned, sequential
from tridiag_tutorial.reference import dense_solve

from conftest import (
    ALL_DTYPES,
    assert_close,
    assert_grads_match_dense,
    make_system,
    torch_ops_driver,
)

N = kernels.PARTITIONED_MIN_N + 6  # a size a GPU's automatic choice sends to the partitioned kernel
on_partitioned = functools.partial(tridiagonal_solve, driver="partitioned")


@pytest.fixture
def no_fallback(monkeypatch):
    """The sequential kernel's solve (the fallback) must not run: the partitioned result stands."""
    monkeypatch.setattr(sequential, "solve", lambda *a: pytest.fail("the fallback ran"))


@pytest.fixture
def fallbacks(monkeypatch):
    calls, original = [], sequential.solve
    monkeypatch.setattr(sequential, "solve", lambda *a: calls.append(1) or original(*a))
    return calls


def dense(lower, diag, upper, rhs):
    """The dense reference, one system at a time: on torch 2.13's CPU build, once
    torch.set_num_threads has been called (the benchmark tests do), a *batched*
    torch.linalg.solve of n >= 500 can fail inside oneMKL ("Pivots given to lu_solve must all be
    greater or equal to 1"); unbatched solves do not."""
    batch = diag.shape[:-1]
    flat = [t.reshape(-1, *t.shape[len(batch):]) for t in (lower, diag, upper, rhs)]
    return torch.stack([dense_solve(*system) for system in zip(*flat)]).reshape(rhs.shape)


def backward_error(lower, diag, upper, rhs, x):
    A = torch.diag_embed(diag) + torch.diag_embed(lower, -1) + torch.diag_embed(upper, 1)
    residual = (A @ x - rhs).abs().flatten(-2).amax(-1)
    norm_a = A.abs().sum(-1).amax(-1)
    return residual / (norm_a * x.abs().flatten(-2).amax(-1) + rhs.abs().flatten(-2).amax(-1))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [23, 64, 65, 100, 1000])
@pytest.mark.parametrize("batch, k", [((), 1), ((3,), 2), ((2, 2), 1)], ids=["one", "batch", "2d"])
def test_matches_dense(no_fallback, dtype, n, batch, k):
    """Not diagonally dominant (pivoting inside the blocks matters), every dtype, batches."""
    lower, diag, upper, rhs = make_system(n, batch, k, dtype=dtype, seed=n + k)
    inputs = [t.clone() for t in (lower, diag, upper, rhs)]
    x = partitioned.solve(lower, diag, upper, rhs)
    assert_close(x, dense(lower, diag, upper, rhs), dtype)
    for t, before in zip((lower, diag, upper, rhs), inputs):
        assert torch.equal(t, before)  # inputs unchanged


@pytest.mark.parametrize("block", [2, 3, 4, 8, 31])
@pytest.mark.parametrize("n", [70, 333])
def test_every_block_size_and_ragged_n(no_fallback, block, n):
    """Any block size, and n that fills no whole number of blocks (the padding rows)."""
    args = make_system(n, (2,), 3, seed=block)
    x = partitioned.solve(*args, block=block)
    assert_close(x, dense(*args))
    assert len(partitioned.levels(n, block)) >= 2  # it did partition


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [500, 1002])
def test_zero_diagonal_needs_pivoting_at_every_step(no_fallback, dtype, n):
    """Diagonal exactly zero, off-diagonals near 1 (condition number about n; n even, since a
    tridiagonal matrix of odd order with a zero diagonal is singular): elimination without
    pivoting would divide by zero at its first step."""
    lower, _, upper, rhs = make_system(n, (2,), 1, dtype=dtype, seed=5)
    phase = torch.tensor(0.6 + 0.8j) if dtype.is_complex else torch.tensor(1.0)
    lower, upper = ((1 + 0.1 * t.abs()) * phase.to(dtype) for t in (lower, upper))
    diag = torch.zeros(2, n, dtype=dtype)
    x = partitioned.solve(lower, diag, upper, rhs)
    eps = torch.finfo(dtype).eps
    assert backward_error(lower, diag, upper, rhs, x).max() < 100 * eps
    assert_close(x, dense(lower, diag, upper, rhs), dtype)


def singular_block_system(n=N):
    """Nonsingular A whose first block (rows 0-3 with BLOCK = 4) is singular: its last row has
    no entry inside the block, only the coupling to the separator, row 4."""
    lower, diag, upper, rhs = make_system(n, (3,), 1, seed=7)
    lower[1, 2], diag[1, 3] = 0.0, 0.0  # system 1, block 0, row 3: only A[3, 4] is left
    return lower, diag, upper, rhs


def test_singular_block_of_a_nonsingular_matrix_falls_back(fallbacks):
    lower, diag, upper, rhs = singular_block_system()
    assert torch.linalg.matrix_rank(torch.diag_embed(diag[1]) + torch.diag_embed(lower[1], -1)
                                    + torch.diag_embed(upper[1], 1)) == N
    x = partitioned.solve(lower, diag, upper, rhs)
    assert fallbacks == [1]
    assert_close(x, dense(lower, diag, upper, rhs))


def test_nearly_singular_block_is_refined_or_falls_back():
    """A block with a pivot of 1e-13: the spikes blow up and so would the error of the unrefined
    solve; refinement (or the fallback to the sequential kernel) gives the accurate answer."""
    lower, diag, upper, rhs = singular_block_system()
    diag[1, 3] = 1e-13
    unchecked = partitioned.solve_unchecked(lower, diag, upper, rhs, partitioned.BLOCK)
    assert backward_error(lower, diag, upper, rhs, unchecked)[1] > 1e3 * torch.finfo(torch.float64).eps
    x = partitioned.solve(lower, diag, upper, rhs)
    assert backward_error(lower, diag, upper, rhs, x).max() < 100 * torch.finfo(x.dtype).eps
    assert_close(x, dense(lower, diag, upper, rhs))


def test_singular_matrix_raises_through_the_fallback():
    lower, diag, upper, rhs = make_system(N, (2, 3), 1, seed=8)
    diag[1, 0, 40], lower[1, 0, 40], upper[1, 0, 39] = 0.0, 0.0, 0.0  # column 40 is zero
    with pytest.raises(SingularMatrixError,
                       match=r"singular: pivot U\[40, 40\] is exactly zero, in batch element \(1, 0\)$") as err:
        partitioned.solve(lower, diag, upper, rhs)
    assert err.value.pivot == 40 and err.value.batch_index == (1, 0)


def half_row_singular(n, i, g):
    """Random float64 bands of an exactly singular A: row i + 1 is half of row i (both keep only
    columns i and i + 1)."""
    lower = torch.randn(n - 1, generator=g, dtype=torch.float64) + 3
    diag = torch.randn(n, generator=g, dtype=torch.float64) + 3
    upper = torch.randn(n - 1, generator=g, dtype=torch.float64)
    lower[i - 1], upper[i + 1] = 0.0, 0.0
    lower[i], diag[i + 1] = 0.5 * diag[i], 0.5 * upper[i]
    return lower, diag, upper


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128], ids=str)
@pytest.mark.parametrize("rhs_kind", ["ones", "one-large-entry", "zero", "in-the-range"])
@pytest.mark.parametrize("n", [64, 300])
def test_singular_matrix_without_an_exact_zero_pivot_raises(n, rhs_kind, dtype):
    """Row i + 1 is exactly half of row i: LAPACK and the sequential kernel meet an exact zero
    pivot; the partitioned kernel's reduced systems meet a pivot of round-off instead (for some
    rows i), and its answer is enormous, or, for a right-hand side that is zero or in the range
    of A, one of many. The probe's solution shows A is singular, whatever the right-hand side."""
    g = torch.Generator().manual_seed(n)
    for i in range(2, n - 2, max(1, n // 40)):
        lower, diag, upper = half_row_singular(n, i, g)
        rhs = torch.ones(n, 1, dtype=torch.float64)
        if rhs_kind == "one-large-entry":  # max|b| far from the singular rows
            rhs[0 if i > n // 2 else n - 1] = 1e3
        elif rhs_kind == "zero":
            rhs = torch.zeros_like(rhs)
        elif rhs_kind == "in-the-range":
            rhs = tridiag_matmul(lower, diag, upper, torch.randn(n, 1, generator=g, dtype=torch.float64))
        lower, diag, upper, rhs = (t.to(dtype) for t in (lower, diag, upper, rhs))
        with pytest.raises(SingularMatrixError, match="singular"):
            partitioned.solve(lower, diag, upper, rhs)


def test_each_column_is_checked_on_its_own():
    """A block singular up to round-off (cond(A) about 1e3): the partitioned answer of a column
    of size 1 is wrong in the third digit, and a column of size 1e15 beside it must not hide
    that from the check (which then falls back)."""
    n = 200
    g = torch.Generator().manual_seed(0)
    lower, upper = (torch.randn(n - 1, generator=g, dtype=torch.float64) for _ in range(2))
    diag = torch.randn(n, generator=g, dtype=torch.float64)
    f1 = diag[0]
    f2 = diag[1] * f1 - lower[0] * upper[0]
    f3 = diag[2] * f2 - lower[1] * upper[1] * f1
    diag[3] = lower[2] * upper[2] * f2 / f3  # det(A[:4, :4]) = 0 up to round-off
    big = torch.randn(n, 1, generator=g, dtype=torch.float64) * 1e15
    big[:12] = 0
    rhs = torch.cat([tridiag_matmul(lower, diag, upper, big),
                     torch.randn(n, 1, generator=g, dtype=torch.float64)], dim=-1)
    expected = dense(lower, diag, upper, rhs)
    unchecked = partitioned.solve_unchecked(lower, diag, upper, rhs, partitioned.BLOCK)
    premise = (unchecked[:, 1] - expected[:, 1]).abs().max() / expected[:, 1].abs().max()
    assert premise > 1e-6  # without the check, column 1 would be wrong
    x = partitioned.solve(lower, diag, upper, rhs)
    for column in range(2):
        error = (x[:, column] - expected[:, column]).abs().max() / expected[:, column].abs().max()
        assert error < 1e-11, (column, error)


def test_an_enormous_unchecked_answer_is_what_the_check_catches():
    """The premise of the test above, for one case: without the check the answer is wrong."""
    n = 64
    g = torch.Generator().manual_seed(0)
    found = False
    for i in range(2, n - 2):
        lower, diag, upper = half_row_singular(n, i, g)
        x = partitioned.solve_unchecked(lower, diag, upper, torch.ones(n, 1, dtype=torch.float64), 4)
        found |= bool(torch.isfinite(x).all() and x.abs().max() > 1e14)
    assert found


def test_huge_finite_entries_do_not_overflow_the_check(no_fallback):
    """Entries near the largest float64: the check's norms must not overflow to inf or NaN."""
    lower, diag, upper, rhs = make_system(N, (2,), 1, seed=18, dominant=True)
    scale = 1e307
    x = partitioned.solve(lower * scale, diag * scale, upper * scale, rhs)
    assert torch.isfinite(x).all()
    assert_close(x * scale, dense(lower, diag, upper, rhs))


def test_badly_scaled_halves_are_each_solved_accurately():
    """Two decoupled halves, one scaled by 1e-12 and with a nearly singular block: a normwise
    check would not see the small half's error; the row-wise check does (and falls back)."""
    lower, diag, upper, rhs = make_system(200, (), 1, seed=19)
    lower[99], upper[99] = 0.0, 0.0  # rows < 100 and >= 100 decouple
    diag[3] = 1e-12  # with lower[2] = 0: block 0 nearly singular
    lower[2] = 0.0
    lower[:99], upper[:99], diag[:100] = lower[:99] * 1e-12, upper[:99] * 1e-12, diag[:100] * 1e-12
    x = partitioned.solve(lower, diag, upper, rhs)
    for half in (slice(0, 100), slice(100, 200)):
        l_h = lower[half][:-1] if half.start == 0 else lower[half.start:]
        u_h = upper[half][:-1] if half.start == 0 else upper[half.start:]
        expected = dense_solve(l_h, diag[half], u_h, rhs[half])
        assert_close(x[half], expected)


@pytest.mark.parametrize("shape", [(N, 0), (0, N, 2), (3, 0, N, 0)], ids=["k=0", "no-systems", "both"])
def test_empty_inputs(shape, no_fallback):
    *batch, n, k = shape
    # a seeded, diagonally dominant A: with k = 0 the probes still run (a singular A raises),
    # and an unseeded random A could fail their checks and fall back
    g = torch.Generator().manual_seed(3)
    lower, upper = (torch.randn(*batch, n - 1, generator=g) for _ in range(2))
    diag = 4 + torch.rand(*batch, n, generator=g)
    x = partitioned.solve(lower, diag, upper, torch.randn(shape))
    assert x.shape == shape
    assert on_partitioned(lower, diag, upper, torch.randn(shape)).shape == shape


@pytest.mark.parametrize("n", [11, 12, 13, 22])
def test_smallest_sizes_that_partition(no_fallback, n):
    assert len(partitioned.levels(n)) == 2
    args = make_system(n, (2,), 2, seed=n)
    assert_close(partitioned.solve(*args), dense(*args))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_stays_in_its_own_system(no_fallback, bad):
    lower, diag, upper, rhs = make_system(N, (4,), 2, seed=9)
    rhs[1, 30, 0] = bad
    x = partitioned.solve(lower, diag, upper, rhs)
    assert not torch.isfinite(x[1]).all()
    others = [0, 2, 3]
    assert_close(x[others], dense(lower[others], diag[others], upper[others], rhs[others]))


def test_zero_rhs_gives_zero_without_fallback(no_fallback):
    lower, diag, upper, rhs = make_system(N, (), 1, seed=10)
    assert torch.equal(partitioned.solve(lower, diag, upper, torch.zeros_like(rhs)),
                       torch.zeros_like(rhs))


def test_block_must_be_at_least_two():
    with pytest.raises(ValueError, match="block must be at least 2"):
        partitioned.solve(*make_system(N, (), 1), block=1)


def count_ops(fn, *args):
    from tridiag_tutorial.bench import benchmarks

    return benchmarks._count_operations(lambda: fn(*args))


def test_operation_count_grows_like_log_n():
    """Counted with a dispatch mode, not timed: from n = 1e4 to 1e5 the sequential kernel's
    count grows tenfold; the partitioned one's by one level of the recursion."""
    counts = {n: count_ops(partitioned.solve, *make_system(n, (), 1, seed=n, dominant=True))
              for n in (10**4, 10**5)}
    assert counts[10**5] <= 1.5 * counts[10**4]
    assert counts[10**5] < 4000  # about 30 operations per row: the sequential kernel'd need 3e6
    one_chain = count_ops(sequential.solve, *make_system(100, (), 1, seed=1))
    assert one_chain > 30 * 100  # the premise: O(n) for the sequential kernel


def test_operation_count_through_the_op_forward_and_backward(monkeypatch):
    """The public op on the torch kernels, forward and backward of all four inputs, n = 1e5:
    the operations of its kernel calls (counted inside them: a dispatch mode around the whole
    call would see each custom op as one operation)."""
    from tridiag_tutorial.bench import benchmarks

    counts, original = [], functions._kernel  # kernels.solve

    def counting(*a):
        with benchmarks.CountOperations() as counter:
            x = original(*a)
        counts.append(counter.count)
        return x

    monkeypatch.setattr(functions, "_kernel", counting)
    args = make_system(10**5, (), 1, seed=11, dominant=True, requires_grad=True)
    x = tridiagonal_solve(*args, driver=torch_ops_driver(10**5))
    torch.autograd.grad(x.square().sum(), args)
    assert len(counts) == 2  # the forward's solve, and the backward's with A^T
    assert all(1000 < c < 4000 for c in counts), counts


def test_the_torch_ops_choice_goes_by_size(monkeypatch):
    """The driver a GPU gets (conftest.torch_ops_driver: kernels.choose_driver for "cuda") is the
    partitioned kernel from PARTITIONED_MIN_N on; a CPU solve with driver=None never runs it."""
    calls, original = [], partitioned.solve
    monkeypatch.setattr(partitioned, "solve",
                        lambda *a: calls.append(a[1].shape[-1]) or original(*a))
    for n in (kernels.PARTITIONED_MIN_N - 1, kernels.PARTITIONED_MIN_N):
        args = make_system(n, (2,), 1, seed=n)
        assert torch_ops_driver(n) == ("sequential" if n < kernels.PARTITIONED_MIN_N else "partitioned")
        assert_close(tridiagonal_solve(*args, driver=torch_ops_driver(n)), dense(*args))
        tridiagonal_solve(*args)  # LAPACK or the C++ kernel, on the CPU by default
    assert calls == [kernels.PARTITIONED_MIN_N]


def test_sequential_driver_keeps_the_sequential_kernel(monkeypatch):
    """driver="sequential" at a size the automatic choice would partition: forward, backward
    and compiled, the partitioned kernel never runs."""
    monkeypatch.setattr(partitioned, "solve", lambda *a: pytest.fail("the partitioned kernel ran"))
    args = make_system(N, (2,), 1, seed=16, requires_grad=True)
    x = tridiagonal_solve(*args, driver="sequential")
    grads = torch.autograd.grad(x.square().sum(), args)
    compiled = torch.compile(lambda *a: tridiagonal_solve(*a, driver="sequential").square().sum(),
                             fullgraph=True)
    assert_close(torch.autograd.grad(compiled(*args), args)[1], grads[1])
    assert_grads_match_dense(grads, args, lambda x: x.square().sum())


def test_backward_solves_with_the_adjoint_on_the_partitioned_kernel(monkeypatch):
    """No factors are kept for the partitioned kernel: the backward solves A^H v = g with it."""
    calls, original = [], partitioned.solve
    monkeypatch.setattr(partitioned, "solve", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(sequential, "factor", lambda *a: pytest.fail("factored"))
    args = make_system(N, (2,), 2, dtype=torch.complex128, requires_grad=True, seed=12)
    loss = lambda x: x.abs().square().sum()
    grads = torch.autograd.grad(loss(on_partitioned(*args)), args)
    assert calls == [1, 1]
    assert_grads_match_dense(grads, args, loss)


def test_gradcheck_forward_ad_and_second_order_on_the_partitioned_kernel():
    args = make_system(N, (2,), 2, seed=13, requires_grad=True)
    assert gradcheck(on_partitioned, args, check_forward_ad=True, check_batched_grad=True)
    assert gradgradcheck(on_partitioned, args)


def test_torch_func_on_the_partitioned_kernel():
    lower, diag, upper, rhs = make_system(N, (), None, seed=14)
    f = lambda d: on_partitioned(lower, d, upper, rhs).square().sum()
    f_dense = lambda d: dense_solve(lower, d, upper, rhs).square().sum()
    assert_close(grad(f)(diag), grad(f_dense)(diag))
    x_of = lambda d: on_partitioned(lower, d, upper, rhs)
    x_dense = lambda d: dense_solve(lower, d, upper, rhs)
    assert_close(jacrev(x_of)(diag), jacrev(x_dense)(diag))
    assert_close(jacfwd(x_of)(diag), jacrev(x_dense)(diag))
    t = torch.ones_like(diag)
    assert_close(jvp(x_of, (diag,), (t,))[1], jvp(x_dense, (diag,), (t,))[1])
    assert_close(hessian(f)(diag), hessian(f_dense)(diag))
    diags = diag + torch.linspace(0, 0.1, 3, dtype=diag.dtype)[:, None]
    assert_close(vmap(grad(f))(diags), vmap(grad(f_dense))(diags))


def test_compiled_on_the_partitioned_kernel(monkeypatch):
    calls, original = [], partitioned.solve
    monkeypatch.setattr(partitioned, "solve", lambda *a: calls.append(1) or original(*a))
    args = make_system(N, (2,), 1, seed=15, requires_grad=True)
    loss = lambda *a: on_partitioned(*a).square().sum()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(*args)
    assert explanation.graph_break_count == 0
    calls.clear()
    torch._dynamo.reset()
    value = torch.compile(loss, fullgraph=True)(*args)
    grads = torch.autograd.grad(value, args)
    assert calls == [1, 1]  # forward, and the backward's solve with A^T
    assert_grads_match_dense(grads, args, lambda x: x.square().sum())


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@CUDA
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_partitioned_matches_dense_with_gradients(dtype):
    args = make_system(1000, (3,), 2, dtype=dtype, seed=17)
    on_gpu = [a.cuda().requires_grad_() for a in args]
    x = tridiagonal_solve(*on_gpu)
    assert x.device.type == "cuda"
    assert_close(x.detach().cpu(), dense(*args), dtype)
    grads = torch.autograd.grad(x.abs().square().sum(), on_gpu)
    expected = torch.autograd.grad(dense(*(a.requires_grad_() for a in args)).abs().square().sum(),
                                   args)
    for g, e in zip(grads, expected):
        assert_close(g.cpu(), e, dtype)


def test_solve_ex_says_whether_it_fell_back():
    """partitioned.solve_ex: the answer and whether the sequential kernel gave it (the accuracy
    harness counts fallbacks with it); solve is its answer alone."""
    system = make_system(200, (), 1, seed=3, dominant=True)
    x, fell_back = partitioned.solve_ex(*system)
    assert fell_back is False and torch.equal(x, partitioned.solve(*system))
    system = singular_block_system()
    x, fell_back = partitioned.solve_ex(*system)
    assert fell_back is True
    assert_close(x, dense(*system))


def test_probes_are_built_on_the_device_without_a_host_tensor(monkeypatch):
    # The probes' entries are 2 frac(i s) - 1 for s the golden ratio and sqrt(2) (mod 1). A
    # tensor built from Python numbers would be a blocking host-to-device copy on a GPU, on every
    # checked solve: _probe must not call torch.tensor.
    n = 7
    i = [float(k) for k in range(1, n + 1)]
    expected = torch.tensor([[2 * ((k * 0.6180339887498949) % 1) - 1, 2 * ((k * 0.4142135623730951) % 1) - 1]
                             for k in i], dtype=torch.float64)

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("_probe built a tensor from host data")

    rhs = torch.zeros(3, n, 1, dtype=torch.float32)
    monkeypatch.setattr(partitioned.torch, "tensor", no_host_tensor)
    probes = partitioned._probe(rhs)
    monkeypatch.undo()
    assert probes.shape == (3, n, 2) and probes.dtype == torch.float32
    torch.testing.assert_close(probes[1].double(), expected.float().double(), rtol=0, atol=0)
