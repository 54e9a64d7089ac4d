"""The package as installed: what importing it costs, the package without its C++ extension
(the schemas defined from Python, every CPU solve on LAPACK), and the extension's library on its
own (the schemas and a solve without the Python package, as an AOTInductor deployment loads it).

Each check that depends on what a process has imported runs in a fresh interpreter."""

import json
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch

import tridiag_tutorial
from tridiag_tutorial import _schemas, tridiagonal_solve
from tridiag_tutorial.kernels import compiled
from tridiag_tutorial.reference import dense_solve

from conftest import assert_close, make_system, require_cpp

IMPORT_BUDGET_S = 0.3  # what `import tridiag_tutorial` may add to `import torch`
FRESH_PROCESSES = 5
# what the C++ library defines
OPS = ("solve", "solve_kernel", "lu_factor", "cpp_solve", "cpp_solve_ex", "cpp_solve_backward")


def run_python(code: str, cwd, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter (this one's executable) in ``cwd``; it prints one JSON
    object as its last line of output, which is returned."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Importing the package.
# ---------------------------------------------------------------------------------------------
IMPORT = """
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import tridiag_tutorial
    t2 = time.perf_counter()
    print(json.dumps({"torch_s": t1 - t0, "package_s": t2 - t1,
                      "dynamo": "torch._dynamo" in sys.modules,
                      "cpp_extension": "torch.utils.cpp_extension" in sys.modules,
                      "cpp_available": tridiag_tutorial.cpp_available()}))
"""


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """FRESH_PROCESSES fresh interpreters, each timing ``import torch`` and then
    ``import tridiag_tutorial`` with time.perf_counter."""
    cwd = tmp_path_factory.mktemp("import")
    return [run_python(IMPORT, cwd) for _ in range(FRESH_PROCESSES)]


def test_import_loads_no_dynamo_and_builds_nothing(imports):
    """``import tridiag_tutorial`` imports no ``torch._dynamo`` (Dynamo is loaded by the first
    torch.compile, not by the package), and nothing that builds C++ (the kernel was built at
    install: ``torch.utils.cpp_extension`` stays unimported); the kernel is there all the same
    where this process has it."""
    for run in imports:
        assert not run["dynamo"], run
        assert not run["cpp_extension"], run
        assert run["cpp_available"] == tridiag_tutorial.cpp_available()


def test_import_costs_little_more_than_torch(imports):
    """The median over fresh interpreters of the time ``import tridiag_tutorial`` takes after
    ``import torch``."""
    package = statistics.median(run["package_s"] for run in imports)
    torch_s = statistics.median(run["torch_s"] for run in imports)
    assert package <= IMPORT_BUDGET_S, (
        f"import tridiag_tutorial took {package:.3f} s after import torch ({torch_s:.3f} s), "
        f"median of {len(imports)} fresh processes: over the {IMPORT_BUDGET_S} s budget")


# ---------------------------------------------------------------------------------------------
# Without the extension: as installed where no C++ compiler worked.
# ---------------------------------------------------------------------------------------------
WITHOUT_EXTENSION = """
    import json, sys
    sys.modules["tridiag_tutorial._C"] = None  # `from . import _C` raises ImportError
    import torch
    import tridiag_tutorial
    from tridiag_tutorial import _schemas, kernels, tridiagonal_lu_factor, tridiagonal_lu_solve
    from tridiag_tutorial.kernels import compiled
    from tridiag_tutorial import tridiagonal_solve

    inputs = torch.load("inputs.pt")
    out, report = {}, {}
    report["cpp_available"] = tridiag_tutorial.cpp_available()
    report["is_available"] = compiled.is_available()
    report["build_error"] = compiled.BUILD_ERROR
    for name, args in inputs.items():
        report["auto_" + name] = kernels.resolve_driver(None, args[3].unsqueeze(-1))
        for driver in (None, "lapack", "sequential", "partitioned"):
            out[f"{name}_{driver}"] = tridiagonal_solve(*args, driver=driver)
        for driver in (None, "lapack", "sequential"):
            factors = tridiagonal_lu_factor(*args[:3], driver=driver)
            out[f"{name}_lu_{driver}"] = tridiagonal_lu_solve(factors, args[3], driver=driver)
        try:
            tridiagonal_solve(*args, driver="cpp")
        except RuntimeError as err:
            report["cpp_error"] = str(err)
    report["schemas"] = {name: str(getattr(torch.ops.tridiag_tutorial, name).default._schema)
                         for name in _schemas.SCHEMAS}
    report["SCHEMAS"] = _schemas.SCHEMAS
    report["has_cpp_solve"] = hasattr(torch.ops.tridiag_tutorial, "cpp_solve")

    args = [t.clone().requires_grad_() for t in inputs["batch"]]
    loss = lambda *a: tridiagonal_solve(*a).square().sum()
    value = torch.compile(loss, fullgraph=True)(*args)
    out["compiled_value"] = value.detach()
    out["compiled_grads"] = list(torch.autograd.grad(value, args))
    report["gradcheck"] = torch.autograd.gradcheck(tridiagonal_solve, args, check_forward_ad=True)
    report["gradgradcheck"] = torch.autograd.gradgradcheck(tridiagonal_solve, args)
    torch.save(out, "out.pt")
    report["modules"] = sorted(name for name, module in sys.modules.items()
                               if name.startswith("tridiag_tutorial") and module is not None)
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def without_extension(tmp_path_factory):
    """``(report, results, inputs)`` of a fresh interpreter where ``tridiag_tutorial._C`` cannot be
    imported: one small batch and one system that the partitioned kernel partitions."""
    cwd = tmp_path_factory.mktemp("without_extension")
    inputs = {"batch": make_system(6, (3,), seed=1, requires_grad=False),
              "large": make_system(70, (), seed=2)}
    torch.save(inputs, cwd / "inputs.pt")
    report = run_python(WITHOUT_EXTENSION, cwd)
    return report, torch.load(cwd / "out.pt"), inputs


def test_without_extension_the_package_says_why(without_extension):
    report, _, _ = without_extension
    assert report["cpp_available"] is False and report["is_available"] is False
    error = report["build_error"]  # "<the ImportError's type>: <its message>"
    assert error.startswith(("ImportError: ", "ModuleNotFoundError: ")), error
    assert "tridiag_tutorial._C" in error
    assert "tridiag_tutorial._C" not in report["modules"]


def test_without_extension_every_driver_but_cpp_solves(without_extension):
    """driver=None (LAPACK on the CPU), "lapack", "sequential" and "partitioned", and the
    factorization on its drivers, against the dense reference."""
    report, results, inputs = without_extension
    assert report["auto_batch"] == "lapack" and report["auto_large"] == "lapack"
    for name, args in inputs.items():
        expected = dense_solve(*args)
        for driver in (None, "lapack", "sequential", "partitioned"):
            assert_close(results[f"{name}_{driver}"], expected)
        for driver in (None, "lapack", "sequential"):
            assert_close(results[f"{name}_lu_{driver}"], expected)


def test_without_extension_cpp_driver_says_how_to_fix_it(without_extension):
    message = without_extension[0]["cpp_error"]
    assert message.startswith("tridiagonal_solve: driver='cpp': ")
    # the build succeeded (the install's record) but the module cannot be imported
    assert ("the C++ kernel is not available: it was built when the package was installed but "
            "cannot be loaded") in message
    assert without_extension[0]["build_error"] in message  # why
    assert "To build it, run " in message  # how to fix it, without touching torch
    assert "-m pip install --force-reinstall --no-deps " in message
    assert "driver='lapack'" in message  # or what to use instead


def test_without_extension_python_defines_the_schemas(without_extension):
    report, _, _ = without_extension
    assert report["SCHEMAS"] == _schemas.SCHEMAS
    assert set(report["schemas"]) == {"solve", "solve_kernel", "lu_factor"}
    for name, schema in report["schemas"].items():
        assert schema == "tridiag_tutorial::" + _schemas.SCHEMAS[name]
    assert report["has_cpp_solve"] is False  # the C++ kernel's op comes with the library only


def test_without_extension_compile_and_gradcheck(without_extension):
    report, results, inputs = without_extension
    args = [t.clone().requires_grad_() for t in inputs["batch"]]
    value = dense_solve(*args).square().sum()
    assert_close(results["compiled_value"], value.detach())
    for got, expected in zip(results["compiled_grads"], torch.autograd.grad(value, args)):
        assert_close(got, expected)
    assert report["gradcheck"] is True and report["gradgradcheck"] is True


# ---------------------------------------------------------------------------------------------
# With the extension: the C++ library defines the schemas, and works without Python.
# ---------------------------------------------------------------------------------------------
def test_cpp_library_defines_the_python_schemas():
    """The schemas in csrc/tridiag.cpp are _schemas.SCHEMAS, the ones the package defines where the
    extension is missing: a graph saved in one install loads in the other."""
    require_cpp()
    assert set(_schemas.SCHEMAS) == {"solve", "solve_kernel", "lu_factor"}
    for name, schema in _schemas.SCHEMAS.items():
        assert str(getattr(torch.ops.tridiag_tutorial, name).default._schema) == (
            "tridiag_tutorial::" + schema)
    assert str(torch.ops.tridiag_tutorial.cpp_solve.default._schema) == (
        "tridiag_tutorial::cpp_solve(Tensor lower, Tensor diag, Tensor upper, Tensor rhs) "
        "-> (Tensor, Tensor)")


LIBRARY_ALONE = """
    import json, sys
    import torch
    torch.ops.load_library(sys.argv[1])
    data = torch.load("inputs.pt")
    T = torch.ops.tridiag_tutorial
    report = {"ops": {name: hasattr(T, name) for name in data["ops"]}}
    report["schemas"] = {name: str(getattr(T, name).default._schema) for name in data["schemas"]}
    l, d, u, rhs = data["args"]
    x = T.solve(l, d, u, rhs, None, None, "N", "lapack")
    report["solve_equal"] = torch.equal(x, data["x"])
    report["solve_kernel_equal"] = torch.equal(
        T.solve_kernel(l, d, u, rhs, None, None, "N", "sequential"), data["x"])
    report["cpp_solve_equal"] = torch.equal(T.cpp_solve(l, d, u, rhs)[0], data["x"])
    try:
        T.solve(*data["singular"], None, None, "N", "lapack")
    except RuntimeError as err:
        report["singular_error"] = str(err)
    try:
        n = d.shape[-1]
        T.solve(l, d, u, rhs, torch.zeros(*d.shape[:-1], 4, n, dtype=d.dtype),
                torch.ones(*d.shape, dtype=torch.int32), "N", "lapack")
    except RuntimeError as err:
        report["factors_error"] = str(err)
    report["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "tridiag_tutorial")
    print(json.dumps(report))
"""


def test_cpp_library_works_without_the_python_package(tmp_path):
    """A process that only loads the library (``torch.ops.load_library``, as an AOTInductor
    deployment does) has the four ops with the package's schemas; ``solve`` without factors
    returns exactly the package's answer (the C++ kernel makes LAPACK's decisions bit for bit),
    and a singular system raises RuntimeError saying so."""
    require_cpp()
    path = compiled.library_path()
    args = make_system(9, (3,), 2, seed=3)
    x = tridiagonal_solve(*args)
    torch.testing.assert_close(tridiagonal_solve(*args, driver="lapack"), x, rtol=0, atol=0)
    singular = [t.clone() for t in args]
    singular[1][2, 0], singular[0][2, 0] = 0.0, 0.0  # system 2: a zero first column
    with pytest.raises(tridiag_tutorial.SingularMatrixError):
        tridiagonal_solve(*singular)
    torch.save({"args": args, "x": x, "singular": singular, "ops": OPS,
                "schemas": {name: "tridiag_tutorial::" + s for name, s in _schemas.SCHEMAS.items()}},
               tmp_path / "inputs.pt")
    code = textwrap.dedent(LIBRARY_ALONE)
    done = subprocess.run([sys.executable, "-c", code, path], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["modules"] == []  # nothing of the Python package was imported
    assert report["ops"] == {name: True for name in OPS}
    for name, schema in report["schemas"].items():
        assert schema == "tridiag_tutorial::" + _schemas.SCHEMAS[name]
    assert report["solve_equal"] and report["solve_kernel_equal"] and report["cpp_solve_equal"]
    assert "singular" in report["singular_error"]
    assert "pivot U[0, 0] is exactly zero, in system 2" in report["singular_error"]
    assert "needs the Python package" in report["factors_error"]
