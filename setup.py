"""Build the package's C++ operators (tridiag_tutorial/csrc/tridiag.cpp, which includes the headers
beside it) at install time, the way pytorch/extension-cpp ships its extension: torch's CppExtension
and BuildExtension, the CPython limited API (one wheel for every CPython the package supports) and
PyTorch's stable ABI (one build for torch 2.13 and later releases).

The metadata is in pyproject.toml. The extension is built against the torch that is installed:

- ``pip install .`` or ``pip install git+URL`` (build isolation on, what most users type): pip
  builds in an isolated environment that holds only setuptools, but runs it with the target
  environment's own interpreter. This script finds torch in that environment's site-packages
  and builds against it. Where the target environment has no torch at all, it stops before pip
  downloads anything and says to install torch first (a plain ``torch`` requirement would pull a
  CUDA build of several GB onto a CPU-only machine).
- ``pip install --no-build-isolation .``: against the torch of the current environment.
- Other front ends that build in an environment of their own (``python -m build``, uv) see no
  torch there: the package installs without its extension, and says so at the first solve.

Where the extension cannot be built (no torch visible, no C++ compiler, a compile error), the
install goes on without it: the package runs every CPU solve on LAPACK through SciPy,
``tridiag_tutorial.cpp_available()`` is False and ``tridiag_tutorial.kernels.compiled.BUILD_ERROR`` gives
the cause this script recorded in ``tridiag_tutorial/_build_info.json``.

Objects are built in a folder named for what they were built with (torch, Python, compiler and
flags), and the extension is always linked again: a checkout's ``build/`` never hands an object
built for another torch, compiler or flags to a new build.
"""

import hashlib
import importlib.machinery
import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py

NAME = "tridiag_tutorial._C"
SOURCES = ["tridiag_tutorial/csrc/tridiag.cpp"]  # one translation unit: it includes the headers
# The kernel's parts, included by tridiag.cpp: a change to one builds the extension again.
DEPENDS = sorted(f"tridiag_tutorial/csrc/{name}" for name in os.listdir(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "tridiag_tutorial", "csrc"))
    if name.endswith(".h"))
INFO = "_build_info.json"
NOTICE = ("tridiag_tutorial: the C++ kernel was not built ({why}); the package installs without "
          "it and solves on the CPU with LAPACK through SciPy.")
# [book: setup-flags]
CXX_FLAGS = [
    "-O3",  # no -march=native: the wheel must run on any x86-64 (or aarch64) CPU
    "-ffp-contract=off",  # no fused multiply-adds (aarch64 compilers fuse by default)
    "-g0",  # no debug information (Python's own CFLAGS may carry -g)
    # Only the stable ABI of torch 2.13 (the package's floor): [major][minor][patch][tag].
    "-DTORCH_TARGET_VERSION=0x020d000000000000",
]
LINK_FLAGS = ["-s"]  # stripped: no symbol table, which loading does not use
# [/book: setup-flags]
NO_TORCH = ("tridiag-tutorial needs PyTorch installed before it is installed, and this environment "
            "has none. Install torch first, then this package again:\n"
            "  CPU only:  pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
            "  with CUDA: pip install torch   (or the command from https://pytorch.org)\n"
            "(A plain torch requirement would download a CUDA build of several GB. Where torch is "
            "installed where this check cannot see it, on PYTHONPATH or in a --target folder, "
            "install with pip install --no-build-isolation. To install without the C++ kernel "
            "and without this check, set TRIDIAG_TUTORIAL_NO_EXTENSION=1.)")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


# ---------------------------------------------------------------------------------------------
# Where torch is.
# ---------------------------------------------------------------------------------------------
def _target_site_packages() -> list[str]:
    """The site-packages folders of the environment being installed into, where a pip build
    environment hid them: pip runs the build with the target environment's interpreter
    (``sys.prefix`` is that environment) and removes its site-packages from ``sys.path`` with a
    ``sitecustomize``. Empty where they are on ``sys.path`` already (no isolation, or a front end
    that builds in an environment of its own)."""
    try:
        dirs = site.getsitepackages()
    except AttributeError:  # a virtualenv's old site.py
        return []
    on_path = {os.path.normcase(os.path.abspath(p)) for p in sys.path}
    hidden = [d for d in dirs if os.path.isdir(d)
              and os.path.normcase(os.path.abspath(d)) not in on_path]
    if not hidden or len(hidden) != len([d for d in dirs if os.path.isdir(d)]):
        return []
    user = site.getusersitepackages() if sys.prefix == sys.base_prefix else None
    if user and os.path.isdir(user) and os.path.normcase(os.path.abspath(user)) not in on_path:
        hidden.append(user)  # pip install --user (pip's build sets PYTHONNOUSERSITE)
    return hidden


