#!/usr/bin/env bash
# Install the binary wheel (.ci/build_wheel.sh) the way a user installs it from an index, with no
# compiler, into fresh virtual environments with each torch the package supports here (2.13, the
# pin and the floor of the stable ABI it is built for; 2.14.1, a later release), and run the
# library's tests there (`make check`'s selection, less the two modules that need the book's
# tools), from outside the repository so that the installed package is the one tested.
#   .ci/test_wheel.sh WHEEL [TORCH_VERSION ...]     (default: 2.13.0 2.14.1)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
wheel=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
versions=("${@:-2.13.0}")
[ $# -gt 0 ] || versions=(2.13.0 2.14.1)
pins=$(grep -E '^(numpy|scipy|pytest|pytest-xdist|execnet|iniconfig|pluggy|packaging|psutil)==' "$repo/requirements-pinned.txt")

for version in "${versions[@]}"; do
    work=$(mktemp -d "${TMPDIR:-/tmp}/tridiag-wheel-test.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "== torch $version: fresh venv, the wheel from an index, no compiler"
    python3 -m venv "$work/venv"
    py="$work/venv/bin/python"
    # shellcheck disable=SC2086
    "$py" -m pip install --quiet "torch==$version" $pins
    # From a folder used as the only index, with no compiler on hand: a binary wheel needs none.
    mkdir "$work/index" && cp "$wheel" "$work/index/"
    CC=/nonexistent CXX=/nonexistent "$py" -m pip install --quiet --no-index \
        --find-links "$work/index" --no-deps tridiag-tutorial
    cd "$work"
    "$py" - "$version" <<'PY'
import sys, torch, tridiag_tutorial
from tridiag_tutorial.kernels import compiled
where = tridiag_tutorial.__file__
assert "site-packages" in where, where
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert tridiag_tutorial.cpp_available(), compiled.BUILD_ERROR
print(f"torch {torch.__version__}: tridiag_tutorial from {where.rsplit('/', 2)[0]}, C++ kernel loaded")
PY
    "$work/venv/bin/pytest" "$repo/tests" --rootdir "$repo" -c "$repo/pyproject.toml" -q \
        -p no:cacheprovider -m "not book and not slow" -n "${WORKERS:-2}" \
        --ignore="$repo/tests/test_book_html.py" --ignore="$repo/tests/test_publishing.py" \
        --ignore="$repo/tests/browser_check.py"
    cd "$repo"
    rm -rf "$work"
    trap - EXIT
done
