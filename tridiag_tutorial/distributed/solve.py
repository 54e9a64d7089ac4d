r"""One tridiagonal system split across the ranks of a ``torch.distributed`` process group.

:mod:`tridiag_tutorial.kernels.partitioned` cuts one system into blocks to solve them *all at once* on one
device. Here the blocks are the pieces that different processes own: rank ``r`` of ``P`` holds
``m_r`` consecutive rows of ``A`` and of ``rhs`` and never sees the rest, so the partitioned
method becomes a distributed one, in which a handful of numbers per rank cross the network
instead of the whole system.

**Layout.** Rank ``r`` holds rows ``s .. s+m-1`` (``m = m_r``) and passes three bands of its own
length ``m``: the first entry of ``lower`` and the last of ``upper`` are the *couplings* to the
neighbouring ranks' rows, and lie outside the rank's block ``A_r`` (the inner box)::

      columns:        s-1        s          s+1     ...      s+m-2      s+m-1       s+m
    row s-1 (rank r-1)           upper'[-1]
                 +----------+--------------------------------------------------+-----------+
    row s        | lower[0] | diag[0]    upper[0]                              |           |
    row s+1      |          | lower[1]   diag[1]    upper[1]                   |           |
      ...        |          |                 ...       ...        ...         |           |
    row s+m-1    |          |                          lower[m-1]  diag[m-1]   | upper[m-1]|
                 +----------+--------------------------------------------------+-----------+
    row s+m (rank r+1)                                              lower''[0]

    lower[j] = A[s+j, s+j-1]   lower[0] couples row s to rank r-1's last row (0 on rank 0)
    diag[j]  = A[s+j, s+j]
    upper[j] = A[s+j, s+j+1]   upper[m-1] couples row s+m-1 to rank r+1's first row (0 on the
                               last rank)

This is JAX's full-length band layout (``dl[0] = 0``, ``du[n-1] = 0``) cut into pieces.
:func:`split_bands` cuts a system given in this package's layout (bands ``(n-1,)``, ``(n,)``,
``(n-1,)``) into the pieces, the way :func:`torch.tensor_split` splits ``n`` rows (or into pieces of
given sizes); :func:`split_sizes` gives the sizes.

**Method** (the spike method; the "two separator rows per rank" form of ``partitioned.py``):

1. Each rank factors its block ``A_r`` (its rows without the two couplings), with partial pivoting
   inside the block (LAPACK ``?gttrf`` through :func:`~tridiag_tutorial.tridiagonal_lu_factor` on
   the CPU), and solves ``A_r [y, v, w] = [b_r, lower[0] e_1, upper[-1] e_m]``: then
   ``x_r = y - v x_{r-1}[last] - w x_{r+1}[first]``.
2. Its first and last rows give two equations in the ``2 P`` unknowns ``f_q = x_q[first]``,
   ``l_q = x_q[last]`` (``f_r + v[0] l_{r-1} + w[0] f_{r+1} = y[0]``, the same with ``[m-1]``):
   one ``all_gather`` of a few numbers per rank, and every rank solves the same ``2P x 2P``
   *reduced system* densely, with partial pivoting, in float64 (complex128 for complex).
3. Each rank recovers its rows from its neighbours' separators ``l_{r-1}`` and ``f_{r+1}``.

**Accuracy: as the partitioned kernel's.** Pivoting happens inside each block only, so a block
that is singular or nearly so while ``A`` is not (LAPACK's row swaps would cross the piece
boundary) makes the spikes grow and costs digits. The same devices as ``partitioned.py`` repair or
detect that: two fixed *probe* right-hand sides ``D z`` beside the caller's (``z`` from the global
row number, so the probes are those of ``partitioned`` on the whole system); ``REFINEMENT_STEPS``
(2) steps of iterative refinement, the residual ``b - A x`` in more than the working precision
(``partitioned._Residual``: float32 in float64, float64 in double-double), which needs each
neighbour's boundary value of ``x`` (one ``all_gather`` of two rows per rank per step); and the
checks of ``partitioned``, every one decided *collectively* (from gathered numbers that are the
same on every rank, so no rank can decide differently and leave the others waiting): a block whose
factorization meets an exact zero pivot, eps times the largest spike entry above ``GROWTH_TOL``,
a reduced system that is exactly singular in float64, a last correction above ``CONVERGENCE_TOL``
eps ``max|x|`` in a checked column, or ``eps max|(D^{-1} A)^{-1} z| > 1 / SINGULAR_MARGIN``.

If a check fails, the call **falls back**: every rank gathers the whole system (one
``all_gather`` of its rows of the bands and of ``rhs``) and solves it with LAPACK
(``driver="lapack"``, on the host), keeping its rows. So a singular ``A`` raises
:class:`torch.linalg.LinAlgError` (the package's :class:`~tridiag_tutorial.SingularMatrixError`,
with LAPACK's pivot) on every rank exactly where LAPACK on the full system raises, and this module
raises nothing else for a valid input. :func:`record` counts the fallbacks (and the bytes).

The tests hold the forward error within 10 times LAPACK's, on two and four gloo processes, where
LAPACK's is below 1e-2, and check that every system where LAPACK raises raises. Badly scaled
systems, zero-diagonal systems where a piece has an odd number of rows (its block is then
singular) and systems with a nearly singular piece may fall back.

**Non-finite entries.** A system (of a batch) with a non-finite band entry on any rank gives NaN in
all its rows on every rank, and a right-hand-side column with a non-finite entry gives NaN in that
column; neither is checked, so neither makes another system fall back. Every collective is made
by every rank whatever the data, so nothing hangs.

**Gradients.** :func:`split_solve` is differentiable (an ``autograd.Function``): the backward is
the same split solve with ``A^H`` (whose local bands need one band entry from each neighbour:
``A^H``'s coupling to rank ``r-1`` is ``conj(upper_{r-1}[-1])``) and the band gradients ``-v x^H``
restricted to the bands, whose coupling entries need the neighbours' boundary rows of ``x``: one
``all_gather`` carries both. A backward with ``create_graph=True`` raises
``NotImplementedError`` (rather than return a gradient whose own derivative would silently miss
the second-order terms). As with every distributed backward (DDP's, ``torch.distributed.nn``'s),
the gradient is that of the *sum of all ranks' losses*, and every rank must run its backward
(a rank whose loss does not use its piece of ``x`` would leave the others waiting). ``lower[0]``
on rank 0 and ``upper[-1]`` on the last rank are not entries of ``A``: their gradient is zero.

**Communication.** :func:`communication` gives the bytes each rank hands to its collectives per
solve (the tests compare it with what :func:`record` counts in gloo processes, and so does ``python
-m tridiag_tutorial.bench.communication``; neither measures the bytes on the wire, which the
backend's framing adds to). At ``n = 1e6``, float64,
``k = 1``, the bytes sent per rank, ``(P - 1)`` times its own tensors' bytes:

==========================  ============  ============
route                       2 ranks       4 ranks
==========================  ============  ============
split solve, 2 refinements  736           2,208
split solve, no refinement  520           1,560
gather the whole system     16,000,368    24,001,104
==========================  ============  ============

Of the split solve's 736 bytes per rank of its own, 368 are the validation's metadata (every
call's first collective), 112 the reduced system and its checks' numbers, 192 the two refinement
steps' boundary rows and 64 the final check; none of it grows with ``n``. The gather sends each
rank's ``n / P`` rows of four columns to each of the others.

Collectives: only ``all_gather`` into one tensor (``all_gather_single``, formerly
``all_gather_into_tensor``), which gloo and NCCL both support, of real tensors of one size on every
rank (complex numbers travel as pairs of reals; pieces of unequal size are padded to the largest).
With a NCCL group the tensors travel on the current CUDA device, with gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _compat
from .._validation import SUPPORTED_DTYPES, broadcast_batch, check_tensors, rhs_layout
from ..api import tridiagonal_lu_factor, tridiagonal_lu_solve, tridiagonal_solve
from ..kernels import partitioned

__all__ = ["MIN_ROWS", "REFINEMENT_STEPS", "split_solve", "gather_solve", "split_bands",
           "split_sizes", "communication", "record", "SolveRecord"]

MIN_ROWS = 2  # rows per rank: a rank's first and last rows must be two different unknowns
REFINEMENT_STEPS = partitioned.REFINEMENT_STEPS
CONVERGENCE_TOL = partitioned.CONVERGENCE_TOL
SINGULAR_MARGIN = partitioned.SINGULAR_MARGIN
GROWTH_TOL = partitioned.GROWTH_TOL
_PROBES = len(partitioned._PROBE_STEPS)

# The validation's metadata, one int64 row per rank: the fields, the batch dimensions (at most
# _MAX_BATCH_DIMS) and the first _MESSAGE_BYTES bytes of a local error's message, so that every
# rank raises with the text of the rank whose inputs were wrong. "method" (split or gather) and
# "steps" (refinement_steps) decide which collectives follow, so the ranks must agree on them.
_FIELDS = ("status", "rows", "columns", "vector", "dtype", "device", "grad", "batch_ndim",
           "method", "steps")
_MAX_BATCH_DIMS = 8
_MESSAGE_BYTES = 224
_META_LEN = len(_FIELDS) + _MAX_BATCH_DIMS + _MESSAGE_BYTES // 8
_ERRORS = (None, TypeError, ValueError, RuntimeError)  # status codes 1, 2, 3
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_METHODS = ("spike", "gather")
_FUNCTIONS = {"spike": "split_solve", "gather": "gather_solve"}
_WIDE = {torch.float32: torch.float64, torch.float64: torch.float64,
         torch.complex64: torch.complex128, torch.complex128: torch.complex128}
_REAL = {torch.float32: torch.float32, torch.float64: torch.float64,
         torch.complex64: torch.float32, torch.complex128: torch.float64}


# --------------------------------------------------------------------------------------------
# Counting what crosses the network
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)  # records compare by identity: record() removes its own
class SolveRecord:
    """What the solves inside a :func:`record` block did on this rank.

    ``collectives``: ``(what, bytes, world_size)`` for each ``all_gather``, ``bytes`` being the size
    of the tensor this rank contributed. ``solves``: split solves run (a backward is one more);
    ``fallbacks``: those of them that fell back to gathering the whole system. ``seconds``: the
    wall-clock seconds of each phase of the solves on this rank, summed over the block, in the
    order first met: ``"call"`` is each forward call whole, validation included, and the other
    names are the steps of the module docstring (``"split: ..."``, and ``"gather: ..."`` for
    :func:`gather_solve` and a fallback); what ``"call"`` holds beyond its phases is the autograd
    and Python around them. A phase's own collective includes the time spent waiting there for the
    slowest rank. On CUDA every phase synchronizes the device at both ends, so a recorded call
    runs more slowly than one outside :func:`record`."""

    collectives: list = dataclasses.field(default_factory=list)
    solves: int = 0
    fallbacks: int = 0
    seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def bytes_contributed(self) -> int:
        """The bytes of this rank's own tensors in all collectives."""
        return sum(b for _, b, _ in self.collectives)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends. An ``all_gather`` must deliver a rank's ``b`` bytes to each
        of the ``P - 1`` others, and in the ring algorithm (gloo's and NCCL's) each rank sends
        ``(P - 1) b`` bytes in all (it forwards the others' pieces as it sends its own)."""
        return sum(b * (p - 1) for _, b, p in self.collectives)


_RECORDS: list[SolveRecord] = []


@contextlib.contextmanager
def record():
    """``with record() as r:`` counts the collectives, solves and fallbacks of the split solves
    inside the block, on this rank (blocks may nest: each counts what happens inside it)."""
    r = SolveRecord()
    _RECORDS.append(r)
    try:
        yield r
    finally:
        _RECORDS.remove(r)


class _Phase:
    """Adds the wall-clock time of its block to every open record's ``seconds[name]``."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.cuda = name, device.type == "cuda"

    def __enter__(self):
        for r in _RECORDS:  # the names in the order the phases begin
            r.seconds.setdefault(self.name, 0.0)
        if self.cuda:  # CUDA returns before the work is done: wait for it at both ends
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.start
        for r in _RECORDS:
            r.seconds[self.name] = r.seconds.get(self.name, 0.0) + elapsed
        return False


def _phase(name: str, device: torch.device):
    """A context that times its block into the open records, or nothing outside :func:`record`."""
    return _Phase(name, device) if _RECORDS else contextlib.nullcontext()


def _all_gather_op():
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (the same op)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------
# Layout and validation
# --------------------------------------------------------------------------------------------
class _Layout(NamedTuple):
    """Where this rank's rows are, and how to talk to the others."""
    group: object
    rank: int
    world_size: int
    sizes: tuple  # rows of every rank
    comm_device: torch.device

    @property
    def offset(self) -> int:
        return sum(self.sizes[:self.rank])

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1


def _comm_device(group, device: torch.device) -> torch.device:
    """The device the collectives' tensors live on: NCCL's are on the current CUDA device, gloo's
    on the CPU; a group with a backend per device type (``"cpu:gloo,cuda:nccl"``) takes the data's
    device, as does any other backend."""
    backend = str(dist.get_backend(group)).lower()
    has_nccl, has_gloo = "nccl" in backend, "gloo" in backend
    if has_nccl and (not has_gloo or device.type == "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    if has_gloo and (not has_nccl or device.type != "cuda"):
        return torch.device("cpu")
    return device


def _all_gather(t: torch.Tensor, layout: _Layout, what: str) -> torch.Tensor:
    """``(P, *t.shape)``: every rank's ``t`` (a real tensor of one shape on every rank)."""
    send = t.detach().reshape(-1).to(layout.comm_device).contiguous()
    out = send.new_empty(layout.world_size * send.numel())
    _all_gather_op()(out, send, group=layout.group)
    for r in _RECORDS:
        r.collectives.append((what, send.numel() * send.element_size(), layout.world_size))
    return out.reshape(layout.world_size, *t.shape).to(t.device)


class _Packet:
    """Several tensors of one rank sent in one ``all_gather``: complex ones as pairs of reals,
    booleans as 0 and 1, everything in one real dtype; :meth:`gather` returns each one gathered,
    ``(P, *shape)``, in its own kind (bools as bools)."""

    def __init__(self, real: torch.dtype, device: torch.device):
        self.real, self.device, self.parts, self.specs = real, device, [], []

    def add(self, t: torch.Tensor) -> None:
        kind = "complex" if t.is_complex() else "bool" if t.dtype == torch.bool else "real"
        flat = torch.view_as_real(t.resolve_conj()) if kind == "complex" else t
        flat = flat.reshape(-1).to(device=self.device, dtype=self.real)
        self.parts.append(flat)
        self.specs.append((tuple(t.shape), kind, flat.numel()))

    def gather(self, layout: _Layout, what: str) -> list:
        gathered = _all_gather(torch.cat(self.parts), layout, what)  # (P, N)
        out, start = [], 0
        for shape, kind, size in self.specs:
            part = gathered[:, start:start + size]
            start += size
            if kind == "complex":
                part = torch.view_as_complex(part.reshape(-1, 2).contiguous())
            part = part.reshape(layout.world_size, *shape)
            out.append(part > 0.5 if kind == "bool" else part)
        return out


class _Prepared(NamedTuple):
    lower: torch.Tensor  # (*B, m)
    diag: torch.Tensor
    upper: torch.Tensor
    rhs: torch.Tensor  # (*B, m, k)
    vector: bool
    layout: _Layout
    empty: bool  # no system or no column: nothing to solve (the same on every rank)


def _local_check(lower, diag, upper, rhs, rank: int, world_size: int, name: str):
    """This rank's own checks: ``(lower, diag, upper, rhs (*B, m, k), vector)`` broadcast (views),
    or an exception (raised by the caller after every rank has said how it went)."""
    check_tensors((lower, diag, upper, rhs), name)
    if diag.device.type == "meta":
        raise ValueError(f"{name}: meta tensors have no data to solve with")
    def shapes():
        return (f"lower{tuple(lower.shape)}, diag{tuple(diag.shape)}, upper{tuple(upper.shape)}, "
                f"rhs{tuple(rhs.shape)}")

    if diag.ndim == 0 or lower.ndim == 0 or upper.ndim == 0:
        raise ValueError(f"{name}: the bands must have at least one dimension, got {shapes()}")
    m = diag.shape[-1]
    if lower.shape[-1] != m or upper.shape[-1] != m:
        raise ValueError(
            f"{name}: on this rank lower, diag and upper must all have its m = diag.shape[-1] = {m} "
            f"rows (lower[..., 0] and upper[..., -1] are the couplings to the neighbouring ranks; "
            f"split_bands makes this layout), got {shapes()}")
    if m < MIN_ROWS:
        raise ValueError(
            f"{name}: every rank must hold at least {MIN_ROWS} rows (its first and last rows are "
            f"the two unknowns it contributes to the reduced system), rank {rank} has {m}; give "
            f"it more rows or fewer ranks")
    vector, rhs_batch = rhs_layout(rhs, diag, m, name, shapes, rows_name="this rank's m")
    batch = broadcast_batch((lower.shape[:-1], diag.shape[:-1], upper.shape[:-1], rhs_batch), name,
                            shapes)
    if len(batch) > _MAX_BATCH_DIMS:
        raise ValueError(f"{name}: at most {_MAX_BATCH_DIMS} batch dimensions, got {len(batch)}; "
                         "flatten them")
    if rank == 0 and bool((lower[..., 0] != 0).any()):
        raise ValueError(f"{name}: lower[..., 0] must be 0 on rank 0 (row 0 has no left "
                         "neighbour), got a nonzero (or NaN) entry")
    if rank == world_size - 1 and bool((upper[..., -1] != 0).any()):
        raise ValueError(f"{name}: upper[..., -1] must be 0 on the last rank ({rank}: its last "
                         "row has no right neighbour), got a nonzero (or NaN) entry")
    lower, diag, upper = (t.expand(*batch, m) for t in (lower, diag, upper))
    rhs = rhs.unsqueeze(-1) if vector else rhs
    rhs = rhs.expand(*batch, m, rhs.shape[-1])
    return lower, diag, upper, rhs, vector


def _encode(text: str) -> list:
    data = text.encode("utf-8")
    if len(data) > _MESSAGE_BYTES:
        data = data[:_MESSAGE_BYTES - 3] + b"..."
    data = data.ljust(_MESSAGE_BYTES, b"\0")
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _decode(words) -> str:
    data = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return data.rstrip(b"\0").decode("utf-8", errors="replace")


def _check_steps(steps, name: str) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 2**62:
        raise ValueError(f"{name}: refinement_steps must be an integer >= 0, got {steps!r}")


def _validate(lower, diag, upper, rhs, group, name: str, steps: int = 0,
              method: str = "spike") -> _Prepared:
    """Check the inputs on every rank, together: each rank checks its own, one ``all_gather``
    tells every rank how the others went (and their shapes and dtypes, the function called and
    its ``refinement_steps``), and every rank raises the same kind of error if any rank's inputs
    are wrong or the ranks disagree. A check that raised on one rank only would leave the others
    waiting in their next collective, and ranks that went on with different steps or functions
    would make different collectives (gloo aborts the process on such a mismatch)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{name}: this process is not a member of the group it was given")
    device = diag.device if isinstance(diag, torch.Tensor) else torch.device("cpu")
    comm = _comm_device(group, device)
    meta = [0] * _META_LEN
    error = None
    try:
        _check_steps(steps, name)
        lower, diag, upper, rhs, vector = _local_check(lower, diag, upper, rhs, rank, world_size,
                                                       name)
        batch = diag.shape[:-1]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (lower, diag, upper, rhs))
        meta[:len(_FIELDS)] = [0, diag.shape[-1], rhs.shape[-1], int(vector),
                               SUPPORTED_DTYPES.index(diag.dtype),
                               _DEVICE_TYPES.index(diag.device.type)
                               if diag.device.type in _DEVICE_TYPES else len(_DEVICE_TYPES),
                               int(grad), len(batch), _METHODS.index(method), steps]
        meta[len(_FIELDS):len(_FIELDS) + len(batch)] = list(batch)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
        meta[0] = _ERRORS.index(type(e)) if type(e) in _ERRORS else 3
        meta[len(_FIELDS) + _MAX_BATCH_DIMS:] = _encode(str(e))
    layout = _Layout(group, rank, world_size, (), comm)
    table = _all_gather(torch.tensor(meta, dtype=torch.int64), layout, "validate").tolist()

    failed = [r for r, row in enumerate(table) if row[0] != 0]
    if failed:
        if error is not None:
            raise error
        r = failed[0]
        others = f" (and on rank(s) {failed[1:]})" if len(failed) > 1 else ""
        raise _ERRORS[table[r][0]](
            f"{name}: the inputs of rank {r} were refused{others}, so every rank raises: "
            f"{_decode(table[r][len(_FIELDS) + _MAX_BATCH_DIMS:])}")

    def column(field):
        return [row[_FIELDS.index(field)] for row in table]

    def differ(field):
        return len(set(column(field))) > 1

    if differ("method"):
        listed = ", ".join(f"rank {r}: {_FUNCTIONS[_METHODS[c]]}"
                           for r, c in enumerate(column("method")))
        raise ValueError(f"{name}: every rank must call the same function (split_solve or "
                         f"gather_solve): they make different collectives; got {listed}")
    if differ("steps"):
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(column("steps")))
        raise ValueError(f"{name}: every rank must pass the same refinement_steps (each step is a "
                         f"collective), got {listed}")

    if differ("dtype"):
        listed = ", ".join(f"rank {r}: {SUPPORTED_DTYPES[c]}" for r, c in enumerate(column("dtype")))
        raise TypeError(f"{name}: every rank must pass the same dtype, got {listed}")
    if differ("device"):
        names = _DEVICE_TYPES + ("other",)
        listed = ", ".join(f"rank {r}: {names[c]}" for r, c in enumerate(column("device")))
        raise ValueError(f"{name}: every rank must pass tensors of one device type, got {listed}")
    batches = [tuple(row[len(_FIELDS):len(_FIELDS) + row[_FIELDS.index("batch_ndim")]])
               for row in table]
    if len(set(batches)) > 1:
        listed = ", ".join(f"rank {r}: {b}" for r, b in enumerate(batches))
        raise ValueError(f"{name}: every rank must have the same (broadcast) batch shape: the "
                         f"batch is a batch of systems split alike; got {listed}")
    if differ("vector") or differ("columns"):
        listed = ", ".join(f"rank {r}: {'(..., m)' if v else f'(..., m, {k})'}"
                           for r, (v, k) in enumerate(zip(column("vector"), column("columns"))))
        raise ValueError(f"{name}: every rank must pass rhs of the same kind (a vector, or the "
                         f"same number k of columns), got {listed}")
    if differ("grad"):
        listed = ", ".join(f"rank {r}: {bool(g)}" for r, g in enumerate(column("grad")))
        raise ValueError(
            f"{name}: either every rank or none must pass inputs that require grad (with grad "
            f"mode on): the backward is collective, and a rank without it would leave the "
            f"others waiting; got {listed}")
    layout = layout._replace(sizes=tuple(column("rows")))
    empty = rhs.shape[-1] == 0 or math.prod(diag.shape[:-1]) == 0
    return _Prepared(lower, diag, upper, rhs, vector, layout, empty)


# --------------------------------------------------------------------------------------------
# The solve
# --------------------------------------------------------------------------------------------
class _Block:
    """This rank's block ``A_r`` (its rows without the couplings), factored once.

    On the CPU, LAPACK ``?gttrf`` once and ``?gttrs`` for each right-hand side. Elsewhere the
    package's automatic choice for each solve (the partitioned kernel from 64 rows on: O(log m)
    operations per solve, where factoring with the sequential kernel would dispatch O(m)).
    An exactly zero pivot does not raise here: :attr:`failed` is set, the solves return NaN, and
    the collective check makes every rank fall back together."""

    def __init__(self, lower, diag, upper):
        self.failed = False
        self.bands = (lower[..., 1:], diag, upper[..., :-1])
        self.factors = None
        if diag.is_cpu:
            try:
                self.factors = tridiagonal_lu_factor(*self.bands, driver="lapack")
            except torch.linalg.LinAlgError:
                self.failed = True

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            try:
                if self.factors is not None:
                    return tridiagonal_lu_solve(self.factors, rhs, driver="lapack")
                return tridiagonal_solve(*self.bands, rhs)
            except torch.linalg.LinAlgError:
                self.failed = True
        return torch.full_like(rhs, math.nan)


def _probe(lower, diag, upper, layout: _Layout) -> torch.Tensor:
    """``(*B, m, 2)``: this rank's rows of ``partitioned``'s two probes ``D z`` of the whole
    system (``z`` from the global row number, ``D`` the rows' largest magnitudes)."""
    m = diag.shape[-1]
    i = torch.arange(layout.offset + 1, layout.offset + m + 1, dtype=torch.float64,
                     device=diag.device)[:, None]
    steps = torch.tensor(partitioned._PROBE_STEPS, dtype=torch.float64, device=diag.device)
    z = (2 * torch.frac(i * steps) - 1).to(diag.dtype)
    row = torch.maximum(diag.abs(), torch.maximum(lower.abs(), upper.abs()))
    return z * torch.where(row > 0, row, torch.ones_like(row))[..., None]


def _ends(t: torch.Tensor) -> torch.Tensor:
    """``(*B, 2, k)``: the first and last rows of ``(*B, m, k)``."""
    return torch.stack([t[..., 0, :], t[..., -1, :]], dim=-2)


class _Spikes(NamedTuple):
    """What every solve with the block's factors reuses: the spikes and the reduced system's
    factors (the same on every rank)."""
    v: torch.Tensor  # (*B, m): A_r^{-1} (lower[0] e_1)
    w: torch.Tensor  # (*B, m): A_r^{-1} (upper[-1] e_m)
    lu: torch.Tensor  # (*B, 2P, 2P) in the wide dtype
    pivots: torch.Tensor
    singular: torch.Tensor  # (*B,): the reduced system met an exactly zero pivot


def _reduced_factors(V, W, layout: _Layout, wide) -> tuple:
    """LU of the reduced system from every rank's spike ends ``V``, ``W`` ``(P, *B, 2)``. Unknowns
    in the order ``f_0, l_0, f_1, l_1, ...``; rank ``r``'s two equations are
    ``f_r + v[0] l_{r-1} + w[0] f_{r+1} = y[0]`` and ``l_r + v[-1] l_{r-1} + w[-1] f_{r+1} = y[-1]``."""
    P = layout.world_size
    batch = V.shape[1:-1]
    M = torch.eye(2 * P, dtype=wide, device=V.device).expand(*batch, 2 * P, 2 * P).clone()
    if P > 1:
        r = torch.arange(1, P, device=V.device)  # ranks with a left neighbour: column of l_{r-1}
        for end in (0, 1):
            M[..., 2 * r + end, 2 * r - 1] = V[1:, ..., end].movedim(0, -1).to(wide)
        r = torch.arange(0, P - 1, device=V.device)  # ranks with a right neighbour: f_{r+1}
        for end in (0, 1):
            M[..., 2 * r + end, 2 * r + 2] = W[:-1, ..., end].movedim(0, -1).to(wide)
    lu, pivots, info = torch.linalg.lu_factor_ex(M)
    return lu, pivots, info != 0


def _solve_reduced(spikes: _Spikes, Y, dtype) -> torch.Tensor:
    """``(*B, P, 2, K)``: every rank's separators ``(f_q, l_q)`` from the gathered block solutions'
    ends ``Y`` ``(P, *B, 2, K)``."""
    P, K = Y.shape[0], Y.shape[-1]
    b = Y.movedim(0, -3).reshape(*Y.shape[1:-2], 2 * P, K).to(spikes.lu.dtype)
    return torch.linalg.lu_solve(spikes.lu, spikes.pivots, b).to(dtype).reshape(
        *Y.shape[1:-2], P, 2, K)


def _recover(y, spikes: _Spikes, S, layout: _Layout) -> torch.Tensor:
    """This rank's rows ``x = y - v l_{r-1} - w f_{r+1}``, its first and last rows set to its own
    separators (as ``partitioned``'s separator rows are the reduced system's solution)."""
    r = layout.rank
    x = y.clone()
    if not layout.first:
        x = x - spikes.v[..., None] * S[..., r - 1, 1, None, :]
    if not layout.last:
        x = x - spikes.w[..., None] * S[..., r + 1, 0, None, :]
    x[..., 0, :] = S[..., r, 0, :]
    x[..., -1, :] = S[..., r, 1, :]
    return x


def _neighbours(E, layout: _Layout):
    """From gathered ends ``E`` ``(P, *B, 2, ...)``: the previous rank's last row and the next
    rank's first row (zeros at the ends of the system)."""
    r = layout.rank
    prev = E[r - 1, ..., 1, :] if not layout.first else torch.zeros_like(E[r, ..., 1, :])
    nxt = E[r + 1, ..., 0, :] if not layout.last else torch.zeros_like(E[r, ..., 0, :])
    return prev, nxt


def _spike_solve(lower, diag, upper, rhs, layout: _Layout, steps: int):
    """``(x, fell_back)``: ``x`` ``(*B, m, k)`` this rank's rows of ``A^{-1} rhs``. Raises only
    through the fallback (LAPACK on the whole system), on every rank alike."""
    dtype, real, wide = diag.dtype, _REAL[diag.dtype], _WIDE[diag.dtype]
    eps = torch.finfo(real).eps
    k = rhs.shape[-1]
    K = k + _PROBES
    device = diag.device
    with _phase("split: probes and finiteness", device):
        b = torch.cat([rhs, _probe(lower, diag, upper, layout)], dim=-1)
        bands_bad = ~(torch.isfinite(lower).all(-1) & torch.isfinite(diag).all(-1)
                      & torch.isfinite(upper).all(-1))  # (*B,)
        columns_bad = ~torch.isfinite(rhs).all(-2)  # (*B, k)

    # 1. the block, with the two spikes beside the right-hand sides
    with _phase("split: 1. block factor and solve", device):
        block = _Block(lower, diag, upper)
        spike_rhs = torch.zeros(*b.shape[:-1], 2, dtype=dtype, device=b.device)
        spike_rhs[..., 0, 0] = lower[..., 0]
        spike_rhs[..., -1, 1] = upper[..., -1]
        solved = block.solve(torch.cat([b, spike_rhs], dim=-1))
        y, v, w = solved[..., :K], solved[..., K], solved[..., K + 1]
        growth = torch.maximum(v.abs().amax(-1), w.abs().amax(-1))  # NaN stays NaN

    # 2. one all_gather: the ends of y, v, w, and what the checks need
    with _phase("split: 2. all_gather of the ends", device):
        packet = _Packet(real, diag.device)
        for t in (_ends(y), torch.stack([v[..., 0], v[..., -1]], -1),
                  torch.stack([w[..., 0], w[..., -1]], -1), bands_bad, columns_bad, growth,
                  torch.tensor(block.failed)):
            packet.add(t)
        Y, V, W, BB, CB, GR, FAILED = packet.gather(layout, "reduced")
        system_bad, column_bad = BB.any(0), CB.any(0)  # the same on every rank
        finite = ~system_bad
        unstable = finite & ~(eps * GR.amax(0) <= GROWTH_TOL)
        fall_back = bool(FAILED.any()) or bool(unstable.any())
    if fall_back:  # decided from gathered numbers: everywhere
        return _gather_solve(lower, diag, upper, rhs, layout, system_bad, column_bad), True

    # 3. the reduced system, solved on every rank; the recovery
    with _phase("split: 3. reduced system and recovery", device):
        spikes = _Spikes(v, w, *_reduced_factors(V, W, layout, wide))
        x = _recover(y, spikes, _solve_reduced(spikes, Y, dtype), layout)

    # 4. refinement: residuals across ranks in more than the working precision
    residual = correction = None
    for _ in range(steps):
        with _phase("split: 4. refinement: all_gathers", device):
            prev, nxt = _neighbours(_all_gather_ends(x, layout, "x_boundaries"), layout)
        with _phase("split: 4. refinement: residual in double-double", device):
            if residual is None:  # the bands split for double-double once, only when refining
                residual = partitioned._Residual(F.pad(lower, (0, 1)), F.pad(diag, (1, 1)),
                                                 F.pad(upper, (1, 0)), F.pad(b, (0, 0, 1, 1)))
            r = residual(torch.cat([prev[..., None, :], x, nxt[..., None, :]], dim=-2))[..., 1:-1, :]
        with _phase("split: 4. refinement: block solve", device):
            yc = block.solve(r)
        with _phase("split: 4. refinement: all_gathers", device):
            Yc = _all_gather_ends(yc, layout, "y_boundaries")
        with _phase("split: 4. refinement: reduced system and recovery", device):
            correction = _recover(yc, spikes, _solve_reduced(spikes, Yc, dtype), layout)
            x = x + correction

    # 5. the checks, on gathered maxima
    with _phase("split: 5. checks", device):
        packet = _Packet(real, diag.device)
        packet.add(x.abs().amax(-2))  # (*B, K); NaN stays NaN
        if correction is not None:
            packet.add(correction.abs().amax(-2))
        packet.add(spikes.singular)
        packet.add(torch.tensor(block.failed))
        gathered = packet.gather(layout, "check")
        x_max = gathered[0].amax(0)
        converged = torch.isfinite(x_max)
        if correction is not None:
            converged &= gathered[1].amax(0) <= CONVERGENCE_TOL * eps * x_max
        singular_reduced, failed = gathered[-2].any(0), gathered[-1].any()
        checked = finite[..., None] & torch.cat(
            [~column_bad,
             torch.ones_like(column_bad[..., :1]).expand(*column_bad.shape[:-1], _PROBES)], dim=-1)
        # the probes' solutions are (D^{-1} A)^{-1} z with |z| <= 1: large means (nearly) singular
        singular = ~(eps * x_max[..., k:].amax(-1) <= 1 / SINGULAR_MARGIN)
        fall_back = (bool(failed) or bool((checked & ~converged).any())
                     or bool((finite & (singular | singular_reduced)).any()))
    if fall_back:
        return _gather_solve(lower, diag, upper, rhs, layout, system_bad, column_bad), True
    with _phase("split: 5. checks", device):
        return _mask(x[..., :k], system_bad, column_bad), False


def _all_gather_ends(t, layout: _Layout, what: str) -> torch.Tensor:
    packet = _Packet(_REAL[t.dtype], t.device)
    packet.add(_ends(t))
    return packet.gather(layout, what)[0]


def _mask(x, system_bad, column_bad) -> torch.Tensor:
    """NaN in every row of a system with a non-finite band entry on some rank, and in every column
    with a non-finite right-hand side entry on some rank."""
    if not (bool(system_bad.any()) or bool(column_bad.any())):
        return x
    bad = system_bad[..., None] | column_bad  # (*B, k)
    return torch.where(bad[..., None, :], torch.full_like(x, math.nan), x)


def _gather_solve(lower, diag, upper, rhs, layout: _Layout, system_bad=None, column_bad=None):
    """Every rank gathers the whole system (its rows of the bands and of ``rhs``, padded to the
    largest piece, in one ``all_gather``), solves it with LAPACK on the host and keeps its rows.
    LAPACK raises on every rank alike (the same data, the same pivots)."""
    rows = max(layout.sizes)
    m = diag.shape[-1]
    device = diag.device
    with _phase("gather: pack", device):
        local = torch.cat([lower[..., None], diag[..., None], upper[..., None], rhs], dim=-1)
        local = F.pad(local, (0, 0, 0, rows - m))  # (*B, rows, 3 + k)
        packet = _Packet(_REAL[diag.dtype], diag.device)
        packet.add(local)
    with _phase("gather: all_gather of the whole system", device):
        gathered = packet.gather(layout, "gather_system")[0]  # (P, *B, rows, 3 + k)
    with _phase("gather: assemble on the host", device):
        full = torch.cat([gathered[p, ..., :size, :] for p, size in enumerate(layout.sizes)],
                         dim=-2)
        host = full.cpu()
    with _phase("gather: LAPACK on the whole system", device):
        x = tridiagonal_solve(host[..., 1:, 0], host[..., 1], host[..., :-1, 2], host[..., 3:],
                              driver="lapack").to(diag.device)
    with _phase("gather: keep the rank's rows", device):
        x = x[..., layout.offset:layout.offset + m, :]
        if system_bad is None:  # the baseline itself: find the non-finite systems from the whole
            system_bad = ~torch.isfinite(full[..., :3]).flatten(-2).all(-1)
            column_bad = ~torch.isfinite(full[..., 3:]).all(-2)
        return _mask(x, system_bad, column_bad)


def _solve(lower, diag, upper, rhs, layout: _Layout, steps: int, method: str):
    if method == "gather":
        x, fell_back = _gather_solve(lower, diag, upper, rhs, layout), False
    else:
        x, fell_back = _spike_solve(lower, diag, upper, rhs, layout, steps)
    for r in _RECORDS:
        r.solves += 1
        r.fallbacks += fell_back
    return x


_DOUBLE_BACKWARD = (
    "split_solve: double backward (create_graph=True through the split solve: Hessians, gradient "
    "penalties) is not supported; its backward is a collective solve that is not itself "
    "differentiated. Differentiate once, or gather the system and use tridiagonal_solve, whose "
    "derivatives of every order work.")


class _SplitSolve(torch.autograd.Function):
    """``x = A^{-1} rhs`` on local pieces ``(*B, m)`` and ``rhs`` ``(*B, m, k)``; the backward is
    a split solve with ``A^H`` and the band gradients ``-v x^H`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, lower, diag, upper, rhs, layout, steps, method):
        x = _solve(lower, diag, upper, rhs, layout, steps, method)
        ctx.save_for_backward(lower, diag, upper, x)
        ctx.layout, ctx.steps, ctx.method = layout, steps, method
        return x

    # [book: split-solve-backward]
    @staticmethod
    def backward(ctx, grad_x):
        if torch.is_grad_enabled():  # create_graph=True: a derivative of this backward is asked for
            raise NotImplementedError(_DOUBLE_BACKWARD)
        lower, diag, upper, x = ctx.saved_tensors
        layout = ctx.layout
        # one all_gather: each rank's couplings and the ends of x
        packet = _Packet(_REAL[diag.dtype], diag.device)
        packet.add(torch.stack([lower[..., 0], upper[..., -1]], dim=-1)[..., None])  # (*B, 2, 1)
        packet.add(_ends(x))
        couplings, ends = packet.gather(layout, "backward_neighbours")
        prev_upper, next_lower = (t[..., 0] for t in _neighbours(couplings, layout))
        x_prev, x_next = _neighbours(ends, layout)
        # A^H's rows of this rank: (A^H)[i, i-1] = conj(A[i-1, i]), (A^H)[i, i+1] = conj(A[i+1, i])
        h_lower = torch.cat([prev_upper[..., None], upper[..., :-1]], dim=-1).conj()
        h_upper = torch.cat([lower[..., 1:], next_lower[..., None]], dim=-1).conj()
        v = _solve(h_lower, diag.conj(), h_upper, grad_x, layout, ctx.steps, ctx.method)
        minus_v = -v
        below = torch.cat([x_prev[..., None, :], x[..., :-1, :]], dim=-2).conj()  # x[i-1]
        above = torch.cat([x[..., 1:, :], x_next[..., None, :]], dim=-2).conj()  # x[i+1]
        grad_lower = (minus_v * below).sum(-1)
        grad_diag = (minus_v * x.conj()).sum(-1)
        grad_upper = (minus_v * above).sum(-1)
        # lower[0] on rank 0 and upper[-1] on the last rank are no entries of A
        if layout.first:
            grad_lower = F.pad(grad_lower[..., 1:], (1, 0))
        if layout.last:
            grad_upper = F.pad(grad_upper[..., :-1], (0, 1))
        return grad_lower, grad_diag, grad_upper, v, None, None, None


_TRANSFORMS = (
    "{name}: torch.func transforms (grad, vmap, jvp, jacrev, jacfwd, hessian, ...) and forward-mode "
    "AD (dual numbers with tangents) are not supported: it is an autograd.Function for ordinary "
    "reverse mode, with a collective solve as its backward. Use loss.backward() or "
    "torch.autograd.grad; for a transform, gather the system and use tridiagonal_solve.")


def _refuse_transforms(name, tensors):
    """Raise before any collective where torch would raise its own, less helpful error (a
    ``torch.func`` transform, or a tangent on an input). Eager only: not read while compiling."""
    if torch.compiler.is_compiling():
        return
    if _compat.transform_active() or (_compat.forward_ad_active() and _compat.any_tangent(tensors)):
        raise NotImplementedError(_TRANSFORMS.format(name=name))


def _run(lower, diag, upper, rhs, group, steps, method, name):
    _refuse_transforms(name, (lower, diag, upper, rhs))
    device = diag.device if isinstance(diag, torch.Tensor) else torch.device("cpu")
    with _phase("call", device):
        with _phase("validate", device):
            p = _validate(lower, diag, upper, rhs, group, name, steps, method)  # steps too
        if p.empty:  # the same on every rank: nothing to solve, no collective more
            x = p.rhs.new_zeros(p.rhs.shape)
        else:
            x = _SplitSolve.apply(p.lower, p.diag, p.upper, p.rhs, p.layout, steps, method)
        return x.squeeze(-1) if p.vector else x


def split_solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
                group=None, *, refinement_steps: int = REFINEMENT_STEPS) -> torch.Tensor:
    r"""Solve one tridiagonal system (or a batch split alike) whose rows are split across the
    ranks of ``group``; every rank of the group calls this with its own rows.

    Args:
        lower: ``(..., m)``, this rank's subdiagonal entries, ``lower[..., j] = A[s+j, s+j-1]``
            (``s`` this rank's first global row); ``lower[..., 0]`` couples to the previous
            rank's last row and must be 0 on rank 0.
        diag: ``(..., m)``, ``diag[..., j] = A[s+j, s+j]``; ``m >= MIN_ROWS`` (2), and the ranks'
            ``m`` may differ.
        upper: ``(..., m)``, ``upper[..., j] = A[s+j, s+j+1]``; ``upper[..., -1]`` couples to the
            next rank's first row and must be 0 on the last rank.
        rhs: ``(..., m)`` (one vector per system, ``rhs.ndim == diag.ndim``) or ``(..., m, k)``.
        group: the process group (``None``: the default one). Ranks are in group-rank order:
            group rank ``r`` holds the rows after those of rank ``r - 1``.
        refinement_steps: steps of iterative refinement (0 skips them and the convergence check;
            the growth and singularity checks stay, but they do not catch a nearly singular
            block: chapter 17 shows an error 10^7 times LAPACK's with no fallback; keep the
            default unless your blocks are known to be well conditioned).

    The batch dimensions broadcast on each rank and must then agree across ranks, as must the
    dtype (float32, float64, complex64, complex128), the kind of ``rhs`` and ``k``, the device type,
    whether the inputs require grad and ``refinement_steps``; and every rank must call this
    function (not :func:`gather_solve` on some). :func:`split_bands` makes the pieces from a
    whole system.

    Returns:
        This rank's rows of ``x``, the shape of its (broadcast) ``rhs``.

    Every error is raised on every rank of the group, whichever rank's inputs are at fault.

    Raises:
        TypeError: an input is not a dense tensor, or dtypes differ or are unsupported.
        ValueError: shapes, devices, the end couplings or the agreement across ranks are wrong
            (the message names what differs and each rank's value), or ``refinement_steps`` is
            not an integer >= 0.
        tridiag_tutorial.SingularMatrixError: ``A`` is singular (from LAPACK on the whole system,
            after the fallback; a :class:`torch.linalg.LinAlgError`).
        RuntimeError: ``torch.distributed`` is not initialized.

    Example (on each of two ranks; ``A`` has 1, 2, 1 in its rows and ``x = [1, 2, 3, 4]``)::

        pieces = split_bands(torch.ones(3), torch.full((4,), 2.0), torch.ones(3),
                             torch.tensor([4.0, 8.0, 12.0, 11.0]), rank, 2)
        x = split_solve(*pieces)   # rank 0: tensor([1., 2.]), rank 1: tensor([3., 4.])
    """
    return _run(lower, diag, upper, rhs, group, refinement_steps, "spike", "split_solve")


def gather_solve(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor,
                 rhs: torch.Tensor, group=None) -> torch.Tensor:
    """The baseline (and :func:`split_solve`'s fallback) with :func:`split_solve`'s arguments:
    every rank gathers the whole system and solves it with LAPACK, keeping its rows. The same
    validation, gradients (the backward gathers ``A^H``'s system) and errors."""
    return _run(lower, diag, upper, rhs, group, 0, "gather", "gather_solve")


# --------------------------------------------------------------------------------------------
# Pieces and bytes
# --------------------------------------------------------------------------------------------
def split_sizes(n: int, world_size: int) -> list:
    """The rows of each rank when ``n`` rows are split as :func:`torch.tensor_split` splits them:
    the first ``n % world_size`` ranks get one row more."""
    if world_size < 1:
        raise ValueError(f"split_sizes: world_size must be at least 1, got {world_size}")
    return [n // world_size + (r < n % world_size) for r in range(world_size)]


def split_bands(lower: torch.Tensor, diag: torch.Tensor, upper: torch.Tensor, rhs: torch.Tensor,
                rank: int, world_size: int, sizes=None):
    """Rank ``rank``'s pieces ``(lower, diag, upper, rhs)`` in :func:`split_solve`'s layout, cut
    from a whole system in this package's layout (bands ``(..., n-1)``, ``(..., n)``,
    ``(..., n-1)``, ``rhs`` ``(..., n)`` or ``(..., n, k)``, broadcasting as
    :func:`~tridiag_tutorial.tridiagonal_solve`'s).

    The rows are split as :func:`split_sizes` says, or into ``sizes`` (one entry per rank, summing
    to ``n``, each at least ``MIN_ROWS``). Differentiable (padding and slicing); the results are
    views of new tensors, the inputs are not modified.
    """
    from .._validation import validate

    p = validate(lower, diag, upper, rhs, name="split_bands")
    n = p.diag.shape[-1]
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"split_bands: world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"split_bands: rank must be in [0, {world_size}), got {rank!r}")
    sizes = split_sizes(n, world_size) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != world_size or sum(sizes) != n or min(sizes) < MIN_ROWS:
        raise ValueError(f"split_bands: the pieces must be {world_size} sizes of at least "
                         f"{MIN_ROWS} rows summing to n = {n}, got {sizes}"
                         + (f" (n >= {MIN_ROWS * world_size} is needed)"
                            if n < MIN_ROWS * world_size else ""))
    s, m = sum(sizes[:rank]), sizes[rank]
    rows = slice(s, s + m)
    lo = F.pad(p.lower, (1, 0))[..., rows]  # lo[i] = A[i, i-1], 0 in row 0
    up = F.pad(p.upper, (0, 1))[..., rows]
    b = p.rhs[..., rows, :]
    return lo, p.diag[..., rows], up, b.squeeze(-1) if p.vector_rhs else b


def communication(n: int, world_size: int, k: int = 1, dtype: torch.dtype = torch.float64,
                  refinement_steps: int = REFINEMENT_STEPS, batch: tuple = ()) -> dict:
    """The bytes per rank of one solve of ``n`` rows split as :func:`split_sizes` says, ``k``
    columns, a batch of shape ``batch``: for each route, ``contributed`` (the size of the rank's
    own tensors in its collectives), ``sent`` (``(P - 1)`` times that: see
    :attr:`SolveRecord.bytes_sent`) and ``collectives`` (how many).

    Routes: ``split_solve`` (with ``refinement_steps`` steps), ``split_solve_no_refinement``,
    ``gather_solve`` (the validation and the gather of the whole system), ``gather_system``
    (that gather alone: each rank's rows of the three bands and of ``rhs``, padded to the largest
    piece) and ``validation`` (the metadata every call gathers first). A backward costs the split
    solve less its validation (``A^H`` is not validated again) plus ``backward_neighbours``:
    ``lower[0]``, ``upper[-1]`` and the first and last rows of ``x``."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"communication: dtype {dtype} is not supported")
    c = 2 if dtype.is_complex else 1  # reals per value
    real = _REAL[dtype].itemsize
    systems = math.prod(batch)
    K = k + _PROBES
    validate = _META_LEN * 8
    reduced = systems * (c * (2 * K + 4) + 1 + k + 1) + 1
    boundaries = systems * c * 2 * K

    def check(steps):
        return systems * (K * (2 if steps else 1) + 1) + 1

    def split(steps):
        reals = reduced + steps * 2 * boundaries + check(steps)
        return validate + reals * real, 3 + 2 * steps

    rows = max(split_sizes(n, world_size))
    gather_system = systems * rows * (3 + k) * c * real
    routes = {"split_solve": split(refinement_steps), "split_solve_no_refinement": split(0),
              "gather_solve": (validate + gather_system, 2), "gather_system": (gather_system, 1),
              "validation": (validate, 1)}
    return {name: dict(contributed=b, sent=b * (world_size - 1), collectives=count)
            for name, (b, count) in routes.items()}
