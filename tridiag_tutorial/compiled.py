"""An optional compiled C++ CPU kernel: ``tridiag_tutorial_cpp::solve``, built on first use.

The source, ``tridiag_tutorial/csrc/tridiag.cpp``, performs exactly the operations of LAPACK's
``?gtsv`` (Gaussian elimination with partial pivoting, then back substitution) for float32,
float64, complex64 and complex128, but on many systems at once: blocks of 8 (double) or 16
(single precision) systems are interleaved in memory so that the compiler vectorises the
elimination across systems, the pivot choice is a select rather than a branch, and the blocks are
spread over threads with ``at::parallel_for``. A single system runs the same code sequentially.

How to call it::

    from tridiag_tutorial import compiled
    solve = compiled.load()               # builds the first time (about a minute), then cached
    x = solve(lower, diag, upper, rhs)    # bands (*B, n-1), (*B, n), (*B, n-1); rhs (*B, n, k)

The inputs must already have one batch shape ``*B`` (broadcast them first) and one dtype; they
may be views with any strides and are never modified. The result is a new C-contiguous
``(*B, n, k)`` tensor. It raises where ``?gtsv`` reports an exactly zero pivot (``info > 0``;
the real routines never check the step with a row interchange, so a NaN diagonal entry above a
zero subdiagonal one gives NaN in that system, not an error), with the package's message
(``"the tridiagonal matrix is singular: pivot U[i, i] is exactly zero, in batch element (a,
b)"``) naming the first such system and ``?gtsv``'s pivot; elsewhere the results equal
``?gtsv``'s bit for bit, NaN included (``tests/test_compiled.py`` checks this on non-finite and
singular families, all four dtypes). The op has a fake kernel that checks what the C++ kernel
checks (shapes, dtypes, layout; inputs on more than one device, a ``meta`` band beside CPU
tensors say, raise :class:`ValueError`), so it can be traced by ``torch.compile``, and a vmap
rule (one call on the stacked systems), so ``torch.func.vmap`` and batched gradients work; it
has no autograd formula (use :func:`tridiag_tutorial.tridiagonal_solve` for gradients).

Nothing is compiled when the package is imported, and LAPACK (through SciPy) stays the default
kernel of :func:`tridiag_tutorial.tridiagonal_solve`: this module is only used once :func:`load`
has been called explicitly. From then on the package's CPU solves without factors run on it
where it measured faster than LAPACK (batches of systems; see
:func:`tridiag_tutorial.kernels.compiled_pays`), forward and backward, in every composition the
op supports; :func:`tridiag_tutorial.kernels.use_compiled` turns that off within a block. Building needs a C++ compiler (``$CXX``, else ``c++``) and
``ninja``; without them :func:`load` raises :class:`RuntimeError` saying what is missing.

The build goes through :func:`torch.utils.cpp_extension.load` and is cached under torch's
extensions directory: ``$TORCH_EXTENSIONS_DIR`` if set, else
``torch.utils.cpp_extension._get_build_directory("tridiag_tutorial_cpp", False)`` (by default
``~/.cache/torch_extensions/<python and torch version tag>/tridiag_tutorial_cpp``). Later
processes reuse the cached library unless the source or the flags change. The library is linked
against the installed torch's C++ ABI, so it only loads in the torch it was built with; torch's
cache directory name carries the Python and torch versions (and the source hash is checked), so
after upgrading torch it is rebuilt. It is compiled with ``-O3`` only (no ``-march=native``), so a
cache shared between machines with different CPUs stays valid.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

__all__ = ["load", "is_loaded", "op", "autograd_op", "SOURCE", "AUTOGRAD_SOURCE"]

NAME = "tridiag_tutorial_cpp"
SOURCE = Path(__file__).with_name("csrc") / "tridiag.cpp"
AUTOGRAD_SOURCE = SOURCE.with_name("tridiag_autograd.cpp")  # the solve with its backward in C++

_op = None
_autograd_op = None


def is_loaded() -> bool:
    """True once :func:`load` has built (or found cached) and loaded the library in this process."""
    return _op is not None


def op():
    """The loaded op ``torch.ops.tridiag_tutorial_cpp.solve`` (call :func:`load` first)."""
    if _op is None:
        raise RuntimeError("tridiag_tutorial.compiled.op(): call tridiag_tutorial.compiled.load() "
                           "first")
    return _op


def autograd_op():
    """The loaded op ``torch.ops.tridiag_tutorial_cpp.solve_autograd`` (call :func:`load` first):
    :func:`op` with an Autograd kernel in C++ (``csrc/tridiag_autograd.cpp``), so that a
    backward runs without entering Python. It has a vmap rule (so ``is_grads_batched``,
    ``jacobian(vectorize=True)`` and ``gradcheck(check_batched_grad=True)`` work) but no
    forward-mode rule, and torch refuses it under ``torch.func.grad``;
    :func:`tridiag_tutorial.tridiagonal_solve` calls it only in eager reverse mode, where it
    measured faster (see :func:`tridiag_tutorial.kernels.cpp_autograd_pays`)."""
    if _autograd_op is None:
        raise RuntimeError("tridiag_tutorial.compiled.autograd_op(): call "
                           "tridiag_tutorial.compiled.load() first")
    return _autograd_op


def _missing_tools() -> list[str]:
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a C++ compiler ({cxx!r}, from $CXX or the default 'c++', is not on PATH)")
    if not is_ninja_available():
        missing.append("ninja (torch.utils.cpp_extension builds with it: pip install ninja)")
    return missing


def load(verbose: bool = False):
    """Build (first call, or when the cache is stale) and load the library; return the op
    ``torch.ops.tridiag_tutorial_cpp.solve``. Later calls return it immediately.

    Raises :class:`RuntimeError` when no C++ compiler or no ninja is available.
    """
    global _op, _autograd_op
    if _op is not None:
        return _op
    missing = _missing_tools()
    if missing:
        raise RuntimeError(
            "tridiag_tutorial.compiled.load() cannot build the C++ kernel: missing "
            + " and ".join(missing)
            + ". The LAPACK kernel (through SciPy) stays the default and needs no compiler.")
    from torch.utils.cpp_extension import load as _cpp_load

    _cpp_load(name=NAME, sources=[str(SOURCE), str(AUTOGRAD_SOURCE)], extra_cflags=["-O3"],
              is_python_module=False, verbose=verbose)
    op = torch.ops.tridiag_tutorial_cpp.solve
    _register_fake()
    _register_vmap()
    _autograd_op = torch.ops.tridiag_tutorial_cpp.solve_autograd.default
    _op = op
    return op


_fake_registered = False
_vmap_registered = False
_LIB = None  # the torch.library.Library that holds the vmap rules (kept alive while loaded)

_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _check_inputs(name: str, lower, diag, upper, rhs) -> None:
    """The checks of the C++ kernel (csrc/tridiag.cpp), on metadata only: what the fake kernel
    does before it returns, so that a traced or meta call fails where the real one would (shapes,
    dtypes, layout) and a mix of devices (a meta band beside CPU tensors) raises ValueError
    rather than returning an uninitialised tensor."""
    op = f"{NAME}::{name}"
    tensors = {"lower": lower, "diag": diag, "upper": upper, "rhs": rhs}
    for key, t in tensors.items():
        if t.layout != torch.strided or t.is_nested:
            raise RuntimeError(f"{op}: {key} must be a dense (strided) tensor, got "
                               f"{'a nested tensor' if t.is_nested else t.layout}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"{op}: all inputs must be on one device, got lower on {lower.device}, "
                         f"diag on {diag.device}, upper on {upper.device}, rhs on {rhs.device}")
    if diag.dtype not in _DTYPES:
        raise RuntimeError(f"{op}: dtype must be float32, float64, complex64 or complex128, got "
                           f"{diag.dtype}")
    if any(t.dtype != diag.dtype for t in tensors.values()):
        raise RuntimeError(f"{op}: all inputs must have one dtype")
    vector = name == "solve_autograd" and rhs.dim() == diag.dim()
    torch._check(diag.dim() >= 1, lambda: f"{op}: diag must have a last dimension n")
    torch._check(vector or rhs.dim() == diag.dim() + 1,
                 lambda: f"{op}: rhs must be (*B, n, k) for diag (*B, n); got rhs "
                 f"{list(rhs.shape)} and diag {list(diag.shape)}")
    n = diag.shape[-1]
    torch._check(n >= 1, lambda: f"{op}: n must be at least 1")
    batch = tuple(diag.shape[:-1])
    torch._check(tuple(lower.shape) == batch + (n - 1,) and tuple(upper.shape) == batch + (n - 1,)
                 and tuple(rhs.shape[:len(batch) + 1]) == batch + (n,),
                 lambda: f"{op}: shapes must be lower, upper (*B, n-1), diag (*B, n), rhs "
                 f"(*B, n, k) with one batch shape; got {list(lower.shape)}, {list(diag.shape)}, "
                 f"{list(upper.shape)}, {list(rhs.shape)}")


def _register_fake() -> None:
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake(f"{NAME}::solve")
    def _solve_fake(lower, diag, upper, rhs):
        _check_inputs("solve", lower, diag, upper, rhs)
        return rhs.new_empty(rhs.shape)  # C-contiguous, like the CPU kernel's result

    @torch.library.register_fake(f"{NAME}::solve_autograd")
    def _solve_autograd_fake(lower, diag, upper, rhs):
        _check_inputs("solve_autograd", lower, diag, upper, rhs)
        return rhs.new_empty(rhs.shape)

    _fake_registered = True


def _vmap_rule(op):
    """The batch rule of ``op`` (``solve`` or ``solve_autograd``): the vmapped dimension moved to
    the front of every input (unbatched inputs expanded to it), one call of the op on the
    unwrapped tensors, the result batched along dimension 0. Without it, vmap (and
    ``is_grads_batched``, ``jacobian(vectorize=True)``, ``gradcheck(check_batched_grad=True)``,
    which use vmap) would hand the C++ code batched tensors, which hold no storage."""
    from .custom_op import _vmap_rule as rule_of  # chapter 5's rule, for any op of this shape

    def rule(info, in_dims, lower, diag, upper, rhs):
        return rule_of(op, info, in_dims, lower, diag, upper, rhs)
    return rule


def _register_vmap() -> None:
    global _vmap_registered, _LIB
    if _vmap_registered:
        return
    _LIB = torch.library.Library(NAME, "FRAGMENT")
    for name in ("solve", "solve_autograd"):
        torch.library.register_vmap(f"{NAME}::{name}",
                                    _vmap_rule(getattr(torch.ops.tridiag_tutorial_cpp, name).default),
                                    lib=_LIB)
    _vmap_registered = True
