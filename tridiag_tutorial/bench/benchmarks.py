"""Benchmark every solver in the book against raw LAPACK ``?gtsv`` and JAX.

Run::

    python -m tridiag_tutorial.bench.benchmarks                  # the full suite (see below)
    python -m tridiag_tutorial.bench.benchmarks --quick          # tiny sizes: a smoke test
    python -m tridiag_tutorial.bench.benchmarks --out results.json

With ``--min-time 0.1 --repeats 4``, the settings of the results the book renders, the main
rows and the comparison with JAX took about 17 minutes on a 2-core machine (10 and 7; the
time-stepping experiment comes on top); the defaults (``--min-time 0.2 --repeats 7``) give each case 3.5 times
that timing budget. Each experiment's settings are recorded beside its rows (``*_config`` in the
JSON): the book's comparisons with JAX, for one, ran ``--jax-only --min-time 0.03`` with 7
repeats (AMD EPYC) and 15 (Intel Xeon).

Method: every figure is a median measured with PyTorch's own ``torch.utils.benchmark``:
``Timer.blocked_autorange`` runs the call in blocks (as many calls per block as make the timer's
own overhead negligible) for ``--min-time`` x ``--repeats`` seconds, and the figure is the median
block's time per call. Each case runs on one thread (``torch.set_num_threads(1)``, which ``Timer``
holds while it measures) and on the default number of threads, in the same process as its
baseline, raw ``?gtsv``; ratios to that baseline are comparable across machines. At the end the
suite prints ``torch.utils.benchmark.Compare`` tables of the run and the ratios to JAX.

Implementations: raw ``?gtsv`` through ``scipy.linalg.lapack`` (the baseline; a Python loop over
the systems of a batch), ``scipy.linalg.solve_banded``, JAX's ``jax.lax.linalg.tridiagonal_solve``
(jitted, forward and ``jax.grad`` of all four inputs; only when JAX is installed, which the
package never requires: ``pip install jax``), dense ``torch.linalg.solve`` (including assembling
the matrix), the sequential pure-torch kernel (``driver="sequential"``), chapter 4's
``autograd.Function``, chapter 5's custom op and the final :func:`tridiag_tutorial.tridiagonal_solve`
as installed (``driver=None``: on the CPU the C++ kernel, except for one complex system of
``n > kernels.CPP_ONE_COMPLEX_SYSTEM_MAX_N``, which goes to LAPACK; see
:func:`tridiag_tutorial.kernels.choose_driver`), and the final op with ``driver="lapack"`` and
``driver="cpp"``. Modes: ``forward`` and ``backward`` (forward plus the gradients of all four
inputs), eager and ``torch.compile(fullgraph=True)``.

JAX's CPU backend sizes its thread pool once, when it starts, from the cores the process may run
on. So the interleaved comparison with JAX (:func:`run_against_jax`) runs each thread count in a
process of its own whose CPU affinity is that many cores, set before torch and JAX are imported:
XLA's pool, LAPACK's and torch's all get those cores (each row records the affinity and the pool
sizes seen). The JAX rows of the main table run in this process, at JAX's default pool.

The one-system experiment (:func:`run_one_system`, ``--one-system-only``) and the single systems
of the comparison with JAX measure the matrices users solve (``FAMILIES``, made by
:func:`one_system_family`: random with and without diagonal dominance, Poisson, implicit heat
steps, badly scaled rows, a nearly singular block, a nearly Toeplitz matrix; ``--families``), each
quiet and with a busy core (:func:`busy_core`: another process spinning on one core while the
pinned process measures; ``--busy``). Rows stored before there were families lack ``family`` and
``busy``: :func:`with_family_defaults` reads them as ``dominant``, quiet.

The time-stepping experiment (:func:`run_time_stepping`, skipped with ``--no-steps``, alone with
``--steps-only``) times an implicit simulation with one fixed matrix, ``u <- A^{-1} u`` for many
steps, forward and forward + backward, solving every step with
:func:`~tridiag_tutorial.tridiagonal_solve` against factoring once with
:func:`~tridiag_tutorial.tridiagonal_lu_factor` and solving with
:func:`~tridiag_tutorial.tridiagonal_lu_solve`.
The routes experiment (:func:`run_routes`, ``--routes-only``) times the final op against the same
op with one of its routes removed (the direct-kernel fast path, the ``inspect``-free
``Function.apply``, the C++ kernel), and against chapter 4's ``autograd.Function``: a route stays
only while it pays.

With ``--merge``, keys of the merged file that this run does not produce (such as ``factor_reuse``,
the measurements of an earlier op that could keep LAPACK's factors for its backward) are kept, and
so are its result rows of cases this run does not measure.

The command line writes each row to ``--out`` as soon as it is measured (atomically: a temporary
file, then ``os.replace``), with the key ``unfinished_run`` (``UNFINISHED``) until the run ends.
An interrupt (Ctrl-C) keeps what was measured, says so and exits with status 130; run again with
``--merge`` of that file to continue: the rows that the unfinished run measured with the same
settings on the same machine are kept and not measured again (``_Suite``; "the same row":
``UNIT_FIELDS``). On a terminal a status line on standard error shows the progress and an
estimate of the time left (``Progress``); elsewhere a plain line now and then. ``--help``
describes all of it in plain text.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy
import scipy.linalg
import torch
from scipy.linalg import get_lapack_funcs
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _routes, kernels
from ..api import tridiagonal_lu_factor, tridiagonal_lu_solve, tridiagonal_solve
from ..book.autograd_function import tridiagonal_solve_function
from ..book.custom_op import tridiagonal_solve_custom_op
from ..kernels import compiled
from ..reference import dense_solve

__all__ = ["problem", "time_call", "run", "run_time_stepping", "run_compiled_kernel", "run_torch_kernels",
           "run_against_jax", "run_one_system", "run_routes", "run_cliffs", "CountOperations", "evaluate_targets",
           "one_system_family", "busy_core", "with_family_defaults", "FAMILIES", "main"]

SINGLE_SIZES = [10**2, 10**3, 10**4, 10**5, 10**6]
BATCHES = [(1024, 256), (16384, 64), (100000, 8)]
DENSE_MAX_N = 2000  # O(n^3) time and O(n^2) memory: larger n would dominate the run
TORCH_KERNEL_MAX_N = 1000  # sequential over n: one system of 10^6 would take minutes


@dataclass
class Result:
    impl: str
    mode: str  # "forward" or "backward" (forward + all four gradients)
    compiled: bool
    n: int
    batch: int  # 0 for a single system
    dtype: str
    threads: int
    seconds: float | None  # median time of one call over the blocks; None if the call failed
    blocks: int = 0  # how many blocks of calls were timed (torch.utils.benchmark's replicates)
    calls_per_block: int = 0
    quartiles: list = field(default_factory=list)  # [25th, 75th] percentile of the blocks' times
    extremes: list = field(default_factory=list)  # [fastest, slowest] block, seconds per call
    error: str | None = None  # the exception, when the implementation failed on this case


def _timer(fn, **labels) -> benchmark.Timer:
    """A ``torch.utils.benchmark.Timer`` of ``fn()`` at torch's current thread count (``Timer``
    sets that count while it measures; its default would be one thread)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(),
                           **labels)


# [book: time-call]
def time_call(fn, min_time: float, repeats: int, **labels) -> benchmark.Measurement:
    """Time ``fn()`` with ``Timer.blocked_autorange`` for ``min_time * repeats`` seconds.

    Two untimed calls first (the first call of a compiled function compiles, which would
    otherwise set the block size). ``blocked_autorange`` then picks the number of calls per block
    (the timer's own overhead below 0.01% of a block) and times blocks until the total reaches the
    budget; the figure is the median block's time per call.
    """
    fn()
    fn()
    return _timer(fn, **labels).blocked_autorange(min_run_time=min_time * repeats)


def _summary(m: benchmark.Measurement) -> dict:
    """The fields of :class:`Result` that describe a measurement."""
    times = np.asarray(m.times)
    return dict(seconds=m.median, blocks=len(times), calls_per_block=m.number_per_run,
                quartiles=[float(q) for q in np.percentile(times, [25, 75])],
                extremes=[float(times.min()), float(times.max())])


def _calls_per_block(timer: benchmark.Timer, min_time: float) -> int:
    """How many calls make one block of ``timer`` last at least ``min_time`` seconds."""
    number = 1
    while True:
        elapsed = timer.timeit(number).times[0] * number
        if elapsed >= min_time or number >= 10**6:
            return number
        number = max(number * 2, int(number * min_time / max(elapsed, 1e-9)))


def _time_interleaved(fns: dict, min_time: float, repeats: int, contexts: dict | None = None,
                      spread: dict | None = None, samples: dict | None = None) -> dict:
    """Median seconds per call of each of ``fns``, timed in alternation (A B, B A, A B, ...), one
    block of each after the other, so that a change in the machine's load affects all alike.
    Each block is a ``Timer.timeit`` of the number of calls that lasts ``min_time``, after one
    untimed call: the first call after a switch runs with the other function's data in the
    caches and its memory freed (measured: without it, JAX's float64 gradient at n = 10^6 timed
    1.44 times as long as when timed alone), which a loop that calls one function never sees.
    ``contexts`` maps some keys to a context manager factory that is entered around every call
    of that function (its warm-up, calibration and each block) and left before the next.
    ``spread``, where given, receives each key's [25th, 75th] percentile of its blocks' times;
    ``samples`` each key's block times, one a round, in the order of the rounds."""
    contexts = contexts or {}

    def within(key):
        return contexts.get(key, contextlib.nullcontext)()

    timers = {}
    for key, fn in fns.items():
        with within(key):
            fn()  # warm up (and compile)
        timers[key] = _timer(fn)
    numbers = {}
    for key, t in timers.items():
        with within(key):
            numbers[key] = _calls_per_block(t, min_time)
    times = {key: [] for key in fns}
    for r in range(repeats):
        for key in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            with within(key):
                fns[key]()
                times[key].append(timers[key].timeit(numbers[key]).median)
    if spread is not None:
        spread.update({key: [float(q) for q in np.percentile(t, [25, 75])]
                       for key, t in times.items()})
    if samples is not None:
        samples.update({key: [float(x) for x in t] for key, t in times.items()})
    return {key: statistics.median(t) for key, t in times.items()}


def _each_thread_count(threads):
    """Set torch's thread count to each of ``threads`` in turn (``None``: the default), yielding
    the count in effect; the default is restored afterwards."""
    default = torch.get_num_threads()
    try:
        for nthreads in threads:
            torch.set_num_threads(nthreads or default)
            yield torch.get_num_threads()
    finally:
        torch.set_num_threads(default)


def problem(n: int, batch: int, dtype: torch.dtype, seed: int = 0, k: int | None = None):
    """A random, diagonally dominant system; ``k`` right-hand sides ``(.., n, k)`` if given."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch,) if batch else ()
    lower = torch.randn(*shape, n - 1, generator=g, dtype=torch.float64)
    upper = torch.randn(*shape, n - 1, generator=g, dtype=torch.float64)
    diag = torch.randn(*shape, n, generator=g, dtype=torch.float64) + 4.0
    rhs = torch.randn(*shape, n, *((k,) if k else ()), generator=g, dtype=torch.float64)
    args = [lower, diag, upper, rhs]
    if dtype.is_complex:  # non-zero imaginary parts, drawn after the real ones
        args = [t + 1j * torch.randn(t.shape, generator=g, dtype=torch.float64) for t in args]
    return [t.to(dtype) for t in args]


def _raw_gtsv(args):
    """The baseline: SciPy's f2py wrapper of ?gtsv, one call per system, nothing else."""
    arrays = [a.numpy() for a in args]
    routine = get_lapack_funcs(("gtsv",), (arrays[1],))[0]
    if arrays[1].ndim == 1:
        dl, d, du, b = arrays
        return lambda: routine(dl, d, du, b)
    systems = list(zip(*arrays))
    return lambda: [routine(dl, d, du, b) for dl, d, du, b in systems]


def _solve_banded(args):
    arrays = [a.numpy() for a in args]
    lower, diag, upper, rhs = arrays
    if diag.ndim == 1:
        lower, diag, upper, rhs = (a[None] for a in arrays)
    bands = []
    for dl, d, du in zip(lower, diag, upper):
        ab = np.zeros((3, d.shape[0]), dtype=d.dtype)
        ab[0, 1:], ab[1], ab[2, :-1] = du, d, dl
        bands.append(ab)
    return lambda: [scipy.linalg.solve_banded((1, 1), ab, b) for ab, b in zip(bands, rhs)]


def _dense(lower, diag, upper, rhs):
    return dense_solve(lower, diag, upper, rhs)


FINAL = "tridiagonal_solve (final)"  # the final op as installed: driver=None
FINAL_LAPACK = "tridiagonal_solve (driver='lapack')"
FINAL_CPP = "tridiagonal_solve (driver='cpp')"  # only where the C++ kernel was built
JAX_IMPL = "jax tridiagonal_solve"
# Names of earlier suites whose meaning no longer exists: dropped from a --merge'd file.
# "final, C++ kernel" was the final op after compiled.load(), when the C++ kernel was opt-in.
RETIRED_IMPLS = ("tridiagonal_solve (final, C++ kernel)",)

TORCH_IMPLS = {
    "torch.linalg.solve (dense)": _dense,
    # the sequential pivoting kernel alone: driver=None would send n >= 64 off the CPU to the
    # partitioned kernel, which run_torch_kernels times against it
    "pure-torch kernel": functools.partial(tridiagonal_solve, driver="sequential"),
    "ch4 autograd.Function": tridiagonal_solve_function,
    "ch5 custom_op": tridiagonal_solve_custom_op,
    FINAL: tridiagonal_solve,
    FINAL_LAPACK: functools.partial(tridiagonal_solve, driver="lapack"),
}
CPP_IMPLS = {FINAL_CPP: functools.partial(tridiagonal_solve, driver="cpp")}
COMPILED = ["ch5 custom_op", FINAL]
# The compiled rows: torch.compile's settings, the same in every experiment.
COMPILE_OPTIONS = dict(fullgraph=True, dynamic=True)


# Why a case is not timed at all, recorded as its row's error (so that a --merge'd file keeps no
# stale row of it). torch.linalg.solve on a batch with more than one thread fails inside oneMKL's
# getrf on torch 2.13's CPU build: "Parameter 6 was incorrect on entry to SLASWP", then wrong
# pivots (AMD EPYC: lu_solve refuses them) or a hang (Intel Xeon), in float32 and float64.
DENSE_BATCH_THREADS = ("not run: torch.linalg.solve on a batch with more than one thread fails in "
                       "oneMKL's getrf (SLASWP parameter 6: wrong pivots or a hang)")


def _not_run(impl: str, batch: int, threads: int) -> str | None:
    if impl.startswith("torch.linalg.solve") and batch and threads > 1:
        return DENSE_BATCH_THREADS
    return None


def _wanted(impl: str, n: int, batch: int) -> bool:
    if impl.startswith("torch.linalg.solve"):
        return n <= DENSE_MAX_N and (batch or 1) * n * n <= 2 * 10**8
    if impl == "pure-torch kernel":
        return n <= TORCH_KERNEL_MAX_N
    return True


def _torch_callable(fn, args, mode):
    """A no-argument callable that runs ``fn`` forward, or forward + the gradients of all four
    inputs (``mode="backward"``, with a cotangent of ones)."""
    leaves = [a.detach().requires_grad_() for a in args]
    cotangent = torch.ones_like(args[3])

    def forward_backward():
        x = fn(*leaves)
        return torch.autograd.grad(x, leaves, cotangent)

    return (lambda: fn(*args)) if mode == "forward" else forward_backward


