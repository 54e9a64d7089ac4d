r"""Which kernel solves, in one place: LAPACK, the compiled C++ kernel, or the pure-torch kernel.

- **CPU**: LAPACK through SciPy (:mod:`tridiag_tutorial.lapack`) by default; the compiled kernel
  (:mod:`tridiag_tutorial.compiled`) once :func:`tridiag_tutorial.compiled.load` has built it,
  for the problems where it measured faster (:func:`compiled_pays`); the pure-torch kernel
  inside :func:`torch_kernel_on_cpu`.
- **Every other device**: kernels in torch ops. Systems of ``n >= PARTITIONED_MIN_N`` unknowns go
  to the partitioned kernel (:mod:`tridiag_tutorial.partitioned`, O(log n) dispatched operations),
  smaller ones to the sequential pivoting kernel (:mod:`tridiag_tutorial.torch_kernel`, O(n)
  operations, each on the whole batch); see :func:`partitioned_pays`. The factorization
  (:func:`factor`, and a solve from factors) is always the sequential kernel's.

All functions here take validated inputs of one batch shape with a matrix right-hand side
``(*B, n, k)``, return new tensors and never modify their inputs. The ops of
:mod:`tridiag_tutorial.ops` and :mod:`tridiag_tutorial.custom_op` call them; ``torch_kernel`` is
the caller's kernel choice for CPU tensors, which those ops save in the forward and reuse in the
backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref

import torch

from . import _compat, _validation, compiled, lapack, partitioned
from . import torch_kernel as _pure_torch  # a module; "torch_kernel" below is the kernel choice

__all__ = ["torch_kernel_on_cpu", "use_compiled", "compiled_pays", "cpp_autograd_pays",
           "use_partitioned", "partitioned_pays", "solve", "factor", "same_kernels_as_forward"]

# Which kernel a CPU tensor goes to is context-local state (a ContextVar: each thread, and each
# asyncio task, has its own), never a module global: a block in one thread cannot change the kernel
# that another thread's solve runs. The ops that the final function calls save the choice made in
# the forward and restore it around their backward (see tridiag_tutorial.ops).
_TORCH_KERNEL_ON_CPU = contextvars.ContextVar("tridiag_tutorial_torch_kernel_on_cpu", default=False)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    """Within the block, the context variable ``var`` holds ``value``; then its earlier value."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def torch_kernel_on_cpu():
    """Within this block, CPU tensors go to the kernels in torch ops instead of LAPACK.

    These kernels (the sequential pivoting kernel and the partitioned one, chosen by
    :func:`~tridiag_tutorial.kernels.partitioned_pays`) are the ones other devices (CUDA) use;
    this lets the tests and the book run that exact code path, through the custom ops, on a
    machine without a GPU. The choice is
    local to the calling thread (and asyncio task); a solve made inside the block runs its backward
    on the same kernel even when the backward runs after the block has ended.
    """
    return _setting(_TORCH_KERNEL_ON_CPU, True)


@torch.compiler.assume_constant_result
def _torch_kernel_on_cpu() -> bool:
    """True inside :func:`torch_kernel_on_cpu` (in this thread or task). Dynamo reads it once,
    when it traces, and bakes the answer into the graph (so a compiled forward and its backward
    agree; a later call of the compiled function keeps the kernel it was traced with)."""
    return _TORCH_KERNEL_ON_CPU.get()


def _numpy(*tensors):
    """NumPy views of the CPU tensors' data (a copy only for a lazily conjugated or negated tensor:
    ``numpy(force=True)`` is ``detach().resolve_conj().resolve_neg().numpy()`` in one call)."""
    return [t.numpy(force=True) for t in tensors]


def lapack_for(t: torch.Tensor, torch_kernel: bool) -> bool:
    """Whether ``t``'s solve runs on the CPU kernels (LAPACK or the compiled one)."""
    return t.device.type == "cpu" and not torch_kernel


# Whether CPU solves may use the compiled kernel once it is loaded (context-local, like the kernel
# choice above; the tests turn it off to test the LAPACK path, and on where they test the kernel).
_USE_COMPILED = contextvars.ContextVar("tridiag_tutorial_use_compiled", default=True)


def use_compiled(enabled: bool):
    """Within the block, CPU solves use the compiled kernel where it pays (``True``, the default
    once :func:`tridiag_tutorial.compiled.load` has run) or always LAPACK (``False``)."""
    return _setting(_USE_COMPILED, enabled)


COMPILED_ONE_SYSTEM_MAX_N = 3000  # measured: see compiled_pays


