"""The worker functions of chapter 17: a model that calls the op, trained on several processes.

Each ``*_worker`` function is what one rank runs: it takes ``(rank, world_size, ...)``, assumes
that :func:`tridiag_tutorial.book.multiprocess.run_on_ranks` has joined it to a gloo process group, and
returns plain Python values and tensors (never DTensors, which cannot leave their process group),
so that the chapter can compare the ranks with each other and with one process. They live in a
module, not in the chapter's cells, because a spawned process imports the function it runs.

- :func:`ddp_worker`: ``DistributedDataParallel``; each rank trains on its slice of the batch.
- :func:`fsdp_worker`: FSDP2, ``torch.distributed.fsdp.fully_shard``: the parameters are
  sharded between steps.
- :func:`dtensor_worker`: the op called on ``DTensor`` inputs, with or without the sharding rules
  of :mod:`tridiag_tutorial.distributed.sharding`.
- :func:`split_solve_worker`: one system whose rows are spread over the ranks
  (:mod:`tridiag_tutorial.distributed.solve`), and :func:`timing_worker`: its solves timed.

:func:`train_one_process` is the reference: the same training on the whole batch in one process.
Everything is float64 and seeded, so the ranks build the same model and the same data.
"""

from __future__ import annotations

import textwrap

import torch
from torch import nn

from ..api import tridiagonal_solve

__all__ = ["N", "FEATURES", "BATCH", "STEPS", "LR", "BandedSolveModel", "make_data",
           "train_one_process", "hello_worker", "ddp_worker", "fsdp_worker", "DTENSOR_CASES",
           "dtensor_worker", "random_system", "split_solve_worker", "timing_worker", "first_line"]

#: Unknowns per system of the demo model.
N = 16
#: Input features per example.
FEATURES = 8
#: Examples in the whole batch, divisible by 1, 2 and 4 ranks.
BATCH = 32
#: Optimizer steps of the demo training.
STEPS = 5
#: Its SGD learning rate.
LR = 0.5
F64 = torch.float64