def _jax():
    """The ``jax`` module with 64-bit floats enabled, or ``None`` when JAX is not installed (it
    is never a requirement: only these benchmarks use it)."""
    try:
        import jax
    except ImportError:
        return None
    jax.config.update("jax_enable_x64", True)
    return jax


def _jax_callable(args, mode: str):
    """``jax.lax.linalg.tridiagonal_solve``, jitted, on the same system: forward, or forward +
    the gradients of all four inputs (``mode="backward"``: ``jax.grad`` of ``sum(x)``, as ours
    with a cotangent of ones). The inputs are built outside the timed call, in JAX's own band
    convention (bands of length ``n``, ``dl[..., 0] = du[..., -1] = 0``) and a matrix ``b``, so
    JAX pays no conversion. ``None`` when JAX is not installed."""
    jax = _jax()
    if jax is None:
        return None
    lower, diag, upper, rhs = (a.numpy() for a in args)
    zero = np.zeros(diag.shape[:-1] + (1,), dtype=diag.dtype)
    inputs = [jax.numpy.asarray(a) for a in (np.concatenate([zero, lower], axis=-1), diag,
                                              np.concatenate([upper, zero], axis=-1),
                                              rhs[..., None] if rhs.ndim == diag.ndim else rhs)]
    solve = jax.lax.linalg.tridiagonal_solve
    if mode == "forward":
        fn = jax.jit(solve)
    else:
        fn = jax.jit(jax.grad(lambda *a: solve(*a).sum(), argnums=(0, 1, 2, 3)))
    return lambda: jax.block_until_ready(fn(*inputs))


def _cpp_or_log(log) -> bool:
    """Whether the C++ kernel was built at install (``driver="cpp"``); if not, the reason logged."""
    if kernels.cpp_available():
        return True
    from ..kernels import compiled
    log(f"  (no C++ kernel rows: it was not built at install: {compiled.BUILD_ERROR})")
    return False


MODES = ("forward", "backward")


def _main_rows(n: int, batch: int, threads: int, impls, compile: bool, jax: bool) -> list:
    """The rows of one case (``n``, ``batch``) of :func:`run` at ``threads`` threads, in the order
    they are timed: ``(impl, mode, compiled, reason)``, ``reason`` saying why the row is not timed
    at all (``None``: timed)."""
    rows = [("dgtsv (raw LAPACK)", "forward", False, None),
            ("scipy solve_banded", "forward", False, None)]
    for impl in impls:
        if not _wanted(impl, n, batch):
            continue
        reason = _not_run(impl, batch, threads)
        for mode in MODES:
            rows.append((impl, mode, False, reason))
            if reason is None and compile and impl in COMPILED:
                rows.append((impl, mode, True, None))
    # JAX last in each case, so that none of our rows is timed right after it (its CPU runtime
    # runs worker threads of its own).
    rows += [(JAX_IMPL, mode, False, None) for mode in (MODES if jax else ())]
    return rows


def _shape(n: int, batch: int) -> str:
    """A case in a few characters: ``n=100`` for one system, ``16x8`` for 16 systems of n = 8."""
    return f"{batch}x{n}" if batch else f"n={n}"


def run(sizes=SINGLE_SIZES, batches=BATCHES, dtypes=(torch.float32, torch.float64),
        threads=(1, None), compile=True, jax=True, cpp=True, min_time=0.2, repeats=7,
        log=print, progress=None, measurements=None, recorder=None):
    """Measure everything; return a list of :class:`Result` (as dicts).

    ``jax``: also time JAX's ``tridiagonal_solve`` and its gradient when JAX is installed (at
    JAX's default thread pool: :func:`run_against_jax` pins it). ``cpp``: also time the final op
    with ``driver="cpp"`` where the C++ kernel was built (the rows of the final op as installed,
    ``driver=None``, use it wherever :func:`~tridiag_tutorial.kernels.choose_driver` picks it,
    with or without ``cpp``). ``progress``, if given, is called with the results so far after
    each row. ``measurements``, if a list, receives every ``torch.utils.benchmark.Measurement``.
    ``recorder`` (the command line's): told the rows to measure, asked which of them a run being
    continued has measured already (those are skipped: not in the returned list), and given each
    row as soon as it is measured.
    """
    recorder = recorder or _NO_RECORDER
    results = []
    shapes = [(n, 0) for n in sizes] + [(n, b) for b, n in batches]
    compiled_fns = {}
    if jax and _jax() is None:
        log("  (no JAX rows: jax is not installed; pip install jax to add them)")
        jax = False
    cpp = cpp and _cpp_or_log(log)
    impls = {**TORCH_IMPLS, **(CPP_IMPLS if cpp else {})}
    dnames = {dtype: str(dtype).replace("torch.", "") for dtype in dtypes}

    def unit(impl, mode, is_compiled, n, batch, dtype, threads):
        return dict(impl=impl, mode=mode, compiled=is_compiled, n=n, batch=batch,
                    dtype=dnames[dtype], threads=threads)

    recorder.begin([unit(impl, mode, is_compiled, n, batch, dtype, count)
                    for count in _thread_count_values(threads) for dtype in dtypes
                    for n, batch in shapes
                    for impl, mode, is_compiled, reason in _main_rows(n, batch, count, impls,
                                                                   compile, jax)
                    if reason is None])
    # Each (function, dtype, rank, mode) compiles once with dynamic shapes; all of them share one
    # code object's cache in Dynamo, so the default limit of 8 entries is too small here.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for actual_threads in _each_thread_count(threads):
        torch._dynamo.reset()  # the thread count is part of Dynamo's guards: start afresh
        compiled_fns.clear()
        for dtype in dtypes:
            dname = dnames[dtype]
            for n, batch in shapes:
                args = None
                for impl, mode, is_compiled, reason in _main_rows(n, batch, actual_threads, impls,
                                                               compile, jax):
                    if reason is not None:  # a row all the same, with its reason
                        row = asdict(Result(impl, mode, False, n, batch, dname, actual_threads,
                                            None, error=reason))
                        results.append(row)
                        recorder.add([row])
                        continue
                    if recorder.done(unit(impl, mode, is_compiled, n, batch, dtype,
                                          actual_threads)):
                        continue
                    if args is None:
                        args = problem(n, batch, dtype)
                    if impl == "dgtsv (raw LAPACK)":
                        fn = _raw_gtsv(args)
                    elif impl == "scipy solve_banded":
                        fn = _solve_banded(args)
                    elif impl == JAX_IMPL:
                        fn = _jax_callable(args, mode)
                    else:
                        solve = impls[impl]
                        if is_compiled:
                            key = (impl, mode, dtype, batch > 0)
                            if key not in compiled_fns:
                                compiled_fns[key] = torch.compile(solve, **COMPILE_OPTIONS)
                            solve = compiled_fns[key]
                        fn = _torch_callable(solve, args, mode)
                    label = f"{impl}{' [compiled]' if is_compiled else ''}"
                    where = (f"  {dname:7s} thr={actual_threads:<2d} {_shape(n, batch):>10s} "
                             f"{mode:8s} {label:36s}")
                    try:
                        m = time_call(fn, min_time, repeats,
                                  label=f"{mode}, {dname}, {actual_threads} thread(s)",
                                  sub_label=f"n={n}" + (f" x {batch}" if batch else ""),
                                  description=label)
                    except Exception as err:  # a failing implementation is a result too
                        error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                        row = asdict(Result(impl, mode, is_compiled, n, batch, dname,
                                            actual_threads, None, error=error))
                        log(f"{where} FAILED {error}"[:100])
                    else:
                        if measurements is not None:
                            measurements.append(m)
                        row = asdict(Result(impl, mode, is_compiled, n, batch, dname,
                                            actual_threads, **_summary(m)))
                        log(f"{where} {m.median * 1e6:12.1f} us")
                    results.append(row)
                    recorder.add([row], f"{dname} {actual_threads} thr {_shape(n, batch)} "
                                        f"{mode} {label}")
                    if progress is not None:
                        progress(list(results))
    return results


# The time-stepping experiment: one fixed matrix, many solves; factoring once against solving
# from the bands every step (the application chapter renders it).
STEP_CASES = {  # kernel -> (n, batch, k): k right-hand sides per system, None for a vector
    "LAPACK": [(1000, 0, None), (1000, 0, 6), (10**5, 0, None), (256, 64, None)],
    "pure-torch kernel": [(32, 256, None)],
}
STEPS = 20
# kernel -> the driver of both strategies: the factorization, the solves from its factors, and
# the solves from the bands (LAPACK ?gttrf/?gttrs against ?gtsv; the sequential torch kernel's
# factor and lu_solve against its solve)
STEP_DRIVERS = {"LAPACK": "lapack", "pure-torch kernel": "sequential"}


def _stepper(n: int, batch: int, dtype, steps: int, factor_once: bool, mode: str, kernel: str,
             k: int | None = None):
    """One simulation of ``steps`` implicit steps; the bands and the initial state require grad
    in ``backward`` mode, whose loss is the sum of the last state. ``kernel`` is a key of
    :data:`STEP_DRIVERS`."""
    lower, diag, upper, u0 = problem(n, batch, dtype, k=k)
    driver = STEP_DRIVERS[kernel]
    args = [t.detach().requires_grad_(mode == "backward") for t in (lower, diag, upper, u0)]

    def simulate():
        lower, diag, upper, u = args
        if factor_once:
            factors = tridiagonal_lu_factor(lower, diag, upper, driver=driver)
            for _ in range(steps):
                u = tridiagonal_lu_solve(factors, u, driver=driver)
        else:
            for _ in range(steps):
                u = tridiagonal_solve(lower, diag, upper, u, driver=driver)
        if mode == "backward":
            torch.autograd.grad(u.sum(), args)
    return simulate


def run_time_stepping(cases=STEP_CASES, steps=STEPS, dtypes=(torch.float64,), threads=(1,),
                      min_time=0.2, repeats=15, log=print, recorder=None):
    """Time ``steps`` implicit steps, factoring once against solving every step.

    The two strategies are timed in alternation (:func:`_time_interleaved`), so a change in the
    machine's load favours neither. Returns a list of dicts with both median times and ``ratio`` =
    factor once / solve every step. ``recorder``: as :func:`run`'s, a row at a time.
    """
    recorder = recorder or _NO_RECORDER

    def unit(kernel, dtype, threads, n, batch, k, mode):
        return dict(kernel=kernel, dtype=str(dtype).replace("torch.", ""), threads=threads, n=n,
                    batch=batch, k=k or 1, steps=steps, mode=mode)

    recorder.begin([unit(kernel, dtype, count, n, batch, k, mode)
                    for count in _thread_count_values(threads)
                    for kernel, shapes in cases.items() for dtype in dtypes
                    for n, batch, k in shapes for mode in MODES])
    rows = []
    for actual_threads in _each_thread_count(threads):
        for kernel, shapes in cases.items():
            for dtype in dtypes:
                for n, batch, k in shapes:
                    for mode in MODES:
                        if recorder.done(unit(kernel, dtype, actual_threads, n, batch, k, mode)):
                            continue
                        best = _time_interleaved(
                            {once: _stepper(n, batch, dtype, steps, once, mode, kernel, k)
                             for once in (True, False)}, min_time, repeats)
                        row = dict(kernel=kernel, dtype=str(dtype).replace("torch.", ""),
                                   threads=actual_threads, n=n, batch=batch, k=k or 1, steps=steps,
                                   mode=mode, factor_once_seconds=best[True],
                                   every_step_seconds=best[False], ratio=best[True] / best[False])
                        rows.append(row)
                        recorder.add([row], f"{kernel} {row['dtype']} {actual_threads} thr "
                                            f"{_shape(n, batch)} k={k or 1} {mode}")
                        log(f"  steps  {kernel:17s} {row['dtype']:8s} threads={actual_threads} "
                            f"n={n:>7d} batch={batch:>5d} k={k or 1} {mode:8s}: factor once "
                            f"{best[True] * 1e3:9.2f} ms, every step {best[False] * 1e3:9.2f} ms, "
                            f"ratio {row['ratio']:.3f}")
    return rows


# The compiled kernel against LAPACK and JAX: forward only, float64, one right-hand side; each
# case's implementations timed in alternation. JAX is timed when it is installed (never required).
ONE_CHAIN = 2**62  # pieces_min_n that keeps every system on the interleaved elimination
COMPILED_CASES = [(256, 1024), (64, 16384), (8, 100000), (10**5, 0), (10**6, 0)]  # (n, batch)


def run_compiled_kernel(cases=COMPILED_CASES, threads=(1, None), min_time=0.2, repeats=15,
                        log=print, recorder=None):
    """Time the compiled kernel's interleaved elimination (the op built at install,
    ``torch.ops.tridiag_tutorial.cpp_solve_ex``, through :func:`tridiag_tutorial.kernels.compiled.solve_ex`
    with the solve in pieces off, so that one system is one chain: chapter 14 compares the
    two), a Python loop of raw ``dgtsv``, the joined ``lapack.solve`` and, if installed, JAX,
    forward only, float64. Returns rows with ``seconds``, ``ns_per_unknown`` and ``ratio`` to the
    ``dgtsv`` loop. Raises ``RuntimeError`` where the C++ kernel was not built. ``recorder``: as
    :func:`run`'s, a case (its rows timed together) at a time."""
    from ..kernels import compiled, lapack
    if not compiled.is_available():
        raise RuntimeError(compiled._missing_message())

    def op(*matrix):
        return compiled.solve_ex(*matrix, pieces_min_n=ONE_CHAIN)
    recorder = recorder or _NO_RECORDER
    recorder.begin([dict(threads=count, n=n, batch=batch)
                    for count in _thread_count_values(threads) for n, batch in cases])
    rows = []
    for actual in _each_thread_count(threads):
        for n, batch in cases:
            if recorder.done(dict(threads=actual, n=n, batch=batch)):
                continue
            args = problem(n, batch, torch.float64)
            matrix = [*args[:3], args[3].unsqueeze(-1)]
            arrays = [a.numpy() for a in matrix]
            fns = {"compiled kernel": lambda: op(*matrix),
                   "dgtsv (raw LAPACK)": _raw_gtsv(args),
                   "lapack.solve (joined batch)": lambda: lapack.solve(*arrays)}
            jax_fn = _jax_callable(args, "forward")
            if jax_fn is not None:
                fns["jax tridiagonal_solve"] = jax_fn
            medians = _time_interleaved(fns, min_time, repeats)
            unknowns = n * max(batch, 1)
            case = []
            for impl, seconds in medians.items():
                row = dict(impl=impl, n=n, batch=batch, threads=actual, seconds=seconds,
                           ns_per_unknown=seconds / unknowns * 1e9,
                           ratio=seconds / medians["dgtsv (raw LAPACK)"])
                case.append(row)
                log(f"  compiled  threads={actual} n={n:>7d} batch={batch:>6d} {impl:28s} "
                    f"{seconds * 1e3:9.3f} ms {row['ns_per_unknown']:7.1f} ns/unknown "
                    f"ratio to dgtsv {row['ratio']:.3f}")
            rows += case
            recorder.add(case, f"{actual} thr {_shape(n, batch)}")
    return rows


# The kernels in torch ops (for devices other than the CPU, timed here on the CPU): the sequential
# pivoting kernel against the partitioned one, with the dgtsv loop as the baseline; float64, one
# right-hand side, timed in alternation. The sequential kernel only up to n = 1000 (one system of
# 10^4 would take seconds per call). Each row also has the number of operations dispatched.
TORCH_KERNEL_CASES = ([(n, b) for b in (0, 64, 1024) for n in (16, 32, 48, 64, 128, 256)]
                      + [(1000, 0), (10**4, 0), (10**5, 0), (10**6, 0)])