def _find_torch() -> tuple[bool, str]:
    """``(found, how)``: makes ``import torch`` work if torch is installed where the package is
    being installed, and says where it came from."""
    if importlib.machinery.PathFinder.find_spec("torch", sys.path) is not None:
        return True, "the build environment's torch"
    hidden = _target_site_packages()
    for folder in hidden:
        if importlib.machinery.PathFinder.find_spec("torch", [folder]) is not None:
            # all of them, after the build environment's own packages: torch's dependencies may
            # lie in another one (Debian's dist-packages); no .pth file of theirs is run
            sys.path.extend(hidden)
            return True, f"the target environment's torch ({folder})"
    return False, ("pip's isolated build" if hidden else "the build environment")


def _pip_is_building() -> bool:
    """pip sets PIP_BUILD_TRACKER for the builds it runs (isolated or not)."""
    return bool(os.environ.get("PIP_BUILD_TRACKER") or os.environ.get("PIP_REQ_TRACKER"))


# ---------------------------------------------------------------------------------------------
# What the build records for the package (compiled.BUILD_ERROR reads it).
# ---------------------------------------------------------------------------------------------
def _write_info(folder: str, error: str | None, cause: str | None = None, **more) -> None:
    """``cause``: ``"switched_off"``, ``"no_torch"``, ``"no_compiler"``, ``"compile_error"`` or
    ``"other"`` where ``error`` says why the extension was not built; None where it was."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, INFO), "w", encoding="utf-8") as f:
        json.dump({"built": error is None, "error": error, "cause": cause, **more}, f, indent=1)
        f.write("\n")


class _RecordingBuildPy(build_py):
    """build_py that records why there is no extension, where none is built at all."""

    no_extension_because: str | None = None
    cause: str | None = None

    def run(self):
        super().run()
        if self.no_extension_because is not None:
            editable = getattr(self, "editable_mode", False)
            folder = "tridiag_tutorial" if editable else os.path.join(self.build_lib,
                                                                      "tridiag_tutorial")
            if editable:  # a library of an earlier build in the source tree would still load
                for name in os.listdir(folder):
                    if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                        os.remove(os.path.join(folder, name))
            _write_info(folder, self.no_extension_because, self.cause)


def _compiler() -> list[str]:
    """The C++ compiler command the build uses: $CXX, else Python's configured one, else c++."""
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shlex.split(cxx)