def compiled_pays(rhs: torch.Tensor) -> bool:
    """Whether the compiled kernel (loaded, allowed) takes this CPU solve instead of LAPACK.

    Decided by measurement against this package's LAPACK kernel (one thread, every dtype, one and
    four right-hand sides): on every batch of 2 to 64 systems of n = 8 to 1000 it took 0.17 to
    1.02 of LAPACK's time (batches of 1024 to 100000 systems: 0.2 to 0.5), and on one system of
    n <= 3000 0.4 to 1.0 (the fixed cost of the call dominates). On one larger system it was
    within a few percent of LAPACK in double precision and about 10% slower in float32, so one
    system of n > 3000 stays on LAPACK. ``rhs`` is the validated ``(*B, n, k)`` right-hand side.
    """
    if not (compiled.is_loaded() and _USE_COMPILED.get()):
        return False
    return rhs.shape[:-2].numel() >= 2 or rhs.shape[-2] <= COMPILED_ONE_SYSTEM_MAX_N


def cpp_autograd_pays(rhs: torch.Tensor, lu, torch_kernel: bool) -> bool:
    """Whether a differentiable CPU solve without factors (``lu is None``) that only reverse-mode
    autograd observes goes to :func:`tridiag_tutorial.compiled.autograd_op`, whose backward runs
    in C++: wherever the compiled kernel takes the forward (:func:`compiled_pays`). Measured
    (``python -m tridiag_tutorial.benchmarks``, the committed ``against_jax`` rows that chapter 11
    renders; float32 and float64, one and two threads), forward + backward took 0.28 to 0.77 of
    the time of the same call on LAPACK with the Python backward, in each of the 20 cases where
    the compiled kernel solves (n = 100 and 1000, and three batch shapes)."""
    return lu is None and lapack_for(rhs, torch_kernel) and compiled_pays(rhs)


PARTITIONED_MIN_N = 64  # measured: see partitioned_pays

# Whether solves in torch ops may use the partitioned kernel (context-local, like the choices
# above; the benchmark suite turns it off to time the sequential kernel alone).
_USE_PARTITIONED = contextvars.ContextVar("tridiag_tutorial_use_partitioned", default=True)


def use_partitioned(enabled: bool):
    """Within the block, solves in torch ops use the partitioned kernel where it pays (``True``,
    the default) or always the sequential pivoting kernel (``False``). Like
    :func:`torch_kernel_on_cpu`, a compiled function keeps the choice it was traced with."""
    return _setting(_USE_PARTITIONED, enabled)


@torch.compiler.assume_constant_result
def _partitioned_allowed() -> bool:
    return _USE_PARTITIONED.get()


def partitioned_pays(rhs: torch.Tensor) -> bool:
    """Whether a solve without factors in torch ops takes the partitioned kernel rather than the
    sequential one: for ``n >= PARTITIONED_MIN_N`` unknowns, whatever the batch.

    The sequential kernel dispatches about 37 operations per row (36,990 for n = 1000), the
    partitioned one a number that grows like ``log n`` (1,989 for n = 1000, 2,986 for n = 1e5,
    3,472 for n = 1e6, with blocks of ``tridiag_tutorial.partitioned.BLOCK`` = 4 rows, its
    refinement included; 1,020, 1,558 and 1,818 before refinement was added), each on
    more data. Measured on the CPU (the only device measured; ``python -m
    tridiag_tutorial.benchmarks --torch-kernels-only``, float64, 1 and 2 threads, the committed
    ``torch_kernels`` rows), partitioned / sequential time at n = 64 was 0.29 to 0.33 for one
    system and 0.44 to 0.47 for 64 systems, and fell to 0.12 and 0.21 to 0.26 at n = 256. For
    1024 systems it was 1.55 to 2.45 on one thread and 0.86 to 2.2 on two: each of the sequential
    kernel's operations then works on 1024 numbers, which amortizes its overhead on a CPU, while
    the partitioned kernel does more arithmetic. The rule ignores the batch all the same, because
    these kernels are made for devices where every operation is a kernel launch of several
    microseconds: there 1024 systems of n = 64 cost 2,358 launches on the sequential kernel and
    1,210 on the partitioned one (596 before refinement; the times above were measured before it
    too). That part is a judgement from the operation counts, not a GPU
    measurement. Inside ``use_partitioned(False)`` it is never taken. ``rhs`` is the validated
    ``(*B, n, k)`` right-hand side.
    """
    return rhs.shape[-2] >= PARTITIONED_MIN_N and _partitioned_allowed()


_CHOICES = (_TORCH_KERNEL_ON_CPU, _USE_COMPILED, _USE_PARTITIONED)
_RECORD = "_tridiag_tutorial_kernel_choices"  # on torch.utils.checkpoint's frame: one per call
_REPLAYED = "_tridiag_tutorial_replayed"      # per recomputation: how many it has used


