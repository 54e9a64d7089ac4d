"""The C++ kernel, built when the package is installed: ``torch.ops.tridiag_tutorial.cpp_solve``.

``pip install`` compiles ``tridiag_tutorial/csrc/tridiag.cpp``, with the headers beside it that
it includes (the kernel's parts), into the extension module ``tridiag_tutorial._C`` (``setup.py``:
torch's ``CppExtension`` with the CPython limited API and PyTorch's stable ABI, the way
pytorch/extension-cpp ships its operators). Importing this module imports ``_C``, whose library
defines the schemas of the package's ops (chapter 14) and the CPU kernel of ``cpp_solve``; nothing
is compiled at import. Where the install could not build it (no C++ compiler), :func:`is_available`
is False, the package defines the same schemas in Python and every CPU solve runs on LAPACK.

The kernel performs exactly the operations of LAPACK's ``?gtsv`` (Gaussian elimination with
partial pivoting, then back substitution) for float32, float64, complex64 and complex128, but on
many systems at once: blocks of 8 (double) or 16 (single precision) systems are interleaved in
memory so that the eliminations of a block run side by side in SIMD registers as independent
chains of divisions, and blocks are spread over threads. Its results equal ``?gtsv``'s bit for
bit, NaN included, and it reports a zero pivot exactly where ``?gtsv`` does
(``tests/test_compiled.py`` checks both).

One real system of ``n >= PIECES_MIN_N`` unknowns (or each of a batch smaller than a block) goes
to the *pieces* kernel instead (:func:`solve_ex`, the op ``cpp_solve_ex``, takes that size as an
argument and says how often it handed a system back). The rows are cut into pieces of about 512;
8 pieces (16 in single precision) are eliminated side by side, with partial pivoting inside each
piece, together with two "spikes" (the pieces' couplings to their neighbours); a small banded
system in the unknowns at the pieces' ends joins them, and each piece's answer is combined from
its three columns with its neighbours' values (or, where that combination cancels, the piece is
solved again). One thread does it all. Its rounding differs from ``?gtsv``'s (it does not pivot
across the ends of the pieces), so its forward error is close to LAPACK's but not within a fixed
multiple of it on every system (``python -m tridiag_tutorial.bench.accuracy --kernels pieces``
measures it; chapter 15 shows the rows). It hands the system to the sequential
elimination, which is ``?gtsv``'s, where it cannot vouch for its answer: a zero or non-finite
pivot in a piece, a step that cancels to rounding, a (nearly) zero pivot in the joining system, a
value that is not finite, cancellation in a piece, or (decided after the first tile of 8 or 16
pieces, once there are 8 tiles or more) a coupling that decays too slowly across a piece, as in
``tridiag(-1, 2, -1)``. So a singular system raises where ``?gtsv`` reports it, at its pivot
(``tests/test_pieces.py``).

:func:`solve` is the kernel as the package calls it: validated inputs of one batch shape
(``(*B, n-1)``, ``(*B, n)``, ``(*B, n-1)``, ``rhs (*B, n, k)``), a new C-contiguous result, and
:class:`~tridiag_tutorial.SingularMatrixError` for a singular system. The op itself returns
``(x, info)`` (``info`` = ``-1`` or ``system * n + pivot``), because an extension on the stable
ABI cannot raise ``torch.linalg.LinAlgError``; the error is raised here, in Python.
:func:`solve_backward` (the op ``cpp_solve_backward``) is the reverse mode of :func:`solve` in
one call: the solve with ``A^H`` on the same kernel and the three band gradients, which the final
op's C++ fast path calls in its backward.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .._validation import SingularMatrixError

__all__ = ["is_available", "library_path", "thread_budget", "ThreadBudget", "solve", "solve_ex", "solve_backward", "PIECES_MIN_N",
           "PIECES_SPIKES", "PIECES_LAST_TILE", "BUILD_ERROR", "repair_command"]

# One real system of this size or more goes to the pieces kernel (the C++ op cpp_solve uses the
# same number: kPiecesMinN in csrc/pieces.h). From 1024 its pieces have 128 rows or more (64 in single
# precision); the committed one-system rows show the pieces faster than the sequential
# elimination from 4096, the smallest size they measure.
PIECES_MIN_N = 1024
# What the pieces kernel does with a spike that decays below the normal range (cut_spike in
# csrc/pieces.h): it stops it there, instead of computing subnormal numbers, which some CPUs
# handle slowly. The benchmark suite records it with each run.
PIECES_SPIKES = "cut below the smallest normal number"
# How the pieces kernel loads its last tile, the only one that can reach the system's last row
# (load in csrc/pieces.h): transposed into the lanes like every other tile, but its last rows. A
# kernel that loaded the whole last tile one value at a time spent four times as long loading it;
# a system of one tile (up to 8,192 unknowns in float32, fewer than 4,096 in float64) paid that
# on every row. The benchmark suite records it with each run.
PIECES_LAST_TILE = ("transposed like the others, except the rows that reach the system's end, read "
                    "one value at a time")

#: Set to ``1`` before the package is imported to run as if the C++ kernel had not been built
#: (every CPU solve on LAPACK): how the tests and the book check the package without it.
DISABLE_ENV = "TRIDIAG_TUTORIAL_NO_CPP"


def _build_report() -> dict:
    """What ``setup.py`` wrote about the extension's build (``_build_info.json`` beside this
    module: whether it was built, and why not), or ``{}`` where it wrote nothing."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(__file__).parent.parent / "_build_info.json").read_text())
    except (OSError, ValueError):
        return {}


