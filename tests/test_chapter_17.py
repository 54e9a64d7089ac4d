"""Chapter 17 (the operator past one machine): the claims the chapter's text makes from its cells,
recomputed with the package, so that the chapter shows values and not asserts. The workers that a
spawned rank runs are defined here, at the top level of this module, which the ranks import."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tridiag_tutorial import distributed, tridiag_matmul, tridiagonal_lu_factor, tridiagonal_solve
from tridiag_tutorial.bench import accuracy
from tridiag_tutorial.book import parallel_demos
from tridiag_tutorial.book.multiprocess import WorkerError, run_on_ranks

from conftest import one_rank_group

F64 = torch.float64


def _max_difference(parameters, expected):
    return max((parameters[name] - expected[name]).abs().max().item() for name in expected)


def _backward_error(lower, diag, upper, rhs, x):
    residual = rhs - tridiag_matmul(lower, diag, upper, x[:, None])[:, 0]
    scale = tridiag_matmul(lower.abs(), diag.abs(), upper.abs(), x.abs()[:, None])[:, 0] + rhs.abs()
    return (residual.abs() / scale).max().item()


def _backward_error_long(lower, diag, upper, rhs, x):
    """The componentwise backward error with the residual b - A x in NumPy's longdouble."""
    bands = (t.numpy() for t in (lower, diag, upper, rhs[:, None]))
    residual = accuracy._residual_long(*bands, x.numpy().astype(np.longdouble)[:, None])[:, 0]
    scale = tridiag_matmul(lower.abs(), diag.abs(), upper.abs(), x.abs()[:, None])[:, 0] + rhs.abs()
    return float(np.max(np.abs(residual) / scale.numpy()))


