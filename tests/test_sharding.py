"""DTensor inputs: the sharding rules of :mod:`tridiag_tutorial.distributed.sharding`.

The multi-process checks spawn ``gloo`` processes on the CPU (world sizes 2 and 4), build a
``DeviceMesh`` of all ranks and call the public functions on DTensors: each result must equal the
single-process solve of the full tensors (and the dense reference), come back with the placements
that the rules promise, and need no collective where none is needed (a dispatch mode counts
them: a batch- or column-sharded solve and its backward are local on every rank). What the rules
do not list (the system dimension ``n`` sharded) is redistributed by DTensor: the answer must be
right all the same. Each world size is one spawned job that runs every check in turn, and a
worker's failure re-raises here with its traceback (``join=True``); every collective has a 60 s
timeout, so a rank that fails cannot leave the others waiting for ever.

The checks run on every rank alike (every rank calls ``full_tensor()``, a collective, and every
rank asserts), so that an assertion never leaves one rank behind in a collective.
"""

import datetime
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tridiag_tutorial import tridiagonal_lu_factor, tridiagonal_lu_solve, tridiagonal_solve
from tridiag_tutorial.book.multiprocess import free_port
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, make_system

TIMEOUT = datetime.timedelta(seconds=60)  # every collective's, so that a failing rank cannot hang
N = 7  # the system size: odd, so that sharding n (and n - 1) is uneven too
NO_STRATEGY = "Operator tridiag_tutorial.{op}.default does not have a sharding strategy registered."


# ---------------------------------------------------------------------------------------------
# Spawning: the workers live at module level, so that the spawned interpreters can import them.
# ---------------------------------------------------------------------------------------------
def spawn(worker, world: int, *args) -> None:
    """Run ``worker(rank, world, port, *args)`` on ``world`` fresh processes; a worker's exception
    is raised here (``torch.multiprocessing.ProcessRaisedException``, with its traceback)."""
    mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # world sizes up to 4 on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)


def _finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The checks, run on every rank of a mesh.
# ---------------------------------------------------------------------------------------------
class Collectives(TorchDispatchMode):
    """Counts the collectives that run inside it (what DTensor's redistribution dispatches: the ops
    of ``torch.ops._c10d_functional`` and its relatives), as
    ``torch.distributed.tensor.debug.CommDebugMode`` does (which imports Inductor: over a
    second per process). A mode sees an op before a tensor subclass does, so it passes the
    ops on DTensors to DTensor and counts what DTensor runs on the local tensors. The checks
    of the ``n``-sharded cases, which must redistribute, show that it sees them."""

    NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if DTensor in types:  # let DTensor turn the op into local ops and collectives first
            return NotImplemented
        if func.namespace in self.NAMESPACES:
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.ops)


def _placed(mesh, tensors, placements, requires_grad=False):
    """DTensors of the (full, identical on every rank) ``tensors``, laid out by ``placements``
    (one placement list per tensor: one placement per mesh dimension)."""
    from torch.distributed.tensor import distribute_tensor

    return [distribute_tensor(t, mesh, list(p)).requires_grad_(requires_grad)
            for t, p in zip(tensors, placements)]


