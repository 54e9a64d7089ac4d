"""The package installed the way users install it, in fresh virtual environments with the pinned
CPU torch: ``pip install <folder>`` with build isolation on builds the C++ kernel against the
installed torch; where it cannot (no compiler), the first solve warns once with the command that
repairs it, and that command builds the kernel without touching torch; without torch the install
stops before pip downloads one; the cause of a failed build is recorded; the setuptools floor of
pyproject.toml is the one the build needs; a build never reuses objects built with another
compiler.

Each test creates its environments and builds the kernel (about a minute a build on two cores).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from test_wheel import _source_copy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PINS = dict(line.strip().split("==") for line in (REPO / "requirements-pinned.txt").read_text()
            .splitlines() if "==" in line and not line.startswith("#"))
TORCH = f"torch=={PINS['torch']}"
FLOOR = next(r for r in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
             ["requires"] if r.startswith("setuptools"))


def _run(cmd, env=None, timeout=900, check=True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**_clean_env(), **(env or {})}, **kw)
    if check:
        assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
    return done


def _clean_env() -> dict:
    """This environment less what would tie a child pip or Python to this test's venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "CC", "CXX", "LDSHARED")
           and not k.startswith("PIP_BUILD") and k != "PIP_REQ_TRACKER"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _venv(path: Path, *packages: str) -> Path:
    """A fresh venv at ``path`` with ``packages`` installed; its python."""
    _run([_base_python(), "-m", "venv", str(path)])
    py = path / "bin" / "python"
    if packages:
        _run([str(py), "-m", "pip", "install", "--quiet", *packages])
    return py


def _base_python() -> str:
    """The interpreter this test's venv was made from (a venv made from a venv's python would
    still be fresh, but the base one is what a user types)."""
    return shutil.which("python3") or sys.executable


def _torch_state(py: Path) -> tuple[str, str]:
    """torch's version and a hash of its RECORD (every file pip installed for it, with hashes)."""
    out = _run([str(py), "-c", "from importlib import metadata as m; d = m.distribution('torch');"
                " print(d.version); print(d.read_text('RECORD'))"], cwd="/").stdout
    version, record = out.split("\n", 1)
    return version, hashlib.sha256(record.encode()).hexdigest()


PROBE = """
import json, warnings
import torch, tridiag_tutorial as t
from tridiag_tutorial.kernels import compiled
l, d = torch.ones(4, dtype=torch.float64), torch.full((5,), 3.0, dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        x = t.tridiagonal_solve(l, d, l, torch.ones(5, dtype=torch.float64))
print(json.dumps({"cpp": t.cpp_available(), "error": compiled.BUILD_ERROR,
                  "file": t.__file__, "residual": float((t.to_dense(l, d, l) @ x - 1).abs().max()),
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
"""


def _probe(py: Path) -> dict:
    out = _run([str(py), "-c", PROBE], cwd="/").stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert "site-packages" in report["file"], report["file"]
    assert report["residual"] < 1e-12
    return report


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The repository's files, as a fresh clone holds them."""
    return _source_copy(tmp_path_factory.mktemp("clone") / "src")


def test_the_ordinary_command_builds_the_kernel_and_a_failed_build_says_how_to_repair_it(
        source, tmp_path):
    py = _venv(tmp_path / "venv", TORCH)
    torch_before = _torch_state(py)

    # 1. pip install <folder>, build isolation on: the kernel is built against the installed torch
    _run([str(py), "-m", "pip", "install", "--quiet", str(source)])
    report = _probe(py)
    assert report["cpp"] is True, report["error"]
    assert report["warnings"] == []
    assert _torch_state(py) == torch_before

    # 2. the same without a compiler: it installs, and the first solve warns once with the cause
    # and the command that repairs it
    _run([str(py), "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
          str(source)], env={"CC": "/nonexistent/cc", "CXX": "/nonexistent/c++"})
    report = _probe(py)
    assert report["cpp"] is False
    assert report["error"].startswith("no C++ compiler: '/nonexistent/c++' was not found")
    assert [category for category, _ in report["warnings"]] == ["UserWarning"]
    message = report["warnings"][0][1]
    assert report["error"] in message and "install a C++ compiler" in message
    command = re.search(r"then run (.+?) , then restart Python", message).group(1)
    assert "--no-deps" in command and "--no-cache-dir" in command and str(source) in command

    # 3. the command, as printed: the kernel is there, torch is as it was
    _run(command, shell=True)
    report = _probe(py)
    assert report["cpp"] is True, report["error"]
    assert report["warnings"] == []
    assert _torch_state(py) == torch_before

    # 4. pip 26.3, building in a venv of its own (its opt-in venv isolation, which hides
    # the target environment): the install goes through, and the warning's command builds here
    _run([str(py), "-m", "pip", "install", "--quiet", "pip==26.3"])
    _run([str(py), "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
          "--use-feature", "venv-isolation", str(source)])
    report = _probe(py)
    assert report["cpp"] is False and report["error"].startswith("no torch in the build environment")
    message = report["warnings"][0][1]
    command = re.search(r"To build it, run (.+?) , then restart Python", message).group(1)
    assert "'setuptools>=77' && " in command and " --no-build-isolation " in command
    _run(command, shell=True)  # builds here, in this environment
    report = _probe(py)
    assert report["cpp"] is True, report["error"]
    assert _torch_state(py) == torch_before