def _build_key(torch_version: str, torch_path: str) -> str:
    """A short hash of what an object file depends on besides the source: torch, Python, the
    compiler (its command and the version it prints) and the flags."""
    cxx = _compiler()
    try:
        version = subprocess.run(cxx + ["--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = ["(not runnable)"]
    parts = [torch_version, torch_path, sys.version, sysconfig.get_platform(),
             *(os.environ.get(v, "") for v in ("CC", "CXX", "LDSHARED", "CFLAGS", "CPPFLAGS",
                                               "LDFLAGS", "CXXFLAGS")),
             *cxx, *version, *CXX_FLAGS, *LINK_FLAGS]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _diagnose(ext, err: Exception) -> tuple[str, str]:
    """``(why, cause)`` of a failed build: no compiler, or the compiler's first error line (from a
    syntax-only run of the same command, whose output the build itself sends to pip's log)."""
    cxx = _compiler()
    if shutil.which(cxx[0]) is None:
        return (f"no C++ compiler: {cxx[0]!r} was not found (install g++ or clang++, or set CXX "
                "to one)", "no_compiler")
    other = (f"{type(err).__name__}: {_first_line(err)}", "other")
    includes = [f"-I{d}" for d in ext.include_dirs] + [f"-I{sysconfig.get_paths()['include']}"]
    defines = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in ext.define_macros]
    flags = ext.extra_compile_args.get("cxx", []) if isinstance(ext.extra_compile_args, dict) \
        else list(ext.extra_compile_args)
    try:
        run = subprocess.run(cxx + ["-fsyntax-only", "-std=c++17", *defines, *includes, *flags,
                                    *ext.sources], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as run_err:
        return f"the C++ compiler {cxx[0]!r} could not be run: {_first_line(run_err)}", "no_compiler"
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    if run.returncode != 0 and errors:
        return f"compile error: {_first_line(errors[0])}", "compile_error"
    return other


def _extension():
    """``(ext_modules, cmdclass, options)`` for setup()."""
    if os.environ.get("TRIDIAG_TUTORIAL_NO_EXTENSION") == "1":  # a LAPACK-only install, on purpose
        why = "TRIDIAG_TUTORIAL_NO_EXTENSION=1 was set at install"
        _say(NOTICE.format(why=why))
        _RecordingBuildPy.no_extension_because, _RecordingBuildPy.cause = why, "switched_off"
        return [], {"build_py": _RecordingBuildPy}, {}
    found, where = _find_torch()
    if not found:
        building_sdist = "sdist" in sys.argv
        # pip's opt-in venv isolation builds in a venv of its own ("pip-build-env-..."), from which
        # the target environment cannot be seen: there, no torch here says nothing about it
        own_venv = "pip-build-env-" in sys.prefix
        if _pip_is_building() and not building_sdist and not own_venv:
            # pip would now download torch to satisfy the dependency: several GB of CUDA build
            sys.exit(NO_TORCH)
        why = (f"no torch in {where}, where the package was built (an isolated environment "
               "of its own, as python -m build, uv or pip's venv isolation make, holds only "
               "setuptools): install torch first, then build with pip, or with pip install "
               "--no-build-isolation")
        if not building_sdist:
            _say(NOTICE.format(why=why))
        _RecordingBuildPy.no_extension_because, _RecordingBuildPy.cause = why, "no_torch"
        return [], {"build_py": _RecordingBuildPy}, {}

    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as err:  # a torch that cannot be imported here: install without the kernel
        why = f"torch could not be imported for the build ({type(err).__name__}: {_first_line(err)})"
        _say(NOTICE.format(why=why))
        _RecordingBuildPy.no_extension_because, _RecordingBuildPy.cause = why, "other"
        return [], {"build_py": _RecordingBuildPy}, {}

    key = _build_key(torch.__version__, os.path.dirname(torch.__file__))

    class Build(BuildExtension):
        """torch's BuildExtension, in a build folder of its own per key; a failed build leaves no
        extension (the install goes on) and records why."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(self.build_temp, f"tridiag-{key}")
            self.force = True  # link again: never keep a library from an earlier build

        def _places(self) -> list[str]:
            """Where the library goes: the build's output, and for an editable install the
            source tree, where the package is imported from."""
            target = self.get_ext_fullpath(NAME)
            places = [target]
            if getattr(self, "editable_mode", False):
                places.append(os.path.join("tridiag_tutorial", os.path.basename(target)))
            return places

        recorded = False

        def _record(self, err: Exception | None) -> None:
            self.recorded = True
            why, cause = _diagnose(ext, err) if err is not None else (None, None)
            if err is not None:
                _say(NOTICE.format(why=why))
            for place in self._places():
                if err is not None and os.path.exists(place):
                    os.remove(place)  # a failed build must not leave the last one importable
                _write_info(os.path.dirname(place) or ".", why, cause, torch=torch.__version__,
                            torch_from=where, key=key)

        def run(self):
            try:
                super().run()
            except Exception as err:  # e.g. the compiler check before any extension is built
                if not self.recorded:  # (an editable install's copy of a library that failed)
                    self._record(err)

        def build_extension(self, ext):
            for place in self._places():
                if os.path.exists(place):
                    os.remove(place)
            try:
                super().build_extension(ext)
            except Exception as err:
                self._record(err)
            else:
                self._record(None)

    # [book: setup-extension]
    # py_limited_api=True: torch's BuildExtension then adds -DPy_LIMITED_API itself (CPython 3.10's
    # limited API on torch 2.13), so the module is an abi3 one; the wheel is tagged for the
    # package's oldest Python.
    ext = CppExtension(NAME, SOURCES, depends=DEPENDS, py_limited_api=True,
                       extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS)
    return [ext], {"build_ext": Build}, {"bdist_wheel": {"py_limited_api": "cp311"}}
    # [/book: setup-extension]


ext_modules, cmdclass, options = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