def _weights(shape, dtype, seed):
    """The weights of the weighted sum ``(x * w).sum()`` whose gradient the checks compare: the
    same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        w = torch.complex(w, torch.randn(shape, generator=g, dtype=torch.float64))
    return w.to(dtype)


def _reference_grads(solve, system, weights):
    leaves = [t.detach().clone().requires_grad_() for t in system]
    loss = (solve(*leaves) * weights.conj()).real.sum()
    return torch.autograd.grad(loss, leaves)


def check_solve(mesh, name, system, placements, expected, *, driver=None, seed=0):
    """One solve on DTensors, forward and backward.

    ``system`` is the plain ``(lower, diag, upper, rhs)``; ``placements`` gives one placement list
    per tensor. ``expected`` is the output's placements when a rule applies (then neither the
    forward nor the backward may run a collective), or ``None`` when no rule applies and DTensor
    must redistribute (then the forward runs at least one collective, the answer is still right,
    and the output is not left sharded on the system dimension)."""
    from torch.distributed.tensor import DTensor, Shard

    inputs = _placed(mesh, system, placements, requires_grad=True)
    with Collectives() as comm:
        x = tridiagonal_solve(*inputs, driver=driver)
    forward_comms = comm.count
    assert isinstance(x, DTensor), f"{name}: the result is a {type(x).__name__}, not a DTensor"
    expected_x = tridiagonal_solve(*system, driver=driver)
    full = x.full_tensor()
    assert full.shape == expected_x.shape, f"{name}: shape {full.shape}, not {expected_x.shape}"
    assert_close(full, expected_x)
    assert_close(full, dense_solve(*system))
    if expected is not None:
        assert tuple(x.placements) == tuple(expected), (
            f"{name}: output placements {x.placements}, expected {expected}")
        assert forward_comms == 0, f"{name}: the forward ran {comm.ops}"
    else:
        assert forward_comms > 0, f"{name}: no rule applies, yet nothing was redistributed"
        vector_rhs = system[3].ndim == system[1].ndim
        n_dim = system[3].ndim - (1 if vector_rhs else 2)
        assert Shard(n_dim) not in x.placements, f"{name}: output sharded on n: {x.placements}"

    # Backward of a weighted sum, the weights laid out as x: the gradients of all four inputs.
    weights = _weights(system[3].shape, system[3].dtype, seed)
    w = _placed(mesh, [weights], [x.placements])[0]
    with Collectives() as comm:
        grads = torch.autograd.grad((x * w.conj()).real.sum(), inputs)
    if expected is not None:
        assert comm.count == 0, f"{name}: the backward ran {comm.ops}"
    expected_grads = _reference_grads(lambda *a: tridiagonal_solve(*a, driver=driver), system,
                                      weights)
    dense_grads = _reference_grads(dense_solve, system, weights)
    for arg, g, e, d in zip(("lower", "diag", "upper", "rhs"), grads, expected_grads, dense_grads):
        assert isinstance(g, DTensor), f"{name}: the gradient of {arg} is not a DTensor"
        g = g.full_tensor()
        assert g.shape == e.shape, f"{name}: grad {arg} shape {g.shape}, not {e.shape}"
        assert_close(g, e)
        assert_close(g, d)
    return x


def check_factorization(mesh, name, system, band_placement, rhs_placement, expected,
                        lu_expected):
    """``tridiagonal_lu_factor`` on DTensor bands and ``tridiagonal_lu_solve`` (``'N'`` and
    ``'T'``) from the factors, forward and backward (through the factors to the bands, and to
    ``rhs``). ``expected``: the solution's placements; ``lu_expected``: the factors'; ``None``
    where DTensor must redistribute."""

    lower, diag, upper, rhs = system
    bands = _placed(mesh, (lower, diag, upper), [band_placement] * 3, requires_grad=True)
    (b,) = _placed(mesh, [rhs], [rhs_placement], requires_grad=True)
    with Collectives() as comm:
        factors = tridiagonal_lu_factor(*bands)
    plain = tridiagonal_lu_factor(lower, diag, upper)
    if lu_expected is not None:
        assert comm.count == 0, f"{name}: factoring ran {comm.ops}"
        assert tuple(factors.lu.placements) == tuple(lu_expected), (
            f"{name}: lu placements {factors.lu.placements}, expected {lu_expected}")
        assert tuple(factors.pivots.placements) == tuple(lu_expected), (
            f"{name}: pivots placements {factors.pivots.placements}, expected {lu_expected}")
    assert torch.equal(factors.pivots.full_tensor(), plain.pivots), f"{name}: pivots differ"
    assert_close(factors.lu.full_tensor(), plain.lu)

    for trans in ("N", "T"):
        with Collectives() as comm:
            x = tridiagonal_lu_solve(factors, b, trans)
        assert_close(x.full_tensor(), tridiagonal_lu_solve(plain, rhs, trans))
        if expected is not None:
            assert tuple(x.placements) == tuple(expected), (
                f"{name} trans={trans}: output placements {x.placements}, expected {expected}")
            assert comm.count == 0, (
                f"{name} trans={trans}: the solve ran {comm.ops}")

    x = tridiagonal_lu_solve(factors, b)
    weights = _weights(rhs.shape, rhs.dtype, 1)
    w = _placed(mesh, [weights], [x.placements])[0]
    grads = torch.autograd.grad((x * w).sum(), [*bands, b])

    def from_factors(lo, d, up, r):
        return tridiagonal_lu_solve(tridiagonal_lu_factor(lo, d, up), r)

    for arg, g, e, d in zip(("lower", "diag", "upper", "rhs"), grads,
                            _reference_grads(from_factors, system, weights),
                            _reference_grads(dense_solve, system, weights)):
        assert_close(g.full_tensor(), e)
        assert_close(g.full_tensor(), d)


def run_checks(mesh, world: int) -> None:
    """Every placement case on a 1-D mesh of ``world`` ranks. The batch sizes are chosen so that
    each sharded dimension has at least ``world`` entries, some of them uneven (5 on 2 or 4
    ranks)."""
    from torch.distributed.tensor import Replicate, Shard

    R = [Replicate()]

    def S(d):
        return [Shard(d)]

    two_d = (world, world + 1)  # dim 0 even, dim 1 uneven on `world` ranks
    system = make_system(N, two_d, 3, seed=1)
    check_solve(mesh, "replicated", system, [R] * 4, R)
    check_solve(mesh, "batch dim 0", system, [S(0)] * 4, S(0))
    check_solve(mesh, "batch dim 1", system, [S(1)] * 4, S(1))
    uneven = make_system(N, (5,), 2, seed=2)
    check_solve(mesh, "uneven batch", uneven, [S(0)] * 4, S(0))
    columns = make_system(N, (3,), world + 1, seed=3)  # k = world + 1: uneven columns
    check_solve(mesh, "rhs columns", columns, [R, R, R, S(2)], S(2))
    check_solve(mesh, "rhs columns, one system", make_system(N, (), 2 * world, seed=4),
                [R, R, R, S(1)], S(1))
    vector = make_system(N, (5,), None, seed=5)
    check_solve(mesh, "vector rhs, batch", vector, [S(0)] * 4, S(0))
    # Mixed placements that a rule covers once a replicated input is sliced locally (free).
    check_solve(mesh, "replicated bands, batch-sharded rhs", system, [R, R, R, S(0)], S(0))
    lo, d, up, rhs = make_system(N, (1,), 2, seed=7)
    rhs = make_system(N, (world + 1,), 2, seed=8)[3]
    check_solve(mesh, "broadcast bands", (lo, d, up, rhs), [R, R, R, S(0)], S(0))
    # n sharded: no rule, DTensor redistributes (to a rule's placements) and the answer is right.
    check_solve(mesh, "n sharded everywhere", system, [S(2), S(2), S(2), S(2)], None)
    check_solve(mesh, "n sharded on diag", system, [R, S(2), R, R], None)
    check_solve(mesh, "n sharded on rhs", system, [R, R, R, S(2)], None)
    check_solve(mesh, "n sharded on a vector rhs", vector, [R, R, R, S(1)], None)

    check_factorization(mesh, "factors, batch dim 0", system, S(0), S(0), S(0), S(0))
    check_factorization(mesh, "factors, batch dim 1", system, S(1), S(1), S(1), S(1))
    check_factorization(mesh, "factors, uneven batch", uneven, S(0), S(0), S(0), S(0))
    check_factorization(mesh, "factors replicated, rhs columns", columns, R, S(2), S(2), R)
    check_factorization(mesh, "factors, n sharded", system, S(2), S(2), None, None)


def run_other_checks(mesh, world: int) -> None:
    """What does not depend on the number of ranks (run on 2): another kernel, complex numbers,
    broadcasting the factors, a plain tensor among DTensors, and ``torch.func`` transforms over
    DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    R, S0 = [Replicate()], [Shard(0)]
    system = make_system(N, (world, world + 1), 3, seed=1)
    check_solve(mesh, "sequential kernel (it factors)", system, [S0] * 4, S0, driver="sequential")
    check_solve(mesh, "complex128", make_system(N, (world,), 2, dtype=torch.complex128, seed=6),
                [S0] * 4, S0)
    # Factors of one matrix, rhs with a longer batch (the factors are expanded).
    lo, d, up, rhs = make_system(N, (1,), 2, seed=9)
    rhs = make_system(N, (world + 1,), 2, seed=10)[3]
    factors = tridiagonal_lu_factor(*_placed(mesh, (lo, d, up), [R] * 3))
    (b,) = _placed(mesh, [rhs], [S0])
    x = tridiagonal_lu_solve(factors, b)
    assert tuple(x.placements) == tuple(S0), f"broadcast factors: {x.placements}"
    assert_close(x.full_tensor(), dense_solve(lo, d, up, rhs))

    # A plain tensor beside DTensors: DTensor's own error, never a result.
    lo, d, up, rhs = system
    dt = _placed(mesh, system, [R] * 4)
    for i in range(4):
        mixed = [system[j] if j == i else dt[j] for j in range(4)]
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            tridiagonal_solve(*mixed)

    # torch.func transforms over DTensors made outside them: out of scope, but never wrong.
    lo, d, up, rhs = _placed(mesh, system, [S0] * 4)

    def loss(diag):
        return (tridiagonal_solve(lo, diag, up, rhs) * rhs).sum()

    g = torch.func.grad(loss)(d)
    expected = torch.func.grad(lambda diag: (tridiagonal_solve(system[0], diag, system[2],
                                                               system[3]) * system[3]).sum())
    assert isinstance(g, DTensor)
    assert_close(g.full_tensor(), expected(system[1]))
    y = torch.func.vmap(tridiagonal_solve)(lo, d, up, rhs)
    assert_close(y.full_tensor(), dense_solve(*system))
    try:  # torch 2.13: make_dual of a DTensor raises (aten._has_same_storage_numel has no rule)
        _, tangent = torch.func.jvp(lambda b: tridiagonal_solve(lo, d, up, b), (rhs,), (rhs,))
    except NotImplementedError as err:
        assert "sharding strategy" in str(err)
    else:
        assert_close(tangent.full_tensor(), dense_solve(*system))


