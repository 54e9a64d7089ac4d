# Two commands do all set-up: `make test` and `make book`. Both create .venv from the pin file.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: test check lint unit nbval book book-check browser-setup floors clean

# The editable install builds the C++ kernel (setup.py: torch's CppExtension, stable ABI) against
# the pinned torch; without build isolation, so that it builds against that torch. Where it
# cannot build, the install goes on and the last line says so.
$(STAMP): requirements-pinned.txt pyproject.toml setup.py tridiag_tutorial/csrc/tridiag.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-pinned.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import tridiag_tutorial as t, tridiag_tutorial.compiled as c; print('tridiag_tutorial: C++ kernel', 'built' if t.cpp_available() else f'NOT built ({c.BUILD_ERROR}); CPU solves run on LAPACK')"
	touch $(STAMP)

test: lint unit nbval

# The edit-test loop, under a minute (25 to 40 s on a 2-core machine): the unit tests less those
# marked `book` (the book build and the rendered HTML) and `slow` (listed by name in
# tests/conftest.py: torch.compile of most graphs and Inductor, every composition on every kernel,
# gradcheck at larger sizes and on every kernel, opcheck of every registered op, the accuracy
# families, n = 1000 and n = 1e5 partitioned cases, the benchmark suites, and every test that
# starts a fresh interpreter: the fuzz, the install and deployment checks, the route trace).
# Every test module keeps its fast tests: solve against the dense reference, gradients,
# factorization, validation and edge inputs on every kernel, and a few compiled graphs.
# `make unit` (part of `make test`) runs everything, slow and book tests included.
check: $(STAMP)
	$(PY) -m pytest tests -q -m "not book and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

unit: $(STAMP) browser-setup
	$(PY) -m pytest tests

# Strict nbval on every chapter, in a fresh venv with the package installed from a built wheel
# and the notebooks copied outside the repository: how a Colab reader meets them.
nbval: $(STAMP)
	.ci/nbval_from_wheel.sh

book: $(STAMP)
	$(PY) .ci/check_notebooks.py notebooks
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# The browser for the book check (`unit` and `book-check` need it): a Chrome/Chromium on PATH or
# in $CHROMIUM, else Debian's chromium installed with apt-get (as root). The tests never install
# it: without a browser the browser tests of tests/test_book_html.py are skipped with the reason,
# and in CI (CI=true) both this step and those tests fail.
browser-setup: $(STAMP)
	$(PY) tests/browser_check.py --install

# The built book in headless Chromium: maths typeset, images loaded, no console errors;
# screenshot in _build/screenshot-chapter.png.
book-check: book browser-setup
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