_REPORT: dict = {}
if os.environ.get(DISABLE_ENV) == "1":
    _C = None
    BUILD_ERROR: str | None = f"switched off with {DISABLE_ENV}=1"
    DISABLED = True
else:
    DISABLED = False
    try:
        from .. import _C
    except ImportError as err:  # not built at install, or built for another platform
        _C = None
        _REPORT = _build_report()
        # the cause the build recorded (no torch at build time, no compiler, a compile error);
        # where the build succeeded or recorded nothing (a copied module, a library built for
        # another platform), the import's own message
        BUILD_ERROR = (_REPORT.get("error") if _REPORT.get("built") is False
                       else f"{type(err).__name__}: {err}")
        # installed without it on purpose (TRIDIAG_TUTORIAL_NO_EXTENSION=1): no advice to build it
        DISABLED = _REPORT.get("cause") == "switched_off"
    else:
        BUILD_ERROR = None


def _installed_from() -> tuple[str, bool]:
    """``(source, editable)``: what pip installed the package from (PEP 610's
    ``direct_url.json``): a folder, ``git+URL@commit``, or ``tridiag-tutorial==VERSION`` for an
    install from an index, from a wheel file (which holds no source to build) or where pip
    recorded nothing."""
    import json
    from importlib import metadata
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    try:
        dist = metadata.distribution("tridiag-tutorial")
        direct = json.loads(dist.read_text("direct_url.json") or "null")
        version = dist.version
    except (metadata.PackageNotFoundError, ValueError):
        return "tridiag-tutorial", False
    if not direct or direct.get("url", "").endswith(".whl"):
        return f"tridiag-tutorial=={version}", False
    url = direct.get("url", "")
    if "vcs_info" in direct:
        vcs = direct["vcs_info"]
        return f"{vcs.get('vcs', 'git')}+{url}@{vcs.get('commit_id', '')}".rstrip("@"), False
    if url.startswith("file://"):
        return url2pathname(urlparse(url).path), bool(direct.get("dir_info", {}).get("editable"))
    return url, False


def repair_command() -> str:
    """The command that builds the C++ kernel into this environment: the package installed again
    from where it came from, with ``--no-deps`` so that torch and everything else stay as they
    are (pip finds the installed torch and builds against it; see ``setup.py``), and without
    pip's cache of wheels it built, which may hold the one without the kernel."""
    import shlex
    import sys

    source, editable = _installed_from()
    python = shlex.quote(sys.executable)
    target = ("-e " if editable else "") + shlex.quote(source)
    if source.startswith("tridiag-tutorial=="):
        target += " --no-binary tridiag-tutorial"  # build from the sdist, here
    if _REPORT.get("cause") == "no_torch":
        # a front end that builds in an environment of its own, without torch: build here instead
        return (f"{python} -m pip install 'setuptools>=77' && {python} -m pip install "
                f"--force-reinstall --no-deps --no-cache-dir --no-build-isolation {target}")
    return f"{python} -m pip install --force-reinstall --no-deps --no-cache-dir {target}"


def missing_advice() -> str:
    """Why the C++ kernel is missing and how to get it (or do without it)."""
    if DISABLED:
        undo = ("unset it, in a new process" if os.environ.get(DISABLE_ENV) == "1"
                else "install the package again without it")
        return f"it was switched off ({BUILD_ERROR}; {undo}, to use it), or use driver='lapack'"
    first = ("install a C++ compiler (for example g++), then run "
             if _REPORT.get("cause") == "no_compiler" else "run ")
    built = _REPORT.get("built")
    state = ("it was not built when the package was installed" if built is False
             else "it was built when the package was installed but cannot be loaded" if built
             else "it was not built, or cannot be loaded")
    return (f"{state} ({BUILD_ERROR or 'no cause recorded'}). To build it, "
            f"{first}{repair_command()} , then restart Python; or use driver='lapack'")


