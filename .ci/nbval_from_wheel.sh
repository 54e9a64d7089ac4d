#!/usr/bin/env bash
# Run every chapter notebook the way a Colab reader meets it, under strict nbval:
#   - the package comes from a wheel built from this checkout (or $WHEEL), installed into a fresh
#     virtual environment that holds only the package and what it and the notebooks need (pinned; JAX for
#     chapter 3's side-by-side cells, which the package itself never imports);
#   - the notebooks run from a copy outside the repository, so no repository file is on sys.path.
# Extra arguments go to pytest (e.g. a notebook name: .ci/nbval_from_wheel.sh 03_adjoint.ipynb).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
builder=${BUILD_PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/tridiag-nbval.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ -n "${WHEEL:-}" ]; then  # a wheel already built (make test: the one .ci/build_wheel.sh made)
    mkdir -p "$work/dist" && cp "$WHEEL" "$work/dist/"
else
    "$builder" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$work/dist" "$repo"
fi
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --constraint "$repo/requirements-pinned.txt" \
    torch numpy scipy matplotlib matplotlib-inline ipykernel nbval pytest pytest-xdist jax jaxlib
"$py" -m pip install --quiet --no-deps "$work"/dist/*.whl

cp -r "$repo/notebooks" "$work/notebooks"
cd "$work/notebooks"
unset PYTHONPATH
"$py" - "$repo" <<'PY'
import sys, tridiag_tutorial
from pathlib import Path
repo, where = Path(sys.argv[1]).resolve(), Path(tridiag_tutorial.__file__).resolve()
assert repo not in where.parents, f"tridiag_tutorial imported from the repository: {where}"
assert "site-packages" in where.parts, f"tridiag_tutorial not from the installed wheel: {where}"
print(f"tridiag_tutorial {tridiag_tutorial.__version__} from the wheel: {where.parent}")
import shutil
# The chapters print what the C++ kernel does: where a compiler exists, the wheel must hold it.
if shutil.which("c++") and not tridiag_tutorial.cpp_available():
    from tridiag_tutorial.kernels import compiled
    sys.exit(f"the wheel was built without its C++ kernel although c++ is here: {compiled.BUILD_ERROR}")
print("C++ kernel:", "in the wheel" if tridiag_tutorial.cpp_available() else "not built")
PY
# On WORKERS pytest-xdist workers (2 unless set; 0: one process), each notebook whole on one
# worker (--dist loadfile: its cells share one kernel, in order).
"$py" -m pytest -p no:cacheprovider -n "${WORKERS:-2}" --dist loadfile \
    --nbval --nbval-sanitize-with nbval-sanitize.cfg "${@:-.}"
