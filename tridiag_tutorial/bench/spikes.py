"""The pieces kernel's spikes, probed outside torch: how many of the spike entries it computes are
subnormal, and its time per solve, with the kernel's cut (``cut_spike`` in ``csrc/pieces.h``) and
without it.

A spike decays geometrically down a piece where the piece is diagonally dominant. Computed to the
end of the piece, it passes through subnormal numbers, on which some CPUs take a slow path for
operations that read or write one; the kernel cuts it to zero instead (chapter 15).
:func:`probe` builds ``csrc/spike_probe.cpp`` (which includes ``pieces.h``, the kernel's own
source, shipped with the package) with g++ on first use, into a temporary folder, and runs it on
one system::

    from tridiag_tutorial.bench import spikes
    from tridiag_tutorial.bench.benchmarks import one_system_family
    system = one_system_family("pivoting", 4096, torch.float32)
    spikes.probe(system)              # Probe(code=0, seconds=..., entries=..., subnormal=...)
    spikes.probe(system, cut=False)   # the kernel without the cut

Nothing is built when the package is imported. Without g++, :func:`probe` raises ``RuntimeError``
saying so.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Probe", "probe", "build"]

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


class Probe(NamedTuple):
    """One run of the probe: ``code`` 0 where the pieces solved the system (-1: handed back);
    ``seconds`` per solve (0.0 where ``repeats`` < 2); ``entries`` the spike entries computed in
    the first solve and ``subnormal`` how many of them were subnormal (-1 where not counted)."""
    code: int
    seconds: float
    entries: int
    subnormal: int


@functools.cache
def build(count: bool, cut: bool) -> Path:
    """The probe's executable, built once per process and variant: ``count`` the spike entries
    (which slows it), ``cut`` them as the kernel does."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise RuntimeError("spikes.probe needs g++ to build csrc/spike_probe.cpp; none was found "
                           "on PATH (install g++, or read the committed rows instead)")
    folder = tempfile.mkdtemp(prefix="tridiag_spike_probe_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # removed when the process ends
    out = Path(folder) / "spike_probe"
    flags = ["-DTT_SPIKE_COUNT"] * count + ["-DTT_SPIKE_KEEP"] * (not cut)
    # the optimisation flags of the wheel's build (setup.py's CXX_FLAGS), without torch
    run = subprocess.run([gxx, "-O3", "-ffp-contract=off", "-std=c++17", "-w", *flags, f"-I{_CSRC}",
                          str(_CSRC / "spike_probe.cpp"), "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"g++ could not build the spike probe: {run.stderr[-2000:]}")
    return out


def probe(system, cut: bool = True, repeats: int = 0, count: bool = True,
          lanes: str = "widest") -> Probe:
    """Solve ``system`` = ``(lower, diag, upper, rhs)`` (one real system, float32 or float64,
    ``rhs`` of n values) on the pieces kernel outside torch, ``repeats`` times (at least once).
    ``lanes="16-byte"`` runs the lanes of CPUs without AVX2."""
    lower, diag, upper, rhs = (t.detach().cpu().numpy() if isinstance(t, torch.Tensor)
                               else np.asarray(t) for t in system)
    dtype = diag.dtype
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"spikes.probe takes float32 or float64 systems, not {dtype}")
    n = diag.shape[0]
    if diag.ndim != 1 or lower.shape != (n - 1,) or upper.shape != (n - 1,) or rhs.size != n:
        raise ValueError("spikes.probe takes one system: lower and upper (n-1,), diag and rhs (n,)")
    env = dict(os.environ)
    env.pop("TRIDIAG_TUTORIAL_NO_AVX2", None)
    if lanes == "16-byte":
        env["TRIDIAG_TUTORIAL_NO_AVX2"] = "1"
    elif lanes != "widest":
        raise ValueError(f"lanes: 'widest' or '16-byte', not {lanes!r}")
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "system.bin"
        with open(data, "wb") as f:
            f.write(np.array([n, dtype.itemsize], dtype=np.int64).tobytes())
            for band in (lower, diag, upper, rhs.reshape(-1)):
                f.write(np.ascontiguousarray(band, dtype=dtype).tobytes())
        run = subprocess.run([str(build(count, cut)), str(data), str(max(1, repeats))],
                             capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"the spike probe failed ({run.returncode}): {run.stderr[-2000:]}")
    code, seconds, entries, subnormal = run.stdout.split()
    return Probe(int(code), float(seconds), int(entries), int(subnormal))
