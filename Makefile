# Two commands do all set-up: `make test` and `make book`. Both create .venv from the pin file.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: test check lint unit nbval book book-check clean

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

# The edit-test loop: the library's unit tests alone (no book build, no notebooks), under a minute.
check: $(STAMP)
	$(PY) -m pytest tests -q -m "not book"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

unit: $(STAMP)
	$(PY) -m pytest tests

# Strict nbval on every chapter, in a fresh venv with the package installed from a built wheel
# and the notebooks copied outside the repository: how a Colab reader meets them.
nbval: $(STAMP)
	.ci/nbval_from_wheel.sh

book: $(STAMP)
	$(PY) .ci/check_notebooks.py notebooks
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# The built book in headless Chromium: maths typeset, images loaded, no console errors
# (installs Debian's chromium when run as root); screenshot in _build/screenshot-chapter.png.
book-check: book
	$(PY) tests/browser_check.py _build/html

clean:
	rm -rf _build $(VENV)
