"""Chapter 16: the three tests of the partitioned kernel's check as numbers beside their bounds.

:func:`tridiag_tutorial.kernels.partitioned.solve_ex` reads back only whether some test failed;
:func:`check_values` repeats its solve and refinement, step for step, and returns each test's
value, so that a chapter can show which test rejects an answer."""

from __future__ import annotations

import torch

from ..kernels import partitioned

# The bound each value of check_values may reach: above it (or NaN) the kernel falls back.
BOUNDS = {"correction": partitioned.CONVERGENCE_TOL, "probe": 1 / partitioned.SINGULAR_MARGIN,
          "growth": partitioned.GROWTH_TOL}


def check_values(lower, diag, upper, rhs, block: int = partitioned.BLOCK) -> dict[str, float]:
    """The values of :func:`~tridiag_tutorial.kernels.partitioned.solve_ex`'s tests for finite
    bands ``(*B, n-1)``, ``(*B, n)``, ``(*B, n-1)`` and a finite ``rhs`` ``(*B, n, k)``, each the
    largest over the columns (the caller's and the two probes) and the systems:

    - ``"correction"``: the last refinement step's correction over ``eps max|x|`` (NaN where an
      answer is not finite);
    - ``"probe"``: ``eps max|(D^{-1} A)^{-1} z|``, ``D`` the rows' largest magnitudes;
    - ``"growth"``: eps times the largest spike entry.

    The kernel falls back where any value is above its bound in :data:`BOUNDS` (or NaN)."""
    k = rhs.shape[-1]
    row = partitioned._row_max(lower, diag, upper)
    probe = partitioned._probe(rhs) * torch.where(row > 0, row, torch.ones_like(row))[..., None]
    b = torch.cat([rhs, probe], dim=-1)
    x, levels = partitioned._factor_solve(lower, diag, upper, b, block)
    residual = partitioned._Residual(lower, diag, upper, b)
    correction = x
    for _ in range(partitioned.REFINEMENT_STEPS):
        correction = partitioned._solve_phase(levels, residual(x), block)
        x = x + correction
    eps = torch.finfo(x.dtype).eps
    x_max = x.abs().amax(-2)  # (*B, k + 2)
    last = correction.abs().amax(-2)
    ratio = torch.where(last == 0, torch.zeros_like(last), last / (eps * x_max))
    ratio = torch.where(torch.isfinite(x).all(-2), ratio, torch.full_like(ratio, torch.nan))
    return {"correction": ratio.max().item(),
            "probe": (eps * x_max[..., k:].amax(-1)).max().item(),
            "growth": (eps * partitioned._growth(levels)).max().item()}


def failed(values: dict[str, float]) -> list[str]:
    """The names of the tests whose value is above its bound, or NaN."""
    return [name for name, value in values.items() if not value <= BOUNDS[name]]
