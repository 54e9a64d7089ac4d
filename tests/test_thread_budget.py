"""The C++ kernel's thread budget (csrc/threads.h, ``claim_chunks``; ``compiled.thread_budget``).

The batch kernel's blocks and the pieces kernel's few large systems are claimed in chunks from a
shared counter by the pool's threads, in one parallel region per solve. A region in which a
thread spent more than a fifth of it off the CPU (another process had its core) is a stall; after
two in a row, regions run on the calling thread alone for a while. These tests make a stall
certain by giving a process two threads and one core, and check that the answers are the same bits
on any thread count, stalled or not."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.linalg
import torch

from tridiag_tutorial.kernels import compiled

from conftest import require_cpp


@pytest.fixture(autouse=True)
def _cpp():
    require_cpp()

BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
LANES = {torch.float32: 16, torch.float64: 8}  # systems in a block of the batch kernel


def dominant_batch(batch, n, k, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    lower = torch.randn(batch, n - 1, generator=generator, dtype=dtype)
    upper = torch.randn(batch, n - 1, generator=generator, dtype=dtype)
    diag = 4 + torch.rand(batch, n, generator=generator, dtype=dtype)
    rhs = torch.randn(batch, n, k, generator=generator, dtype=dtype)
    return lower, diag, upper, rhs


def same_bits(a, b):
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, n, k", [
    (1, 8, 1),          # one block, padded: no region
    (100_003, 8, 2),    # many chunks of blocks, the last one short
    (13, 4096, 1),      # two blocks, one a chunk
    (3, 5000, 3),       # the pieces kernel, one system a chunk
])
def test_same_bits_on_any_thread_count(dtype, batch, n, k):
    """Each shape on 1, 2 and 3 threads gives the same bits; each system the bits it gets when
    solved alone where that is the same kernel (a block of the batch kernel holds systems of
    fewer than ``PIECES_MIN_N`` unknowns, or the pieces kernel solves both); and the answer is
    SciPy's banded solve's."""
    args = dominant_batch(batch, n, k, dtype, seed=batch + n)
    previous = torch.get_num_threads()
    try:
        answers = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            answers[threads] = compiled.solve(*args)
    finally:
        torch.set_num_threads(previous)
    for threads in (2, 3):
        assert same_bits(answers[threads], answers[1]), threads
    same_kernel_alone = n < compiled.PIECES_MIN_N or batch < LANES[dtype]
    for s in sorted({0, batch // 2, batch - 1}):
        if same_kernel_alone:
            alone = compiled.solve(*(a[s:s + 1] for a in args))
            assert same_bits(answers[1][s:s + 1], alone), s
        lower, diag, upper, rhs = (a[s].double().numpy() for a in args)
        bands = np.stack([np.r_[0.0, upper], diag, np.r_[lower, 0.0]])
        expected = scipy.linalg.solve_banded((1, 1), bands, rhs)
        tolerance = 1e-4 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(answers[1][s].double().numpy(), expected, rtol=tolerance,
                                   atol=tolerance, err_msg=str(s))


# In a fresh process with one core and two threads: the pool's second thread can only run when the
# first is off the core, so every parallel region stalls.
ONE_CORE_TWO_THREADS = textwrap.dedent("""
    import json, os, sys
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before torch starts its threads
    import torch
    from tridiag_tutorial.kernels import compiled
    sys.path.insert(0, sys.argv[1])
    from test_thread_budget import dominant_batch, same_bits

    out = {}
    for name, (batch, n, k, dtype) in {
            "batch": (40_000, 32, 1, torch.float64),
            "pieces": (3, 100_000, 1, torch.float64)}.items():
        if name != sys.argv[2]:
            continue
        args = dominant_batch(batch, n, k, dtype, seed=5)
        torch.set_num_threads(1)
        alone = compiled.solve(*args)
        torch.set_num_threads(2)
        start = compiled.thread_budget()
        xs = []
        for _ in range(6):
            xs.append(compiled.solve(*args))
            if compiled.thread_budget().solo_seconds_left > 0:
                break
        stalled = compiled.thread_budget()
        xs.append(compiled.solve(*args))  # within the 50 ms alone: no region, no stall
        end = compiled.thread_budget()
        out[name] = dict(
            stalls=stalled.stalled_regions - start.stalled_regions,
            solo_left=stalled.solo_seconds_left,
            stalls_while_alone=end.stalled_regions - stalled.stalled_regions,
            same_bits=[same_bits(x, alone) for x in xs])
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
@pytest.mark.parametrize("kernel", ["batch", "pieces"])
def test_two_threads_on_one_core_stall_and_then_run_alone(kernel):
    """Two threads on one core, the batch kernel (40000 systems of 32) or the pieces kernel (3
    systems of 1e5), in a fresh process: two stalled regions in a row, then the solves run alone
    (the next one measures no region); every answer has the bits of the one-thread solve."""
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", ONE_CORE_TWO_THREADS, tests, kernel],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])[kernel]
    assert got["stalls"] == 2, got
    assert got["solo_left"] > 0, got
    assert got["stalls_while_alone"] == 0, got
    assert all(got["same_bits"]), got


def test_thread_budget_without_the_kernel_names_it(monkeypatch):
    """Without the C++ kernel, ``thread_budget`` raises the missing-kernel error."""
    monkeypatch.setattr(compiled, "_C", None)
    with pytest.raises(RuntimeError, match=re.escape("C++ kernel is not available")):
        compiled.thread_budget()