def run_checks_2d(mesh) -> None:
    """On a 2 x 2 mesh: a rule on each mesh dimension (torch expands the one-dimension rules to
    every combination), still without a collective."""
    from torch.distributed.tensor import Replicate, Shard

    system = make_system(N, (2, 3), 4, seed=11)
    check_solve(mesh, "2-D mesh, batch dims 0 and 1", system, [[Shard(0), Shard(1)]] * 4,
                [Shard(0), Shard(1)])
    check_solve(mesh, "2-D mesh, batch dim 0 and columns", system,
                [[Shard(0), Replicate()]] * 3 + [[Shard(0), Shard(3)]], [Shard(0), Shard(3)])
    uneven = make_system(N, (5,), 2, seed=12)
    check_solve(mesh, "2-D mesh, batch dim 0 twice", uneven, [[Shard(0), Shard(0)]] * 4,
                [Shard(0), Shard(0)])
    check_factorization(mesh, "2-D mesh, factors", system, [Shard(0), Shard(1)],
                        [Shard(0), Shard(1)], [Shard(0), Shard(1)], [Shard(0), Shard(1)])


def _checks_worker(rank: int, world: int, port: int) -> None:
    _init(rank, world, port)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import tridiag_tutorial.distributed.sharding  # noqa: F401  (registers the rules)

        mesh = init_device_mesh("cpu", (world,))
        run_checks(mesh, world)
        if world == 2:
            run_other_checks(mesh, world)
        if world == 4:
            run_checks_2d(init_device_mesh("cpu", (2, 2)))
    finally:
        _finish()