def same_kernels_as_forward(function):
    """``function`` (a public function of :mod:`tridiag_tutorial.ops`), run under
    ``torch.utils.checkpoint(..., use_reentrant=False)`` on the kernels its forward chose.

    The checkpoint recomputes the forward when the backward needs it, after the caller's
    :func:`torch_kernel_on_cpu`, :func:`use_compiled` or :func:`use_partitioned` block may have
    ended; without this the recomputation ran on another kernel and saved other tensors (torch
    raised ``CheckpointError``: 7 tensors saved in the forward, 5 in the recomputation). So in a
    checkpointed forward each call records the three choices on the checkpoint's frame, and the
    recomputation replays them, call by call in the same order. Outside a checkpoint, and while
    compiling (a compiled function keeps the choice it was traced with), it only calls
    ``function``."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        frame, recomputation = _compat.checkpoint_state()
        if frame is None:
            return function(*args, **kwargs)
        record = frame.__dict__.setdefault(_RECORD, [])
        if recomputation is None:  # the checkpointed forward: record this call's choices
            record.append(tuple(var.get() for var in _CHOICES))
            return function(*args, **kwargs)
        replayed = frame.__dict__.setdefault(_REPLAYED, weakref.WeakKeyDictionary())
        index = replayed.get(recomputation, 0)
        replayed[recomputation] = index + 1
        if index >= len(record):  # not in the forward: nothing to replay (torch reports it)
            return function(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for var, value in zip(_CHOICES, record[index]):
                stack.enter_context(_setting(var, value))
            return function(*args, **kwargs)
    return wrapper


def lapack_solves(rhs: torch.Tensor, torch_kernel: bool) -> bool:
    """Whether a solve of this ``(*B, n, k)`` right-hand side without factors runs on LAPACK."""
    return lapack_for(rhs, torch_kernel) and not compiled_pays(rhs)


# Below this many elements, a backward's band products run on NumPy views rather than torch
# tensors. torch runs an elementwise operation on one thread below its grain size of 32768
# elements (at::internal::GRAIN_SIZE), so there NumPy (always one thread) does the same work with
# a fraction of torch's fixed cost per operation (measured at n = 100, one thread: about 0.3 µs
# for a NumPy product, 1.1 µs for torch's).
NUMPY_BACKWARD_MAX_ELEMENTS = 32768


def numpy_backward_pays(grad_x: torch.Tensor, lu, torch_kernel: bool) -> bool:
    """Whether a first-order backward without factors (``lu is None``) runs on NumPy arrays:
    for LAPACK solves of at most ``NUMPY_BACKWARD_MAX_ELEMENTS`` elements."""
    return (lu is None and grad_x.numel() <= NUMPY_BACKWARD_MAX_ELEMENTS
            and lapack_solves(grad_x, torch_kernel))


def factor(lower, diag, upper, torch_kernel: bool):
    """``(lu, pivots)``: ``(*B, 4, n)`` and ``(*B, n)`` int32 (see :func:`tridiag_tutorial.lapack.factor`)."""
    if lapack_for(diag, torch_kernel):
        lu, pivots = lapack.factor(*_numpy(lower, diag, upper))
        return torch.from_numpy(lu), torch.from_numpy(pivots)
    return _pure_torch.factor(lower, diag, upper)


def solve(lower, diag, upper, rhs, lu, pivots, trans: str, torch_kernel: bool):
    """Solve ``M x = rhs``. Without factors (``lu is None``), ``M`` is the matrix of the bands and
    ``trans`` is ``'N'``. With the factors of a matrix ``A``, ``M`` is ``A`` (``trans='N'``),
    ``A^T`` (``'T'``) or ``A^H`` (``'C'``), and the bands (``M``'s) are not read."""
    on_cpu = lapack_for(rhs, torch_kernel)
    if lu is None:
        if on_cpu and compiled_pays(rhs):
            return compiled.op()(lower, diag, upper, rhs)
        if on_cpu:
            return torch.from_numpy(lapack.solve(*_numpy(lower, diag, upper, rhs)))
        if partitioned_pays(rhs):
            return partitioned.solve(lower, diag, upper, rhs)
        return _pure_torch.solve(lower, diag, upper, rhs)
    _validation.check_pivot_values(pivots)  # ?gttrs trusts them: a bad value reads out of bounds
    if on_cpu:
        return torch.from_numpy(lapack.factor_solve(*_numpy(lu, pivots, rhs), trans))
    return _pure_torch.lu_solve(lu, pivots, rhs, trans)