def row_sharded_worker(rank, world_size, n):
    """The chapter's local_map worker: split_solve on a DTensor sharded along n, built from each
    rank's own pieces with DTensor.from_local (nothing moves between the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import local_map

    solve = local_map(distributed.split_solve, out_placements=[Shard(0)], in_placements=([Shard(0)],) * 4)
    mesh = init_device_mesh("cpu", (world_size,))
    pieces = distributed.split_bands(*parallel_demos.random_system(n), rank, world_size)
    inputs = [DTensor.from_local(p, mesh, [Shard(0)]) for p in pieces]
    x = solve(*inputs)
    return {"placements": tuple(x.placements), "local": x.to_local(), "x": x.full_tensor(),
            "shapes": [tuple(t.shape) for t in inputs], "inputs local": [t.to_local() for t in inputs],
            "pieces": pieces}


def test_unequal_slices_need_each_rank_to_scale_its_sum():
    model = parallel_demos.BandedSolveModel()
    features, targets = parallel_demos.make_data(30)
    with torch.no_grad():
        squared = (model(features) - targets).square().mean(dim=1)
    slices = [squared[a:b] for a, b in [(0, 8), (8, 16), (16, 23), (23, 30)]]
    mean_of_means = sum(s.mean() for s in slices) / 4
    fixed = sum(s.sum() * 4 / 30 for s in slices) / 4
    assert abs(mean_of_means - squared.mean()) > 1e-4
    assert abs(fixed - squared.mean()) < 1e-12


def test_gathering_a_row_sharded_system_moves_4n_entries():
    n = 10**6
    for world_size, megabytes in ((2, 16.0), (4, 24.0)):
        received = (4 * n - 2) * 8 * (world_size - 1) / world_size
        assert round(received / 1e6, 1) == megabytes


@pytest.mark.slow
def test_data_parallel_and_fsdp_give_the_parameters_of_one_process():
    reference = parallel_demos.train_one_process()
    untrained = parallel_demos.BandedSolveModel().state_dict()
    assert _max_difference(reference["parameters"], untrained) > 1e-3
    for ranks in (run_on_ranks(parallel_demos.ddp_worker, 2), run_on_ranks(parallel_demos.fsdp_worker, 2)):
        for r in ranks:
            assert _max_difference(r["parameters"], ranks[0]["parameters"]) == 0
            assert _max_difference(r["parameters"], reference["parameters"]) < 1e-12
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]),
                                       rtol=1e-12, atol=0)
            assert r["band_types"] == ("Parameter",) * 3
    assert [r["stored"]["lower"][2] for r in ranks] == [(8,), (7,)]
    assert all(kind == "DTensor" for kind, _, _ in ranks[0]["stored"].values())


@pytest.mark.slow
def test_an_uneven_batch_is_refused_on_the_ranks():
    with pytest.raises(WorkerError) as info:
        run_on_ranks(parallel_demos.ddp_worker, 2, parallel_demos.STEPS, parallel_demos.LR, 31)
    assert info.value.type_name == "ValueError" and "does not split evenly" in info.value.worker_message
    assert info.value.rank in (0, 1)


@pytest.mark.slow
def test_dtensor_layouts_without_and_with_rules():
    without = run_on_ranks(parallel_demos.dtensor_worker, 2, False)
    messages = {result["error"] for ranks in without for result in ranks.values()}
    assert messages == {"NotImplementedError: Operator tridiag_tutorial.solve_kernel.default does not "
                        "have a sharding strategy registered."}
    with_rules = run_on_ranks(parallel_demos.dtensor_worker, 2, True)
    for r in with_rules:
        for result in r.values():
            assert "error" not in result, result
            assert result["max |x - plain|"] < 1e-14 and result["max |grad - plain|"] < 1e-14
    outputs = {name: result["output"] for name, result in with_rules[0].items()}
    assert outputs == {"batch sharded": "(Shard(dim=0),)", "columns sharded": "(Shard(dim=1),)",
                       "replicated": "(Replicate(),)", "rows (n) sharded": "(Replicate(),)"}


@pytest.mark.slow
def test_local_map_runs_the_split_solve_on_a_row_sharded_dtensor():
    n = 10**4
    ranks = run_on_ranks(row_sharded_worker, 2, n)
    system = parallel_demos.random_system(n)
    x_lapack = tridiagonal_solve(*system, driver="lapack")
    pieces = [r["local"] for r in ranks]
    assert [p.shape[0] for p in pieces] == [n // 2, n // 2]
    assert all("Shard(dim=0)" in str(r["placements"]) for r in ranks)
    assert (torch.cat(pieces) - x_lapack).abs().max() / x_lapack.abs().max() < 1e-10
    assert torch.equal(ranks[0]["x"], torch.cat(pieces))
    # from_local: the global DTensors have n rows, each rank's block is its own piece, unchanged
    for r in ranks:
        assert r["shapes"] == [(n,)] * 4
        assert all(torch.equal(a, b) for a, b in zip(r["inputs local"], r["pieces"]))
    whole = [torch.cat([r["pieces"][i] for r in ranks]) for i in range(4)]
    padded = F.pad(system[0], (1, 0)), system[1], F.pad(system[2], (0, 1)), system[3]
    assert all(torch.equal(a, b) for a, b in zip(whole, padded))


@pytest.mark.slow
def test_the_timing_worker_times_every_route_and_its_phases():
    rounds = 2
    ranks = run_on_ranks(parallel_demos.timing_worker, 2, 2000, rounds)
    for times in ranks:
        assert list(times) == ["LAPACK, whole system", "split_solve_no_refinement", "split_solve",
                               "gather_solve"]
        assert all(len(rows) == rounds for rows in times.values())
        assert all(list(row) == ["wall"] for row in times["LAPACK, whole system"])
        for route in ("split_solve_no_refinement", "split_solve", "gather_solve"):
            for row in times[route]:
                phases = sum(t for name, t in row.items() if name not in ("wall", "call"))
                assert 0 < phases <= row["call"] <= row["wall"], (route, row)
        refined = {name for row in times["split_solve"] for name in row}
        unrefined = {name for row in times["split_solve_no_refinement"] for name in row}
        assert any("refinement" in name for name in refined - unrefined)
        assert not any("refinement" in name for name in unrefined)
        assert any(name.startswith("gather:") for name in times["gather_solve"][0])


@pytest.mark.slow
def test_the_split_solve_is_accurate_and_sends_a_fixed_amount():
    n = 10**6
    system = parallel_demos.random_system(n)
    x_lapack = tridiagonal_solve(*system, driver="lapack")
    pivots = tridiagonal_lu_factor(*system[:3]).pivots
    swaps = (pivots != torch.arange(1, n + 1, dtype=pivots.dtype)).sum().item()
    assert 0.05 < swaps / n < 0.1
    assert _backward_error(*system, x_lapack) < 1e-13
    small = run_on_ranks(parallel_demos.split_solve_worker, 2, 10**4)
    for world_size in (2, 4):
        ranks = run_on_ranks(parallel_demos.split_solve_worker, world_size, n)
        x = torch.cat([r["x"] for r in ranks])
        assert (x - x_lapack).abs().max() / x_lapack.abs().max() < 1e-10
        assert _backward_error(*system, x) < 1e-15
        # what refinement buys: without it the backward error is many times larger
        unrefined = _backward_error(*system, torch.cat([r["x_no_refinement"] for r in ranks]))
        assert unrefined > 10 * _backward_error(*system, x)
        # the printed figures, the residual in longdouble: LAPACK 128.2u, the split solve 0.9u
        u = torch.finfo(F64).eps / 2
        lapack_long, split_long = (_backward_error_long(*system, y) / u for y in (x_lapack, x))
        assert split_long < 1 < 100 < lapack_long
        assert (f"{lapack_long:.1f}", f"{split_long:.1f}") == ("128.2", "0.9")
        assert all(r["fallbacks"] == {"split_solve": 0, "split_solve_no_refinement": 0,
                                      "gather_solve": 0} for r in ranks)
        assert all(r["collectives"]["split_solve_no_refinement"] == 3 for r in ranks)
        assert all(r["sent"]["split_solve"] < 10_000 for r in ranks)
        assert all(r["sent"]["gather_solve"] > 10**7 for r in ranks)
        # without refinement x is LAPACK's bit for bit but for a few rows about the block
        # boundaries, so the worst row, and the backward error, are LAPACK's
        plain = torch.cat([r["x_no_refinement"] for r in ranks])
        differ = torch.nonzero(plain != x_lapack).flatten()
        starts = torch.tensor([sum(r["rows"] for r in ranks[:q]) for q in range(1, world_size)])
        assert 0 < len(differ) < 50 * world_size
        assert int((differ[:, None] - starts[None, :]).abs().min(1).values.max()) <= 50
        assert unrefined == pytest.approx(_backward_error(*system, x_lapack), rel=1e-12)
        formula = distributed.communication(n, world_size)
        assert all(r["sent"][name] == formula[name]["sent"] for r in ranks for name in formula
                   if name in r["sent"])
    # the split solve's bytes do not grow with n; the gather's grow about a hundredfold
    big = run_on_ranks(parallel_demos.split_solve_worker, 2, n)
    assert small[0]["sent"]["split_solve"] == big[0]["sent"]["split_solve"]
    assert big[0]["sent"]["gather_solve"] > 90 * small[0]["sent"]["gather_solve"]


def gradient_placements_worker(rank, world_size, n=8, k=4):
    """The chapter's worker: the placements of the gradients under column sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    lower, diag, upper, _ = parallel_demos.random_system(n)
    rhs = torch.randn(n, k, generator=torch.Generator().manual_seed(1), dtype=F64)
    inputs = [distribute_tensor(t, mesh, [p]).requires_grad_()
              for t, p in zip((lower, diag, upper, rhs), [Replicate()] * 3 + [Shard(1)])]
    tridiagonal_solve(*inputs).square().sum().backward()
    return [str(t.grad.placements) for t in inputs]