# ---------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_solve_and_factorization(world):
    """Every placement case on ``world`` ranks (:func:`run_checks`), and on 2 ranks the checks
    that do not depend on their number (:func:`run_other_checks`), on 4 a 2 x 2 mesh
    (:func:`run_checks_2d`)."""
    spawn(_checks_worker, world)


FRESH = """
    import datetime, json, os, sys
    import torch
    import tridiag_tutorial
    from tridiag_tutorial import tridiagonal_solve
    from tridiag_tutorial.reference import dense_solve
    assert "torch.distributed.tensor" not in sys.modules, "import tridiag_tutorial imported DTensor"

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    system = [torch.randn(3, n, generator=g, dtype=torch.float64) for n in (6, 7, 6)]
    system[1] += 8  # diagonally dominant
    system.append(torch.randn(3, 7, 2, generator=g, dtype=torch.float64))
    inputs = [distribute_tensor(t, mesh, [Shard(0)]) for t in system]
    ops = torch.ops.tridiag_tutorial
    errors = []  # the ops first: a public function may register the rules (see the test)
    for call in (lambda: ops.solve_kernel.default(*inputs, None, None, "N", "lapack"),
                 lambda: ops.solve.default(*inputs, None, None, "N", "lapack"),
                 lambda: ops.lu_factor.default(*inputs[:3], "lapack")):
        try:
            with torch.inference_mode():  # below autograd (solve's Autograd kernel calls
                call()                        # solve_kernel, which would answer instead)
            errors.append(None)
        except NotImplementedError as err:
            errors.append(str(err).splitlines()[0])
    print(json.dumps(errors))
    try:
        x = tridiagonal_solve(*inputs)
        print(json.dumps(["solved", "tridiag_tutorial.distributed.sharding" in sys.modules,
                          torch.allclose(x.full_tensor(), dense_solve(*system))]))
    except NotImplementedError as err:
        print(json.dumps(["raised", str(err).splitlines()[0]]))

    import tridiag_tutorial.distributed.sharding as sharding
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    overloads = [getattr(ops, name).default for name in sharding.OPS]
    before = [funcs.get(op) for op in overloads]
    assert all(f is not None for f in before), before
    sharding.register()
    assert [funcs.get(op) for op in overloads] == before, "register() registered again"
    x = tridiagonal_solve(*inputs)
    assert isinstance(x, DTensor) and tuple(x.placements) == (Shard(0),), x
    torch.testing.assert_close(x.full_tensor(), dense_solve(*system))
    dist.destroy_process_group()
    print("ok")
"""


