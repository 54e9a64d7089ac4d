"""The package as pip builds it: the C++ kernel compiled at install on the stable ABI, and an
install that goes on without it where no compiler works."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import require_cpp

REPO = Path(__file__).resolve().parents[1]


def _source_copy(dest: Path) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore), without build
    outputs: what a fresh clone holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        path = REPO / os.fsdecode(name)
        if path.is_file() and not path.is_relative_to(REPO / "notebooks"):
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return dest


def _wheel_without_kernel(tmp_path, env: dict) -> tuple[list[str], str]:
    """Build the package's wheel from a clean copy with ``env`` added to the environment (no
    build isolation), check that it holds no library, and extract it into ``tmp_path/site``:
    ``(its file names, the build's output)``."""
    src = _source_copy(tmp_path / "src")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(src)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert not [n for n in names if n.endswith((".so", ".pyd"))], names
        z.extractall(tmp_path / "site")
    return names, build.stdout + build.stderr


def _last_line_from_the_wheel(tmp_path, script: str) -> str:
    """Run ``script`` with the package extracted into ``tmp_path/site``: its last printed line.
    -S: no site processing, so the .pth hooks of an editable install of the repository (make
    test's) cannot map the package back to the source tree; the environment's site-packages come
    after the extracted wheel on the path."""
    path = os.pathsep.join([str(tmp_path / "site"), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    run = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_without_a_compiler_the_wheel_installs_and_runs_on_lapack(tmp_path):
    _, output = _wheel_without_kernel(tmp_path, {"CC": "false", "CXX": "false",
                                                 "LDSHARED": "false"})
    notices = [line.strip() for line in output.splitlines()
               if "tridiag_tutorial: the C++ kernel was not built" in line]
    assert notices, "no line at install says that the C++ kernel was not built"
    assert "LAPACK" in notices[0]
    script = """
import torch, tridiag_tutorial as t
from tridiag_tutorial.kernels import compiled
assert "site" in t.__file__, t.__file__
assert not t.cpp_available() and compiled.BUILD_ERROR
l, d, u = torch.ones(2, 4, dtype=torch.float64), torch.full((2, 5), 3.0, dtype=torch.float64), \
    torch.ones(2, 4, dtype=torch.float64)
b = torch.arange(10.0, dtype=torch.float64).reshape(2, 5)
x = t.tridiagonal_solve(l, d, u, b)
err = (t.dense_solve(l, d, u, b) - x).abs().max().item()
try:
    t.tridiagonal_solve(l, d, u, b, driver="cpp")
except RuntimeError as e:
    message = str(e)
print(f"{err:.0e}|{message}")
"""
    err, message = _last_line_from_the_wheel(tmp_path, script).split("|", 1)
    assert float(err) < 1e-12
    assert "not built when the package was installed" in message and "driver='lapack'" in message


def test_the_extension_uses_only_the_stable_abi():
    """The built library is a limited-API (abi3) module, and every symbol it takes from torch is
    a C function of the stable ABI's shim (``aoti_torch_*``, ``torch_*``): none of libtorch's or
    c10's C++ symbols, which change between releases. So one build loads in later torch releases."""
    require_cpp()
    from tridiag_tutorial.kernels import compiled

    path = compiled.library_path()
    assert path.endswith(".abi3.so"), path
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(["nm", "-D", "--undefined-only", "-C", path], capture_output=True,
                         text=True, check=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
    torch_cpp = [s for s in symbols if s.startswith(("c10::", "at::", "torch::", "caffe2::"))]
    assert torch_cpp == [], torch_cpp[:10]
    shim = [s for s in symbols if s.startswith(("aoti_torch_", "torch_"))]
    assert shim, "the library calls no stable-ABI function: is it the extension?"


@pytest.mark.slow
def test_a_deliberate_lapack_only_install_does_not_warn(tmp_path):
    """TRIDIAG_TUTORIAL_NO_EXTENSION=1 at install: no kernel, on purpose, so no warning at the
    first solve, and driver="cpp" says it was switched off instead of how to build it."""
    _wheel_without_kernel(tmp_path, {"TRIDIAG_TUTORIAL_NO_EXTENSION": "1"})
    script = """
import warnings, torch, tridiag_tutorial as t
assert "site" in t.__file__ and not t.cpp_available()
l, d = torch.ones(4, dtype=torch.float64), torch.full((5,), 3.0, dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t.tridiagonal_solve(l, d, l, torch.ones(5, dtype=torch.float64))
try:
    t.tridiagonal_solve(l, d, l, torch.ones(5, dtype=torch.float64), driver="cpp")
except RuntimeError as e:
    message = str(e)
print(f"{len(caught)}|{message}")
"""
    count, message = _last_line_from_the_wheel(tmp_path, script).split("|", 1)
    assert count == "0"
    assert "switched off (TRIDIAG_TUTORIAL_NO_EXTENSION=1 was set at install" in message
    assert "pip install" not in message
