"""The op's optional routes, each behind one switch.

The simplest route of a call is the general one: validate, resolve the driver, apply the eager
``autograd.Function`` (:class:`~tridiag_tutorial.functions._TridiagonalSolve`) through
``Function.apply``, dispatch the op ``tridiag_tutorial::solve_kernel``. Each route below skips
part of that where nothing can observe the difference, and stays only while a committed benchmark
row (``python -m tridiag_tutorial.bench.benchmarks --routes-only``) shows that it pays:

- ``cpp_fast_path``: ``driver=None`` on the CPU where the automatic choice is the C++ kernel, no
  transform, mode or compilation: the C++ op checks the inputs itself, no Python validation
  (:func:`tridiag_tutorial.api._solve_on_cpp`; with a gradient,
  :class:`~tridiag_tutorial.functions._CppSolve`);
- ``fused_backward``: that route's backward as one C++ call, ``cpp_solve_backward`` (the solve
  with ``A^H`` and the band gradients); off, a solve on the C++ kernel and the band products in
  torch ops (:func:`~tridiag_tutorial.functions._unfused_backward`);
- ``direct_kernel``: the kernel called without the dispatcher when no gradient, transform or mode
  can see the call (:func:`tridiag_tutorial.functions._unobserved`,
  :func:`~tridiag_tutorial.functions._direct`);
- ``function_apply``: ``_compat.function_apply`` in place of ``Function.apply``, which binds the
  arguments with ``inspect`` on every call.

The benchmark harness and the tests turn routes off with :func:`disabled`; nothing else changes
them. The switches are plain module state, read on every call: not for use from several threads
that disagree about them.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

__all__ = ["ON", "ROUTES", "disabled"]

ROUTES = ("cpp_fast_path", "fused_backward", "direct_kernel", "function_apply")

#: Which optional routes are on (all, unless a block of :func:`disabled` runs).
ON = SimpleNamespace(**{name: True for name in ROUTES})


@contextlib.contextmanager
def disabled(*names: str):
    """Turn the named routes off while the block runs (``with disabled("cpp_fast_path"):``)."""
    unknown = sorted(set(names) - set(ROUTES))
    if unknown:
        raise ValueError(f"unknown routes {unknown}; the routes are {', '.join(ROUTES)}")
    saved = {name: getattr(ON, name) for name in names}
    for name in names:
        setattr(ON, name, False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ON, name, value)