def split_gradients_worker(rank, world_size, n, create_graph=False):
    pieces = [t.requires_grad_() for t in distributed.split_bands(*parallel_demos.random_system(n), rank, world_size)]
    x = distributed.split_solve(*pieces)
    try:
        grads = torch.autograd.grad(x.square().sum(), pieces, create_graph=create_graph)
    except RuntimeError as err:
        return type(err).__name__
    return [g.detach() for g in grads]


@pytest.mark.slow
def test_replicated_bands_get_partial_gradients_under_column_sharding():
    ranks = run_on_ranks(gradient_placements_worker, 2)
    for placements in ranks:
        assert all("Partial" in p for p in placements[:3]) and "Shard(dim=1)" in placements[3]


@pytest.mark.slow
def test_split_solve_gradients_match_one_process_and_double_backward_is_refused():
    n = 1000
    inputs = [t.clone().requires_grad_() for t in parallel_demos.random_system(n)]
    expected = torch.autograd.grad(tridiagonal_solve(*inputs).square().sum(), inputs)
    largest = max(t.abs().max().item() for t in expected)
    for rank, grads in enumerate(run_on_ranks(split_gradients_worker, 2, n)):
        for got, want in zip(grads, distributed.split_bands(*expected, rank, 2)):
            assert (got - want).abs().max().item() < 1e-12 * largest
    assert run_on_ranks(split_gradients_worker, 2, n, True) == ["NotImplementedError"] * 2


def test_bytes_favour_the_split_solve_from_a_few_dozen_unknowns_whatever_k():
    crossings = []
    for k in (1, 10, 100):
        sent = {n: distributed.communication(n, 4, k=k) for n in range(8, 200)}
        below = [n for n, r in sent.items() if r["split_solve"]["sent"] >= r["gather_solve"]["sent"]]
        crossings.append(max(below) + 1)  # from here on the split solve sends less
        assert all(r["split_solve"]["sent"] < r["gather_solve"]["sent"] for n, r in sent.items() if n >= crossings[-1])
    assert all(20 < n < 100 for n in crossings) and max(crossings) - min(crossings) < 10