class CountOperations(TorchDispatchMode):
    """While active, counts the operations dispatched to kernels (in ``count``); a custom op
    counts as one, so count inside its kernel to see the operations it runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _count_operations(fn) -> int:
    """The number of operations ``fn()`` dispatches to kernels."""
    with CountOperations() as counter:
        fn()
    return counter.count


def run_torch_kernels(cases=TORCH_KERNEL_CASES, threads=(1, None), min_time=0.2, repeats=15,
                      log=print, recorder=None):
    """Time the sequential torch kernel (:func:`tridiag_tutorial.kernels.sequential.solve`), the
    partitioned one (:func:`tridiag_tutorial.kernels.partitioned.solve`) and the ``dgtsv`` loop, forward,
    float64. Returns rows with ``seconds``, ``operations`` (dispatched, for the torch kernels),
    ``ratio`` to the ``dgtsv`` loop and ``vs_sequential`` (partitioned / sequential).
    ``recorder``: as :func:`run`'s, a case (its rows timed together) at a time."""
    from ..kernels import partitioned, sequential
    recorder = recorder or _NO_RECORDER
    recorder.begin([dict(threads=count, n=n, batch=batch)
                    for count in _thread_count_values(threads) for n, batch in cases])
    rows = []
    for actual in _each_thread_count(threads):
        for n, batch in cases:
            if recorder.done(dict(threads=actual, n=n, batch=batch)):
                continue
            args = problem(n, batch, torch.float64)
            matrix = [*args[:3], args[3].unsqueeze(-1)]
            fns = {"partitioned torch kernel": lambda: partitioned.solve(*matrix),
                   "dgtsv (raw LAPACK)": _raw_gtsv(args)}
            if n <= TORCH_KERNEL_MAX_N:
                fns["sequential torch kernel"] = lambda: sequential.solve(*matrix)
            medians = _time_interleaved(fns, min_time, repeats)
            case = []
            for impl, seconds in medians.items():
                row = dict(impl=impl, n=n, batch=batch, threads=actual, seconds=seconds,
                           operations=None if impl.startswith("dgtsv")
                           else _count_operations(fns[impl]),
                           ratio=seconds / medians["dgtsv (raw LAPACK)"],
                           vs_sequential=(seconds / medians["sequential torch kernel"]
                                          if "sequential torch kernel" in medians else None))
                case.append(row)
                log(f"  torch kernels  threads={actual} n={n:>7d} batch={batch:>5d} {impl:25s} "
                    f"{seconds * 1e3:9.3f} ms  ops {row['operations'] or '-':>7}  "
                    f"vs sequential {row['vs_sequential'] or float('nan'):.3f}")
            rows += case
            recorder.add(case, f"{actual} thr {_shape(n, batch)}")
    return rows


CLIFF_CASES = [(100000, 8), (1024, 256)]  # (batch, n): the issue's batch, and one for n >= 64


