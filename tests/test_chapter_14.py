"""What chapter 14 (a C++ operator and shipping it) states about the package's own operator,
recomputed here: the shipped library's symbols, the kernel against LAPACK, its errors."""

import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tridiag_tutorial
from tridiag_tutorial import SingularMatrixError
from tridiag_tutorial.kernels import compiled, lapack

from conftest import require_cpp

LIBTORCH_CPP = re.compile(r"\b(c10|at|torch|caffe2)::")


def batch(seed=0, n=50, shape=(3, 7), k=2):
    g = torch.Generator().manual_seed(seed)
    lower = torch.randn(*shape, n - 1, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(*shape, n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    diag = sign * (1.5 + torch.randn(*shape, n, generator=g, dtype=torch.float64).abs())
    upper = torch.randn(*shape, n - 1, generator=g, dtype=torch.float64)
    return lower, diag, upper, torch.randn(*shape, n, k, generator=g, dtype=torch.float64)


def _dynamic_symbols(library, *options):
    """The names of the dynamic symbols `nm -D *options` lists for a shared library."""
    listing = subprocess.run(["nm", "-D", *options, str(library)], capture_output=True, text=True,
                             check=True).stdout
    return {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}


def test_the_shipped_library_needs_only_c_functions_of_torch():
    """Section 14.7: tridiag_tutorial._C needs no C++ symbol of libtorch, registers its ops through
    the stable ABI's C functions, and needs of CPython only what its module stub calls."""
    require_cpp()
    if shutil.which("nm") is None:
        pytest.skip("nm is not installed")
    names = _dynamic_symbols(compiled.library_path(), "-C", "--undefined-only")
    assert not [s for s in names if LIBTORCH_CPP.search(s)]
    assert any(s.startswith("aoti_torch_library_def") for s in names)
    assert "torch_call_dispatcher" in names
    assert {s for s in names if s.startswith("Py")} <= {"PyModule_Create2", "Py_BuildValue"}


def test_the_kernel_gives_lapacks_bits_on_a_batch():
    require_cpp()
    system = batch()
    x_cpp = compiled.solve(*system)
    x_lapack = torch.from_numpy(lapack.solve(*(t.numpy() for t in system)))
    assert torch.equal(x_cpp, x_lapack)


def test_a_singular_system_raises_as_on_lapack_and_the_op_reports_its_pivot():
    require_cpp()
    lower, diag, upper, rhs = (t.clone() for t in batch(n=5, shape=(3,), k=1))
    diag[1, 0] = 0.0
    lower[1, 0] = 0.0
    messages = []
    for solve in (lambda: compiled.solve(lower, diag, upper, rhs),
                  lambda: lapack.solve(*(t.numpy() for t in (lower, diag, upper, rhs)))):
        with pytest.raises(SingularMatrixError) as caught:
            solve()
        messages.append(str(caught.value))
    assert messages[0] == messages[1] and "(1,)" in messages[0]
    _, info = torch.ops.tridiag_tutorial.cpp_solve(lower, diag, upper, rhs)
    assert int(info) == 1 * 5 + 0


def test_the_op_refuses_integers_with_a_runtime_error():
    require_cpp()
    ints = [torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64), torch.ones(3, 1, dtype=torch.int64)]
    with pytest.raises(RuntimeError, match="dtype must be float32, float64"):
        torch.ops.tridiag_tutorial.cpp_solve(*ints)


def test_without_the_library_the_schemas_still_exist():
    """Section 14.5: the package defines every schema, with or without the C++ library."""
    for name in ("solve", "solve_kernel", "lu_factor"):
        assert getattr(torch.ops.tridiag_tutorial, name).default._schema.name == f"tridiag_tutorial::{name}"
    assert isinstance(tridiag_tutorial.cpp_available(), bool)


def test_the_import_stub_the_chapter_shows_is_the_packages():
    """Section 14.7 shows the import stub in short: a module `_C` created in tridiag.cpp's PyInit__C,
    imported by kernels/compiled.py, which tolerates its absence with `_C = None`."""
    package = tridiag_tutorial.__file__.rsplit("/", 1)[0]
    with open(f"{package}/csrc/tridiag.cpp") as f:
        cpp = f.read()
    with open(f"{package}/kernels/compiled.py") as f:
        python = f.read()
    assert re.search(r"PyMODINIT_FUNC PyInit__C\(void\)", cpp)
    assert re.search(r'PyModuleDef_HEAD_INIT, "_C"', cpp)
    assert re.search(r"try:\n\s+from \.\. import _C\n\s+except ImportError.*\n\s+_C = None", python)


def test_the_import_stub_shown_is_the_minimal_form_of_one_with_one_function():
    """Section 14.7 labels its PyInit__C "the minimal form": the package's own lists one function in
    a methods[] table (whence Py_BuildValue among the CPython functions _C needs)."""
    package = tridiag_tutorial.__file__.rsplit("/", 1)[0]
    with open(f"{package}/csrc/tridiag.cpp") as f:
        cpp = f.read()
    stub = cpp[cpp.index("PyMODINIT_FUNC PyInit__C(void)"):]
    stub = stub[:stub.index("\n}\n") + 3]
    table = re.search(r"PyMethodDef (\w+)\[\] = \{(.*?)\};", stub, re.S)
    assert table, stub
    entries = re.findall(r"\{\s*(\"\w+\"|nullptr)", table[2])
    assert len(entries) == 2 and entries[-1] == "nullptr", entries
    assert re.search(rf"PyModuleDef_HEAD_INIT, \"_C\", nullptr, -1, {table[1]}\}}", stub)


LIBRARY_ALONE = """
import sys
from pathlib import Path
import torch
torch.ops.load_library(sys.argv[1])
op = torch.ops.tridiag_tutorial
g = torch.Generator().manual_seed(0)
lower, upper = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(2))
diag = 4 + torch.rand(8, generator=g, dtype=torch.float64)
rhs = torch.randn(8, 2, generator=g, dtype=torch.float64)
dense = torch.diag(diag) + torch.diag(lower, -1) + torch.diag(upper, 1)
expected = torch.linalg.solve(dense, rhs)
x_kernel, _ = op.cpp_solve(lower, diag, upper, rhs)
for driver in ("cpp", "lapack", "sequential", "partitioned"):
    x = op.solve(lower, diag, upper, rhs, None, None, "N", driver)
    print(driver, float((x - expected).abs().max()) < 1e-12, torch.equal(x, x_kernel))
attempts = {"lu_factor": lambda: op.lu_factor(lower, diag, upper, "sequential"),
            "trans": lambda: op.solve(lower, diag, upper, rhs, None, None, "T", "cpp"),
            "factors": lambda: op.solve(lower, diag, upper, rhs, diag, diag.int(), "N", "lapack")}
WHY = {"lu_factor": "needs the Python package", "trans": "trans must be 'N'",
       "factors": "needs the Python package"}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "ran")
    except RuntimeError as error:  # refused, and saying why
        print(name, "refused", WHY[name] in str(error))
try:
    op.solve(0 * lower, 0 * diag, upper, rhs, None, None, "N", "cpp")
    print("singular ran")
except RuntimeError as error:  # plain: only the package's Python raises SingularMatrixError
    print("singular", type(error).__name__, "in system 0 (flat index over the batch)" in str(error))
try:  # no fake kernel registered from Python: the fake tensors reach the composite kernel
    torch.compile(lambda *bands: op.solve(*bands, None, None, "N", "cpp"), fullgraph=True,
                  backend="eager")(lower, diag, upper, rhs)
    print("compile ran")
except RuntimeError as error:
    print("compile refused", "CPU tensors only" in str(error), "import" in str(error))
print("imported", any(m.startswith("tridiag_tutorial") for m in sys.modules))
"""


@pytest.mark.slow
def test_the_library_alone_solves_from_the_bands_on_any_driver_and_refuses_the_rest():
    """Section 14.6 (and chapter 13's section 13.8): in a process that loads only the library, the
    composite kernel solves whatever driver the graph recorded, on the C++ kernel (its bits),
    refuses factoring, solves from factors and trans other than 'N', raises a plain RuntimeError
    on a singular matrix, and compiling a call of the op fails inside the C++ kernel, on fake
    tensors, with no word of a module to import (section 14.7: _C sets no pystub)."""
    require_cpp()
    run = subprocess.run([sys.executable, "-c", LIBRARY_ALONE, str(compiled.library_path())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:-1] == [
        "cpp True True", "lapack True True", "sequential True True", "partitioned True True",
        "lu_factor refused True", "trans refused True", "factors refused True",
        "singular RuntimeError True", "compile refused True False", "imported False"]


def test_libtorch_cpu_defines_the_c_functions_and_libc10_only_what_libstdcxx_has_too():
    """Section 14.7: libtorch_cpu.so defines every C function of torch that _C calls; libc10.so,
    though _C is linked against it, defines none of them, only standard-library functions that
    libstdc++.so.6 defines too."""
    require_cpp()
    if shutil.which("nm") is None or shutil.which("ldd") is None:
        pytest.skip("nm or ldd is not installed")
    library = compiled.library_path()
    undefined = _dynamic_symbols(library, "--undefined-only")
    calls = {s for s in undefined if s.startswith(("aoti_torch_", "torch_"))}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert calls and calls <= _dynamic_symbols(torch_lib / "libtorch_cpu.so", "--defined-only")
    from_c10 = undefined & _dynamic_symbols(torch_lib / "libc10.so", "--defined-only")
    assert not from_c10 & calls
    assert all(re.match(r"_ZN?[KVRO]*St", s) for s in from_c10), from_c10
    located = subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
    libstdcxx = re.search(r"libstdc\+\+\.so\.6 => (/\S+)", located)
    assert libstdcxx, located
    assert from_c10 <= _dynamic_symbols(libstdcxx[1], "--defined-only")


COMPOSITE_ON_META = """
import sys
import torch
torch.ops.load_library(sys.argv[1])
op = torch.ops.tridiag_tutorial
for name in ("solve", "solve_kernel", "lu_factor", "cpp_solve"):
    meta = [line for line in torch._C._dispatch_dump_table("tridiag_tutorial::" + name).splitlines()
            if line.startswith("Meta:")]  # private: the computed dispatch table, looked at only
    print(name, "tridiag.cpp" in meta[0])
bands = [torch.empty(shape, dtype=torch.float64, device="meta") for shape in ((3,), (4,), (3,), (4, 1))]
try:
    op.solve(*bands, None, None, "N", "cpp")
    print("solve ran")
except RuntimeError as error:  # the composite kernel's own check, on meta tensors
    print("solve", "CPU tensors only" in str(error), "import" in str(error))
try:
    op.cpp_solve(*bands)
    print("cpp_solve ran")
except NotImplementedError as error:  # no kernel fills Meta: the missing-fake error a pystub extends
    print("cpp_solve", type(error).__name__, "fake impl" in str(error))
"""


def test_the_composite_kernel_fills_meta_so_meta_tensors_reach_its_cpu_check():
    """Sections 14.3, 14.6 and 14.7: with only the library loaded, the CompositeExplicitAutograd
    kernel of solve, solve_kernel and lu_factor also fills the Meta key, so meta (and the
    compiler's fake) tensors run it and fail its CPU check, with no module to import named: a
    pystub's hint could not show there. cpp_solve, with a CPU kernel only, has nothing on Meta."""
    require_cpp()
    run = subprocess.run([sys.executable, "-c", COMPOSITE_ON_META, str(compiled.library_path())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:-1] == [
        "solve True", "solve_kernel True", "lu_factor True", "cpp_solve False",
        "solve True False", "cpp_solve NotImplementedError True"]


def test_the_packages_fake_kernel_replaces_the_composite_one_on_meta():
    """Section 14.7: importing the package registers solve's fake kernel from Python, on Meta."""
    require_cpp()
    meta = [line for line in torch._C._dispatch_dump("tridiag_tutorial::solve").splitlines()
            if line.startswith("Meta:")]
    assert len(meta) == 1 and ".py:" in meta[0], meta


def test_opcheck_misses_a_missing_autograd_kernel_when_the_output_is_a_fresh_tensor():
    """Section 14.3: `opcheck`'s test_autograd_registration fails for an op without an autograd
    kernel only where the kernel's output carries autograd history; a kernel that writes a fresh
    tensor, as the chapter's C++ loop does, passes every test."""
    lib = torch.library.Library("ch14_test_no_autograd", "DEF")
    lib.define("fresh(Tensor x) -> Tensor")
    lib.define("live(Tensor x) -> Tensor")

    def fresh(x):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        with torch.no_grad():
            out.copy_(torch.where(x > 0, x, -0.1 * x))
        return out

    lib.impl("fresh", fresh, "CPU")
    lib.impl("live", lambda x: torch.where(x > 0, x, -0.1 * x), "CPU")
    for name in ("fresh", "live"):
        torch.library.register_fake(f"ch14_test_no_autograd::{name}", lambda x: x.new_empty(x.shape), lib=lib)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered")
        results = {name: torch.library.opcheck(getattr(torch.ops.ch14_test_no_autograd, name), (x,),
                                               raise_exception=False) for name in ("fresh", "live")}
    assert all(result == "SUCCESS" for result in results["fresh"].values()), results["fresh"]
    assert isinstance(results["live"]["test_autograd_registration"], Exception)
    assert "autograd kernel" in str(results["live"]["test_autograd_registration"])
