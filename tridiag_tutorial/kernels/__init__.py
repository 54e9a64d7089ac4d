r"""Which kernel solves, in one place: the ``driver`` of every public function.

Four kernels, each named by a driver (the word :func:`torch.linalg.svd` and
:func:`torch.linalg.lstsq` use for the same idea):

- ``"lapack"``: LAPACK ``?gtsv`` / ``?gttrf`` / ``?gttrs`` through SciPy (:mod:`tridiag_tutorial.kernels.lapack`), CPU;
- ``"cpp"``: the C++ kernel built at install (:mod:`tridiag_tutorial.kernels.compiled`), CPU, solves
  without factors;
- ``"sequential"``: the pivoting kernel in torch ops (:mod:`tridiag_tutorial.kernels.sequential`),
  any device, O(n) dispatched operations; it also factors and solves from factors;
- ``"partitioned"``: the partitioned kernel in torch ops (:mod:`tridiag_tutorial.kernels.partitioned`),
  any device, O(log n) dispatched operations, solves without factors.

``driver=None`` asks :func:`choose_driver`, a pure function of the device, the dtype, the shape
and whether the C++ kernel is installed; the public functions resolve it before they call an op,
so the choice travels in the op's arguments: Dynamo guards on the shapes and the flag it depends
on, the backward and ``jvp`` solve with the driver of the forward, and
``torch.utils.checkpoint``'s recomputation makes the same choice from the same inputs.

All functions here take validated inputs of one batch shape with a matrix right-hand side
``(*B, n, k)``, return new tensors and never modify their inputs.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch
import torch.utils.dlpack

from .. import _validation
from . import compiled, lapack, partitioned
from . import sequential as _sequential

__all__ = ["DRIVERS", "FACTOR_DRIVERS", "cpp_available", "choose_driver", "choose_factor_driver",
           "resolve_driver", "resolve_factor_driver", "solve", "factor",
           "CPP_ONE_COMPLEX_SYSTEM_MAX_N", "PARTITIONED_MIN_N"]

DRIVERS = ("lapack", "cpp", "sequential", "partitioned")
FACTOR_DRIVERS = ("lapack", "sequential")  # the kernels that factor and solve from factors
_CPU_ONLY = ("lapack", "cpp")

CPP_ONE_COMPLEX_SYSTEM_MAX_N = 3000  # see choose_driver
PARTITIONED_MIN_N = 64               # see choose_driver

_CPP = compiled.is_available()  # fixed for the life of the process


def cpp_available() -> bool:
    """Whether the C++ kernel was built when the package was installed (``driver="cpp"``)."""
    return _CPP


def choose_driver(device_type: str, dtype: torch.dtype, batch: int, n: int, cpp: bool) -> str:
    """The automatic choice (``driver=None``) for a solve without factors: a pure function.

    ``device_type`` is the tensors' ``device.type``, ``batch`` the number of systems, ``n`` their
    size and ``cpp`` whether the C++ kernel is installed. Of ``dtype`` only whether it is complex
    counts: one large complex system has no solve in pieces in the C++ kernel (see below).

    - **CPU**: the C++ kernel, where installed, for every batch of two or more systems, for one
      real system of any size and for one complex system of ``n <= CPP_ONE_COMPLEX_SYSTEM_MAX_N``;
      LAPACK otherwise: the cases where the committed benchmark rows show the C++ kernel faster
      than this package's LAPACK kernel (``python -m tridiag_tutorial.bench.benchmarks``: the
      batches of ``--compiled-only``, the one large system of ``--one-system-only`` on nine
      families of matrices, quiet and with a core busy; chapters 12 and 15 show them). One real
      system of ``compiled.PIECES_MIN_N`` unknowns or more goes to the kernel's solve in pieces,
      which eliminates many pieces of the one system side by side, and hands a system whose
      pieces it cannot vouch for (``tridiag(-1, 2, -1)``, say) to its sequential elimination,
      ``?gtsv``'s arithmetic. One complex system has no such solve, and above
      ``CPP_ONE_COMPLEX_SYSTEM_MAX_N`` unknowns it stays on LAPACK: a heuristic cut that no
      committed benchmark row times.
    - **Every other device**: the partitioned kernel for ``n >= PARTITIONED_MIN_N``, the
      sequential one below. The sequential kernel dispatches a fixed number of operations per
      row, each a kernel launch on a GPU; the partitioned one a number that grows like ``log n``
      (``--torch-kernels-only`` counts both; chapter 16). That part is a judgement from the
      operation counts for few systems, where launches dominate, not a GPU measurement: the
      partitioned kernel writes 18 to 20 times the sequential kernel's bytes, so a large
      batch, bound by memory bandwidth on a GPU, should favour the sequential kernel.
    - **MPS** (Apple's GPUs, without float64): the sequential kernel at every size, since the
      partitioned kernel's check computes in float64 (``driver="partitioned"`` is refused there).
      Not run on MPS hardware: a judgement from the dtypes each kernel writes (chapter 16).
    """
    if device_type == "cpu":
        # the dtype and n first: for real dtypes and for small systems the batch size is not
        # looked at, so a traced or exported graph does not guard on it
        if cpp and (not dtype.is_complex or n <= CPP_ONE_COMPLEX_SYSTEM_MAX_N or batch >= 2):
            return "cpp"
        return "lapack"
    if device_type == "mps":  # no float64 there: the partitioned kernel's check needs it
        return "sequential"
    return "partitioned" if n >= PARTITIONED_MIN_N else "sequential"


def choose_factor_driver(device_type: str) -> str:
    """The automatic choice for factoring, and for a solve from factors: LAPACK on the CPU, the
    sequential kernel (the same pivot choices, the same factors) elsewhere."""
    return "lapack" if device_type == "cpu" else "sequential"


def _check_driver(driver, allowed, device: torch.device, name: str) -> str:
    if not isinstance(driver, str) or driver not in allowed:
        raise ValueError(f"{name}: driver must be None or one of {', '.join(map(repr, allowed))}, "
                         f"got {driver!r}")
    if driver in _CPU_ONLY and device.type != "cpu":
        others = [repr(d) for d in allowed if d not in _CPU_ONLY]
        use = ", ".join(["driver=None"] + others[:-1]) + " or " + others[-1]
        raise ValueError(f"{name}: driver={driver!r} runs on CPU tensors only, got tensors on "
                         f"{device}; use {use}")
    if driver == "partitioned" and device.type == "mps":
        raise ValueError(f"{name}: driver='partitioned' computes its check in float64, which MPS "
                         f"lacks; use driver=None or 'sequential' on MPS, or move the tensors to "
                         f"the CPU")
    if driver == "cpp" and not _CPP:
        raise RuntimeError(f"{name}: driver='cpp': " + compiled._missing_message())
    return driver


def resolve_driver(driver: str | None, rhs: torch.Tensor, name: str = "tridiagonal_solve") -> str:
    """The driver of a solve without factors of the validated ``(*B, n, k)`` ``rhs``: ``driver``
    checked (a name of ``DRIVERS`` that can run on ``rhs``'s device), or the automatic choice.

    Raises:
        ValueError: an unknown driver, ``"lapack"`` / ``"cpp"`` for tensors not on the CPU, or
            ``"partitioned"`` on MPS.
        RuntimeError: ``"cpp"`` where the C++ kernel was not built.
    """
    if driver is None:  # math.prod, not numel(): numel() would specialize an exported batch size
        batch = math.prod(rhs.shape[:-2])
        chosen = choose_driver(rhs.device.type, rhs.dtype, batch, rhs.shape[-2], _CPP)
        # is_compiling() first: a graph that Dynamo traces reads no flag, and guards on none
        if not _CPP and not torch.compiler.is_compiling() and not _warned and not compiled.DISABLED:
            if choose_driver(rhs.device.type, rhs.dtype, batch, rhs.shape[-2], True) == "cpp":
                _warn_missing_cpp()
        return chosen
    return _check_driver(driver, DRIVERS, rhs.device, name)


_warned = False


def _warn_missing_cpp() -> None:
    """One UserWarning per process, at the first solve that would have run on the C++ kernel had
    it been built: the package works without it, more slowly, and the warning says how to build
    it (or how to silence it)."""
    global _warned
    _warned = True
    frame, level = sys._getframe(1), 1  # point at the caller's line, outside torch and this package
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "tridiag_tutorial", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"tridiag_tutorial: the C++ kernel is not available, so this solve runs on LAPACK "
        f"(slower): {compiled.missing_advice()}. Set {compiled.DISABLE_ENV}=1 to run without it "
        "and without this warning.", UserWarning, stacklevel=level + 1)


def resolve_factor_driver(driver: str | None, device: torch.device, name: str) -> str:
    """As :func:`resolve_driver`, for factoring and solving from factors (``FACTOR_DRIVERS``)."""
    if driver is None:
        return choose_factor_driver(device.type)
    if driver in DRIVERS and driver not in FACTOR_DRIVERS:
        raise ValueError(f"{name}: driver={driver!r} solves without factors only; the "
                         f"factorization runs on {' or '.join(map(repr, FACTOR_DRIVERS))} "
                         "(or driver=None)")
    return _check_driver(driver, FACTOR_DRIVERS, device, name)


class _DLPack:
    """A DLPack capsule as NumPy takes it (``np.from_dlpack`` asks the object for it)."""

    __slots__ = ("capsule",)

    def __init__(self, tensor: torch.Tensor):
        self.capsule = torch.utils.dlpack.to_dlpack(tensor)

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _numpy(*tensors):
    """Read-only NumPy views of the CPU tensors' data (a copy only for a lazily conjugated or
    negated tensor), through DLPack: ``Tensor.numpy()`` would mark the tensor's storage as one that
    can never be resized again, and FSDP2 frees a parameter's memory by resizing its storage to 0.
    The capsule is made by ``torch.utils.dlpack.to_dlpack`` directly: ``Tensor.__dlpack__``'s
    Python checks cost as much again as ``Tensor.numpy()`` itself, four times a call."""
    views = []
    for t in tensors:
        if t.requires_grad:
            t = t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        views.append(np.from_dlpack(_DLPack(t)))
    return views


def factor(lower, diag, upper, driver: str):
    """``(lu, pivots)``: ``(*B, 4, n)`` and ``(*B, n)`` int32 (see :func:`tridiag_tutorial.kernels.lapack.factor`)."""
    if driver == "lapack":
        lu, pivots = lapack.factor(*_numpy(lower, diag, upper))
        return torch.from_numpy(lu), torch.from_numpy(pivots)
    return _sequential.factor(lower, diag, upper)


def solve(lower, diag, upper, rhs, lu, pivots, trans: str, driver: str):
    """Solve ``M x = rhs`` on ``driver``'s kernel. Without factors (``lu is None``), ``M`` is the
    matrix of the bands and ``trans`` is ``'N'``. With the factors of a matrix ``A`` (``driver``
    one of ``FACTOR_DRIVERS``), ``M`` is ``A`` (``trans='N'``), ``A^T`` (``'T'``) or ``A^H``
    (``'C'``), and the bands (``M``'s) are not read."""
    if lu is None:
        if driver == "cpp":
            return compiled.solve(lower, diag, upper, rhs)
        if driver == "lapack":
            return torch.from_numpy(lapack.solve(*_numpy(lower, diag, upper, rhs)))
        if driver == "partitioned":
            return partitioned.solve(lower, diag, upper, rhs)
        return _sequential.solve(lower, diag, upper, rhs)
    _validation.check_pivot_values(pivots)  # ?gttrs trusts them: a bad value reads out of bounds
    if driver == "lapack":
        return torch.from_numpy(lapack.factor_solve(*_numpy(lu, pivots, rhs), trans))
    return _sequential.lu_solve(lu, pivots, rhs, trans)
