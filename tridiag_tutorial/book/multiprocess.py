"""Run a function on several processes joined by a gloo process group, from anywhere (chapter 17).

Training on several processes starts one Python process per rank; each joins a *process group*
(``torch.distributed.init_process_group``) and then runs the same code on its share of the work.
Launchers such as ``torchrun`` or ``torch.multiprocessing.spawn`` do this from a script. From a
notebook two things get in the way, and :func:`run_on_ranks` handles both:

- The start method must be *spawn* (a fresh interpreter per rank: forking a process that already
  runs torch's thread pools is unsafe), and a spawned process finds the function to run by
  importing it. A function defined in a notebook cell lives in the kernel's ``__main__``, which a
  fresh interpreter cannot import. So the function must come from a module
  (:mod:`tridiag_tutorial.book.parallel_demos` holds the chapter's); :func:`run_on_ranks` says so
  before it starts anything when it is given one from ``__main__``.
- A failure in one rank must reach the caller as an error, never as a hang. A rank that raises
  is reported with its rank and its own traceback; a rank that dies without a word (a crash,
  ``os._exit``) is reported with its exit code; and a run that is not finished within
  ``timeout`` seconds is stopped. In each case the other ranks, which may be waiting in a
  collective for the one that failed, are terminated.

Results come back through one pipe per rank, as bytes pickled by the plain ``pickle`` (tensors
by value): ``torch.multiprocessing``'s own pickling would share tensor storage, which needs the
sending process alive until the receiver has mapped it, and a rank exits right after it returns.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_on_ranks", "WorkerError", "WorkerTimeout", "free_port"]

# How long a rank that has stopped (or is told to stop) gets before it is killed, in seconds.
_GRACE = 5.0


class WorkerError(RuntimeError):
    """A rank raised, or exited before returning its result.

    ``rank`` is the rank that failed; ``type_name`` and ``worker_message`` are the type and the
    message of its exception (``None`` when it died without one, and then ``exitcode`` is its exit
    code); ``worker_traceback`` is the traceback text printed in that process. The message of this
    error starts with the rank and the worker's own first line, so that the first line says what
    went wrong where.
    """

    def __init__(self, message: str, *, rank: int, type_name: str | None = None,
                 worker_message: str | None = None, worker_traceback: str | None = None,
                 exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name
        self.worker_message = worker_message
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode


class WorkerTimeout(WorkerError, TimeoutError):
    """The ranks had not all returned within ``timeout`` seconds (``rank``: the first of those that
    had not). A hang in a collective (a rank that never joins, mismatched calls) ends here."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now: bind to port 0 and let the system choose. (Another
    process could take it before rank 0 binds it; that race is rare, and the run then fails with
    an address-in-use error rather than hanging.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(**values: str):
    """Set environment variables for the duration of the block: a spawned process copies the
    parent's environment when it starts, so this is how variables that must be set before torch
    is imported (``OMP_NUM_THREADS``) reach it."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker(payload: bytes, rank: int, world_size: int, timeout: float, conn) -> None:
    """One rank: join the gloo group, run the function, send ``("ok", value)`` or ``("error",
    type name, message, traceback)`` back as pickled bytes, leave the group.

    The function and its arguments arrive pickled by the parent (``payload``), so that a failure
    to unpickle them is reported like any other exception, instead of killing the process before
    this function runs."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 is set too; ranks share the machine's cores
    joined = False
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        joined = True
        message = pickle.dumps(("ok", fn(rank, world_size, *args)))
    except BaseException as error:  # noqa: BLE001 (everything goes back to the parent)
        message = pickle.dumps(("error", type(error).__name__, str(error),
                                traceback.format_exc()))
    conn.send_bytes(message)
    conn.close()
    if joined:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _stop(processes) -> None:
    """Terminate the ranks still running, and kill those that do not stop within the grace time."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 timeout: float = 120) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each call in its
    own process, with the processes joined by a gloo process group.

    Each process is started with the *spawn* method, with ``OMP_NUM_THREADS=1`` (and
    ``torch.set_num_threads(1)``: the ranks share the cores), ``MASTER_ADDR=127.0.0.1`` and a
    free ``MASTER_PORT``; it calls ``torch.distributed.init_process_group("gloo", rank=rank,
    world_size=world_size, timeout=timeout)``, runs ``fn(rank, world_size, *args)``, and destroys
    the group. The list holds the return values in rank order; they must be picklable (tensors
    are sent by value).

    ``fn`` must be importable by a fresh process: a function defined at the top level of a module,
    not in a notebook cell, a script's ``__main__``, a closure or a lambda (``ValueError``).

    Raises :class:`WorkerError` (with the rank, and the worker's traceback text in the message)
    when a rank raises or exits without a result, and :class:`WorkerTimeout` when the ranks have
    not all returned within ``timeout`` seconds, counted from the start of the processes. In both
    cases every other rank is terminated first: nothing is left waiting in a collective.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"run_on_ranks: timeout must be positive, got {timeout!r}")
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__", "__mp_main__") or "<locals>" in getattr(
            fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"run_on_ranks: {getattr(fn, '__qualname__', fn)!r} (module {module!r}) cannot be "
            f"imported by a spawned process; define it at the top level of a module (a .py file "
            f"on the path) and import it from there")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as error:
        raise ValueError(f"run_on_ranks: the function or its arguments cannot be pickled for the "
                         f"worker processes: {error}") from error

    ctx = multiprocessing.get_context("spawn")
    processes, connections = [], []
    start = time.monotonic()
    try:
        with _environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          OMP_NUM_THREADS="1"):
            for rank in range(world_size):
                receiver, sender = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(payload, rank, world_size, timeout, sender),
                                name=f"rank {rank}", daemon=True)
                p.start()
                sender.close()  # the child holds the only sending end: its exit means EOF here
                processes.append(p)
                connections.append(receiver)
        results: dict[int, Any] = {}
        waiting = dict(enumerate(connections))
        while waiting:
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                first = min(waiting)
                raise WorkerTimeout(
                    f"rank {first} of {world_size} had not returned after {timeout:g} s "
                    f"(ranks still running: {sorted(waiting)}); they were stopped. A rank that "
                    f"waits in a collective for another one that never joins hangs like this",
                    rank=first)
            for conn in multiprocessing.connection.wait(list(waiting.values()), remaining):
                rank = next(r for r, c in waiting.items() if c is conn)
                del waiting[rank]
                try:
                    message = pickle.loads(conn.recv_bytes())
                except EOFError:
                    processes[rank].join(_GRACE)
                    code = processes[rank].exitcode
                    raise WorkerError(
                        f"rank {rank} of {world_size} exited with code {code} before returning "
                        f"a result (a crash, or os._exit / sys.exit in the function)",
                        rank=rank, exitcode=code) from None
                if message[0] == "error":
                    _, type_name, text, trace = message
                    first_line = text.strip().splitlines()[0] if text.strip() else ""
                    raise WorkerError(
                        f"rank {rank} of {world_size} raised {type_name}: {first_line}\n\n"
                        f"Traceback in rank {rank}:\n{trace}",
                        rank=rank, type_name=type_name, worker_message=text,
                        worker_traceback=trace)
                results[rank] = message[1]
        for p in processes:  # each rank leaves its group after sending; let it finish
            p.join(max(0.0, min(_GRACE, timeout - (time.monotonic() - start))))
        return [results[rank] for rank in range(world_size)]
    finally:
        _stop(processes)
        for conn in connections:
            conn.close()
