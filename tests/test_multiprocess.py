"""run_on_ranks (tridiag_tutorial.book.multiprocess) and chapter 17's training demos on 2 and 4 gloo ranks.

The launcher must return every rank's value in rank order, and turn every way a rank can fail
into an error in the caller: an exception (with its rank, message and traceback), an exit without
a result, a hang. The demos must train as one process does: data parallelism changes where the
gradient is computed, not what it is.

Each test that starts processes is marked slow (a fresh interpreter per rank imports torch, 2 to 4
s); the checks of one world size share one spawned job.
"""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from tridiag_tutorial.book import parallel_demos
from tridiag_tutorial.book.multiprocess import WorkerError, WorkerTimeout, run_on_ranks

slow = pytest.mark.slow


# -- the workers: top-level functions, so that a spawned process can import them ----------------
def _training_job(rank, world_size, token):
    """Everything one world size checks, in one spawned job: the rank and environment this
    process got, a collective across the ranks, and the DDP and FSDP2 demos."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"rank": rank, "world_size": world_size, "token": token,
            "pid": os.getpid(), "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "sum": total.item(),
            "ddp": parallel_demos.ddp_worker(rank, world_size),
            "fsdp": parallel_demos.fsdp_worker(rank, world_size)}


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # rank 0 would wait here for rank 1 until the group's timeout
    return rank


def _exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()  # never completes: rank 1 is gone
    return rank


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


# -- the launcher ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """The demos' training in this process, on the whole batch."""
    return parallel_demos.train_one_process()


@pytest.fixture(scope="module", params=[2, 4])
def job(request):
    world_size = request.param
    return world_size, run_on_ranks(_training_job, world_size, "abc", timeout=120)


@slow
def test_values_come_back_in_rank_order_from_separate_processes(job):
    world_size, results = job
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size and r["token"] == "abc" for r in results)
    pids = {r["pid"] for r in results}
    assert len(pids) == world_size and os.getpid() not in pids
    # the all_reduce of rank + 1 over the group: 1 + 2 + ... + world_size on every rank
    assert [r["sum"] for r in results] == [world_size * (world_size + 1) / 2] * world_size
    assert all(r["threads"] == 1 and r["OMP_NUM_THREADS"] == "1" for r in results)


def _max_difference(parameters, expected):
    assert parameters.keys() == expected.keys()
    return max((parameters[name] - expected[name]).abs().max().item() for name in expected)


@slow
@pytest.mark.parametrize("demo", ["ddp", "fsdp"])
def test_data_parallel_training_equals_one_process(job, reference, demo):
    world_size, results = job
    first = results[0][demo]["parameters"]
    initial = parallel_demos.BandedSolveModel().state_dict()
    assert _max_difference(first, initial) > 1e-3, "training did not move the parameters"
    for r in results:
        out = r[demo]
        # every rank holds the same parameters (DDP: bit for bit; FSDP2: gathered shards)
        assert _max_difference(out["parameters"], first) == 0
        # and they are those of one process on the whole batch, up to the order of the sums
        assert _max_difference(out["parameters"], reference["parameters"]) < 1e-12
        torch.testing.assert_close(torch.tensor(out["losses"]),
                                   torch.tensor(reference["losses"]), rtol=1e-12, atol=0)
        assert out["band_types"] == ("Parameter",) * 3  # the op saw ordinary parameters


@slow
def test_fsdp_stores_only_a_shard_between_steps(job):
    world_size, results = job
    n = parallel_demos.N
    for name, length in [("lower", n - 1), ("diag", n), ("upper", n - 1)]:
        shards = [r["fsdp"]["stored"][name] for r in results]
        assert all(kind == "DTensor" and placements == "(Shard(dim=0),)"
                   for kind, placements, _ in shards)
        assert sum(shape[0] for _, _, shape in shards) == length
        assert max(shape[0] for _, _, shape in shards) == -(-length // world_size)


@slow
def test_a_worker_exception_is_raised_with_its_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    error = caught.value
    assert error.rank == 1 and error.type_name == "ValueError"
    assert str(error).startswith("rank 1 of 2 raised ValueError: deliberate failure on rank 1")
    assert "_raise_on_rank_one" in error.worker_traceback  # the worker's own frames
    assert "_raise_on_rank_one" in str(error)
    assert time.monotonic() - start < 30, "the parent waited for rank 0's barrier to time out"
    assert not multiprocessing.active_children(), "a rank was left running"


@slow
def test_a_worker_that_exits_without_a_result_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_on_ranks(_exit_on_rank_one, 2, timeout=60)
    assert not isinstance(caught.value, WorkerTimeout)
    assert caught.value.rank == 1 and caught.value.exitcode == 3
    assert "exited with code 3" in str(caught.value)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


@slow
def test_a_run_past_its_timeout_is_stopped():
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as caught:
        run_on_ranks(_sleep, 2, 600, timeout=4)
    elapsed = time.monotonic() - start
    assert 4 <= elapsed < 20
    assert caught.value.rank == 0 and "had not returned after 4 s" in str(caught.value)
    assert isinstance(caught.value, TimeoutError)
    assert not multiprocessing.active_children()


# -- what is refused before any process starts (fast) -------------------------------------------
def test_a_function_a_spawned_process_cannot_import_is_refused():
    def local(rank, world_size):
        return rank

    for fn in (local, lambda rank, world_size: rank):
        with pytest.raises(ValueError, match="cannot be imported by a spawned process"):
            run_on_ranks(fn, 2)
    main_function = type(local)(local.__code__, {"__name__": "__main__"}, "in_a_cell")
    main_function.__module__, main_function.__qualname__ = "__main__", "in_a_cell"
    with pytest.raises(ValueError, match=r"'in_a_cell' \(module '__main__'\)"):
        run_on_ranks(main_function, 2)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("world_size, timeout", [(0, 10), (1.5, 10), (2, 0)])
def test_bad_arguments_are_refused(world_size, timeout):
    with pytest.raises(ValueError, match="world_size|timeout"):
        run_on_ranks(_sleep, world_size, 0, timeout=timeout)


def test_an_uneven_batch_is_refused():
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        parallel_demos._rank_slice(0, 4, 30)


def test_the_model_solves_each_example_with_the_bands():
    """The demo model against the dense reference: A x_i = W f_i + c for every example."""
    model = parallel_demos.BandedSolveModel()
    features, _ = parallel_demos.make_data(6)
    x = model(features)
    rhs = model.encode(features)
    A = (torch.diag(model.diag) + torch.diag(model.lower, -1) + torch.diag(model.upper, 1))
    torch.testing.assert_close(x, torch.linalg.solve(A, rhs.T).T, rtol=1e-10, atol=1e-12)