def test_the_reduced_system_is_banded_three_unknowns_an_equation():
    # the Schur complement of the separators (each piece's first and last rows), ordered by rank
    n, world_size = 40, 4
    lower, diag, upper, _ = parallel_demos.random_system(n)
    dense = torch.diag(diag) + torch.diag(lower, -1) + torch.diag(upper, 1)
    starts = [0, 10, 20, 30]
    separators = sorted({s for start in starts for s in (start, start + 9)})
    inner = [i for i in range(n) if i not in separators]
    a_ss, a_si = dense[separators][:, separators], dense[separators][:, inner]
    reduced = a_ss - a_si @ torch.linalg.solve(dense[inner][:, inner], dense[inner][:, separators])
    nonzero = reduced.abs() > 1e-12
    assert nonzero.shape == (2 * world_size, 2 * world_size)
    assert int(nonzero.sum(1).max()) == 3
    rows, cols = torch.nonzero(nonzero, as_tuple=True)
    assert int((rows - cols).abs().max()) <= 2  # banded


def fallback_worker(rank, world_size, system):
    """The chapter's worker: this rank's rows of split_solve and the fallbacks it counted."""
    pieces = distributed.split_bands(*system, rank, world_size)
    with distributed.record() as counted:
        x = distributed.split_solve(*pieces)
    return x, counted.fallbacks


@pytest.mark.slow
def test_a_singular_block_makes_every_rank_fall_back_to_lapack():
    n = 1000
    system = [t.clone() for t in parallel_demos.random_system(n)]
    s = n // 2  # rank 1's first row: column s keeps only A[s-1, s]
    system[1][s], system[0][s], system[2][s - 1] = 0.0, 0.0, 1.5
    with pytest.raises(torch.linalg.LinAlgError):  # rank 1's block alone is singular
        tridiagonal_lu_factor(system[0][s:], system[1][s:], system[2][s:], driver="lapack")
    x_lapack = tridiagonal_solve(*system, driver="lapack")  # A itself is regular
    ranks = run_on_ranks(fallback_worker, 2, system)
    assert [fallbacks for _, fallbacks in ranks] == [1, 1]
    x = torch.cat([x for x, _ in ranks])
    assert (x - x_lapack).abs().max() <= 1e-14 * x_lapack.abs().max()
    regular = run_on_ranks(fallback_worker, 2, list(parallel_demos.random_system(n)))
    assert [fallbacks for _, fallbacks in regular] == [0, 0]