def test_in_a_fresh_process_the_ops_fail_until_the_rules_are_registered():
    """In a fresh interpreter (a process group of one rank): ``import tridiag_tutorial`` leaves
    ``torch.distributed.tensor`` unimported (it costs import time); before the rules are
    registered, the ops called on DTensors fail with DTensor's message (so the rules are what
    makes the other tests work); the public function registers the rules the first time it meets
    a DTensor, and solves;
    ``import tridiag_tutorial.distributed.sharding`` registers the rules of the three ops, a second
    ``register()`` changes nothing, and the public function then solves."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FRESH), str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    errors, public, ok = (json.loads(line) if line != "ok" else line
                          for line in done.stdout.strip().splitlines()[-3:])
    assert errors == [NO_STRATEGY.format(op=op) for op in ("solve_kernel", "solve", "lu_factor")]
    assert public == ["solved", True, True]  # the public function registered the rules itself
    assert ok == "ok"


def _spec(ndim):
    """What a rule function reads of DTensor's description of a tensor: its ``ndim``."""
    return types.SimpleNamespace(ndim=ndim)


@pytest.mark.parametrize("factored", [False, True], ids=["bands", "factors"])
def test_solve_strategies_list_the_promised_placements(factored):
    """The rule of ``solve_kernel`` for a 2-D batch ``(B0, B1)``, written out by hand: replicate,
    batch dimension 0 or 1 everywhere, or ``rhs``'s columns (dimension 3) alone; ``None`` for
    absent factors and for the two strings."""
    from torch.distributed.tensor import Replicate, Shard

    from tridiag_tutorial.distributed.sharding import solve_strategies

    lu, pivots = (_spec(4), _spec(3)) if factored else (None, None)
    got = solve_strategies(_spec(3), _spec(3), _spec(3), _spec(4), lu, pivots, "N", "lapack")
    R = Replicate()

    def row(out, bands, rhs, factors):
        f = factors if factored else None
        return ([out], [bands, bands, bands, rhs, f, f, None, None])

    assert [(list(o), list(i)) for o, i in got] == [
        row(R, R, R, R),
        row(Shard(0), Shard(0), Shard(0), Shard(0)),
        row(Shard(1), Shard(1), Shard(1), Shard(1)),
        row(Shard(3), R, Shard(3), R),
    ]


def test_lu_factor_strategies_list_the_promised_placements():
    from torch.distributed.tensor import Replicate, Shard

    from tridiag_tutorial.distributed.sharding import lu_factor_strategies

    got = lu_factor_strategies(_spec(2), _spec(2), _spec(2), "lapack")
    R = Replicate()
    assert [(list(o), list(i)) for o, i in got] == [
        ([R, R], [R, R, R, None]),
        ([Shard(0), Shard(0)], [Shard(0), Shard(0), Shard(0), None]),
    ]