def test_without_torch_the_install_stops_before_downloading_one(source, tmp_path):
    py = _venv(tmp_path / "venv")
    done = _run([str(py), "-m", "pip", "install", str(source)], check=False, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "needs PyTorch installed before it is installed" in output
    assert "--index-url https://download.pytorch.org/whl/cpu" in output
    assert not re.search(r"(Collecting|Downloading|Processing) .*torch", output), output[-3000:]
    listed = _run([str(py), "-m", "pip", "list", "--format=json"]).stdout
    assert "torch" not in {p["name"] for p in json.loads(listed)}


def test_a_front_end_without_torch_records_why(source, tmp_path):
    """A build in an environment without torch that is not pip's (as ``python -m build`` or uv
    run one): the wheel holds no kernel and says why, and the repair builds here, in this
    environment, without isolation."""
    py = _venv(tmp_path / "venv", FLOOR)
    src = shutil.copytree(source, tmp_path / "src", ignore=shutil.ignore_patterns("build"))
    _run([str(py), "setup.py", "-q", "bdist_wheel", "-d", str(tmp_path / "dist")], cwd=src)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]
        info = json.loads(z.read("tridiag_tutorial/_build_info.json"))
    assert info["built"] is False and info["cause"] == "no_torch"
    assert info["error"].startswith("no torch in the build environment")


def test_a_compile_error_is_named_and_objects_are_not_reused(source, tmp_path):
    """In one checkout with its build/ folder: a build with the setuptools floor; a build with no
    compiler fails (it used to reuse the last object file and succeed); a compile error is
    recorded by its first line; and one setuptools release below the floor cannot build the
    package at all (the floor is what the build needs)."""
    major, minor = (int(v) for v in (FLOOR.split(">=")[1] + ".0").split(".")[:2])
    # the floor's release series (77.0.0 was withdrawn: 77.0.x takes the newest of it)
    py = _venv(tmp_path / "venv", TORCH, f"{FLOOR},<{major}.{minor + 1}")
    src = Path(shutil.copytree(source, tmp_path / "src", ignore=shutil.ignore_patterns("build")))
    dist = tmp_path / "dist"

    def wheel(env=None) -> dict:
        shutil.rmtree(dist, ignore_errors=True)
        _run([str(py), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
              "--wheel-dir", str(dist), str(src)], env=env)
        (built,) = dist.glob("*.whl")
        with zipfile.ZipFile(built) as z:
            info = json.loads(z.read("tridiag_tutorial/_build_info.json"))
            info["libraries"] = [n for n in z.namelist() if n.endswith(".so")]
            info["sources"] = sorted(n for n in z.namelist() if "/csrc/" in n)
            info["data"] = sorted(n for n in z.namelist() if n.endswith(".json")
                                  and not n.endswith("_build_info.json"))
        return info

    info = wheel()
    assert info["built"] is True and info["libraries"] == ["tridiag_tutorial/_C.abi3.so"]
    # the C++ source travels with the wheel, every file of it (chapter 14 reads it)
    assert info["sources"] == sorted(f"tridiag_tutorial/csrc/{f.name}"
                                     for f in (src / "tridiag_tutorial" / "csrc").iterdir()
                                     if f.suffix in (".cpp", ".h")), info["sources"]
    # and the reference timings chapter 12 reads where no repository is beside it (Colab)
    assert info["data"] == ["tridiag_tutorial/bench/reference_rows.json"], info["data"]
    info = wheel({"CC": "/nonexistent/cc", "CXX": "/nonexistent/c++"})
    assert info["built"] is False and info["libraries"] == [] and info["cause"] == "no_compiler"
    keys = sorted(p.name for p in (src / "build").glob("temp.*/tridiag-*"))
    assert len(keys) == 2, keys  # a build folder per compiler

    cpp = src / "tridiag_tutorial" / "csrc" / "tridiag.cpp"
    cpp.write_text('#error "a deliberate error for the test"\n' + cpp.read_text())
    info = wheel()
    assert info["built"] is False and info["libraries"] == [] and info["cause"] == "compile_error"
    assert info["error"].startswith("compile error: ") and "a deliberate error for the test" in (
        info["error"])

    _run([str(py), "-m", "pip", "install", "--quiet", f"setuptools<{major}.{minor}"])
    done = _run([str(py), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--wheel-dir", str(dist), str(src)], check=False)
    assert done.returncode != 0
    assert "project.license" in done.stdout + done.stderr