def test_one_more_column_costs_the_split_solve_13_numbers_per_rank_and_the_gather_n_over_p():
    for n, world_size in ((1000, 2), (10**6, 4), (999, 3)):
        for k in (1, 7):
            fewer, more = (distributed.communication(n, world_size, k=j) for j in (k, k + 1))
            added = {name: (more[name]["contributed"] - fewer[name]["contributed"]) // 8
                     for name in ("split_solve", "gather_solve")}
            assert added["split_solve"] == 13
            assert added["gather_solve"] == -(-n // world_size)  # the largest piece's rows


def fallback_collectives_worker(rank, world_size, system):
    """The chapter's fallback worker, returning instead the collectives that the rank's record
    names, in order."""
    pieces = distributed.split_bands(*system, rank, world_size)
    with distributed.record() as counted:
        distributed.split_solve(*pieces)
    return [what for what, _, _ in counted.collectives], counted.fallbacks


@pytest.mark.slow
def test_a_zero_pivot_in_a_block_falls_back_right_after_step_2s_all_gather():
    n = 1000
    system = [t.clone() for t in parallel_demos.random_system(n)]
    s = n // 2
    system[1][s], system[0][s], system[2][s - 1] = 0.0, 0.0, 1.5
    bad = run_on_ranks(fallback_collectives_worker, 2, system)
    good = run_on_ranks(fallback_collectives_worker, 2, list(parallel_demos.random_system(n)))
    good_names = good[0][0]  # validation, step 2, two per refinement step, step 5's checks
    assert all(names == good_names and fallbacks == 0 for names, fallbacks in good)
    assert len(good_names) == 7
    for names, fallbacks in bad:  # validation, step 2, then the gather of the whole system
        assert fallbacks == 1 and names[:2] == good_names[:2] and len(names) == 3
        assert names[2] not in good_names  # no refinement and no step-5 gather before falling back


def test_the_bytes_cross_when_the_largest_piece_has_12_to_13_rows_whatever_k_and_p():
    for world_size in (2, 3, 4):
        for k in (1, 10, 100):
            n = 2 * world_size
            while (distributed.communication(n, world_size, k=k)["split_solve"]["sent"]
                   >= distributed.communication(n, world_size, k=k)["gather_solve"]["sent"]):
                n += 1
            assert max(distributed.split_sizes(n, world_size)) in (12, 13), (world_size, k, n)


def singular_batch_worker(rank, world_size, seconds):
    """The chapter's worker: a batch of 4 systems sharded over the ranks, system 3 singular; the
    rank that raised meets the other at a barrier, the other calls full_tensor() on a group whose
    timeout is ``seconds``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tridiag_tutorial import SingularMatrixError

    g = torch.Generator().manual_seed(0)
    lower, upper = torch.randn(2, 4, 7, generator=g, dtype=F64)
    diag = 4 + torch.rand(4, 8, generator=g, dtype=F64)
    rhs = torch.randn(4, 8, generator=g, dtype=F64)
    diag[3, 0] = upper[3, 0] = 0.0
    group = dist.new_group(timeout=datetime.timedelta(seconds=seconds))
    mesh = DeviceMesh.from_group(group, "cpu")
    inputs = [distribute_tensor(t, mesh, [Shard(0)]) for t in (lower, diag, upper, rhs)]
    out = {}
    try:
        x = tridiagonal_solve(*inputs)
        out["solved"] = len(x.to_local())
        try:
            x.full_tensor()
            out["collective"] = "returned"
        except RuntimeError as error:
            out["collective"] = str(error)
    except SingularMatrixError as error:
        out["batch_index"] = error.batch_index
    dist.barrier()
    return out


@pytest.mark.slow
def test_a_singular_system_raises_only_on_its_rank_and_the_other_waits_out_its_timeout():
    g = torch.Generator().manual_seed(0)
    lower, upper = torch.randn(2, 4, 7, generator=g, dtype=F64)
    diag = 4 + torch.rand(4, 8, generator=g, dtype=F64)
    diag[3, 0] = upper[3, 0] = 0.0
    with pytest.raises(torch.linalg.LinAlgError):  # system 3 alone is singular
        tridiagonal_lu_factor(lower[3], diag[3], upper[3])
    tridiagonal_lu_factor(lower[:3], diag[:3], upper[:3])
    rank0, rank1 = run_on_ranks(singular_batch_worker, 2, 3, timeout=60)
    assert rank1 == {"batch_index": (1,)}  # counted within rank 1's shard
    assert rank0["solved"] == 2 and "Timed out" in rank0["collective"]


def _componentwise_condition(lower, diag, upper, rhs, x, iterations=5):
    """The chapter's Hager estimate of || |A^-1| (|A||x| + |b|) ||_inf / ||x||_inf."""
    g = tridiag_matmul(lower.abs(), diag.abs(), upper.abs(), x.abs()[:, None])[:, 0] + rhs.abs()

    def solve(v, transposed=False):
        bands = (upper, diag, lower) if transposed else (lower, diag, upper)
        return tridiagonal_solve(*bands, v, driver="lapack")

    v = torch.full_like(x, 1 / len(x))
    estimate = 0.0
    for _ in range(iterations):
        y = g * solve(v, transposed=True)
        estimate = max(estimate, y.abs().sum().item())
        z = solve(g * torch.sign(y))
        if z.abs().max() <= z @ v:
            break
        v = torch.zeros_like(x)
        v[z.abs().argmax()] = 1.0
    return estimate / x.abs().max().item()


def test_hagers_estimate_is_a_close_lower_bound_of_the_componentwise_condition_number():
    for seed in range(6):
        lower, diag, upper, rhs = parallel_demos.random_system(300, seed)
        x = tridiagonal_solve(lower, diag, upper, rhs, driver="lapack")
        dense = torch.diag(diag) + torch.diag(lower, -1) + torch.diag(upper, 1)
        g = dense.abs() @ x.abs() + rhs.abs()
        exact = ((torch.linalg.inv(dense).abs() @ g).max() / x.abs().max()).item()
        estimate = _componentwise_condition(lower, diag, upper, rhs, x)
        assert exact / 3 <= estimate <= exact * (1 + 1e-10)


@pytest.mark.slow
def test_the_gap_between_split_solve_and_lapack_is_within_the_conditioning_bound():
    n = 10**6
    system = parallel_demos.random_system(n)
    x_lapack = tridiagonal_solve(*system, driver="lapack")
    x = torch.cat([r["x"] for r in run_on_ranks(parallel_demos.split_solve_worker, 2, n)])
    kappa = _componentwise_condition(*system, x_lapack)
    difference = ((x - x_lapack).abs().max() / x_lapack.abs().max()).item()
    bound = kappa * (_backward_error(*system, x_lapack) + _backward_error(*system, x))
    assert difference <= bound  # first order: each error is at most kappa times its backward error
    assert bound > 100 * difference  # the chapter's "some 600 times" the measured difference


def test_the_timing_prose_quotes_the_stored_timing_output():
    """Section 17.5's timing cell is not compared by nbval (its output varies), so the numbers the
    next cell's prose quotes are checked here against the output stored in the notebook."""
    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "17_distributed.ipynb")
                       .read_text())["cells"]
    index = next(i for i, c in enumerate(cells)
                 if "parallel_demos.timing_worker, 2, n, rounds" in "".join(c["source"]))
    out = "".join("".join(o.get("text", "")) for o in cells[index]["outputs"])
    prose = " ".join("".join(cells[index + 1]["source"]).split())

    def median(route):
        return float(re.search(rf"^{re.escape(route)}\s+([\d.]+) ms", out, re.M)[1])

    lapack, plain, refined, gather = (median(r) for r in (
        "LAPACK, whole system", "split_solve_no_refinement", "split_solve", "gather_solve"))
    assert f"one LAPACK call on the whole system, {lapack:.1f} ms" in prose
    assert f"| gather | {gather:.1f} | {gather / lapack:.1f} |" in prose
    assert f"| split solve, unrefined | {plain:.1f} | {plain / lapack:.1f} |" in prose
    assert f"| split solve, refined (default) | {refined:.1f} | {refined / lapack:.0f} |" in prose
    block = out.split("split_solve_no_refinement", 1)[1].split("split_solve ", 1)[0]
    ranks = [float(v) for v in re.search(r"1\. block factor and solve\s+([\d.]+) ms.*\|\s+([\d.]+) ms",
                                         block).groups()]
    assert f"the rank's block, {min(ranks):.0f} to {max(ranks):.0f}" in prose
    assert f"{min(ranks) / lapack:.1f} to {max(ranks) / lapack:.1f} times `?gtsv`" in prose
    diff = re.search(r"per round:\s+(-?[\d.]+) ms \((-?[\d.]+) to (-?[\d.]+)\); "
                     r"split_solve_no_refinement faster in (\d+) of (\d+) rounds", out).groups()
    assert f"${diff[0]}$ ms in the median (quartiles ${diff[1]}$ to ${diff[2]}$)" in prose
    assert f"faster in {diff[3]} of {diff[4]} rounds" in prose
    alone = re.findall(r"^LAPACK, parent process alone.*?\s([\d.]+) ms", out, re.M)
    assert f"strided views of the gathered system: {alone[1]} against {alone[0]}" in prose
    keep = [float(v) for v in re.search(r"keep the rank's rows\s+([\d.]+) ms.*\|\s+([\d.]+) ms",
                                        out).groups()]
    estimate = gather - sum(keep) / 2 - (float(alone[1]) - float(alone[0]))  # without scan and views
    assert f"roughly {5 * round(estimate / 5)} ms" in prose
    step2 = [float(q) for q in re.findall(r"2\. all_gather of the ends\s+[\d.]+ ms \(([\d.]+) to", out)
             + re.findall(r"2\. all_gather of the ends.*\|\s+[\d.]+ ms \(([\d.]+) to", out)]
    assert f"lower quartiles of {min(step2)} to {max(step2)} ms" in prose
    summary = " ".join(next("".join(c["source"]) for c in cells
                            if "## 17.7 Summary" in "".join(c["source"])).split())
    assert (f"refined, the default that nearly singular blocks need, about {refined / gather:.0f} times "
            f"slower ({refined:.1f} against {gather:.1f} ms)") in summary
    # the break-even ranks, 1/P arithmetic on the printed ratios: two ranks ran at 5.4 and 44 times LAPACK
    assert (f"about {round(2 * plain / lapack)} ranks unrefined, {round(2 * refined / lapack)} refined"
            in prose)


