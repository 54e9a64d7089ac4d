"""Build the package's C++ operators (tridiag_tutorial/csrc/tridiag.cpp) at install time, the way
pytorch/extension-cpp ships its extension: torch's CppExtension and BuildExtension, the CPython
limited API (one wheel for every CPython the package supports) and PyTorch's stable ABI (one build for torch
2.13 and later releases).

The metadata is in pyproject.toml. Build with torch already installed and without build
isolation (``pip install --no-build-isolation .``): an isolated build environment holds only
setuptools (pyproject.toml asks for no torch), so it would find no torch and install the package
without its extension. Where the extension cannot be built (no torch at build time, no C++
compiler, a compile error), the install goes on without it: the package then runs every CPU solve
on LAPACK through SciPy, and ``tridiag_tutorial.cpp_available()`` is False.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

NAME = "tridiag_tutorial._C"
SOURCES = ["tridiag_tutorial/csrc/tridiag.cpp"]
NOTICE = ("tridiag_tutorial: the C++ kernel was not built ({why}); the package installs without "
          "it and solves on the CPU with LAPACK through SciPy.")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _OptionalBuild(build_ext):
    """Build the extension where possible; otherwise print one line and install without it."""

    def run(self):
        try:
            super().run()
        except Exception as err:  # no compiler, or a compile error: the package works without it
            _say(NOTICE.format(why=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:
            _say(NOTICE.format(why=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))


def _extension():
    """``(ext_modules, cmdclass, options)`` for setup(); no extension where torch is missing."""
    if os.environ.get("TRIDIAG_TUTORIAL_NO_EXTENSION") == "1":  # to test the LAPACK-only install
        _say(NOTICE.format(why="TRIDIAG_TUTORIAL_NO_EXTENSION=1"))
        return [], {}, {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say(NOTICE.format(why="torch is not installed in the build environment; install torch "
                               "first and build with pip install --no-build-isolation"))
        return [], {}, {}

    class Build(_OptionalBuild, BuildExtension):
        pass

    # py_limited_api=True: torch's BuildExtension then adds -DPy_LIMITED_API itself (CPython 3.10's
    # limited API on torch 2.13), so the module is an abi3 one; the wheel is tagged for the
    # package's oldest Python.
    ext = CppExtension(
        NAME, SOURCES, py_limited_api=True,
        extra_compile_args={"cxx": [
            "-O3",  # no -march=native: the wheel must run on any x86-64 (or aarch64) CPU
            "-ffp-contract=off",  # no fused multiply-adds (aarch64 compilers fuse by default)
            # Only the stable ABI of torch 2.13 (the package's floor): [major][minor][patch][tag].
            "-DTORCH_TARGET_VERSION=0x020d000000000000",
        ]})
    return [ext], {"build_ext": Build}, {"bdist_wheel": {"py_limited_api": "cp311"}}


ext_modules, cmdclass, options = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
