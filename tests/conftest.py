"""Shared test helpers: one tolerance table keyed by dtype, seeded random systems, kernels."""

import contextlib

import pytest
import torch

from tridiag_tutorial import dense_solve, kernels
from tridiag_tutorial.custom_op import torch_kernel_on_cpu

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


def kernel_context(kernel):
    """``"torch"``: the pure-torch kernel on CPU (the CUDA code path); ``"lapack"``: the default."""
    return torch_kernel_on_cpu() if kernel == "torch" else contextlib.nullcontext()


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
def _lapack_unless_asked():
    """Once a test has loaded the compiled kernel, the package would use it for every CPU batch:
    tests run on LAPACK unless they ask for the compiled kernel (``kernels.use_compiled(True)``)."""
    with kernels.use_compiled(False):
        yield


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Compiled state left by one test (explain, compile caches) must not leak into another."""
    yield
    torch._dynamo.reset()


def load_compiled_or_skip():
    """Build (or find cached) and load the C++ kernel, returning its op. Skip only where the build
    cannot even start (no compiler or no ninja) outside CI. In CI (``CI=true``) with a C++
    compiler on PATH, and anywhere once both tools are there, a failed build is a test failure:
    ninja is declared with the test tools (requirements-pinned.txt, the ``test`` extra), so a
    skip there would hide a broken kernel."""
    import os
    import shutil

    from tridiag_tutorial import compiled

    missing = compiled._missing_tools()
    in_ci = os.environ.get("CI", "").lower() == "true"
    has_compiler = shutil.which(os.environ.get("CXX", "c++")) is not None
    if missing and not (in_ci and has_compiler):
        pytest.skip(f"the C++ kernel cannot be built here: missing {', '.join(missing)}")
    try:
        return compiled.load()
    except Exception as err:
        pytest.fail(f"compiled.load() failed although the build tools are here: {err}",
                    pytrace=False)


# The four kernels a CPU solve can run on, and how each is selected (tests/test_kernel_matrix.py).
KERNELS = ["lapack", "cpp", "torch-sequential", "torch-partitioned"]


@contextlib.contextmanager
def kernel_selected(kernel):
    """Within the block, solves run on ``kernel`` (one of :data:`KERNELS`) where the routing rules
    allow it: "cpp" for batches of >= 2 systems or one system of n <= 3000
    (``kernels.compiled_pays``), "torch-partitioned" for n >= ``kernels.PARTITIONED_MIN_N``.
    The caller loads the C++ kernel first (:func:`load_compiled_or_skip`)."""
    with contextlib.ExitStack() as stack:
        if kernel == "cpp":
            stack.enter_context(kernels.use_compiled(True))
        elif kernel.startswith("torch"):
            stack.enter_context(kernels.torch_kernel_on_cpu())
            stack.enter_context(kernels.use_partitioned(kernel == "torch-partitioned"))
        yield
