"""The batched kernel's block width W, probed outside torch: the time per solve of a batch of
float64 systems with ``run_kernel<double, false, W>`` (``csrc/batched.h``) for W = 1, 2, 4, 8, 16.

The kernel eliminates the W systems of a block side by side, in W / 2 SSE2 vectors of 2 doubles
(W = 1: one system, with branches). The extension is built with W = 8 only; :func:`probe` builds
``csrc/lanes_probe.cpp`` (which includes ``batched.h``, the kernel's own source, shipped with the
package) with g++ and the wheel's flags, once per W, on first use, into a temporary folder::

    from tridiag_tutorial.bench import lanes
    lanes.probe(system, 8)             # Probe(seconds=..., flagged=0, x=array(...))
    lanes.probe(system, 2, repeats=50)

``system`` is ``(lower, diag, upper, rhs)`` of a batch: shapes (S, n-1), (S, n), (S, n-1), (S, n),
S a multiple of W. Nothing is built when the package is imported. Without g++, :func:`probe` raises
``RuntimeError`` saying so.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Probe", "WIDTHS", "probe", "build"]

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
WIDTHS = (1, 2, 4, 8, 16)


class Probe(NamedTuple):
    """One run of the probe: ``seconds`` per solve of the whole batch (the kernel only, the first
    solve not counted where ``repeats`` > 1), ``flagged`` the systems that met a zero pivot, and
    ``x`` the first solve's answers, shape (S, n)."""
    seconds: float
    flagged: int
    x: np.ndarray


@functools.cache
def build(width: int) -> Path:
    """The probe's executable for block width ``width``, built once per process."""
    if width not in WIDTHS:
        raise ValueError(f"lanes.build: W is one of {WIDTHS}, not {width!r}")
    gxx = shutil.which("g++")
    if gxx is None:
        raise RuntimeError("lanes.probe needs g++ to build csrc/lanes_probe.cpp; none was found "
                           "on PATH (install g++)")
    folder = tempfile.mkdtemp(prefix="tridiag_lanes_probe_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # removed when the process ends
    out = Path(folder) / f"lanes_probe_{width}"
    # the optimisation flags of the wheel's build (setup.py's CXX_FLAGS), without torch
    run = subprocess.run([gxx, "-O3", "-ffp-contract=off", "-std=c++17", "-w", f"-DPROBE_W={width}",
                          f"-I{_CSRC}", str(_CSRC / "lanes_probe.cpp"), "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"g++ could not build the lanes probe: {run.stderr[-2000:]}")
    return out


def probe(system, width: int, repeats: int = 0) -> Probe:
    """Solve the float64 batch ``system`` = ``(lower, diag, upper, rhs)`` with the batched kernel
    at block width ``width``, ``repeats`` times (at least once)."""
    lower, diag, upper, rhs = (np.asarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor)
                                          else t, dtype=np.float64) for t in system)
    if diag.ndim != 2 or diag.shape[1] < 2:
        raise ValueError("lanes.probe takes a batch: diag of shape (S, n), n >= 2")
    s, n = diag.shape
    if lower.shape != (s, n - 1) or upper.shape != (s, n - 1) or rhs.shape != (s, n):
        raise ValueError("lanes.probe: lower and upper (S, n-1), diag and rhs (S, n)")
    if s % width:
        raise ValueError(f"lanes.probe: the batch's {s} systems are not a multiple of W = {width}")
    exe = build(width)
    with tempfile.TemporaryDirectory() as folder:
        data, answer = Path(folder) / "systems.bin", Path(folder) / "x.bin"
        with open(data, "wb") as f:
            f.write(np.array([s, n], dtype=np.int64).tobytes())
            # per system: lower, diag, upper, rhs, one after another
            f.write(np.concatenate([lower, diag, upper, rhs], axis=1).tobytes())
        run = subprocess.run([str(exe), str(data), str(max(1, repeats)), str(answer)],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"the lanes probe failed ({run.returncode}): {run.stderr[-2000:]}")
        x = np.fromfile(answer, dtype=np.float64).reshape(s, n)
    seconds, flagged = run.stdout.split()
    return Probe(float(seconds), int(flagged), x)