def is_available() -> bool:
    """Whether the C++ kernel was built at install time and loaded (``driver="cpp"`` works)."""
    return _C is not None


def library_path() -> str:
    """The path of the compiled library: what ``torch.ops.load_library`` loads in a process that
    does not import this package (an AOTInductor deployment, chapter 14)."""
    if _C is None:
        raise RuntimeError(_missing_message())
    return _C.__file__


class ThreadBudget(NamedTuple):
    """What :func:`thread_budget` reports. ``stalled_regions``, the parallel regions of the kernel
    since the library loaded whose threads did not pay (the region took more than 0.8 of the CPU
    time its threads spent in it, and more than 0.3 ms, as when another process has one of their
    cores); ``solo_seconds_left``, how long the kernel's parallel regions still run on the calling
    thread alone (0 when they use torch's thread pool)."""
    stalled_regions: int
    solo_seconds_left: float


def thread_budget() -> ThreadBudget:
    """The C++ kernel's thread budget. Each of its parallel regions (the batch kernel's blocks,
    the few large systems of the pieces kernel) compares its wall time with the CPU time its
    threads spent in it, about what one thread would have needed; after two regions in a row
    that took more than 0.8 of it, regions run on the calling thread alone for 50 ms, then try
    the pool again, doubling that time (up to 2 s) while the tries stall. Threads claim the
    region's work in chunks, so a slower thread takes fewer. The pool's size is still
    ``torch.get_num_threads()``."""
    if _C is None:
        raise RuntimeError(_missing_message())
    stalled, solo_ns = _C.thread_budget()
    return ThreadBudget(int(stalled), solo_ns / 1e9)


def _missing_message() -> str:
    return f"tridiag_tutorial: the C++ kernel is not available: {missing_advice()}."


def solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
          rhs: torch.Tensor) -> torch.Tensor:
    """``x = A^{-1} rhs`` on the C++ kernel, for CPU inputs of one batch shape and ``rhs``
    ``(*B, n, k)`` or ``(*B, n)``; raises :class:`~tridiag_tutorial.SingularMatrixError` where
    ``?gtsv`` reports a zero pivot (the first such system in batch order). The op checks its
    inputs (devices, layouts, dtypes, shapes) before it reads them and raises ``RuntimeError``
    for any it cannot solve, so this may be called on unvalidated tensors."""
    if _C is None:
        raise RuntimeError(_missing_message())
    x, info = torch.ops.tridiag_tutorial.cpp_solve.default(lower, diag, upper, rhs)
    _raise_if_singular(info, diag)
    return x


def solve_ex(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
             pieces_min_n: int = PIECES_MIN_N) -> tuple[torch.Tensor, int]:
    """:func:`solve` with the size from which a real system (one, or each of a batch smaller than
    a block) goes to the pieces kernel, and the number of such systems it handed to the
    sequential kernel: ``(x, fallbacks)``. ``pieces_min_n=0`` sends every such system there
    (its pieces are then at least 8 rows, padded with identity rows); a large value, none."""
    if _C is None:
        raise RuntimeError(_missing_message())
    x, info, fallbacks = torch.ops.tridiag_tutorial.cpp_solve_ex.default(
        lower, diag, upper, rhs, pieces_min_n)
    _raise_if_singular(info, diag)
    return x, int(fallbacks)


def solve_backward(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, x: torch.Tensor,
                   grad_x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The reverse mode of ``x = A^{-1} rhs`` in one call of the op ``cpp_solve_backward``:
    ``(grad_lower, grad_diag, grad_upper, grad_rhs)`` from ``x`` and ``grad_x = dL/dx`` (both of
    ``rhs``'s shape), where ``grad_rhs = v = A^{-H} grad_x`` is one solve on the kernel of
    :func:`solve` and the band gradients are the bands of ``-v x^H`` summed over the columns
    (:func:`tridiag_tutorial.rules.solve_backward`, with the products formed in C++ instead of
    four passes of torch ops). Raises :class:`~tridiag_tutorial.SingularMatrixError` as
    :func:`solve` does for ``A^H``."""
    if _C is None:
        raise RuntimeError(_missing_message())
    *grads, info = torch.ops.tridiag_tutorial.cpp_solve_backward.default(
        lower, diag, upper, x, grad_x)
    _raise_if_singular(info, diag)
    return tuple(grads)


def _raise_if_singular(info: torch.Tensor, diag: torch.Tensor) -> None:
    """The ops' ``info`` (``-1``, or ``system * n + pivot`` of the first singular system) as
    :class:`~tridiag_tutorial.SingularMatrixError`."""
    code = int(info)
    if code >= 0:
        n = diag.shape[-1]
        raise SingularMatrixError.at(code % n, code // n, diag.shape[:-1])
