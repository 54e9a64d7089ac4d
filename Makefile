# Two commands do all set-up: `make test` and `make book`. Both create .venv from the pin file.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: test check lint unit wheel wheel-test nbval book book-check browser-setup floors clean

# The editable install builds the C++ kernel (setup.py: torch's CppExtension, stable ABI) against
# the pinned torch; without build isolation, so that it builds against that torch. Where it
# cannot build, the install goes on and the last line says so.
$(STAMP): requirements-pinned.txt pyproject.toml setup.py $(wildcard tridiag_tutorial/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-pinned.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import tridiag_tutorial as t, tridiag_tutorial.kernels.compiled as c; print('tridiag_tutorial: C++ kernel', 'built' if t.cpp_available() else f'NOT built ({c.BUILD_ERROR}); CPU solves run on LAPACK')"
	touch $(STAMP)

test: lint unit wheel-test nbval

# The unit tests and the chapters run on WORKERS pytest-xdist workers (2: the CI machine's cores;
# WORKERS=0 runs them in one process). `loadgroup` keeps a module whose fixture is expensive on
# one worker, and without the reorder the longest tests start first (tests/conftest.py).
WORKERS ?= 2
export WORKERS  # to .ci/test_wheel.sh and .ci/nbval_from_wheel.sh
XDIST := -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

# The edit-test loop: about 2900 tests in 174 s on two workers, 231 s in one process (pytest's
# figures, the 2-core development machine (AMD EPYC), quiet, venv built). It runs the unit tests less those marked `book` (the
# book build and the rendered HTML) and `slow` (listed by name in tests/conftest.py: torch.compile
# of most graphs and Inductor, every composition on every kernel, the factored solve on every kernel
# and size, gradcheck at larger sizes, in complex128 and on every kernel, opcheck of every
# registered op, the accuracy families, n = 1000 to 1e5 (the partitioned kernel and the C++ pieces
# kernel at their largest sizes), k = 3 columns on batches of the C++ kernel, the benchmark suites and
# experiments, and every test that starts a fresh interpreter or kernel: the fuzz, the install,
# wheel and deployment checks, the chapters run without the C++ kernel, the sixteen-byte lanes of
# the pieces kernel, the route trace).
# Every test module keeps fast tests where it has cheap ones: solve against the dense reference
# (every dtype, batch and column count), gradients and gradcheck, factorization with every
# transpose, validation and edge inputs on every kernel, the pieces kernel against ?gtsv's error up
# to n = 4099, and a few compiled graphs.
# `make unit` (part of `make test`) runs everything, slow and book tests included.
check: $(STAMP)
	$(PY) -m pytest tests -q -m "not book and not slow" $(XDIST)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Every test, slow and book ones included. Installs nothing: the browser tests of
# tests/test_book_html.py use the browser that `make browser-setup` found or installed; without
# one they are skipped with that advice (in CI, CI=true, they fail). The log ends with the 30
# slowest tests, to show where the suite's time goes.
unit: $(STAMP)
	$(PY) -m pytest tests --durations=30 $(XDIST)

# The binary wheel as a release ships it (.ci/build_wheel.sh: pip wheel against the pinned torch,
# then auditwheel repair: a stripped cp311-abi3 manylinux wheel without torch's libraries), built
# again on every run from this checkout.
WHEELHOUSE := build/wheelhouse
wheel: $(STAMP)
	.ci/build_wheel.sh $(WHEELHOUSE)

# That wheel installed with no compiler into fresh venvs with torch 2.13.0 (the pin) and 2.14.1,
# and the library's tests (`make check`'s selection) run against it there (.ci/test_wheel.sh;
# the release workflow runs the same script).
wheel-test: wheel
	.ci/test_wheel.sh $(WHEELHOUSE)/tridiag_tutorial-*.whl 2.13.0 2.14.1

# Strict nbval on every chapter, in a fresh venv with the package installed from that wheel and
# the notebooks copied outside the repository: how a Colab reader meets them.
nbval: wheel
	WHEEL="$$(ls $(WHEELHOUSE)/tridiag_tutorial-*.whl)" .ci/nbval_from_wheel.sh

book: $(STAMP)
	$(PY) .ci/check_notebooks.py notebooks
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# Set-up step, run once per machine before `make unit`/`make test`/`make book-check` (.ci/run
# runs it before `make test`; no test target depends on it): the browser for the book check, a
# Chrome/Chromium on PATH or in $CHROMIUM, else Debian's chromium installed with apt-get (as
# root). The only step that installs a system package. Without a browser the browser tests of
# tests/test_book_html.py are skipped with the reason; in CI (CI=true) this step and they fail.
browser-setup: $(STAMP)
	$(PY) tests/browser_check.py --install

# The built book in headless Chromium: maths typeset, images loaded, no console errors;
# screenshot in _build/screenshot-chapter.png. Needs the browser of `make browser-setup`.
book-check: book
	$(PY) tests/browser_check.py _build/html

# The dependency floors of pyproject.toml, tested: a fresh venv with exactly the oldest versions
# it allows (each `>=` read as `==`), the package installed from this checkout, then `make
# check`'s selection of tests (less the two modules that need the book's tools, yaml and bs4).
# Downloads the packages, so it is not part of `make test`.
FLOORS_VENV ?= build/floors-venv
floors:
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --only-binary :all: \
	    $$($(PYTHON) -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; assert all(d.count(">=") == 1 for d in deps), deps; print(" ".join(d.replace(">=", "==") for d in deps))') \
	    $$(grep -E '^(pytest|ninja|setuptools)==' requirements-pinned.txt)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation .
	$(FLOORS_VENV)/bin/python -m pip list | grep -iE '^(torch|numpy|scipy) '
	$(FLOORS_VENV)/bin/pytest tests -q -p no:cacheprovider -m "not book and not slow" \
	    --ignore=tests/test_book_html.py --ignore=tests/test_publishing.py

clean:
	rm -rf _build $(VENV)
