"""Deployment without the Python package (chapters 8 and 14): an ``nn.Module`` that calls the op is
exported with a dynamic batch, packaged by AOTInductor, and run in a fresh process that loads only
the extension's shared library (``torch.ops.load_library``) and never imports ``tridiag_tutorial``.

The package calls the op through AOTInductor's proxy executor; in that process the op's only
kernel is the library's own (``csrc/tridiag.cpp`` defines the schemas of ``solve`` and
``solve_kernel`` and a CompositeExplicitAutograd kernel for both, on the C++ solver), so the results
must equal the eager module's. Without ``load_library`` the package cannot be loaded at all.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tridiag_tutorial
from tridiag_tutorial.kernels import compiled

import conftest

N = 50                 # unknowns per signal (static in the exported graph)
EXAMPLE_BATCH = 3      # the batch of the example input given to torch.export
RUN_BATCHES = (4, 7)   # the batches the fresh process runs: neither is the example's
BATCH = dict(min=2, max=1024)


class Smoother(nn.Module):
    """One implicit diffusion step along the last dimension: ``y = (I + c L)^{-1} x`` for signals
    ``x`` of shape ``(batch, n)``, where ``L`` is the 1-D Laplacian (2 on the diagonal, -1 beside
    it) and ``c`` a learnable diffusion coefficient."""

    def __init__(self, diffusion: float = 0.5):
        super().__init__()
        self.diffusion = nn.Parameter(torch.tensor(diffusion, dtype=torch.float64))

    def forward(self, x):
        c = self.diffusion
        off = (-c).expand(*x.shape[:-1], x.shape[-1] - 1)
        diag = (1 + 2 * c).expand(x.shape)
        return tridiag_tutorial.tridiagonal_solve(off, diag, off, x)


# The fresh process. argv: the library to load ("" for none), the package, the inputs, the
# outputs. A finder at the front of sys.meta_path refuses every import of tridiag_tutorial, so
# nothing (not torch, not the package loader) can import it behind the script's back.
CHILD = textwrap.dedent("""
    import sys

    class _Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "tridiag_tutorial":
                raise ImportError("test_deploy: the fresh process must not import " + name)
            return None

    sys.meta_path.insert(0, _Refuse())

    import torch

    lib, package, inputs, outputs = sys.argv[1:5]
    if lib:
        torch.ops.load_library(lib)
    else:
        # aoti_load_package tries load_pt2 first and, when that raises, logs only "Loading outdated
        # pt2 file" and tries the legacy loader, whose error on this package is not always the
        # first's (CI once saw a JSON parse error on an empty input). Report load_pt2's own error.
        from torch.export.pt2_archive._package import load_pt2
        try:
            load_pt2(package)
        except RuntimeError as error:
            print("load_pt2:", error, file=sys.stderr)
    model = torch._inductor.aoti_load_package(package)
    xs = torch.load(inputs, weights_only=True)
    with torch.no_grad():
        ys = [model(x) for x in xs]
    loaded = sorted(m for m in sys.modules if m.startswith("tridiag_tutorial"))
    assert not loaded, loaded
    torch.save(ys, outputs)
""")


def _run_child(lib: str, package, tmp_path):
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    gen = torch.Generator().manual_seed(24)
    xs = [torch.randn(b, N, dtype=torch.float64, generator=gen) for b in RUN_BATCHES]
    torch.save(xs, inputs)
    # TMPDIR: the package loader unpacks into a fresh aotinductor_* folder there and leaves it
    # behind when loading fails; under tmp_path it goes when pytest clears its old folders.
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, lib, str(package), str(inputs), str(outputs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, xs, outputs


@pytest.fixture(scope="module")
def model():
    return Smoother(diffusion=0.7).eval()


def _export(model, strict=False):
    x = torch.randn(EXAMPLE_BATCH, N, dtype=torch.float64)
    with torch.no_grad():
        return torch.export.export(model, (x,), strict=strict,
                                   dynamic_shapes={"x": {0: torch.export.Dim("batch", **BATCH)}})


@pytest.fixture(scope="module")
def package(model, tmp_path_factory):
    """The AOTInductor package of the exported module (one C++ compile for the whole file)."""
    conftest.require_cpp()
    ep = _export(model)
    path = tmp_path_factory.mktemp("aoti") / "smoother.pt2"
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_holds_the_op_as_one_node_with_a_dynamic_batch(model, strict):
    """The exported graph calls ``tridiag_tutorial::solve`` once (the op, not its kernel), and
    the batch stays a symbol with the range asked for (the automatic driver choice must not
    specialise it to the example's batch). The C++ library is not needed for this."""
    ep = _export(model, strict=strict)
    ours = [node.target for node in ep.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("tridiag_tutorial.")]
    assert ours == [torch.ops.tridiag_tutorial.solve.default], ep.graph
    (x,) = [node for node in ep.graph.nodes
            if node.op == "placeholder" and node.name == "x"]
    batch = x.meta["val"].shape[0]
    assert isinstance(batch, torch.SymInt), f"the batch was specialised to {batch}"
    bounds = ep.range_constraints[batch.node.expr]
    assert (int(bounds.lower), int(bounds.upper)) == (BATCH["min"], BATCH["max"])


def test_package_runs_in_a_process_with_only_the_library(model, package, tmp_path):
    """A fresh process that loads only the extension's library runs the package at batches other
    than the example's, without importing tridiag_tutorial, and agrees with the eager module."""
    proc, xs, outputs = _run_child(compiled.library_path(), package, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ys = torch.load(outputs, weights_only=True)
    assert [tuple(y.shape) for y in ys] == [(b, N) for b in RUN_BATCHES]
    with torch.no_grad():
        for x, y in zip(xs, ys):
            torch.testing.assert_close(y, model(x), rtol=1e-12, atol=1e-14)


def test_package_needs_the_library(package, tmp_path):
    """The negative control: the same fresh process without ``torch.ops.load_library`` cannot
    load the package (``aoti_load_package`` raises), and the loader's first error names the op it
    lacks."""
    proc, _, outputs = _run_child("", package, tmp_path)
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr.strip().splitlines()[-1], proc.stderr[-4000:]
    first = [line for line in proc.stderr.splitlines() if line.startswith("load_pt2:")]
    assert first and "tridiag_tutorial::solve" in first[0], proc.stderr[-4000:]
    assert not outputs.exists()