def _cliff_problems(batch: int, n: int):
    """The clean float64 problem and two copies with one bad system in the middle: a NaN on the
    diagonal, and finite inputs whose solution overflows (``A = 1e-300 I``, ``b = 1e300``)."""
    lower, diag, upper, rhs = problem(n, batch, torch.float64)
    mid = batch // 2
    nan = [t.clone() for t in (lower, diag, upper, rhs)]
    nan[1][mid, n // 2] = float("nan")
    big = [t.clone() for t in (lower, diag, upper, rhs)]
    big[0][mid], big[2][mid], big[1][mid], big[3][mid] = 0.0, 0.0, 1e-300, 1e300
    return {"clean": (lower, diag, upper, rhs), "one NaN system": nan,
            "one overflowing system": big}


def _cliff_kernels(log):
    """Kernel name -> (the solve's driver, the factorization's driver, which n it takes): LAPACK,
    the C++ kernel where it was built (it solves only: its factor rows are LAPACK's), the
    sequential and the partitioned torch kernels (the partitioned kernel solves only: it factors
    with the sequential one, as on a GPU)."""
    found = {"LAPACK": ("lapack", "lapack", lambda n: True)}
    if _cpp_or_log(log):
        found["C++ kernel"] = ("cpp", "lapack", lambda n: True)
    found["sequential torch kernel"] = ("sequential", "sequential",
                                        lambda n: n <= TORCH_KERNEL_MAX_N)
    found["partitioned torch kernel"] = ("partitioned", "sequential",
                                         lambda n: n >= kernels.PARTITIONED_MIN_N)
    return found


CLIFF_OPS = ("solve", "factor", "factored solve")


def run_cliffs(cases=CLIFF_CASES, threads=(1,), min_time=0.2, repeats=15, kernels_wanted=None,
               log=print, recorder=None):
    """Time, interleaved in one process, a clean batch against the same batch with one NaN system
    and with one overflowing system, for ``tridiagonal_solve``, ``tridiagonal_lu_factor`` and
    ``tridiagonal_lu_solve``, on each kernel (issue 23: one bad system must cost at most 2x).
    Returns rows with ``kernel``, ``op``, ``input``, ``batch``, ``n``, ``seconds`` and ``ratio``
    (dirty / clean, 1.0 for the clean row); a call that raises gives ``seconds = None`` and its
    ``error``. ``recorder``: as :func:`run`'s, a kernel, op and case (its three rows timed
    together) at a time."""
    recorder = recorder or _NO_RECORDER
    rows = []
    found = _cliff_kernels(log)

    def unit(name, op, threads, batch, n):
        return dict(kernel=name, op=op, threads=threads, batch=batch, n=n)

    recorder.begin([unit(name, op, count, batch, n) for name in kernels_wanted or list(found)
                    if name in found for count in _thread_count_values(threads)
                    for batch, n in cases if found[name][2](n) for op in CLIFF_OPS])
    for name in kernels_wanted or list(found):
        if name not in found:
            log(f"  cliffs: no {name} rows (the kernel is not available)")
            continue
        solver, factorer, takes = found[name]
        for actual in _each_thread_count(threads):
            for batch, n in cases:
                if not takes(n) or all(recorder.done(unit(name, op, actual, batch, n))
                                       for op in CLIFF_OPS):
                    continue
                problems = _cliff_problems(batch, n)
                factors = {}
                for label, (lo, d, up, _) in problems.items():
                    try:
                        factors[label] = tridiagonal_lu_factor(lo, d, up, driver=factorer)
                    except Exception as err:  # recorded in the factored-solve rows
                        factors[label] = err
                ops = {
                    "solve": lambda p, label: lambda: tridiagonal_solve(*p, driver=solver),
                    "factor": lambda p, label: lambda: tridiagonal_lu_factor(
                        *p[:3], driver=factorer),
                    "factored solve": lambda p, label: lambda: tridiagonal_lu_solve(
                        factors[label], p[3], driver=factorer),
                }
                for op, make in ops.items():
                    if recorder.done(unit(name, op, actual, batch, n)):
                        continue
                    fns, errors = {}, {}
                    for label, p in problems.items():
                        fn = make(p, label)
                        try:
                            fn()
                            fns[label] = fn
                        except Exception as err:
                            errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                    medians = _time_interleaved(fns, min_time, repeats)
                    case = []
                    for label in problems:
                        seconds = medians.get(label)
                        clean = medians.get("clean")
                        row = dict(kernel=name, op=op, input=label, batch=batch, n=n,
                                   threads=actual, seconds=seconds,
                                   ratio=seconds / clean if seconds and clean else None,
                                   error=errors.get(label))
                        case.append(row)
                        log(f"  cliffs  {name:24s} {op:14s} {batch:>6d} x {n:<4d} "
                            f"{label:22s} " + (f"{seconds * 1e3:9.3f} ms  ratio "
                                               f"{row['ratio']:.2f}" if seconds
                                               else f"error {row['error']}"))
                    rows += case
                    recorder.add(case, f"{name} {op} {actual} thr {_shape(n, batch)}")
    return rows


THREAD_BUDGET_CASES = [(100000, 8), (10000, 100), (1024, 256), (64, 4096),  # (batch, n)
                       (2, 10**5), (3, 10**5), (4, 10**5), (2, 10**6), (4, 10**6)]
THREAD_BUDGET_FAMILIES = ("dominant", "poisson")  # the pieces kernel's: solved, and handed back


def _thread_budget_problem(batch: int, n: int, family: str, dtype: torch.dtype):
    """``batch`` systems of ``family``: each system :func:`one_system_family` (seeds 0, 1, ...)
    where the batch is small, else the suite's dominant problem (:func:`problem`)."""
    if batch <= 16:
        systems = [one_system_family(family, n, dtype, seed=s) for s in range(batch)]
        return [torch.stack(parts) for parts in zip(*systems)]
    return list(problem(n, batch, dtype))


def run_thread_budget(cases=THREAD_BUDGET_CASES, dtypes=(torch.float32, torch.float64),
                      families=THREAD_BUDGET_FAMILIES, busy=(False, True), threads=(1, 2),
                      min_time=0.05, repeats=15, log=print, recorder=None):
    """The C++ kernel's thread budget: ``tridiagonal_solve`` (``driver=None``) on the same inputs
    at each of ``threads`` (torch's thread count), interleaved in this process (A B, B A, ...:
    each block ``min_time`` seconds of calls after one untimed call, the median of ``repeats``
    blocks), quiet and (``busy``) with :func:`busy_core` keeping the last core busy.

    ``cases``: ``(batch, n)``. Batches of 16 systems or fewer are each of ``families`` (the
    pieces kernel's few large systems; Poisson's it hands back to the sequential elimination);
    larger ones are the suite's dominant problem, labelled ``dominant`` (the batch kernel, whose
    operations do not depend on the values). One right-hand side.

    Returns rows with ``batch``, ``n``, ``family``, ``dtype``, ``busy``, ``busy_core``,
    ``threads`` (the count timed), ``seconds``, ``vs_one_thread`` (seconds / the one-thread
    seconds of the same case and condition) and ``stalled_regions`` (the kernel's count of
    parallel regions with a stalled thread during the case, :func:`compiled.thread_budget`).
    Needs the C++ kernel. ``recorder``: as :func:`run`'s, a case (its rows timed together) at a
    time."""
    if not compiled.is_available():
        raise RuntimeError("run_thread_budget needs the C++ kernel: " + compiled.missing_advice())
    recorder = recorder or _NO_RECORDER
    counts = [int(t) for t in threads]
    dnames = {str(d).replace("torch.", ""): d for d in dtypes}

    def plan(is_busy):
        return [(batch, n, family, dname) for batch, n in cases
                for family in (families if batch <= 16 else ("dominant",)) for dname in dnames]

    def unit(batch, n, family, dname, is_busy):
        return dict(batch=batch, n=n, family=family, dtype=dname, busy=is_busy)

    conditions = list(dict.fromkeys(bool(b) for b in busy))
    recorder.begin([unit(*case, b) for b in conditions for case in plan(b)])
    rows = []
    default = torch.get_num_threads()
    try:
        for is_busy in conditions:
            with (busy_core() if is_busy else contextlib.nullcontext()) as spinner:
                for batch, n, family, dname in plan(is_busy):
                    if recorder.done(unit(batch, n, family, dname, is_busy)):
                        continue
                    args = _thread_budget_problem(batch, n, family, dnames[dname])

                    def call():
                        tridiagonal_solve(*args)

                    # Timed here, not with _time_interleaved: its Timer sets the thread count
                    # that it was made with while it measures, and here the count is what varies.
                    torch.set_num_threads(counts[0])
                    call()
                    number = _calls_per_block(_timer(call), min_time)
                    times = {c: [] for c in counts}
                    stalled0 = compiled.thread_budget().stalled_regions
                    for r in range(repeats):
                        for c in (counts if r % 2 == 0 else counts[::-1]):
                            torch.set_num_threads(c)
                            call()
                            start = time.perf_counter()
                            for _ in range(number):
                                call()
                            times[c].append((time.perf_counter() - start) / number)
                    stalled = compiled.thread_budget().stalled_regions - stalled0
                    medians = {c: statistics.median(t) for c, t in times.items()}
                    case = [dict(batch=batch, n=n, family=family, dtype=dname, busy=is_busy,
                                 busy_core=None if spinner is None else spinner.core,
                                 threads=c, seconds=medians[c],
                                 vs_one_thread=medians[c] / medians[counts[0]],
                                 stalled_regions=stalled) for c in counts]
                    rows += case
                    log(f"  thread budget  {_load_text(is_busy, spinner and spinner.core):5s} "
                        f"{batch:>6d} x {n:<7d} {family:9s} {dname:7s} " + "  ".join(
                            f"{c} thr {medians[c] * 1e3:8.3f} ms" for c in counts)
                        + f"  ratio {case[-1]['vs_one_thread']:.2f}  stalled {stalled}")
                    recorder.add(case, f"thread budget {batch} x {n} {family} {dname}")
    finally:
        torch.set_num_threads(default)
    return rows


def format_thread_budget(rows) -> str:
    """The rows of :func:`run_thread_budget` as a table: per case and condition, the time at
    each thread count over the one-thread time."""
    counts = sorted({r["threads"] for r in rows})
    lines = ["thread budget: seconds at each thread count / one thread's (same case, condition)",
             f"{'load':5s} {'batch x n':>16s} {'family':9s} {'dtype':7s} "
             + " ".join(f"{c:>3d} thr" for c in counts)]
    by_case = {}
    for r in rows:
        key = (r["busy"], r["batch"], r["n"], r["family"], r["dtype"])
        by_case.setdefault(key, {})[r["threads"]] = r["vs_one_thread"]
    for (is_busy, batch, n, family, dname), ratios in by_case.items():
        lines.append(f"{'busy' if is_busy else 'quiet':5s} {f'{batch} x {n}':>16s} {family:9s} "
                     f"{dname:7s} " + " ".join(_ratio_text(ratios.get(c), 7) for c in counts))
    return "\n".join(lines)


def _case(row) -> tuple:
    """What a result row measured: implementation, mode, compiled or not, shape, dtype, threads."""
    return tuple(row.get(k) for k in ("impl", "mode", "compiled", "n", "batch", "dtype",
                                      "threads"))


def _lookup(results, **key):
    for r in results:
        if all(r[k] == v for k, v in key.items()) and r["seconds"] is not None:
            return r["seconds"]
    return None


def evaluate_targets(results):
    """The issue's targets as ratios to the baseline measured in the same run."""
    final = FINAL
    base = "dgtsv (raw LAPACK)"
    rows = []
    for (dtype, threads) in sorted({(r["dtype"], r["threads"]) for r in results}):
        common = dict(dtype=dtype, threads=threads)

        def ratio(impl, mode, n, batch, reference=base, compiled=False):
            t = _lookup(results, impl=impl, mode=mode, n=n, batch=batch, compiled=compiled, **common)
            b = _lookup(results, impl=reference, mode="forward", n=n, batch=batch, compiled=False,
                        **common)
            return None if t is None or b is None else t / b

        ns = sorted({r["n"] for r in results if r["batch"] == 0})
        for n in ns:
            if n >= 10**4:
                rows.append(dict(target="forward, one system, n >= 1e4: <= 1.2x dgtsv",
                                 n=n, batch=0, limit=1.2, ratio=ratio(final, "forward", n, 0),
                                 **common))
            if n >= 10**5:
                rows.append(dict(target="forward+backward (4 grads), n >= 1e5: <= 2.0x dgtsv",
                                 n=n, batch=0, limit=2.0, ratio=ratio(final, "backward", n, 0),
                                 **common))
            if n == 100:
                rows.append(dict(target="forward, n = 100: <= 10x dgtsv", n=n, batch=0,
                                 limit=10.0, ratio=ratio(final, "forward", n, 0), **common))
            if n == 1000:
                dense = ratio("torch.linalg.solve (dense)", "forward", n, 0)
                ours = ratio(final, "forward", n, 0)
                rows.append(dict(target="n = 1000: >= 100x faster than dense (ratio <= 0.01)",
                                 n=n, batch=0, limit=0.01,
                                 ratio=None if dense is None else ours / dense, **common))
        for batch, n in sorted({(r["batch"], r["n"]) for r in results if r["batch"]}):
            rows.append(dict(target="batch forward: >= 3x faster than a loop of dgtsv "
                                    "(ratio <= 0.333)",
                             n=n, batch=batch, limit=1 / 3, ratio=ratio(final, "forward", n, batch),
                             **common))
    for row in rows:
        row["met"] = row["ratio"] is not None and row["ratio"] <= row["limit"]
    return rows


# Our final op against JAX: the side-by-side that the performance chapter's scorecard renders.
# Per case and mode, the final op as installed, the final op on LAPACK, JAX and (at
# AGAINST_JAX_COMPILED_CASES) the compiled final op are timed in alternation (_time_interleaved),
# so that a drift of the machine's speed during the run, which separately timed rows cannot tell
# from a difference, affects all alike. Each thread count runs in a process of its own, pinned to
# that many cores (see run_against_jax).
AGAINST_JAX_CASES = [(n, 0) for n in SINGLE_SIZES] + [(n, b) for b, n in BATCHES]  # (n, batch)
AGAINST_JAX_COMPILED_CASES = [(100, 0), (256, 1024)]  # (n, batch): where compiled / eager is shown
COMPILED_FINAL = "torch.compile(tridiagonal_solve)"  # the final op as installed, compiled
XLA_POOL_THREAD = "tf_XLAEigen"  # the name of the threads of XLA's CPU intra-op pool


def _cpu_cores():
    """The cores this process may run on (its affinity), or ``None`` where the platform cannot
    tell (``os.sched_getaffinity`` is Linux only)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def _thread_names() -> dict | None:
    """How many threads of this process have each name (``/proc/self/task/*/comm``), or ``None``
    where ``/proc`` does not exist. XLA's CPU intra-op pool names its threads
    :data:`XLA_POOL_THREAD`, one per thread of the pool."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = Counter()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return dict(names)


# The child process of run_against_jax: its CPU affinity set before torch and JAX are imported
# (they size their thread pools from it when they start), then the interleaved timings, each
# case's rows printed as one line (_ChildRecorder) as soon as they are measured. An interrupt
# ends it quietly: the parent says what was kept.
_PINNED_CHILD = """
import json, os, sys
with open(sys.argv[1]) as f:
    config = json.load(f)
if config["cores"] is not None:
    os.sched_setaffinity(0, config["cores"])
try:
    from tridiag_tutorial.bench import benchmarks
    entry = getattr(benchmarks, config.pop("entry", "_against_jax_here"))
    recorder = benchmarks._ChildRecorder(**config.pop("recorder"))
    entry(**config, recorder=recorder)
except KeyboardInterrupt:
    sys.exit(130)
"""
_ROWS_LINE = "@@rows "  # how a pinned child's line of rows begins (the rest: JSON)


class _ChildRecorder:
    """The recorder of a pinned child process: each case's rows printed on one line that starts
    with ``_ROWS_LINE``, which :func:`_in_pinned_process` reads as soon as it comes and hands to
    the run's recorder; ``done``: the cases (values of ``fields``) that the parent says to skip."""

    def __init__(self, fields=(), done=()):
        self.fields = tuple(fields)
        self.measured = {tuple(unit) for unit in done}

    def begin(self, units):
        pass

    def done(self, unit: dict) -> bool:
        return tuple(unit[f] for f in self.fields) in self.measured

    def add(self, rows, label=None):
        print(_ROWS_LINE + json.dumps(dict(rows=rows, label=label)), flush=True)


def _in_pinned_process(config: dict, log, recorder=None) -> list:
    """Run :func:`_against_jax_here` (or the function of this module named by ``config["entry"]``)
    with ``config`` in a new Python process (see ``_PINNED_CHILD``), its output lines passed to
    ``log`` and its rows to ``recorder`` as they come; returns its rows. ``config["recorder"]``:
    the child's :class:`_ChildRecorder` (``fields`` and the ``done`` cases). An interrupt stops
    the child too."""
    recorder = recorder or _NO_RECORDER
    config = dict(config)
    config.setdefault("recorder", {})
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_parent, env.get("PYTHONPATH")) if p)  # this very package
    env["PYTHONUNBUFFERED"] = "1"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        child = subprocess.Popen([sys.executable, "-c", _PINNED_CHILD, config_path],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            for line in child.stdout:
                if line.startswith(_ROWS_LINE):
                    case = json.loads(line[len(_ROWS_LINE):])
                    rows += case["rows"]
                    recorder.add(case["rows"], case["label"])
                else:
                    log(line.rstrip("\n"))
        except BaseException:  # an interrupt (or a failing log): the child must not run on
            child.terminate()
            child.wait()
            raise
        if child.wait() in (130, -2):  # the interrupt reached the child first (Ctrl-C: both)
            raise KeyboardInterrupt
        if child.returncode != 0:
            entry = config.get("entry", "_against_jax_here").strip("_").replace("_here", "")
            raise RuntimeError(f"run_{entry}: the process pinned to {config['threads']} "
                               f"core(s) failed with exit status {child.returncode} (its error "
                               "is on stderr above)")
    return rows


# One large system: the matrices users solve (FAMILIES), quiet and with a busy core. Per family,
# n, dtype, thread count and condition, raw ?gtsv, the memory floor, the op and the C++ kernel
# called directly are timed in one alternation (see run_one_system).
ONE_SYSTEM_CASES = (4096, 10**5, 10**6)  # n
FAMILIES = ("dominant", "pivoting", "poisson", "heat_r1", "heat_r1e2", "heat_r1e4", "scaled_rows",
            "nearly_singular_block", "near_toeplitz")
BACKWARD_FAMILIES = ("dominant",)  # the families timed forward + backward by default
QUICK_FAMILIES = ("dominant", "pivoting")  # --quick's families
HEAT_R = {"heat_r1": 1.0, "heat_r1e2": 1e2, "heat_r1e4": 1e4}  # I + r tridiag(-1, 2, -1)
NEAR_TOEPLITZ_DIAG = 2.001  # tridiag(-1, 2.001, -1)
SCALED_ROWS_EXPONENT = {torch.float32: 30, torch.float64: 100}  # row scales 10^-e .. 10^e
# The family and condition of a row stored before rows had them (the one-system and JAX rows
# then timed the suite's diagonally dominant problem, quiet).
FAMILY_DEFAULTS = {"family": "dominant", "busy": False}
BUSY_SETTLE = 0.3  # seconds busy_core waits for its spinner to run
RAW_GTSV = "raw ?gtsv (SciPy)"
FLOOR = "memory floor (a copy of the same bytes)"
LARGE_KERNEL = "C++ large-system kernel (compiled.solve_ex)"


def run_against_jax(cases=AGAINST_JAX_CASES, dtypes=(torch.float32, torch.float64),
                    threads=(1, None), min_time=0.1, repeats=9,
                    compiled_cases=AGAINST_JAX_COMPILED_CASES, families=FAMILIES,
                    busy=(False, True), backward_families=BACKWARD_FAMILIES, log=print,
                    recorder=None):
    """Time the final op against JAX's ``jax.lax.linalg.tridiagonal_solve``, forward and forward +
    backward (all four gradients; ``jax.grad`` of ``sum(x)`` for JAX).

    Per case, dtype, family and mode, in alternation: the final op as installed (``FINAL``,
    ``driver=None``), the final op on LAPACK (``FINAL_LAPACK``), at ``compiled_cases`` the final
    op compiled (``COMPILED_FINAL``: ``torch.compile(tridiagonal_solve, **COMPILE_OPTIONS)``,
    the backward through its compiled backward; the ``dominant`` family only), and JAX.

    One system (``batch`` 0) is each of ``families`` (:func:`one_system_family`); forward + backward
    only for ``backward_families`` (``None``: all), the others forward only. A batch is the
    suite's random diagonally dominant problem (:func:`problem`: ``N(0, 1) + 4`` on the diagonal),
    labelled ``dominant``, both modes, and is measured in the quiet condition only.

    Each of ``threads`` (``None``: every core this process may use) runs in a process of its own
    whose CPU affinity is that many cores, set before torch and JAX are imported, so that XLA's
    thread pool, LAPACK's and torch's (``torch.set_num_threads`` as well) all have exactly those
    cores; a count above the cores available is skipped, said so. Without
    ``os.sched_setaffinity`` (not Linux) the process is not pinned: its rows say
    ``affinity=None``. ``busy``: the conditions, ``False`` quiet, ``True`` with another process
    spinning on one core while the process measures (:func:`busy_core`; see
    :func:`_in_pinned_processes` for which core).

    Returns rows with ``impl``, ``mode``, ``compiled``, ``n``, ``batch``, ``dtype``, ``threads``,
    ``family``, ``busy``, ``busy_core`` (the spinning core; ``None``: quiet, or, with ``busy``
    true, no core could be made busy), ``seconds``, ``ratio`` = seconds / JAX's (below 1: faster
    than JAX), ``vs_eager`` (compiled rows: seconds / the eager ``FINAL``'s; else ``None``), and
    what the process saw: ``affinity`` (its cores), ``torch_threads`` and ``xla_threads`` (the
    threads of XLA's CPU pool, counted by name; ``None`` where they cannot be seen). Needs JAX.
    ``recorder``: as :func:`run`'s, a case, family and mode (its rows timed together) at a time.
    Rows stored before the families (no ``family`` / ``busy``): read them with
    :func:`with_family_defaults`."""
    if importlib.util.find_spec("jax") is None:
        raise RuntimeError("run_against_jax needs JAX: pip install jax")
    _check_families(families)
    dnames = [str(d).replace("torch.", "") for d in dtypes]
    cases = [tuple(c) for c in cases]
    families = list(families)
    backward = None if backward_families is None else list(backward_families)
    config = dict(cases=[list(c) for c in cases], dtypes=dnames, min_time=min_time,
                  repeats=repeats, compiled_cases=[list(c) for c in compiled_cases],
                  families=families, backward_families=backward)

    def units(count, is_busy):
        return [dict(dtype=dname, threads=count, busy=is_busy, family=family, n=n, batch=batch,
                     mode=mode)
                for dname in dnames
                for n, batch, family, mode in _against_jax_plan(cases, families, backward,
                                                                is_busy)]

    return _in_pinned_processes(threads, config, "against JAX", log, recorder, units, busy)


def _against_jax_plan(cases, families, backward_families, busy: bool):
    """The ``(n, batch, family, mode)`` that :func:`_against_jax_here` measures, in its order."""
    plan = []
    for n, batch in cases:
        if batch and busy:  # batches: the quiet condition only
            continue
        for family in (("dominant",) if batch else families):
            for mode in _family_modes(family, MODES, None if batch else backward_families):
                plan.append((n, batch, family, mode))
    return plan


def _in_pinned_processes(threads, config: dict, label: str, log, recorder=None,
                         units=lambda count, busy: [], busy=(False,)) -> list:
    """The rows of :func:`_in_pinned_process` with ``config`` for each of ``threads`` (``None``:
    every core this process may use), in a process pinned to that many cores (``config`` gets
    ``threads`` and ``cores``: the first ``threads`` cores this process may use); a count above
    the cores available is skipped, said so. For each count, one process per condition of
    ``busy`` (``config`` gets ``busy`` and ``busy_core``): quiet (``False``), or (``True``) with
    :func:`busy_core` spinning, in a process of its own, on the last of the measuring process's
    cores where it has two or more (so that one of its threads shares a core with the spinner),
    else on the last core this process may use (so that its one thread has the other core
    alone); where no core can be made busy (one core, or no ``os.sched_setaffinity``) the
    process measures all the same and its rows say ``busy_core=None``.
    ``units(count, busy)``: the cases (dicts of the same keys) that the process at ``count``
    threads in that condition measures, for ``recorder``; a process with no case left to measure
    is not started."""
    recorder = recorder or _NO_RECORDER
    available = _cpu_cores()
    rows = []
    counts = [wanted or (len(available) if available else os.cpu_count()) for wanted in threads]
    counts = list(dict.fromkeys(counts))  # (1, None) on one core: one process
    for count in counts:
        if available is not None and count > len(available):
            log(f"  {label}: no rows for {count} threads: this process may use "
                f"{len(available)} core(s)")
    counts = [c for c in counts if available is None or c <= len(available)]
    conditions = list(dict.fromkeys(bool(b) for b in busy))
    recorder.begin([unit for count in counts for b in conditions for unit in units(count, b)])
    for count in counts:
        cores = None if available is None else available[:count]
        for is_busy in conditions:
            wanted = units(count, is_busy)
            fields = list(wanted[0]) if wanted else []
            done = [[unit[f] for f in fields] for unit in wanted if recorder.done(unit)]
            if len(done) == len(wanted):
                continue  # nothing to measure, or all measured by the run being continued
            core = cores[-1] if cores and len(cores) >= 2 else None
            with (busy_core(core) if is_busy else contextlib.nullcontext()) as spinner:
                if is_busy and spinner is None:
                    log(f"  {label}: {count} thread(s), busy: no core can be made busy here "
                        "(one core, or no os.sched_setaffinity); measured all the same, "
                        "busy_core=None")
                rows += _in_pinned_process(
                    dict(config, threads=count, cores=cores, busy=is_busy,
                         busy_core=None if spinner is None else spinner.core,
                         recorder=dict(fields=fields, done=done)), log, recorder)
    return rows


def _against_jax_here(cases, dtypes, threads, cores, min_time, repeats, compiled_cases,
                      families=("dominant",), backward_families=BACKWARD_FAMILIES, busy=False,
                      busy_core=None, log=print, recorder=None):
    """:func:`run_against_jax`'s measurements at ``threads`` threads in this process, whose
    affinity the caller has set to ``cores`` (a list, or ``None``) before importing torch; the
    caller keeps ``busy_core`` busy (``busy``) while this runs."""
    recorder = recorder or _NO_RECORDER
    torch.set_num_threads(threads)
    jax = _jax()
    compiled_cases = {tuple(c) for c in compiled_cases}
    cases = [tuple(c) for c in cases]
    # Each (dtype, rank, mode) compiles once with dynamic shapes; they share one code object's
    # cache in Dynamo, so the default limit of 8 entries is too small here.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled_solve = torch.compile(tridiagonal_solve, **COMPILE_OPTIONS)
    affinity = _cpu_cores()
    log(f"  against JAX: a process pinned to cores {affinity}, torch threads "
        f"{torch.get_num_threads()}, jax {jax.__version__}, {_busy_text(busy, busy_core)}")
    plan = _against_jax_plan(cases, families, backward_families, busy)
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        problems = {}
        for n, batch, family, mode in plan:
            if recorder.done(dict(dtype=dname, threads=threads, busy=busy, family=family, n=n,
                                  batch=batch, mode=mode)):
                continue
            if (n, batch, family) not in problems:
                problems.clear()  # one problem at a time: 1e6 unknowns are 32 MB in float64
                problems[n, batch, family] = (problem(n, batch, dtype) if batch else
                                              one_system_family(family, n, dtype))
            args = problems[n, batch, family]
            fns = {FINAL: _torch_callable(tridiagonal_solve, args, mode),
                   FINAL_LAPACK: _torch_callable(TORCH_IMPLS[FINAL_LAPACK], args, mode)}
            if (n, batch) in compiled_cases and family == "dominant":
                fns[COMPILED_FINAL] = _torch_callable(compiled_solve, args, mode)
            fns[JAX_IMPL] = _jax_callable(args, mode)
            fns, errors = _working(fns)
            spread = {}
            medians = _time_interleaved(fns, min_time, repeats, spread=spread)
            medians.update(dict.fromkeys(errors))
            names = _thread_names()
            seen = dict(affinity=affinity, torch_threads=torch.get_num_threads(),
                        xla_threads=None if names is None else names.get(XLA_POOL_THREAD))
            jax_seconds, eager = medians.get(JAX_IMPL), medians.get(FINAL)
            case = []
            for impl, seconds in medians.items():
                compiled = impl == COMPILED_FINAL
                case.append(dict(
                    impl=impl, mode=mode, compiled=compiled, n=n, batch=batch, dtype=dname,
                    threads=threads, family=family, busy=busy, busy_core=busy_core,
                    seconds=seconds, quartiles=spread.get(impl),
                    ratio=_quotient(seconds, jax_seconds),
                    vs_eager=_quotient(seconds, eager) if compiled else None,
                    error=errors.get(impl), **seen))
            log(f"  against JAX  {dname:8s} threads={threads} (XLA pool {seen['xla_threads']}) "
                f"{_load_text(busy, busy_core):5s} {family:21s} n={n:>7d} batch={batch:>6d} "
                f"{mode:8s} ours / JAX: "
                + "  ".join(f"{_short(impl)} {_ratio_text(_quotient(medians[impl], jax_seconds))}"
                            for impl in medians if impl != JAX_IMPL))
            rows += case
            recorder.add(case, f"{dname} {threads} thr {_load_text(busy, busy_core)} {family} "
                               f"{_shape(n, batch)} {mode}")
    return rows




def _check_families(families):
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} "
                         f"{', '.join(map(repr, unknown))}; the families: {', '.join(FAMILIES)}")


def one_system_family(family: str, n: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    """``(lower, diag, upper, rhs)``: one system of ``n`` unknowns of ``family`` (one of
    ``FAMILIES``), torch tensors of ``dtype`` (float32 or float64), ``rhs`` of shape ``(n,)`` as
    :func:`problem`'s single system. All made in NumPy float64 and then cast; ``rhs`` is
    standard normal from ``numpy.random.default_rng(seed)`` (for the families of
    :mod:`tridiag_tutorial.bench.accuracy`, its right-hand side, drawn so).

    - ``dominant``: ``accuracy.make("dominant")`` (random, 4 added to the diagonal's magnitude);
    - ``pivoting``: ``accuracy.make("random")`` (diagonal ``±(1.5 + |N|)``: needs row
      interchanges);
    - ``poisson``: ``tridiag(-1, 2, -1)``;
    - ``heat_r1``, ``heat_r1e2``, ``heat_r1e4``: an implicit heat step ``I + r tridiag(-1, 2,
      -1)`` (diagonal ``1 + 2r``, off-diagonals ``-r``) for ``r`` = 1, 1e2, 1e4 (``HEAT_R``);
    - ``scaled_rows``: the pivoting family with row ``i`` and ``rhs[i]`` multiplied by
      ``10^t_i``, ``t_i`` going evenly from ``-e`` to ``e`` down the rows, ``e`` = 100 in float64
      and 30 in float32 (``SCALED_ROWS_EXPONENT``; 1e100 overflows float32);
    - ``nearly_singular_block``: ``accuracy.make("nearly_singular_block")`` (one block of the
      partitioned kernel's size singular, perturbed by a relative ``10^U(-15, -3)``);
    - ``near_toeplitz``: ``tridiag(-1, 2.001, -1)``."""
    from . import accuracy  # here: only this experiment needs it
    _check_families([family])
    if dtype not in SCALED_ROWS_EXPONENT:
        raise ValueError(f"one_system_family: float32 or float64, not {dtype}")
    if family in ("dominant", "pivoting", "scaled_rows", "nearly_singular_block"):
        recipe = {"pivoting": "random", "scaled_rows": "random"}.get(family, family)
        lower, diag, upper, rhs = (np.asarray(a, dtype=np.float64) for a in
                                   accuracy.make(recipe, n, np.float64, seed))
        rhs = rhs.reshape(n)
        if family == "scaled_rows":
            e = SCALED_ROWS_EXPONENT[dtype]
            scale = 10.0 ** np.linspace(-e, e, n)
            diag, rhs = diag * scale, rhs * scale
            lower, upper = lower * scale[1:], upper * scale[:-1]  # lower[i]: row i + 1
    else:
        if family == "poisson":
            d, off = 2.0, -1.0
        elif family == "near_toeplitz":
            d, off = NEAR_TOEPLITZ_DIAG, -1.0
        else:
            r = HEAT_R[family]
            d, off = 1.0 + 2.0 * r, -r
        lower, upper = np.full(n - 1, off), np.full(n - 1, off)
        diag = np.full(n, d)
        rhs = np.random.default_rng(seed).standard_normal(n)
    return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) for a in (lower, diag, upper, rhs)]


def with_family_defaults(rows) -> list:
    """``rows`` of :func:`run_one_system` or :func:`run_against_jax`, each with ``family`` and
    ``busy`` (copies): rows stored before there were families lack them and timed the suite's
    dominant problem, quiet (``FAMILY_DEFAULTS``)."""
    return [{**FAMILY_DEFAULTS, **r} for r in rows]


@dataclass
class Spinner:
    """What :func:`busy_core` started: the spinning process and the core it is pinned to."""
    pid: int
    core: int
    process: subprocess.Popen


# The spinning process of busy_core: Python's empty loop, in rounds of a few milliseconds, after
# each of which it checks that the process that started it is still its parent. A parent killed
# without running its clean-up (SIGTERM, SIGKILL) would otherwise leave it spinning for ever, and
# every later measurement on the machine would silently run with one core busy.
SPIN = """import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def busy_core(core: int | None = None, settle: float = BUSY_SETTLE):
    """Keep one core busy while the block runs: another Python process spinning (``SPIN``: an
    empty loop that ends once this process is no longer its parent) pinned with ``os.sched_setaffinity`` to ``core`` (default: the last core this process
    may use); yields a ``Spinner`` (its ``pid``, ``core`` and ``process``) once it has run for
    ``settle`` seconds, and kills and waits for it on leaving the block, whatever ends it (an
    exception, an interrupt). Yields
    ``None``, starting nothing, where no core can be made busy beside this process: without
    ``os.sched_setaffinity``, or on one core."""
    cores = _cpu_cores()
    if not hasattr(os, "sched_setaffinity") or not cores or len(cores) < 2:
        yield None
        return
    core = cores[-1] if core is None else core
    process = subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        os.sched_setaffinity(process.pid, {core})
        time.sleep(settle)
        if process.poll() is not None:
            raise RuntimeError(f"busy_core: the spinning process ended (status "
                               f"{process.returncode})")
        yield Spinner(process.pid, core, process)
    finally:
        process.kill()
        process.wait()


def _busy_text(busy: bool, core) -> str:
    """The condition in words, for the log."""
    if not busy:
        return "quiet"
    return f"core {core} busy" if core is not None else "busy asked, but no core could be made busy"


def _load_text(busy: bool, core) -> str:
    """The condition in a few characters: ``quiet``, ``busy`` or ``busy*`` (asked for, but no core
    could be made busy)."""
    return "busy" if busy and core is not None else "busy*" if busy else "quiet"


def _family_text(family: str) -> str:
    """A family in at most 13 characters, for the tables."""
    return {"nearly_singular_block": "near_singular"}.get(family, family)[:13]


def _quotient(a, b):
    return None if a is None or not b else a / b


def _ratio_text(q, width: int = 0) -> str:
    return f"{'-' if q is None else f'{q:.2f}':>{width}s}"


def _working(fns: dict):
    """``fns`` split into those whose call succeeds (called once here) and ``{key: error}``."""
    ok, errors = {}, {}
    for key, fn in fns.items():
        try:
            fn()
        except Exception as err:  # a failing implementation is a result too
            text = str(err).splitlines()
            errors[key] = f"{type(err).__name__}: {text[0] if text else ''}"
        else:
            ok[key] = fn
    return ok, errors


def _kernel_min_n() -> int:
    """From how many unknowns one real system goes to the C++ kernel's solve in pieces."""
    return compiled.PIECES_MIN_N


def _family_modes(family: str, modes, backward_families) -> list:
    """The modes timed for ``family``: forward always (the baseline's mode), backward where asked
    for and the family is one of ``backward_families`` (``None``: every family)."""
    return ["forward"] + (["backward"] if "backward" in modes and (
        backward_families is None or family in backward_families) else [])


def _large_kernel_callable(args, mode):
    """The C++ kernel for one large system (:func:`tridiag_tutorial.kernels.compiled.solve_ex`, its
    default arguments), called directly, without the final op's dispatch: forward, or forward +
    the four gradients as the final op's C++ fast path computes them
    (:func:`compiled.solve_backward`: one more solve, with ``A^T``, and the band gradients, in
    one call)."""
    lower, diag, upper = args[:3]
    rhs = args[3].unsqueeze(-1)
    if mode == "forward":
        return lambda: compiled.solve_ex(lower, diag, upper, rhs)
    ones = torch.ones_like(rhs)

    def forward_backward():
        x, _ = compiled.solve_ex(lower, diag, upper, rhs)
        return compiled.solve_backward(lower, diag, upper, x, ones)

    return forward_backward


def _floor_callable(args):
    """The memory-traffic floor of a solve: one streaming copy of the bytes a solver must read
    (the four bands) into a buffer of their size, both made before the timed call."""
    source = np.concatenate([a.numpy().ravel() for a in args])
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def run_one_system(cases=ONE_SYSTEM_CASES, families=FAMILIES,
                   dtypes=(torch.float32, torch.float64), threads=(1, 2), busy=(False, True),
                   min_time=0.1, repeats=9, modes=MODES, backward_families=BACKWARD_FAMILIES,
                   log=print, recorder=None):
    """One large system of each size ``n`` in ``cases`` and each of ``families``
    (:func:`one_system_family`), timed in alternation (:func:`_time_interleaved`) in a process
    pinned to each thread count (the first cores this process may use; as
    :func:`run_against_jax`), quiet and with a busy core (``busy``; see
    :func:`_in_pinned_processes`): raw ``?gtsv`` through SciPy (forward only), the memory floor
    (:func:`_floor_callable`, forward only), the final op as installed (``FINAL``), the final op
    on LAPACK, the C++ large-system kernel called directly (``LARGE_KERNEL``:
    :func:`_large_kernel_callable`), and JAX's ``tridiagonal_solve`` where JAX is installed
    (forward and ``jax.grad``). ``modes``: forward always (the baseline's mode); backward only
    for ``backward_families`` (``None``: every family).

    Returns rows with ``impl``, ``mode`` (``forward``; ``backward`` = forward + all four
    gradients), ``family``, ``n``, ``dtype``, ``threads``, ``busy``, ``busy_core`` (the
    spinning core; ``None`` where quiet or where no core could be made busy), ``seconds``,
    ``ns_per_unknown``, ``vs_gtsv`` (seconds / raw ``?gtsv``'s, timed in the same alternation;
    forward rows only, else ``None``), ``vs_jax`` (seconds / JAX's in the same mode, or
    ``None``), ``floor_ns_per_unknown``, ``error`` (an implementation that failed on the system:
    no time), ``kernel_min_n`` (from which n one system goes to the C++ large-system kernel) and
    what the process saw (``affinity``, ``torch_threads``); ``LARGE_KERNEL``'s rows also
    ``kernel_fallbacks`` (``solve_ex``'s count for this system). A thread count above the cores
    available is skipped, said so. ``recorder``: as :func:`run`'s, a system (its rows, all
    modes, timed together) at a time. Rows stored before the families: read them with
    :func:`with_family_defaults`.

    Run time (estimated from single cases on a 2-core machine, one system of each size, float64,
    one thread): a forward case takes about 32 s at n = 4096 and 1e5 and 40 s at 1e6 with
    ``min_time=0.2`` and 15 interleaved repeats (the command line's defaults), a forward +
    backward case of the dominant family about 25 s more; all families, sizes, dtypes, thread
    counts and both conditions: about 2 hours (about 50 minutes with ``min_time=0.1`` and 9)."""
    _check_families(families)
    dnames = [str(d).replace("torch.", "") for d in dtypes]
    families, cases = list(families), list(cases)
    backward = None if backward_families is None else list(backward_families)
    config = dict(entry="_one_system_here", cases=cases, dtypes=dnames, families=families,
                  modes=list(modes), backward_families=backward, min_time=min_time,
                  repeats=repeats)

    def units(count, is_busy):
        return [dict(dtype=dname, threads=count, busy=is_busy, family=family, n=n)
                for dname in dnames for family in families for n in cases]

    return _in_pinned_processes(threads, config, "one system", log, recorder, units, busy)


def _one_system_here(cases, dtypes, threads, cores, min_time, repeats, families=("dominant",),
                     modes=MODES, backward_families=BACKWARD_FAMILIES, busy=False,
                     busy_core=None, log=print, recorder=None):
    """:func:`run_one_system`'s measurements at ``threads`` threads in this process, whose
    affinity the caller has set to ``cores`` before importing torch; the caller keeps
    ``busy_core`` busy (``busy``) while this runs."""
    recorder = recorder or _NO_RECORDER
    torch.set_num_threads(threads)
    has_jax = _jax() is not None
    has_kernel = compiled.is_available()
    min_n = _kernel_min_n()
    log(f"  one system: a process pinned to cores {_cpu_cores()}, torch threads "
        f"{torch.get_num_threads()}, {_busy_text(busy, busy_core)}; the C++ kernel "
        + (f"takes one system from n = {min_n}" if has_kernel else "was not built"))
    load = _load_text(busy, busy_core)
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for family in families:
            for n in cases:
                if recorder.done(dict(dtype=dname, threads=threads, busy=busy, family=family,
                                      n=n)):
                    continue
                args = one_system_family(family, n, dtype)
                medians, errors, spreads = {}, {}, {}
                for mode in _family_modes(family, modes, backward_families):
                    fns = {}
                    if mode == "forward":
                        fns[RAW_GTSV] = _raw_gtsv(args)
                        fns[FLOOR] = _floor_callable(args)
                    fns[FINAL] = _torch_callable(tridiagonal_solve, args, mode)
                    fns[FINAL_LAPACK] = _torch_callable(TORCH_IMPLS[FINAL_LAPACK], args, mode)
                    if has_kernel:
                        fns[LARGE_KERNEL] = _large_kernel_callable(args, mode)
                    if has_jax:
                        fns[JAX_IMPL] = _jax_callable(args, mode)
                    fns, errors[mode] = _working(fns)
                    spreads[mode] = {}
                    medians[mode] = _time_interleaved(fns, min_time, repeats,
                                                      spread=spreads[mode])
                    medians[mode].update(dict.fromkeys(errors[mode]))
                    log(f"  one system  {dname:8s} thr={threads} {load:5s} {family:21s} "
                        f"n={n:>8d} {mode:8s} ns/unknown: "
                        + "  ".join(f"{_short(impl)} "
                                    + ("failed" if s is None else f"{s / n * 1e9:.1f}")
                                    for impl, s in medians[mode].items()))
                fallbacks = None
                if has_kernel:
                    with contextlib.suppress(Exception):
                        fallbacks = int(compiled.solve_ex(*args[:3], args[3].unsqueeze(-1))[1])
                gtsv, floor = medians["forward"].get(RAW_GTSV), medians["forward"].get(FLOOR)
                case = []
                for mode, times in medians.items():
                    jax_seconds = times.get(JAX_IMPL)
                    for impl, seconds in times.items():
                        row = dict(
                            impl=impl, mode=mode, family=family, n=n, dtype=dname,
                            threads=threads, busy=busy, busy_core=busy_core, seconds=seconds,
                            quartiles=spreads[mode].get(impl),
                            ns_per_unknown=None if seconds is None else seconds / n * 1e9,
                            vs_gtsv=_quotient(seconds, gtsv) if mode == "forward" else None,
                            vs_jax=_quotient(seconds, jax_seconds),
                            floor_ns_per_unknown=None if floor is None else floor / n * 1e9,
                            error=errors[mode].get(impl), kernel_min_n=min_n, affinity=cores,
                            torch_threads=torch.get_num_threads())
                        if impl == LARGE_KERNEL:
                            row["kernel_fallbacks"] = fallbacks
                        case.append(row)
                rows += case
                recorder.add(case, f"{dname} {threads} thr {load} {family} n={n}")
    return rows


def _number(value, spec: str, width: int) -> str:
    return f"{'' if value is None else format(value, spec):>{width}s}"


def format_one_system(rows, width=None) -> str:
    """The rows of :func:`run_one_system` as a table (ns per unknown and the ratios), then a
    summary of the final op's forward time over raw ``?gtsv``'s: per dtype, thread count and
    condition the median and the largest over the families and sizes, and per family the median
    over the sizes on one thread, quiet. Rows stored before the families count as ``dominant``,
    quiet. At most ``width`` columns."""
    rows = with_family_defaults(rows)
    width = width or SUMMARY_WIDTH
    lines = [f"{'impl':12s} {'mode':8s} {'dtype':7s} {'thr':>3s} {'load':5s} {'family':13s} "
             f"{'n':>8s} {'ns/unk':>7s} {'/gtsv':>6s} {'/jax':>6s} {'floor':>6s}"]
    for r in rows:
        lines.append(f"{_short(r['impl'])[:12]:12s} {r['mode']:8s} {r['dtype']:7s} "
                     f"{r['threads']:>3d} {_load_text(r['busy'], r.get('busy_core', 0)):5s} "
                     f"{_family_text(r['family']):13s} {r['n']:>8d} "
                     f"{_number(r.get('ns_per_unknown'), '.2f', 7)} "
                     f"{_number(r.get('vs_gtsv'), '.2f', 6)} {_number(r.get('vs_jax'), '.2f', 6)} "
                     f"{_number(r.get('floor_ns_per_unknown'), '.2f', 6)}")
    if any(r["busy"] and r.get("busy_core", 0) is None for r in rows):
        lines.append("busy*: a busy core was asked for, but none could be made busy (one core, "
                     "or no os.sched_setaffinity)")
    final = [r for r in rows if r["impl"] == FINAL and r["mode"] == "forward"
             and r.get("vs_gtsv") is not None]
    if not final:
        return "\n".join(lines)
    lines += [""] + textwrap.wrap(
        "The final op as installed, forward, over raw ?gtsv timed in the same alternation "
        "(below 1: faster), over the families and sizes:", width)
    lines.append(f"{'dtype':7s} {'thr':>3s} {'load':5s} {'median':>6s} {'largest':>7s}  "
                 "(family, n)")
    groups = {}
    for r in final:
        groups.setdefault((r["dtype"], r["threads"], _load_text(r["busy"],
                                                              r.get("busy_core", 0))), []).append(r)
    for (dtype, threads, load), group in sorted(groups.items(), key=lambda item: (
            item[0][0], item[0][1], item[0][2] != "quiet", item[0][2])):
        worst = max(group, key=lambda r: r["vs_gtsv"])
        median = statistics.median(r["vs_gtsv"] for r in group)
        lines.append(f"{dtype:7s} {threads:>3d} {load:5s} {median:6.2f} {worst['vs_gtsv']:7.2f}  "
                     f"({worst['family']}, n = {_compact(worst['n'])})")
    quiet = [r for r in final if r["threads"] == 1 and not r["busy"]]
    if quiet:
        dtypes = sorted({r["dtype"] for r in quiet})
        lines += ["", "One thread, quiet: the median over the sizes, per family"]
        lines.append(f"{'family':21s}" + "".join(f" {d:>8s}" for d in dtypes))
        for family in dict.fromkeys(r["family"] for r in quiet):
            cells = []
            for d in dtypes:
                qs = [r["vs_gtsv"] for r in quiet if (r["family"], r["dtype"]) == (family, d)]
                cells.append(_ratio_text(statistics.median(qs) if qs else None, 8))
            lines.append(f"{family:21s}" + "".join(f" {c}" for c in cells))
    return "\n".join(lines)


def _short(impl: str) -> str:
    """A short label of one of the final op's rows, for the log."""
    return {FINAL: "as installed", FINAL_LAPACK: "lapack", COMPILED_FINAL: "compiled",
            RAW_GTSV: "gtsv", FLOOR: "floor", JAX_IMPL: "jax", LARGE_KERNEL: "large kernel"
            }.get(impl, impl)


def format_against_jax(rows) -> str:
    """The rows of :func:`run_against_jax` as a table (at most ``SUMMARY_WIDTH`` columns). Rows
    stored before the families count as ``dominant``, quiet."""
    rows = with_family_defaults(rows)
    lines = textwrap.wrap(
        "Ours / JAX (interleaved medians; below 1: ours is faster). backward: our forward + "
        "backward against jax.grad, all four gradients. Each thread count in a process pinned to "
        "that many cores; load: quiet, or busy (another process spinning on one core). ours: the "
        "final op as installed (driver=None), on LAPACK (driver='lapack'), compiled "
        "(torch.compile).", SUMMARY_WIDTH)
    lines.append(f"{'dtype':7s} {'thr':>3s} {'xla':>3s} {'load':5s} {'family':13s} {'n':>6s} "
                 f"{'batch':>6s} {'mode':8s} {'ours':12s} {'time':>8s} {'ratio':>6s} "
                 f"{'/eager':>6s}")
    for r in rows:
        if r["impl"] != JAX_IMPL:
            eager = "" if r.get("vs_eager") is None else f"{r['vs_eager']:6.2f}"
            lines.append(f"{r['dtype']:7s} {r['threads']:>3d} {str(r.get('xla_threads')):>3s} "
                         f"{_load_text(r['busy'], r.get('busy_core', 0)):5s} "
                         f"{_family_text(r['family']):13s} {_compact(r['n']):>6s} "
                         f"{r['batch']:>6d} {r['mode']:8s} "
                         f"{_short(r['impl'])[:12]:12s} {_time_text(r['seconds']):>8s} "
                         f"{_ratio_text(r.get('ratio'), 6)} {eager:>6s}")
    if any(r["busy"] and r.get("busy_core", 0) is None for r in rows):
        lines.append("busy*: a busy core was asked for, but none could be made busy (one core, "
                     "or no os.sched_setaffinity)")
    return "\n".join(lines)


# Route justification (issue 24): every route of the final op that is not the simplest one
# stays only while a committed row shows that it pays, >= 1.25x over the route it replaces, in a
# case a user meets. Float64, one thread, timed in alternation with the op as installed.
ROUTE_CASES = [(100, 0), (1000, 0), (8, 1024), (10000, 0), (256, 1024)]  # (n, batch)
ROUTE_AS_INSTALLED = "as installed"


def _without_cpp_fast_path():
    """The final op without ``api._solve_on_cpp``: every call validates its inputs in Python and
    resolves the driver before it calls the C++ kernel."""
    return _routes.disabled("cpp_fast_path")


def _without_direct_kernel():
    """The final op with every kernel call dispatched: no C++ fast path, and no direct kernel
    call (``functions._unobserved`` and ``functions._direct`` say False), so every call goes
    through the autograd.Function and the op ``tridiag_tutorial::solve_kernel`` (forward and
    backward)."""
    return _routes.disabled("cpp_fast_path", "direct_kernel")


def _with_function_apply():
    """The final op without ``api._solve_on_cpp`` (as :func:`_without_cpp_fast_path`: a call with
    gradients then applies the general path's autograd.Function), applying that Function with
    plain ``_TridiagonalSolve.apply`` (which binds the arguments to ``forward``'s signature with
    :mod:`inspect` on every call) instead of ``_compat.function_apply``: compare its row with
    the row without the C++ fast path."""
    return _routes.disabled("cpp_fast_path", "function_apply")


def _without_fused_backward():
    """The final op whose C++ fast path runs its backward as a solve with ``A^H`` on the C++
    kernel (:func:`compiled.solve`) and the band gradients in torch ops
    (:func:`rules.solve_backward`), in place of the one C++ call ``cpp_solve_backward``."""
    return _routes.disabled("fused_backward")


# route -> (function, context factory or None, what the route's row tells)
ROUTES = {
    ROUTE_AS_INSTALLED: (tridiagonal_solve, None, "the final op, driver=None"),
    "without the C++ fast path": (
        tridiagonal_solve, _without_cpp_fast_path,
        "justifies api._solve_on_cpp (the C++ op checks the inputs, no Python validation; with "
        "gradients, functions._CppSolve)"),
    "without the fused C++ backward": (
        tridiagonal_solve, _without_fused_backward,
        "justifies compiled.solve_backward (the fast path's backward in one C++ call, not a "
        "solve and the band products in torch ops)"),
    "without direct kernel calls": (
        tridiagonal_solve, _without_direct_kernel,
        "justifies functions._unobserved / functions._direct (kernels called without the dispatcher)"),
    "Function.apply instead of _compat.function_apply": (
        tridiagonal_solve, _with_function_apply,
        "justifies _compat.function_apply (no inspect binding per call): over the row without "
        "the C++ fast path"),
    "ch4 autograd.Function": (
        tridiagonal_solve_function, None,
        "chapter 4's Function on LAPACK: the simplest differentiable solve"),
    "driver='lapack'": (TORCH_IMPLS[FINAL_LAPACK], None,
                        "justifies the C++ kernel where driver=None picks it"),
}
CPP_ROUTES = {"driver='cpp'": (CPP_IMPLS[FINAL_CPP], None,
                               "the C++ kernel named explicitly (driver=None's choice here)")}


def run_routes(cases=ROUTE_CASES, threads=(1,), modes=("forward", "backward"), min_time=0.1,
               repeats=21, log=print, recorder=None):
    """Time the final op as installed against the same op with one route removed, and against
    the simpler functions it replaces, float64, timed in alternation (:func:`_time_interleaved`;
    a route's switch in :mod:`tridiag_tutorial._routes` is off only while its own calls run).

    Routes (``ROUTES``): ``"as installed"`` (``driver=None``); the same op with one of its
    routes switched off (the C++ fast path, direct kernel calls, ``_compat.function_apply``);
    chapter 4's ``autograd.Function``; ``driver='lapack'`` and, where built, ``driver='cpp'``. ``backward`` is forward + the gradients of all four inputs;
    ``forward`` a call without gradients. Returns rows with ``route``, ``mode``, ``n``, ``batch``,
    ``dtype``, ``threads``, ``seconds``, ``ratio`` = seconds / the op's as installed (above 1:
    the route that the row removes pays), ``tells``, ``quartiles`` (of the blocks' times) and
    ``rounds`` (each round's block time, in the order of the rounds: the routes of a case were
    timed in the same rounds, so a ratio can be taken round by round)."""
    routes = {**ROUTES, **(CPP_ROUTES if _cpp_or_log(log) else {})}
    recorder = recorder or _NO_RECORDER
    recorder.begin([dict(threads=count, n=n, batch=batch, mode=mode)
                    for count in _thread_count_values(threads) for n, batch in cases
                    for mode in modes])
    rows = []
    for actual in _each_thread_count(threads):
        for n, batch in cases:
            args = problem(n, batch, torch.float64)
            for mode in modes:
                if recorder.done(dict(threads=actual, n=n, batch=batch, mode=mode)):
                    continue
                fns = {route: _torch_callable(fn, args, mode)
                       for route, (fn, _, _) in routes.items()}
                contexts = {route: context for route, (_, context, _) in routes.items()
                            if context is not None}
                spread, samples = {}, {}
                medians = _time_interleaved(fns, min_time, repeats, contexts, spread=spread,
                                            samples=samples)
                case = []
                for route, seconds in medians.items():
                    case.append(dict(route=route, mode=mode, n=n, batch=batch, dtype="float64",
                                     threads=actual, seconds=seconds,
                                     ratio=seconds / medians[ROUTE_AS_INSTALLED],
                                     tells=routes[route][2], quartiles=spread[route],
                                     rounds=samples[route]))
                log(f"  routes  threads={actual} n={n:>5d} batch={batch:>5d} {mode:8s} "
                    f"as installed {medians[ROUTE_AS_INSTALLED] * 1e6:9.1f} us; / it: "
                    + "  ".join(f"{route} {medians[route] / medians[ROUTE_AS_INSTALLED]:.2f}"
                                for route in routes if route != ROUTE_AS_INSTALLED))
                rows += case
                recorder.add(case, f"{actual} thr {_shape(n, batch)} {mode}")
    return rows


def format_routes(rows) -> str:
    lines = textwrap.wrap("Routes: time / the final op's as installed (interleaved medians; "
                          "above 1: the route the row removes pays)", SUMMARY_WIDTH)
    lines += [f"{'case':>12s} {'mode':8s} {'route':48s} {'time':>10s} {'ratio':>6s}"]
    for r in rows:
        case = f"{r['batch']} x {r['n']}" if r["batch"] else f"n = {r['n']}"
        lines.append(f"{case:>12s} {r['mode']:8s} {r['route']:48s} "
                     f"{r['seconds'] * 1e6:8.1f}us {r['ratio']:6.2f}")
    return "\n".join(lines)


def _jax_version():
    jax = _jax()
    return None if jax is None else jax.__version__


def jax_cpu_calls() -> dict | None:
    """The custom calls (library kernels) in JAX's lowered CPU program for its tridiagonal
    solve, per dtype, e.g. ``{"float64": ["lapack_dgtsv_ffi"]}``: what JAX runs underneath.
    ``None`` when JAX is not installed."""
    jax = _jax()
    if jax is None:
        return None
    calls = {}
    for dtype in ("float32", "float64"):
        bands = [jax.numpy.zeros(4, dtype=dtype)] * 3
        text = jax.jit(jax.lax.linalg.tridiagonal_solve).lower(
            *bands, jax.numpy.zeros((4, 1), dtype=dtype)).as_text()
        calls[dtype] = sorted(set(re.findall(r"custom_call @(\w+)", text)))
    return calls


def machine_info():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "default_threads": torch.get_num_threads(),
        "affinity": _cpu_cores(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
        else None,  # over the last 1, 5 and 15 minutes: other work on the machine
        "cpp_kernel": kernels.cpp_available(),
        # the pieces kernel's spikes (kernels.compiled.PIECES_SPIKES): a run's one-system rows
        # depend on it on CPUs that handle subnormal numbers slowly
        "pieces_spikes": compiled.PIECES_SPIKES if kernels.cpp_available() else None,
        # how it loads its last tile (kernels.compiled.PIECES_LAST_TILE): the time of a system of
        # one or a few tiles depends on it
        "pieces_last_tile": compiled.PIECES_LAST_TILE if kernels.cpp_available() else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "jax": _jax_version(),
        "jax_cpu_calls": jax_cpu_calls(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("OPENBLAS", "OMP", "MKL", "XLA"))},
    }


def format_steps_table(rows) -> str:
    lines = ["Time stepping: factor once / solve every step (< 1: factoring once is faster)",
             f"{'kernel':17s} {'dtype':8s} {'thr':>3s} {'n':>7s} {'batch':>5s} {'k':>2s} {'steps':>5s} "
             f"{'mode':8s} {'once':>10s} {'every':>10s} {'ratio':>6s}"]
    for r in rows:
        lines.append(f"{r['kernel']:17s} {r['dtype']:8s} {r['threads']:>3d} {r['n']:>7d} "
                     f"{r['batch']:>5d} {r.get('k', 1):>2d} {r['steps']:>5d} {r['mode']:8s} "
                     f"{r['factor_once_seconds'] * 1e3:8.2f}ms {r['every_step_seconds'] * 1e3:8.2f}ms "
                     f"{r['ratio']:6.3f}")
    return "\n".join(lines)


def _thread_counts(text: str) -> tuple:
    """``--threads``'s value as thread counts (``None`` for ``default``)."""
    return tuple(None if t == "default" else int(t) for t in text.split(","))


# ---------------------------------------------------------------------------------------------
# The command line: rows written as they are measured, progress on stderr, runs that continue.

SUMMARY_WIDTH = 100  # the printed tables fit in this many columns


def _compact(n: int) -> str:
    """``n`` in few characters: ``1e5`` for a power of ten from 10^4 on, else the digits."""
    for k in range(4, 19):
        if n == 10**k:
            return f"1e{k}"
    return str(n)


def _time_text(seconds) -> str:
    """A time in a few characters: three or four digits and a unit (``1.23ms``, ``456us``)."""
    if seconds is None:
        return "-"
    for unit, scale in (("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        value = seconds / scale
        if value < 999.5:
            break
    return f"{value:.{2 if value < 9.995 else 1 if value < 99.95 else 0}f}{unit}"


_RESULT_LABELS = {FINAL: "final op", FINAL_LAPACK: "final op, lapack", FINAL_CPP: "final op, cpp"}


def _result_label(row) -> str:
    label = _RESULT_LABELS.get(row["impl"], row["impl"])
    return (label + (" [compiled]" if row.get("compiled") else ""))[:30]


def format_results(rows, width=SUMMARY_WIDTH) -> str:
    """The rows of :func:`run` as tables of median times per call, one per mode, dtype and thread
    count: an implementation a line, a case a column (``n=100``: one system of 100 unknowns;
    ``16x8``: 16 systems of 8), split into tables of fewer columns where the cases would not fit
    in ``width`` characters."""
    groups = {}
    for r in rows:
        groups.setdefault((r["mode"], r["dtype"], r["threads"]), []).append(r)
    order = sorted(groups, key=lambda g: (MODES.index(g[0]) if g[0] in MODES else len(MODES),
                                          str(g[1]), g[2]))
    lines = textwrap.wrap(
        "Median time per call. A column per case: n=100 is one system of 100 unknowns, 1024x256 "
        "a batch of 1024 systems of 256. final op: tridiagonal_solve as installed (driver=None); "
        "final op, lapack / cpp: with driver='lapack' / 'cpp'.", width)
    for mode, dtype, threads in order:
        group = groups[mode, dtype, threads]
        labels = list(dict.fromkeys(_result_label(r) for r in group))
        cases = list(dict.fromkeys((r["n"], r["batch"]) for r in group))
        cells = {}
        for r in group:
            error = r.get("error") or ""
            cells[_result_label(r), (r["n"], r["batch"])] = (
                _time_text(r["seconds"]) if r["seconds"] is not None
                else "not run" if error.startswith("not run") else "failed")
        headers = {case: (f"{_compact(case[1])}x{_compact(case[0])}" if case[1]
                          else f"n={_compact(case[0])}") for case in cases}
        widths = {case: max([len(headers[case])] + [len(cells.get((label, case), ""))
                                                     for label in labels]) for case in cases}
        label_width = max(len(label) for label in labels)
        chunks, used = [[]], label_width
        for case in cases:
            if chunks[-1] and used + 1 + widths[case] > width:
                chunks.append([])
                used = label_width
            chunks[-1].append(case)
            used += 1 + widths[case]
        for i, chunk in enumerate(chunks):
            part = f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            lines += ["", f"{mode}, {dtype}, {threads} thread(s){part}",
                      " " * label_width + "".join(f" {headers[c]:>{widths[c]}s}" for c in chunk)]
            for label in labels:
                if any((label, c) in cells for c in chunk):
                    lines.append(f"{label:{label_width}s}" + "".join(
                        f" {cells.get((label, c), ''):>{widths[c]}s}" for c in chunk))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:02.0f} min"


class Progress:
    """How far a run is, on ``stream`` (standard error). On a terminal: a status line rewritten in
    place after each row, ``[57/412] main suite: float64 1 thr n=1e5 forward final op ~12 min
    left``, cleared while a log line is printed (:meth:`log`, on ``out``: standard output).
    Elsewhere (a pipe, a file, CI): plain lines only, no carriage returns: one when a part of the
    run begins, then at most one every ``every`` seconds, and one when it ends.

    The estimate of the time left is the part's time per row so far times its rows left.
    ``tty`` overrides ``stream.isatty()``; ``clock`` and ``width`` are for tests."""

    def __init__(self, stream=None, out=None, tty=None, clock=time.monotonic, every=60.0,
                 width=None):
        self.stream = sys.stderr if stream is None else stream
        self._out = out
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty, self.clock, self.every, self._width = tty, clock, every, width
        self.name, self.total, self.count, self.status, self.shown = None, 0, 0, "", False
        self.started = self.last = clock()

    @property
    def out(self):
        return sys.stdout if self._out is None else self._out

    def width(self) -> int:
        if self._width:
            return self._width
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns if columns > 0 else shutil.get_terminal_size((SUMMARY_WIDTH, 24)).columns

    def begin(self, name: str, total: int, kept: int = 0, units: str = "rows"):
        """A part of the run begins: ``total`` rows (``units``) to measure, ``kept`` kept from a
        run that did not finish."""
        self.clear()
        self.name, self.total, self.count = name, total, 0
        self.started = self.last = self.clock()
        self._line(f"{name}: {total} {units} to measure"
                   + (f" ({kept} measured before, kept)" if kept else ""))
        self.status = f"[0/{total}] {name}: estimating the time left"
        self._draw()

    def advance(self, label: str = ""):
        """One more row (or case timed in alternation) measured: ``label``."""
        self.count += 1
        elapsed = self.clock() - self.started
        left = ("done" if self.count >= self.total else
                f"~{_duration(elapsed / self.count * (self.total - self.count))} left")
        head = f"[{self.count}/{self.total}] {self.name}: "
        room = self.width() - 1 - len(head) - len(left) - 1
        if len(label) > room:
            label = label[:max(room - 3, 0)] + "..."
        self.status = f"{head}{label} {left}"
        if self.tty:
            self._draw()
        elif self.clock() - self.last >= self.every:
            self._line(self.status)
            self.last = self.clock()

    def end(self):
        """The part of the run is over."""
        if self.name is None:
            return
        self.clear()
        self._line(f"{self.name}: {self.count} measured in "
                   f"{_duration(self.clock() - self.started)}")
        self.name, self.status = None, ""

    def log(self, line: str):
        """Print a line of the run's log on ``out``, the status line (if any) below it."""
        self.clear()
        print(line, file=self.out, flush=True)
        self._draw()

    def clear(self):
        """Erase the status line (a terminal only); :meth:`advance` draws it again."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False

    def _draw(self):
        if self.tty and self.status:
            self.stream.write("\r\x1b[K" + self.status)
            self.stream.flush()
            self.shown = True

    def _line(self, text: str):
        self.clear()
        print(text, file=self.stream, flush=True)


# Where a run has not finished, the results file says so under this key: {suite key: the
# settings and machine of the run}; a run with --merge of that file and the same settings and
# machine keeps that suite's rows and measures only the others (see _Suite).
UNFINISHED = "unfinished_run"
# What identifies a row (or a case timed in alternation: a "unit") in each suite's list.
UNIT_FIELDS = {
    "results": ("impl", "mode", "compiled", "n", "batch", "dtype", "threads"),  # = _case
    "time_stepping": ("kernel", "dtype", "threads", "n", "batch", "k", "steps", "mode"),
    "compiled_kernel": ("threads", "n", "batch"),
    "torch_kernels": ("threads", "n", "batch"),
    "cliffs": ("kernel", "op", "threads", "batch", "n"),
    "routes": ("threads", "n", "batch", "mode"),
    "against_jax": ("dtype", "threads", "busy", "family", "n", "batch", "mode"),
    "one_system": ("dtype", "threads", "busy", "family", "n"),
    "thread_budget": ("batch", "n", "family", "dtype", "busy"),
}
# A unit field that rows stored before it existed lack: its value in those rows.
UNIT_DEFAULTS = dict(FAMILY_DEFAULTS)
SUITE_NAMES = {"results": "main suite", "time_stepping": "time stepping",
               "compiled_kernel": "compiled kernel", "torch_kernels": "torch kernels",
               "cliffs": "cliffs", "routes": "routes", "against_jax": "against JAX",
               "one_system": "one system", "thread_budget": "thread budget"}
# what a unit is called in each suite's messages
UNIT_WORDS = {"results": "rows", "time_stepping": "rows"}  # else "cases"
# machine_info()'s entries that may change between two parts of one measurement (the rows
# record their own thread counts)
_NOT_IDENTITY = ("date", "load_average", "default_threads")


class _NoRecorder:
    """The recorder of a call from Python: nothing measured before, nothing recorded."""

    def begin(self, units):
        pass

    def done(self, unit: dict) -> bool:
        return False

    def add(self, rows, label=None):
        pass


_NO_RECORDER = _NoRecorder()


def _thread_count_values(threads) -> list:
    """The thread counts that :func:`_each_thread_count` will set (``None``: torch's current)."""
    return [t or torch.get_num_threads() for t in threads]


def _file_mode(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_json(path: str, data):
    """Write ``data`` to ``path`` atomically: into a temporary file in the same folder, then
    ``os.replace``; an interrupt in the middle leaves the previous version, never half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Suite:
    """One experiment's rows in the results file of a run (its recorder): the experiment calls
    :meth:`begin` with the units it will measure, skips those that :meth:`done` says a run
    being continued has measured, and gives each unit's rows to :meth:`add`, which rewrites the
    file at once.

    The rows under ``key``: those of this run, then the merged file's rows that stay: with
    ``replace_cases`` those of units this run does not measure (the main suite, the time
    stepping); without, none (an experiment's list is replaced whole), except, either way, the
    units kept from a run being continued. That is a run that wrote ``UNFINISHED[key]`` equal to
    this run's (the same settings and ``machine_info()`` but for ``_NOT_IDENTITY``); its rows of
    units in this run's plan are kept, not measured again (in the main suite, those with a
    time: a failed row is measured again)."""

    def __init__(self, report, key, config, settings=None, replace_cases=True, wall=False,
                 on_store=None):
        self.report, self.key, self.name = report, key, SUITE_NAMES[key]
        self.units = UNIT_WORDS.get(key, "cases")
        self.fields = UNIT_FIELDS[key]
        self.machine_key, self.config_key = (("machine", "config") if key == "results"
                                             else (f"{key}_machine", f"{key}_config"))
        self.config = {k: str(v) for k, v in config.items()}
        settings = {**self.config, **{k: str(v) for k, v in (settings or {}).items()}}
        identity = {k: v for k, v in report.machine.items() if k not in _NOT_IDENTITY}
        self.marker = json.loads(json.dumps(dict(settings=settings, machine=identity)))
        earlier = report.data.get(key) or []
        if key == "results":
            earlier = [r for r in earlier if r.get("impl") not in RETIRED_IMPLS]
        self.earlier = earlier
        self.resumed = report.merged_unfinished.get(key) == self.marker
        self.measured = {self.unit(r) for r in earlier if self.resumed
                         and (key != "results" or r.get("seconds") is not None)}
        self.wall_before = 0.0
        if self.resumed and wall:
            self.wall_before = float(report.data.get(self.config_key, {}).get("wall_seconds", 0))
        self.replace_cases, self.wall, self.on_store = replace_cases, wall, on_store
        self.plan, self.kept, self.new, self.count, self.total = set(), set(), [], 0, 0
        self.started = time.perf_counter()

    def unit(self, row) -> tuple:
        return tuple(row.get(f, UNIT_DEFAULTS.get(f)) for f in self.fields)

    def begin(self, units):
        self.plan = {self.unit(u) for u in units}
        self.kept = self.measured & self.plan
        self.total = len(self.plan - self.kept)
        self.report.unfinished[self.key] = self.marker
        self.report.active = self
        self.store()
        self.report.progress.begin(self.name, self.total, kept=len(self.kept), units=self.units)

    def done(self, unit: dict) -> bool:
        return self.unit(unit) in self.kept

    def add(self, rows, label=None):
        """``rows`` (one unit's) measured; ``label`` ``None``: rows not timed (not run)."""
        self.new += rows
        if label is not None:
            self.count += 1
        self.store()
        if label is not None:
            self.report.progress.advance(label)
        if _SIGINT_SEEN:  # a Ctrl-C that a library swallowed (raised inside its gc callback)
            raise KeyboardInterrupt

    def rows(self) -> list:
        replaced = self.plan | {self.unit(r) for r in self.new}
        return [r for r in self.earlier if self.unit(r) in self.kept
                or (self.replace_cases and self.unit(r) not in replaced)] + self.new

    def this_run(self) -> list:
        """The rows of this run's plan: those kept from the run continued, and the new ones."""
        return [r for r in self.earlier if self.unit(r) in self.kept] + self.new

    def store(self):
        """Put the rows so far in the report and write it."""
        data = self.report.data
        rows = self.rows()
        data[self.key] = rows
        data[self.machine_key] = self.report.machine
        config = dict(self.config)
        if self.wall:
            elapsed = self.wall_before + time.perf_counter() - self.started
            config["wall_seconds"] = str(round(elapsed, 1))
        data[self.config_key] = config
        if self.on_store is not None:
            self.on_store(data, rows)
        self.report.write()

    def finish(self):
        self.store()
        self.report.active = None
        self.report.progress.end()


class _Report:
    """The results file that a run writes (``out``): the merged file's content (``merged``,
    ``--merge``), each experiment's rows (:class:`_Suite`) as they are measured."""

    def __init__(self, out, merged=None, progress=None, merge=None):
        self.out, self.merge = out, merge
        self.merged = merged or {}
        unfinished = self.merged.get(UNFINISHED)
        self.merged_unfinished = dict(unfinished) if isinstance(unfinished, dict) else {}
        self.unfinished = dict(self.merged_unfinished)
        self.data = {k: v for k, v in self.merged.items() if k != UNFINISHED}
        self.progress = progress or Progress()
        self.active, self.written, self.suites, self._machine = None, False, [], None

    @property
    def machine(self) -> dict:
        if self._machine is None:
            self._machine = machine_info()
        return self._machine

    def suite(self, key, config, **options) -> _Suite:
        suite = _Suite(self, key, config, **options)
        self.suites.append(suite)
        return suite

    def write(self):
        data = dict(self.data)
        if self.unfinished:
            data[UNFINISHED] = self.unfinished
        _write_json(self.out, data)
        self.written = True

    def finish(self) -> dict:
        """The run is over: its experiments' rows no longer say that it did not finish."""
        for suite in self.suites:
            self.unfinished.pop(suite.key, None)
        self.write()
        return self.data

    def interrupted(self):
        """Write what was measured (again: the interrupt may have come during a write) and say
        so, on standard error."""
        self.progress.clear()
        if self.active is not None:
            self.active.store()
        if not self.written:
            message = f"Interrupted before anything was measured: {self.out} was not written."
        else:
            suite = self.active
            where = (f" ({suite.name}: {suite.count} of {suite.total} {suite.units} measured)"
                     if suite else "")
            again = ("run the same command again" if self.merge and os.path.exists(self.merge)
                     and os.path.samefile(self.merge, self.out)
                     else f"run the command again with --merge {self.out}")
            message = (f"Interrupted{where}. {self.out} keeps all that this run measured; to "
                       f"continue, {again}.")
        print("\n" + message, file=sys.stderr, flush=True)


def _store_targets(data, results):
    data["targets"] = evaluate_targets(results)


DEFAULT_MIN_TIME, DEFAULT_REPEATS = 0.2, 7

DESCRIPTION = """\
Benchmark every solver in the book against raw LAPACK ?gtsv and, when installed, JAX.

Without an --...-only switch it runs the main suite (every implementation, forward and
forward + backward, one system of n = 1e2 to 1e6 and three batches, float32 and float64, on
one thread and on torch's default thread count), then the time-stepping experiment, then the
interleaved comparison with JAX. With --min-time 0.1 --repeats 4 (the settings of the book's
main rows) the main suite and the comparison with JAX took about 17 minutes on a 2-core
machine; the defaults time each case 3.5 times as long. Each figure is a median time per
call measured with torch.utils.benchmark (in the interleaved experiments, of blocks timed in
alternation with what they are compared with).

examples:
  python -m tridiag_tutorial.bench.benchmarks --quick --out quick.json    tiny sizes: a smoke test
  python -m tridiag_tutorial.bench.benchmarks --out results.json          the full suite
  python -m tridiag_tutorial.bench.benchmarks --merge results.json --out results.json
                                          continue a run that was interrupted
"""

EPILOG = """\
progress:
  On a terminal, a status line on stderr shows the rows measured, the one just measured and
  an estimate of the time left in that part of the run (from its time per row so far).
  Elsewhere (a pipe, CI) stderr gets plain lines: when each part begins, about one a minute,
  and when it ends. stdout gets a line per measurement and summary tables at the end.

results file, interrupts and --merge:
  Each row is written to --out as soon as it is measured (the file is replaced atomically, so
  it is valid JSON at every moment). Ctrl-C stops the run, keeps what was measured and exits
  with status 130; to continue, run the command again with --merge OUT. With --merge, the
  merged file's entries that this run does not write are kept, and so are its rows of cases
  this run does not measure. The rows of a run that did not finish are kept, not measured
  again, when this run has the same settings (--quick, --min-time, --repeats, --threads,
  --families, --busy, --no-compile, --no-jax, --no-cpp) on the same machine (CPU, cores,
  affinity, versions, OMP/MKL/OPENBLAS/XLA variables). The same row: in the main suite, the
  same implementation, mode, compiled or not, n, batch, dtype and thread count; in the other
  experiments, the same case (its rows are timed together, in alternation; in the one-system
  experiment and the comparison with JAX, the same family and condition, quiet or busy, too).

matrix families and a busy core (--one-system-only, the comparison with JAX):
  One system is each of --families: dominant and pivoting (random, with and without diagonal
  dominance), poisson tridiag(-1, 2, -1), heat_r1 / heat_r1e2 / heat_r1e4 (an implicit heat
  step I + r tridiag(-1, 2, -1)), scaled_rows (rows scaled from 1e-100 to 1e100; float32: 1e-30
  to 1e30), nearly_singular_block and near_toeplitz tridiag(-1, 2.001, -1). Backward only for
  dominant. A busy condition runs another process spinning on one core while the pinned
  process measures: on 2 threads the last of its 2 cores, on 1 thread the last core the run
  may use (on 2 cores: the other one). Estimated on a 2-core machine (one case of each size
  timed): --one-system-only about 2 h at the default --min-time and --repeats, about 50 min
  with --min-time 0.1 --repeats 4; --jax-only about as long.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tridiag_tutorial.bench.benchmarks",
                                     description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one dtype, one thread: a smoke test (about half a "
                             "minute); each case timed for 0.001 s x 3 unless --min-time or "
                             "--repeats is given")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile cases")
    parser.add_argument("--no-jax", action="store_true",
                        help="skip JAX's rows even when jax is installed")
    parser.add_argument("--no-cpp", action="store_true",
                        help="skip the rows of the final op with driver='cpp' (the rows of "
                             "driver=None run the kernel it chooses all the same)")
    parser.add_argument("--out", default="benchmark_results.json",
                        help="JSON file to write (default: benchmark_results.json)")
    parser.add_argument("--min-time", type=float,
                        help=f"seconds per repeat (default {DEFAULT_MIN_TIME}): the main suite "
                             "times each case for min-time x repeats seconds; the interleaved "
                             "experiments time 2 x repeats + 1 blocks of min-time")
    parser.add_argument("--repeats", type=int,
                        help=f"repeats per case (default {DEFAULT_REPEATS})")
    parser.add_argument("--threads",
                        help="comma-separated thread counts; 'default' is torch's default "
                             "(for --jax-only: every core this process may use); if not given, "
                             "1,default (for --routes-only: 1; for --one-system-only: 1,2)")
    parser.add_argument("--merge", metavar="FILE",
                        help="a previous results JSON: its entries that this run does not "
                             "write are kept, and its rows of cases this run does not measure; "
                             "the rows of a run that did not finish (interrupted), with the same "
                             "settings on the same machine, are kept and not measured again")
    parser.add_argument("--no-steps", action="store_true",
                        help="skip the time-stepping experiment (run_time_stepping)")
    parser.add_argument("--steps-only", action="store_true",
                        help="run only the time-stepping experiment; with --merge, keep the merged "
                             "file's other results and replace its time-stepping rows")
    parser.add_argument("--compiled-only", action="store_true",
                        help="run only the compiled-kernel experiment (run_compiled_kernel; it "
                             "needs the C++ kernel built at install); with --merge, keep the rest of "
                             "the merged file")
    parser.add_argument("--jax-only", action="store_true",
                        help="run only the interleaved comparison with JAX (run_against_jax; the "
                             "full suite runs it at its end when jax is installed); with --merge, "
                             "keep the rest of the merged file")
    parser.add_argument("--cliffs-only", action="store_true",
                        help="run only the cliffs experiment (run_cliffs: a clean batch against one "
                             "NaN or overflowing system, every kernel); with --merge, keep the rest")
    parser.add_argument("--routes-only", action="store_true",
                        help="run only the route-justification experiment (run_routes: the final op "
                             "against itself without a fast path, with plain Function.apply, on "
                             "LAPACK, and chapter 4's Function); with --merge, keep the rest")
    parser.add_argument("--one-system-only", action="store_true",
                        help="run only the experiment on one large system (run_one_system: raw "
                             "?gtsv, the final op, the C++ kernel, JAX and the memory floor, "
                             "interleaved, on 1 and 2 threads, for each matrix family of "
                             "--families, quiet and with a busy core, see --busy); with --merge, "
                             "keep the rest of the merged file")
    parser.add_argument("--families", type=_families_option, metavar="F1,F2,...",
                        help="comma-separated matrix families of the one-system experiment and of "
                             "the single systems of the comparison with JAX (default: all, "
                             f"{', '.join(FAMILIES)}; --quick: {','.join(QUICK_FAMILIES)})")
    parser.add_argument("--dtypes", type=_dtypes_option, metavar="D1,D2",
                        help="comma-separated dtypes of the comparison with JAX (float32, "
                             "float64; default: both)")
    parser.add_argument("--busy", choices=tuple(BUSY_CHOICES),
                        help="the conditions of the one-system experiment and of the comparison "
                             "with JAX: quiet, busy (another process spinning on one core while "
                             "they measure) or both (default: both; --quick: quiet)")
    parser.add_argument("--thread-budget-only", action="store_true",
                        help="run only the C++ kernel's thread budget: one thread against two "
                             "on the same inputs, quiet and with a core busy (run_thread_budget; "
                             "--busy picks the conditions); with --merge, keep the rest of the "
                             "merged file")
    parser.add_argument("--torch-kernels-only", action="store_true",
                        help="run only the experiment on the kernels in torch ops "
                             "(run_torch_kernels); with --merge, keep the rest of the merged file")
    return parser


BUSY_CHOICES = {"quiet": (False,), "busy": (True,), "both": (False, True)}  # --busy


def _families_option(text: str) -> tuple:
    """``--families``'s value as a tuple of families."""
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    try:
        _check_families(families)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not families:
        raise argparse.ArgumentTypeError("no family named")
    return families


def _dtypes_option(text: str) -> tuple:
    """``--dtypes``'s value as a tuple of torch dtypes (float32 and float64 only)."""
    names = tuple(d.strip() for d in text.split(",") if d.strip())
    known = {"float32": torch.float32, "float64": torch.float64}
    unknown = [d for d in names if d not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {unknown[0]!r}; use float32 and/or float64" if unknown
            else "no dtype named")
    return tuple(known[d] for d in dict.fromkeys(names))


def _family_options(opts) -> dict:
    """The families and conditions (``--families``, ``--busy``) of :func:`run_one_system` and
    :func:`run_against_jax`: by default every family, quiet and busy; with ``--quick``
    ``QUICK_FAMILIES``, quiet."""
    families = opts.families or (QUICK_FAMILIES if opts.quick else FAMILIES)
    busy = BUSY_CHOICES[opts.busy or ("quiet" if opts.quick else "both")]
    return dict(families=families, busy=busy)


def _timing(opts):
    """``(min_time, repeats, interleaved repeats)`` of the run: the options', else the defaults
    (``--quick``: 0.001 s, 3 and 3)."""
    quick = opts.quick and opts.repeats is None
    min_time = opts.min_time if opts.min_time is not None else (
        0.001 if opts.quick else DEFAULT_MIN_TIME)
    repeats = opts.repeats if opts.repeats is not None else DEFAULT_REPEATS
    return min_time, 3 if quick else repeats, 3 if quick else 2 * repeats + 1


def _main_experiment(opts, report, key, run_experiment, quick_cases, quick_extra=None,
                     extra=None, threads="1,default"):
    """``--compiled-only`` / ``--torch-kernels-only`` / ``--jax-only`` / ``--cliffs-only`` /
    ``--routes-only`` / ``--one-system-only``, and the full run's comparison with JAX: one
    experiment's rows (under ``key``, with ``key_machine`` and ``key_config``) in ``report``.
    ``quick_extra`` and ``extra``: more arguments of ``run_experiment`` (``--quick`` only, and
    always). ``threads``: the experiment's thread counts where ``--threads`` is not given."""
    min_time, _, repeats = _timing(opts)
    if opts.quick:
        config = dict(cases=quick_cases, threads=(1,), min_time=min_time, repeats=repeats,
                      **(quick_extra or {}))
    else:
        config = dict(min_time=min_time, repeats=repeats,
                      threads=_thread_counts(opts.threads or threads))
    config.update(extra or {})
    suite = report.suite(key, config, replace_cases=False, wall=True)
    run_experiment(**config, log=report.progress.log, recorder=suite)
    suite.finish()
    return report.data[key]


def _against_jax_options(opts) -> dict:
    """``_main_experiment``'s extra arguments of :func:`run_against_jax`: with ``--quick`` the
    compiled rows at n = 100 only; none with ``--no-compile``; the families and conditions
    (:func:`_family_options`); the dtypes of ``--dtypes``, where given."""
    extra = _family_options(opts)
    if opts.dtypes:
        extra["dtypes"] = opts.dtypes
    if opts.no_compile:
        return dict(extra=dict(compiled_cases=(), **extra))
    return dict(quick_extra=dict(compiled_cases=[(100, 0)]), extra=extra)


def _measure(opts, report) -> list:
    """Run what ``opts`` asks for into ``report``; returns the summary tables to print."""
    only = [("compiled_only", "compiled_kernel", run_compiled_kernel, [(8, 16), (100, 0)], {}),
            ("cliffs_only", "cliffs", run_cliffs, [(16, 8), (8, 64)], {}),
            ("torch_kernels_only", "torch_kernels", run_torch_kernels, [(16, 4), (100, 0)], {}),
            ("one_system_only", "one_system", run_one_system, [10**4],
             dict(threads="1,2", extra=_family_options(opts))),
            ("routes_only", "routes", run_routes, [(100, 0), (8, 16)], dict(threads="1")),
            ("jax_only", "against_jax", run_against_jax, [(8, 16), (100, 0)],
             _against_jax_options(opts)),
            ("thread_budget_only", "thread_budget", run_thread_budget, [(64, 4096), (2, 10**5)],
             dict(quick_extra=dict(families=("dominant",), dtypes=(torch.float64,)),
                  extra=dict(threads=(1, 2), busy=BUSY_CHOICES[opts.busy or "both"])))]
    tables = {"one_system": format_one_system, "routes": format_routes,
              "against_jax": format_against_jax, "thread_budget": format_thread_budget}
    for switch, key, experiment, quick_cases, options in only:
        if getattr(opts, switch):
            rows = _main_experiment(opts, report, key, experiment, quick_cases, **options)
            return [tables[key](rows)] if key in tables else []
    min_time, repeats, step_repeats = _timing(opts)
    if opts.quick:
        config = dict(sizes=[8, 100], batches=[(16, 8)], dtypes=(torch.float64,), threads=(1,),
                      min_time=min_time, repeats=repeats)
        steps_config = dict(cases={"LAPACK": [(8, 0, None), (8, 16, 2)],
                                   "pure-torch kernel": [(8, 4, None)]},
                            steps=3, threads=(1,), min_time=min_time, repeats=step_repeats)
    else:
        threads = _thread_counts(opts.threads or "1,default")
        config = dict(min_time=min_time, repeats=repeats, threads=threads)
        steps_config = dict(min_time=min_time, repeats=step_repeats, threads=threads)
    log = report.progress.log
    summary = []
    if not opts.steps_only:
        suite = report.suite("results", config, on_store=_store_targets,
                             settings=dict(compile=not opts.no_compile, jax=not opts.no_jax,
                                           cpp=not opts.no_cpp))
        run(compile=not opts.no_compile, jax=not opts.no_jax, cpp=not opts.no_cpp, log=log,
            recorder=suite, **config)
        suite.finish()
        summary.append(format_results(suite.this_run()))
    else:  # the merged file's main rows stay, as they were measured
        data = report.data
        data["results"] = [r for r in data.get("results", [])
                           if r.get("impl") not in RETIRED_IMPLS]
        data["targets"] = evaluate_targets(data["results"])
        data.setdefault("machine", report.machine)
        data.setdefault("config", {k: str(v) for k, v in config.items()})
    if not opts.no_steps:
        # --steps-only replaces the merged file's time-stepping rows; the full run those of the
        # cases it measures
        steps = report.suite("time_stepping", steps_config, replace_cases=not opts.steps_only)
        run_time_stepping(log=log, recorder=steps, **steps_config)
        steps.finish()
    report.data.setdefault("time_stepping", [])
    if not opts.no_jax and not opts.steps_only and _jax() is not None:
        rows = _main_experiment(opts, report, "against_jax", run_against_jax, [(8, 16), (100, 0)],
                                **_against_jax_options(opts))
        summary.append(format_against_jax(rows))
    if report.data["time_stepping"]:
        summary.append(format_steps_table(report.data["time_stepping"]))
    return summary


_SIGINT_SEEN = []  # SIGINTs received during main: checked after each measured unit


def _on_sigint(signum, frame):
    """Raise ``KeyboardInterrupt`` as Python's own handler does, and remember the signal: where the
    exception is raised inside a gc callback (JAX registers one), Python prints it as ignored and
    goes on, so :meth:`_Suite.add` raises it again after the unit being measured."""
    _SIGINT_SEEN.append(signum)
    raise KeyboardInterrupt


def main(argv=None):
    """The command line (``python -m tridiag_tutorial.bench.benchmarks --help``): measure, write the
    results file as rows are measured, print the summary; returns the report written. An
    interrupt (``KeyboardInterrupt``) leaves the rows measured in the file, says so on standard
    error and propagates."""
    opts = _parser().parse_args(argv)
    handle = (threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, _on_sigint) if handle else None
    _SIGINT_SEEN.clear()
    try:
        return _main(opts)
    finally:
        if handle:
            signal.signal(signal.SIGINT, previous)


def _main(opts):
    merged = {}
    if opts.merge:
        with open(opts.merge) as f:
            merged = json.load(f)
    report = _Report(opts.out, merged, Progress(), merge=opts.merge)
    try:
        summary = _measure(opts, report)
        data = report.finish()
    except KeyboardInterrupt:
        report.interrupted()
        raise
    for table in summary:
        print("\n" + table)
    print(f"\nwrote {opts.out}")
    return data


def _cli():
    """``python -m tridiag_tutorial.bench.benchmarks``: :func:`main`, and on an interrupt exit status
    130 without a traceback (main has said what was kept)."""
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    _cli()