def first_line(error: BaseException, width: int = 150) -> str:
    """``'ErrorType: first line of the message'``, shortened to ``width`` characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return textwrap.shorten(f"{type(error).__name__}: {text}", width)


class BandedSolveModel(nn.Module):
    """``features (B, FEATURES) -> x (B, N)`` with ``A x_i = W f_i + c`` for each example ``i``.

    The three bands of ``A`` are parameters, and so are the weight and bias of the linear layer
    that makes the right-hand sides. The forward calls the public op once, with the batch as the
    columns of one matrix right-hand side ``(N, B)`` (a ``(B, N)`` right-hand side would read as
    ``N`` columns of ``B`` rows). It records, in ``band_types``, the type of
    the band tensors that reached the op, so that a wrapper (DDP, FSDP2) can be seen to hand it
    ordinary tensors.
    """

    def __init__(self, n: int = N, features: int = FEATURES, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.encode = nn.Linear(features, n, dtype=F64)
        with torch.no_grad():  # seeded, independent of the global generator
            self.encode.weight.copy_(torch.randn(n, features, generator=g, dtype=F64) / 3)
            self.encode.bias.copy_(torch.randn(n, generator=g, dtype=F64) / 3)
        self.lower = nn.Parameter(-1 + 0.1 * torch.randn(n - 1, generator=g, dtype=F64))
        self.diag = nn.Parameter(3 + 0.1 * torch.randn(n, generator=g, dtype=F64))
        self.upper = nn.Parameter(-1 + 0.1 * torch.randn(n - 1, generator=g, dtype=F64))
        self.band_types: tuple[str, ...] = ()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        rhs = self.encode(features)  # (B, n)
        self.band_types = tuple(type(t).__name__ for t in (self.lower, self.diag, self.upper))
        x = tridiagonal_solve(self.lower, self.diag, self.upper, rhs.T)  # (n, B)
        return x.T.contiguous()  # a copy, not a view: FSDP2 warns about returned views


def make_data(batch: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features (batch, FEATURES), targets (batch, N))``: the targets come from a model with
    other parameters (seed 123), plus noise, so that there is something to fit."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, FEATURES, generator=g, dtype=F64)
    with torch.no_grad():
        targets = BandedSolveModel(seed=123)(features)
    return features, targets + 0.01 * torch.randn(targets.shape, generator=g, dtype=F64)


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as plain tensors (an FSDP2 parameter, a DTensor, is gathered first)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _rank_slice(rank: int, world_size: int, batch: int) -> slice:
    """The rows of the batch that ``rank`` trains on: ``batch / world_size`` consecutive ones.
    The batch must divide evenly: with unequal slices the mean of the ranks' mean losses, which
    data parallelism computes, is not the mean loss over the batch."""
    if batch % world_size:
        raise ValueError(f"the batch of {batch} examples does not split evenly over {world_size} "
                         f"ranks; use a batch size divisible by the number of ranks")
    size = batch // world_size
    return slice(rank * size, (rank + 1) * size)


def _train(model: nn.Module, step_model: nn.Module, features, targets, steps, lr, world_size=1):
    """``steps`` SGD steps of the mean squared error; returns the loss over the whole batch before
    each step (each rank's loss averaged over the ranks when ``world_size > 1``)."""
    optimizer = torch.optim.SGD(step_model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (step_model(features) - targets).square().mean()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if world_size > 1:
            torch.distributed.all_reduce(total)
            total /= world_size
        losses.append(total.item())
    return losses


def train_one_process(steps: int = STEPS, lr: float = LR, batch: int = BATCH) -> dict:
    """The reference: ``steps`` SGD steps on the whole batch in this process. Returns
    ``{"losses": [...], "parameters": {name: tensor}}``."""
    model = BandedSolveModel()
    features, targets = make_data(batch)
    losses = _train(model, model, features, targets, steps, lr)
    return {"losses": losses, "parameters": _parameters(model)}


def ddp_worker(rank: int, world_size: int, steps: int = STEPS, lr: float = LR,
               batch: int = BATCH) -> dict:
    """One rank of data-parallel training with ``DistributedDataParallel``.

    Every rank builds the same model (DDP would broadcast rank 0's parameters anyway) and takes
    its slice of the batch. In ``backward`` DDP all-reduces the gradients and divides by the
    number of ranks, so every rank steps with the gradient of the mean loss over the whole batch:
    the training of :func:`train_one_process`, up to the order of floating-point sums. The op is
    called by the module's forward on this rank's plain tensors; DDP works on the gradients only.

    Returns ``{"losses", "parameters", "band_types", "local_batch"}``.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = BandedSolveModel()
    ddp = DistributedDataParallel(model)  # CPU tensors: no device_ids
    features, targets = make_data(batch)
    rows = _rank_slice(rank, world_size, batch)
    losses = _train(model, ddp, features[rows], targets[rows], steps, lr, world_size)
    return {"losses": losses, "parameters": _parameters(model), "band_types": model.band_types,
            "local_batch": rows.stop - rows.start}


def fsdp_worker(rank: int, world_size: int, steps: int = STEPS, lr: float = LR,
                batch: int = BATCH) -> dict:
    """One rank of fully sharded data parallelism, FSDP2 (``fully_shard``).

    ``fully_shard(model)`` replaces each parameter by a DTensor sharded on its first dimension:
    between steps a rank stores only its rows of every parameter (unevenly where the length does
    not divide: 15 entries over 2 ranks are 8 + 7). Before the forward FSDP2 all-gathers them
    and swaps ordinary full tensors into the module, so the op sees plain tensors, as in one
    process; after the backward it reduce-scatters the gradients (averaged over the ranks) into
    the shards, and the optimizer updates each shard.

    Returns ``{"losses", "parameters" (gathered), "band_types" (what the forward saw),
    "stored": {name: (type, placements, local shape)} (between steps)}``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = BandedSolveModel()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    features, targets = make_data(batch)
    rows = _rank_slice(rank, world_size, batch)
    losses = _train(model, model, features[rows], targets[rows], steps, lr, world_size)
    stored = {name: (type(p).__name__, str(tuple(p.placements)), tuple(p.to_local().shape))
              for name, p in model.named_parameters()}
    return {"losses": losses, "parameters": _parameters(model), "band_types": model.band_types,
            "stored": stored}


def hello_worker(rank: int, world_size: int) -> tuple[int, float]:
    """``(rank, sum)``: each rank contributes ``rank + 1`` to an ``all_reduce`` (a sum over the
    group, left on every rank), the smallest check that the ranks are joined."""
    value = torch.tensor([rank + 1.0], dtype=F64)
    torch.distributed.all_reduce(value)
    return rank, value.item()


def _random_system(batch: tuple[int, ...], n: int, k: int | None, seed: int):
    """A seeded, well-conditioned system: bands ``(*batch, n-1)``, ``(*batch, n)``, and ``rhs``
    ``(*batch, n)`` (``k`` None) or ``(*batch, n, k)``. Every rank draws the same one."""
    g = torch.Generator().manual_seed(seed)
    lower = torch.randn(*batch, n - 1, generator=g, dtype=F64)
    diag = 4 + torch.rand(*batch, n, generator=g, dtype=F64)
    upper = torch.randn(*batch, n - 1, generator=g, dtype=F64)
    rhs = torch.randn(*batch, n, *(() if k is None else (k,)), generator=g, dtype=F64)
    return lower, diag, upper, rhs


#: The cases of :func:`dtensor_worker`, each ``(name, batch shape, k, placement of the bands,
#: placement of rhs)``, ``k`` None for a vector right-hand side. Placements are named as
#: ``torch.distributed.tensor`` prints them; ``Shard`` dimensions count from the front.
DTENSOR_CASES = (
    ("batch sharded", (4,), None, "Shard(0)", "Shard(0)"),
    ("columns sharded", (), 4, "Replicate()", "Shard(1)"),
    ("replicated", (), 4, "Replicate()", "Replicate()"),
    ("rows (n) sharded", (), 4, "Shard(0)", "Shard(0)"),
)


def dtensor_worker(rank: int, world_size: int, with_rules: bool, n: int = 8) -> dict:
    """``DTensor`` inputs for each case of ``DTENSOR_CASES``, with or without sharding rules.

    This is what tensor parallelism hands an op: every tensor a ``DTensor`` laid out on a 1-D
    device mesh of all the ranks. Each case distributes a seeded system (the same on every rank)
    with its placements. Without ``with_rules`` the worker calls the kernel op
    ``tridiag_tutorial::solve_kernel`` itself, as one would call a custom op of one's own, in a
    process where nothing has registered a sharding rule for it: DTensor does not know the op and
    the call raises. With ``with_rules`` it solves with the public ``tridiagonal_solve``, which
    registers the package's rules (:mod:`tridiag_tutorial.distributed.sharding`) the first time a DTensor
    reaches it, and backpropagates ``x.square().sum()``.

    Returns ``{case name: result}``, where a result is ``{"error": first line}``, or the output's
    placements and this rank's local shape, and the largest differences between the gathered
    solution and gradients and those of the same solve on plain tensors in this process.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"Replicate()": Replicate(), "Shard(0)": Shard(0), "Shard(1)": Shard(1)}
    results = {}
    for name, batch, k, band_placement, rhs_placement in DTENSOR_CASES:
        plain = [t.requires_grad_() for t in _random_system(batch, n, k, seed=7)]
        expected = tridiagonal_solve(*plain)
        expected_grads = torch.autograd.grad(expected.square().sum(), plain)
        spread = [distribute_tensor(t.detach(), mesh, [placements[band_placement]])
                  for t in plain[:3]]
        spread.append(distribute_tensor(plain[3].detach(), mesh, [placements[rhs_placement]]))
        if not with_rules:  # the op itself: no rule registered in this process
            lower, diag, upper, rhs = spread
            matrix = rhs if k is not None else rhs.unsqueeze(-1)
            try:
                torch.ops.tridiag_tutorial.solve_kernel.default(lower, diag, upper, matrix, None,
                                                                None, "N", "lapack")
                results[name] = {"error": None}
            except Exception as error:  # noqa: BLE001 (reported, each rank the same)
                results[name] = {"error": first_line(error)}
            continue
        spread = [t.requires_grad_() for t in spread]
        try:
            x = tridiagonal_solve(*spread)
            grads = torch.autograd.grad(x.square().sum(), spread)
        except Exception as error:  # noqa: BLE001 (reported, each rank the same)
            results[name] = {"error": first_line(error)}
            continue
        results[name] = {
            "output": str(tuple(x.placements)),
            "local shape": tuple(x.to_local().shape),
            "max |x - plain|": (x.full_tensor() - expected).abs().max().item(),
            "max |grad - plain|": max((g.full_tensor() - e).abs().max().item()
                                      for g, e in zip(grads, expected_grads)),
        }
    return results


def random_system(n: int, seed: int = 3):
    """One seeded system ``(lower, diag, upper, rhs)`` of ``n`` unknowns that is *not* diagonally
    dominant (the diagonal is ``(1.5 + |N(0, 1)|)`` with a random sign, the off-diagonals
    ``N(0, 1)``), so that LAPACK pivots; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(F64)
    diag = (1.5 + torch.randn(n, generator=g, dtype=F64).abs()) * sign
    lower = torch.randn(n - 1, generator=g, dtype=F64)
    upper = torch.randn(n - 1, generator=g, dtype=F64)
    return lower, diag, upper, torch.randn(n, generator=g, dtype=F64)


def split_solve_worker(rank: int, world_size: int, n: int, seed: int = 3) -> dict:
    """One system of ``n`` unknowns whose rows are spread over the ranks, solved with
    :func:`tridiag_tutorial.distributed.solve.split_solve`.

    Every rank draws the same global system (:func:`random_system`) and keeps only its
    consecutive rows (``split_bands``), as a simulation split across machines would hold them;
    then the ranks solve it together, with refinement and without (``refinement_steps=0``). The
    same pieces are solved a third time with ``gather_solve``, which gathers the whole system on
    every rank and solves it with LAPACK, the baseline. ``record()`` counts, on this rank, the
    bytes each solve sends.

    Returns ``{"x": this rank's rows of the split solve's solution, "x_no_refinement": the same
    without refinement, "rows": how many, "sent": bytes sent per solve, "collectives": their
    number, "fallbacks"}``, each of the last three a dict keyed by the route:
    ``"split_solve"``, ``"split_solve_no_refinement"``, ``"gather_solve"``.
    """
    from functools import partial

    from .. import distributed as distributed_solve

    pieces = distributed_solve.split_bands(*random_system(n, seed), rank, world_size)
    out = {"rows": pieces[1].shape[-1], "sent": {}, "collectives": {}, "fallbacks": {}}
    routes = {"split_solve": distributed_solve.split_solve,
              "split_solve_no_refinement": partial(distributed_solve.split_solve, refinement_steps=0),
              "gather_solve": distributed_solve.gather_solve}
    for name, solve in routes.items():
        with distributed_solve.record() as counted:
            x = solve(*pieces)
        if name != "gather_solve":
            out["x" if name == "split_solve" else "x_no_refinement"] = x
        out["sent"][name] = counted.bytes_sent
        out["collectives"][name] = len(counted.collectives)
        out["fallbacks"][name] = counted.fallbacks
    return out


def timing_worker(rank: int, world_size: int, n: int, rounds: int, seed: int = 3) -> dict:
    """Wall-clock times of four ways to solve the system of :func:`split_solve_worker`.

    ``rounds`` rounds after a warm-up round that is dropped; in each, the four solves one after
    the other (interleaved, so that a slow spell of the machine falls on every route), each
    started from a barrier: LAPACK on the whole system (which every rank holds here), the split
    solve without refinement and with it, and ``gather_solve``. ``record()`` times the phases of
    each distributed call (:attr:`~tridiag_tutorial.distributed.solve.SolveRecord.seconds`).

    Returns ``{route: [one dict per round]}`` on this rank, a dict ``{"wall": seconds of the
    call, phase name: seconds}`` (no phases for LAPACK).
    """
    import time
    from functools import partial

    from .. import distributed as distributed_solve

    system = random_system(n, seed)
    pieces = distributed_solve.split_bands(*system, rank, world_size)
    split_solve = distributed_solve.split_solve
    routes = {"LAPACK, whole system": partial(tridiagonal_solve, *system, driver="lapack"),
              "split_solve_no_refinement": partial(split_solve, *pieces, refinement_steps=0),
              "split_solve": partial(split_solve, *pieces),
              "gather_solve": partial(distributed_solve.gather_solve, *pieces)}
    times = {name: [] for name in routes}
    for round_ in range(rounds + 1):
        for name, solve in routes.items():
            torch.distributed.barrier()
            with distributed_solve.record() as phases:
                start = time.perf_counter()
                solve()
                wall = time.perf_counter() - start
            if round_ > 0:  # round 0 warms up
                times[name].append({"wall": wall, **phases.seconds})
    return times
