"""Shared test helpers: one tolerance table keyed by dtype, seeded random systems, kernels."""

import pytest
import torch

from tridiag_tutorial import dense_solve, kernels

# Tolerances for comparing a tridiagonal solve with the dense reference, keyed by dtype.
# Single precision is looser: both solvers round, and condition numbers here reach ~1e2.
TOL = {
    torch.float32: dict(rtol=2e-4, atol=2e-5),
    torch.complex64: dict(rtol=2e-4, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.complex128: dict(rtol=1e-10, atol=1e-12),
}
REAL_DTYPES = [torch.float32, torch.float64]

# Tests that pin a bug of torch itself run only on the releases where it was measured; on any
# other release they are skipped (with this reason), not silently passed or failed.
TRAP_MEASURED_ON = ("2.13.", "2.14.")
torch_trap = pytest.mark.skipif(
    not torch.__version__.startswith(TRAP_MEASURED_ON),
    reason=f"this torch bug was measured on torch {', '.join(v[:-1] for v in TRAP_MEASURED_ON)} only")
ALL_DTYPES = REAL_DTYPES + [torch.complex64, torch.complex128]


def assert_close(actual, expected, dtype=None):
    dtype = dtype or expected.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def torch_ops_driver(n: int) -> str:
    """The driver that a device other than the CPU gets for systems of ``n`` unknowns: the
    kernels in torch ops (the CUDA code path), run here on the CPU."""
    return kernels.choose_driver("cuda", torch.float64, 1, n, False)


def driver_for(kernel: str, n: int):
    """``"torch"``: the kernels in torch ops that another device would run; ``"lapack"``: LAPACK."""
    return torch_ops_driver(n) if kernel == "torch" else "lapack"


def assert_grads_match_dense(grads, args, loss, dtype=None):
    """``grads`` of ``loss(x)`` w.r.t. ``args`` equal the dense reference's, with TOL[dtype]."""
    expected = torch.autograd.grad(loss(dense_solve(*args)), args)
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        assert_close(g, e, dtype)


def make_system(n, batch=(), k=None, dtype=torch.float64, seed=0, dominant=False,
                requires_grad=False):
    """Random ``(lower, diag, upper, rhs)``; ``rhs`` is ``(*batch, n)`` if ``k`` is None.

    ``dominant=False`` gives matrices that are not diagonally dominant (so pivoting matters),
    yet well conditioned enough for float32 comparisons: the diagonal is 1.5 + |N(0, 1)| with a
    random sign, the off-diagonals N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)
    real = torch.float32 if dtype in (torch.float32, torch.complex64) else torch.float64

    def randn(*shape):
        x = torch.randn(*shape, generator=g, dtype=real)
        if dtype.is_complex:
            x = torch.complex(x, torch.randn(*shape, generator=g, dtype=real))
        return x

    lower, upper = randn(*batch, n - 1), randn(*batch, n - 1)
    sign = torch.where(torch.rand(*batch, n, generator=g) < 0.5, -1.0, 1.0).to(real)
    diag = (1.5 + randn(*batch, n).abs()) * sign
    if dominant:
        diag = diag + 4 * sign
    rhs = randn(*batch, n) if k is None else randn(*batch, n, k)
    out = [t.to(dtype) for t in (lower, diag, upper, rhs)]
    return [t.requires_grad_() for t in out] if requires_grad else out


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Compiled state left by one test (explain, compile caches) must not leak into another."""
    yield
    torch._dynamo.reset()


def require_cpp():
    """Skip unless the C++ kernel was built at install. Where it should have been built (in CI,
    ``CI=true``, or wherever a C++ compiler is on PATH: ``make test`` installs with one), its
    absence is a test failure, not a skip, so a broken build cannot hide."""
    import os
    import shutil

    from tridiag_tutorial import compiled

    if compiled.is_available():
        return
    in_ci = os.environ.get("CI", "").lower() == "true"
    has_compiler = shutil.which(os.environ.get("CXX", "c++")) is not None
    if in_ci or has_compiler:
        pytest.fail(f"the C++ kernel was not built although a compiler is here: "
                    f"{compiled.BUILD_ERROR}", pytrace=False)
    pytest.skip(f"the C++ kernel was not built at install: {compiled.BUILD_ERROR}")


# The four kernels a CPU solve can run on: the values of the public functions' ``driver``.
KERNELS = list(kernels.DRIVERS)