@pytest.mark.slow
def test_fsdp2_on_a_submodule_frees_the_bands_and_trains_as_one_process(tmp_path, monkeypatch):
    """Section 17.3's second run: the worker module the notebook writes (bands in a submodule
    sharded before the root), written and run here."""
    import textwrap

    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "17_distributed.ipynb")
                       .read_text())["cells"]
    source = next("".join(c["source"]) for c in cells
                  if c["cell_type"] == "code" and "def nested_fsdp_worker" in "".join(c["source"]))
    (tmp_path / "chapter_17_fsdp_workers.py").write_text(textwrap.dedent(source.split("'''")[1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    import chapter_17_fsdp_workers

    ranks = run_on_ranks(chapter_17_fsdp_workers.nested_fsdp_worker, 2)
    reference = parallel_demos.train_one_process()
    assert [r["between"] for r in ranks] == ["DTensor, (8,) entries of lower",
                                             "DTensor, (7,) entries of lower"]
    for r in ranks:
        assert r["seen"] == ["Parameter"] * 3  # the op received plain, full tensors
        assert r["gradient"] == "DTensor"
        assert _max_difference(r["parameters"], reference["parameters"]) < 1e-12
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-12, atol=0)


def _stored_timing_output_and_prose():
    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "17_distributed.ipynb")
                       .read_text())["cells"]
    index = next(i for i, c in enumerate(cells)
                 if "parallel_demos.timing_worker, 2, n, rounds" in "".join(c["source"]))
    out = "".join("".join(o.get("text", "")) for o in cells[index]["outputs"])
    return out, " ".join("".join(cells[index + 1]["source"]).split())


def test_the_refined_route_was_slower_on_rank_0_and_rank_1_waited_for_it():
    """The prose says rank 0 was slower in most phases of the refined split solve, and quotes the
    refinement's all-gather waits; both are read here from the stored timing output."""
    out, prose = _stored_timing_output_and_prose()
    refined = out.split("\nsplit_solve ", 1)[1].split("\ngather_solve", 1)[0]
    phases = re.findall(r"^    (\S.*?)\s+([\d.]+) ms \([^)]*\) \|\s+([\d.]+) ms", refined, re.M)
    computing = [(name, float(r0), float(r1)) for name, r0, r1 in phases
                 if "all_gather" not in name and "beyond" not in name]
    assert len(computing) >= 6
    assert sum(r0 > r1 for _, r0, r1 in computing) > len(computing) / 2
    waits = next((float(r0), float(r1)) for name, r0, r1 in phases
                 if name == "4. refinement: all_gathers")
    assert waits[1] > waits[0]
    assert "Rank 0 was slower in most phases" in prose
    assert f"({waits[1]:.0f} against {waits[0]:.0f})" in prose


def nearly_singular_block_worker(rank, world_size, system):
    """The chapter's split solve of one system with and without refinement: ``{steps: (x, fallbacks)}``."""
    pieces = distributed.split_bands(*system, rank, world_size)
    out = {}
    for steps in (distributed.REFINEMENT_STEPS, 0):
        with distributed.record() as counted:
            x = distributed.split_solve(*pieces, refinement_steps=steps)
        out[steps] = (x, counted.fallbacks)
    return out


def _nearly_singular_block_system(n=1000, shrink=1e-10):
    """``random_system(n)`` with rank 0's last diagonal entry (2 ranks) moved so that the
    determinant of rank 0's block is ``shrink`` times what it was: changing ``M[j, j]`` by ``t``
    multiplies ``det M`` by ``1 + t (M^-1)[j, j]``; ``(M^-1)[j, j]`` from SciPy's ``?gtsv``."""
    from scipy.linalg import lapack as scipy_lapack

    lower, diag, upper, rhs = (t.clone() for t in parallel_demos.random_system(n))
    m = n // 2
    e_last = torch.zeros(m, 1, dtype=F64)
    e_last[-1] = 1.0
    *_, z, info = scipy_lapack.dgtsv(lower[:m - 1].numpy(), diag[:m].numpy(), upper[:m - 1].numpy(),
                                     e_last.numpy())
    assert info == 0
    diag[m - 1] -= (1 - shrink) / float(z[-1, 0])
    return [lower, diag, upper, rhs], m


def _smallest_pivot(lower, diag, upper):
    from scipy.linalg import lapack as scipy_lapack

    _, u_diag, *_, info = scipy_lapack.dgttrf(lower.numpy(), diag.numpy(), upper.numpy())
    assert info == 0
    return float(abs(u_diag).min())


def _mp_forward_errors(system, solutions):
    """``max|x - x_ref| / max|x_ref|`` of each solution, ``x_ref`` refined from SciPy's ``?gtsv``
    with residuals and iterates in 40-digit mpmath (independent of the package's reference)."""
    import mpmath
    import numpy as np
    from scipy.linalg import lapack as scipy_lapack

    arrays = [t.numpy() for t in system]
    n = len(arrays[1])

    def gtsv(b):
        *_, x, info = scipy_lapack.dgtsv(*arrays[:3], np.asarray(b, dtype=np.float64)[:, None])
        assert info == 0
        return x[:, 0]

    with mpmath.workdps(40):
        lo, d, up, b = ([mpmath.mpf(float(v)) for v in a] for a in arrays)
        x = [mpmath.mpf(float(v)) for v in gtsv(arrays[3])]
        for _ in range(6):
            r = [b[i] - d[i] * x[i] - (lo[i - 1] * x[i - 1] if i else 0) - (up[i] * x[i + 1] if i < n - 1 else 0)
                 for i in range(n)]
            x = [xi + float(ci) for xi, ci in zip(x, gtsv([float(v) for v in r]))]
        scale = max(abs(v) for v in x)
        return [float(max(abs(mpmath.mpf(float(v)) - xr) for v, xr in zip(s.tolist(), x)) / scale)
                for s in solutions]


def _new_cell_output_and_prose():
    cells = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "17_distributed.ipynb")
                       .read_text())["cells"]
    index = next(i for i, c in enumerate(cells) if c.get("id") == "f17refine")
    out = "".join("".join(o.get("text", "")) for o in cells[index]["outputs"])
    return out, " ".join("".join(cells[index + 1]["source"]).split())


def test_the_nearly_singular_block_is_nearly_singular_and_lapack_is_accurate_on_it():
    """The stored output and its prose: rank 0's block has a pivot 5e8 times smaller than A's smallest, 0.2, and
    LAPACK's forward error is 1e-15 (SciPy's ?gttrf and ?gtsv, and an mpmath reference, here)."""
    system, m = _nearly_singular_block_system()
    lower, diag, upper, _ = system
    block = _smallest_pivot(lower[:m - 1], diag[:m], upper[:m - 1])
    whole = _smallest_pivot(*system[:3])
    assert block < 1e-9 and whole > 0.1
    (lapack_error,) = _mp_forward_errors(system, [tridiagonal_solve(*system, driver="lapack")])
    assert lapack_error < 1e-14
    out, prose = _new_cell_output_and_prose()
    assert f"the whole A {whole:.1f}; rank 0's block {whole / block:.0e} times smaller" in out
    assert f"forward error max |x - x_ref| / max |x_ref|: {lapack_error:.0e}" in out
    mantissa, exponent = f"{whole / block:.0e}".split("e")
    assert f"a pivot ${mantissa} \\times 10^{int(exponent)}$ times smaller than $A$'s smallest, ${whole:.1f}$" in prose
    assert "the split solve's error was $10^7$ times LAPACK's, and no check fell back" in prose
    assert "refined, about a tenth of LAPACK's" in prose
    assert "refinement_steps=2: forward error / LAPACK's, to the nearest power of ten: 10^-1; fallbacks on each rank [0, 0]" in out
    assert "refinement_steps=0: forward error / LAPACK's, to the nearest power of ten: 10^7; fallbacks on each rank [0, 0]" in out


@pytest.mark.slow
def test_refinement_is_what_keeps_a_nearly_singular_block_within_lapacks_error():
    """The chapter's claim for refinement on its own split solve: on a block 1e-10 from singular
    (by determinant), unrefined the error is about 10^7 times LAPACK's and no check falls back;
    refined, below LAPACK's (about a tenth), also without a fallback."""
    system, _ = _nearly_singular_block_system()
    ranks = run_on_ranks(nearly_singular_block_worker, 2, system)
    refined, unrefined = (torch.cat([r[steps][0] for r in ranks]) for steps in (distributed.REFINEMENT_STEPS, 0))
    lapack_error, refined_error, unrefined_error = _mp_forward_errors(
        system, [tridiagonal_solve(*system, driver="lapack"), refined, unrefined])
    assert all(r[steps][1] == 0 for r in ranks for steps in (distributed.REFINEMENT_STEPS, 0))
    assert round(math.log10(unrefined_error / lapack_error)) == 7
    assert refined_error < lapack_error
    assert round(math.log10(refined_error / lapack_error)) == -1


def test_the_backward_is_one_all_gather_then_a_split_solve_with_the_conjugate_transpose():
    """Section 17.5: the backward of split_solve all-gathers once (couplings and the ends of x), then
    runs the forward's split solve (its collectives less the validation) with A^H; the right-hand
    side's gradient is v = A^-H g, checked against a solve with the transposed bands."""
    with one_rank_group():
        system = parallel_demos.random_system(50)
        pieces = [t.clone().requires_grad_() for t in distributed.split_bands(*system, 0, 1)]
        with distributed.record() as forward:
            x = distributed.split_solve(*pieces)
        with distributed.record() as backward:
            grads = torch.autograd.grad(x.square().sum(), pieces)
    forward_names = [what for what, _, _ in forward.collectives]
    backward_names = [what for what, _, _ in backward.collectives]
    assert forward_names[0] == "validate" and backward_names[0] == "backward_neighbours"
    assert backward_names[1:] == forward_names[1:] and backward.solves == 1
    lower, diag, upper, _ = system
    v = tridiagonal_solve(upper, diag, lower, 2 * x.detach(), driver="lapack")  # A^T v = g, g = 2x
    torch.testing.assert_close(grads[3], v, rtol=1e-10, atol=1e-12)


def test_a_torch_func_transform_is_refused_before_the_group_is_needed():
    """Section 17.5: in a process with no process group, a plain split_solve fails in its
    validation (which needs the group), but under torch.func.grad the refusal comes first and
    names the remedies."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    pieces = distributed.split_bands(*parallel_demos.random_system(8), 0, 1)

    def loss(diag):
        return distributed.split_solve(pieces[0], diag, *pieces[2:]).square().sum()

    with pytest.raises(RuntimeError, match="init_process_group"):
        loss(pieces[1])
    with pytest.raises(NotImplementedError, match=r"^split_solve: torch\.func") as refused:
        torch.func.grad(loss)(pieces[1])
    assert "loss.backward()" in str(refused.value) and "tridiagonal_solve" in str(refused.value)
