"""The publishing set-up agrees with itself: book config, toc, environments, CI and notebooks.

Fast, static checks (no build): tests/test_book_html.py builds the book and checks the result.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((REPO / "_config.yml").read_text())
TOC = yaml.safe_load((REPO / "_toc.yml").read_text())
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))

COLAB = "https://colab.research.google.com"
# Direct requirements that are not in pyproject.toml but that the notebooks (nbval compares the
# `<Figure size ...>` text of matplotlib-inline), the book and its tests import.
EXTRA_DIRECT = {
    "matplotlib-inline", "ipython", "myst-nb", "myst-parser", "sphinx", "sphinx-book-theme",
    "sphinxcontrib-bibtex", "sphinx-mathjax-offline", "playwright", "pyyaml", "beautifulsoup4",
}
# conda-forge name -> PyPI name, where they differ.
CONDA_TO_PYPI = {"pytorch-cpu": "torch", "pytorch": "torch"}


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def repository() -> tuple[str, str, str, str]:
    """``(url, org, repo, branch)`` from _config.yml."""
    url = CONFIG["repository"]["url"].rstrip("/")
    match = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+)", url)
    assert match, f"repository.url must be https://github.com/ORG/REPO, got {url!r}"
    return url, match[1], match[2], CONFIG["repository"]["branch"]


def workflow(name: str) -> dict:
    path = REPO / ".github" / "workflows" / name
    assert path.exists(), f"missing {path.relative_to(REPO)}"
    wf = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as True.
    wf["on"] = wf.pop(True, wf.get("on"))
    return wf


def steps(wf: dict) -> list[dict]:
    return [step for job in wf["jobs"].values() for step in job.get("steps", [])]


def runs(wf: dict) -> list[str]:
    return [line.strip() for step in steps(wf) for line in step.get("run", "").splitlines()]


def uses(wf: dict) -> list[str]:
    return [step["uses"].split("@")[0] for step in steps(wf) if "uses" in step]


# ----------------------------------------------------------------------------------------------
# _config.yml and _toc.yml
# ----------------------------------------------------------------------------------------------
def test_config_is_valid_for_jupyter_book():
    from jupyter_book.config import validate_yaml

    validate_yaml(CONFIG, raise_on_errors=True)


def test_config_promises():
    url, _, _, branch = repository()
    assert branch == "main", "repository.branch defaults to master in Jupyter Book: set it"
    assert CONFIG["only_build_toc_files"] is True
    assert CONFIG["execute"]["execute_notebooks"] == "off", (
        "the book renders committed outputs; nbval in `make test` proves them current")
    assert CONFIG["launch_buttons"]["colab_url"] == COLAB
    assert CONFIG["html"]["use_repository_button"] and CONFIG["html"]["use_issues_button"]
    sphinx = CONFIG["sphinx"]
    assert sphinx["recursive_update"] is True, (
        "without recursive_update, sphinx.config replaces generated options such as launch buttons")
    for ext in ("sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx-mathjax-offline"):
        assert ext in sphinx["extra_extensions"]
    for bib in CONFIG["bibtex_bibfiles"]:
        assert (REPO / bib).is_file(), bib
    for pattern in (".venv", "_build", "tests"):
        assert pattern in CONFIG["exclude_patterns"]
    for ext in ("amsmath", "dollarmath", "colon_fence"):
        assert ext in CONFIG["parse"]["myst_enable_extensions"]
    for _, path in (sphinx.get("local_extensions") or {}).items():
        assert (REPO / path).is_dir(), path


def toc_files() -> list[str]:
    files = [TOC["root"]]
    for part in TOC["parts"]:
        files += [entry["file"] for entry in part["chapters"]]
    return files


def resolve(docname: str) -> Path | None:
    for suffix in ("", ".md", ".ipynb"):
        path = REPO / (docname + suffix)
        if path.is_file():
            return path
    return None


def test_toc_lists_existing_files_once():
    assert TOC["format"] == "jb-book"
    files = toc_files()
    assert len(files) == len(set(files)), "a page is listed twice in _toc.yml"
    missing = [f for f in files if resolve(f) is None]
    assert not missing, f"_toc.yml lists files that do not exist: {missing}"


# The book's parts, in reading order; every chapter notebook sits in one of them.
CHAPTER_PARTS = ["Foundations", "Building the operator", "Using it", "Engineering"]


def test_toc_structure():
    captions = [part["caption"] for part in TOC["parts"]]
    assert captions == ["Getting started", *CHAPTER_PARTS, "Reference"]
    assert TOC["root"] == "book/intro"
    parts = {part["caption"]: [e["file"] for e in part["chapters"]] for part in TOC["parts"]}
    assert parts["Getting started"] == ["book/setup"]
    assert parts["Reference"] == ["book/notation", "book/api", "book/bibliography",
                                  "book/contributing"]


def committed_notebooks() -> list[Path]:
    """Chapter notebooks known to git (all of them where git is unavailable).

    A notebook still being written (untracked) need not be in the book yet; a committed one must.
    """
    try:
        listed = subprocess.run(["git", "ls-files", "notebooks"], cwd=REPO, capture_output=True,
                                text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return NOTEBOOKS
    tracked = {REPO / name for name in listed}
    return [nb for nb in NOTEBOOKS if nb in tracked]


def test_every_chapter_notebook_is_in_the_toc_in_order():
    listed = [str(Path(f).with_suffix("")) if f.endswith(".ipynb") else f
              for part in TOC["parts"] if part["caption"] in CHAPTER_PARTS
              for f in (e["file"] for e in part["chapters"])]
    assert listed, "the chapter parts of _toc.yml are empty"
    assert all(f.startswith("notebooks/") for f in listed), listed
    numbers = [int(Path(f).name[:2]) for f in listed]
    assert numbers == list(range(1, len(numbers) + 1)), (
        f"_toc.yml must list the chapters in order, 01, 02, ...: {listed}")
    missing = [f"notebooks/{nb.stem}" for nb in committed_notebooks()
               if f"notebooks/{nb.stem}" not in listed]
    assert not missing, (f"committed chapter notebooks missing from _toc.yml: {missing} "
                         "(add a line `- file: notebooks/<name>` under its part)")


# ----------------------------------------------------------------------------------------------
# Pin file and environment.yml
# ----------------------------------------------------------------------------------------------
def pins() -> dict[str, str]:
    found = {}
    for line in (REPO / "requirements-pinned.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;=]+)", line)
        assert match, f"requirements-pinned.txt: not an exact `name==version` pin: {line!r}"
        name = canonical(match[1])
        assert name not in found, f"requirements-pinned.txt pins {name} twice"
        found[name] = match[2]
    return found


def test_pin_file_is_sorted_exact_pins():
    lines = [l for l in (REPO / "requirements-pinned.txt").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines == sorted(lines, key=str.upper), "keep requirements-pinned.txt sorted (sort -f)"
    pins()


def environment() -> tuple[dict[str, str], str]:
    """``({pypi name: version}, python version)`` from environment.yml."""
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert "conda-forge" in env["channels"]
    packages, python = {}, None

    def add(spec: str, conda: bool):
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(==|=)\s*([^\s=]+)\s*", spec)
        assert match, f"environment.yml: pin every package to one version: {spec!r}"
        name = canonical(match[1])
        name = CONDA_TO_PYPI.get(name, name) if conda else name
        assert name not in packages, f"environment.yml lists {name} twice"
        packages[name] = match[3]

    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for spec in dep["pip"]:
                add(spec, conda=False)
        elif dep.strip() == "pip":
            continue
        elif dep.startswith("python"):
            python = dep.split("=")[-1]
        else:
            add(dep, conda=True)
    return packages, python


def direct_requirements() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        specs += group
    names = {canonical(re.match(r"[A-Za-z0-9._-]+", spec)[0]) for spec in specs}
    return names | {canonical(n) for n in EXTRA_DIRECT}


def test_environment_yml_matches_pin_file():
    pinned = pins()
    packages, python = environment()
    assert python == "3.11", "environment.yml: python=3.11, as in CI"
    wrong = {name: (version, pinned.get(name)) for name, version in packages.items()
             if pinned.get(name) != version}
    assert not wrong, (f"environment.yml disagrees with requirements-pinned.txt "
                       f"(name: (environment.yml, pin file)): {wrong}")
    missing = direct_requirements() - packages.keys()
    assert not missing, f"direct requirements missing from environment.yml: {sorted(missing)}"


def test_direct_requirements_are_pinned():
    missing = direct_requirements() - pins().keys()
    assert not missing, f"direct requirements missing from requirements-pinned.txt: {sorted(missing)}"


# ----------------------------------------------------------------------------------------------
# CI workflows, Makefile and README
# ----------------------------------------------------------------------------------------------
def test_test_workflow():
    wf = workflow("test.yml")
    assert {"push", "pull_request"} <= set(wf["on"]), wf["on"]
    for job in wf["jobs"].values():
        assert job["runs-on"].startswith("ubuntu")
    assert "actions/checkout" in uses(wf)
    pythons = [str(s["with"]["python-version"]) for s in steps(wf)
               if s.get("uses", "").startswith("actions/setup-python")]
    assert pythons == ["3.11"], pythons
    assert "make test" in runs(wf)


def test_book_workflow():
    wf = workflow("book.yml")
    assert wf["on"]["push"]["branches"] == ["main"]
    perms = wf.get("permissions", {})
    assert perms.get("pages") == "write" and perms.get("id-token") == "write", perms
    build, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    assert "make book" in runs({"jobs": {"build": build}})
    upload = [s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact")]
    assert len(upload) == 1 and upload[0]["with"]["path"] == "_build/html"
    assert deploy["needs"] == "build" or "build" in deploy["needs"]
    assert deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages") for s in deploy["steps"])
    pythons = [str(s["with"]["python-version"]) for s in build["steps"]
               if s.get("uses", "").startswith("actions/setup-python")]
    assert pythons == ["3.11"], pythons


def test_release_workflow():
    """Binary wheels as a compiled extension ships them: manylinux abi3 wheels repaired by
    auditwheel without torch's libraries, built against torch 2.13 (the floor of the stable ABI),
    tested in fresh environments with torch 2.13 and 2.14.1 by the script `make test` runs too,
    and published only after those tests."""
    wf = workflow("release.yml")
    jobs = wf["jobs"]
    build = next(s for s in jobs["wheels"]["steps"] if s.get("uses", "").startswith(
        "pypa/cibuildwheel"))
    env = build["env"]
    assert env["CIBW_BUILD"].startswith("cp311-manylinux")
    assert "torch==2.13.0" in env["CIBW_BEFORE_BUILD"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in env["CIBW_BEFORE_BUILD"]
    repair = env["CIBW_REPAIR_WHEEL_COMMAND_LINUX"]
    assert repair.startswith("auditwheel repair") and "--exclude 'libtorch*.so'" in repair
    assert ".ci/test_wheel.sh wheelhouse/*.whl 2.13.0 2.14.1" in runs({"jobs": {"t": jobs["test"]}})
    assert set(jobs["publish"]["needs"]) >= {"test"}
    repair_here = (REPO / ".ci" / "build_wheel.sh").read_text()
    assert "auditwheel\" repair --exclude 'libtorch*.so' --exclude 'libc10*.so'" in repair_here
    assert "--exclude 'libc10*.so'" in repair


def test_makefile_and_readme_name_the_same_commands():
    makefile = (REPO / "Makefile").read_text()
    for target in ("test", "book"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no `{target}` target"
    assert "jupyter-book build . -W -n --keep-going" in makefile
    readme = REPO / "README.md"
    if readme.exists():
        text = readme.read_text()
        for command in ("make test", "make book"):
            assert command in text, f"README.md does not mention `{command}`"


# ----------------------------------------------------------------------------------------------
# Notebooks: Colab badge and the Colab set-up cell
# ----------------------------------------------------------------------------------------------
def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_colab_badge_points_at_this_notebook(path):
    url, org, repo, branch = repository()
    expected = f"{COLAB}/github/{org}/{repo}/blob/{branch}/notebooks/{path.name}"
    nb = json.loads(path.read_text())
    markdown = [source(c) for c in nb["cells"] if c["cell_type"] == "markdown"]
    links = [u for text in markdown for u in re.findall(rf"{re.escape(COLAB)}/github/[^\s)\"'>]+", text)]
    assert expected in links[:1], f"{path.name}: the first Colab link must be {expected}, found {links}"
    assert set(links) == {expected}, f"{path.name}: every Colab link must open this notebook: {links}"
    badge = re.search(r"\[!\[[^\]]*\]\((https://colab\.research\.google\.com/assets/colab-badge\.svg)\)\]\(",
                      markdown[0])
    assert badge, f"{path.name}: the first cell must show the Colab badge"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_colab_setup_cell(path):
    url, _, _, branch = repository()
    nb = json.loads(path.read_text())
    first = source(next(c for c in nb["cells"] if c["cell_type"] == "code"))
    lines = first.splitlines()
    guard = [i for i, line in enumerate(lines)
             if re.fullmatch(r"if\s+['\"]google\.colab['\"]\s+in\s+sys\.modules\s*:.*", line.strip())]
    assert guard, f"{path.name}: the first code cell must test `\"google.colab\" in sys.modules`"
    assert re.search(r"^import sys\b", first, re.M), f"{path.name}: the set-up cell imports sys"
    installs = [i for i, line in enumerate(lines) if re.search(r"\bpip\b.*\binstall\b", line)]
    assert installs, f"{path.name}: the set-up cell installs nothing"
    indent = len(lines[guard[0]]) - len(lines[guard[0]].lstrip())
    for i in installs:
        line = lines[i]
        assert i > guard[0] and len(line) - len(line.lstrip()) > indent, (
            f"{path.name}: install outside the Colab guard: {line.strip()!r}")
        unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "", line)
        assert not re.search(r"[<>]", unquoted), (
            f"{path.name}: quote pip specifiers (an unquoted > or < is a shell redirect): {line.strip()!r}")
    for i in installs:
        # The ordinary command: pip's isolated build finds Colab's own torch and builds the C++
        # kernel against it (setup.py); --no-build-isolation would build with Colab's setuptools,
        # which may be older than the floor the build needs (pyproject.toml's build-system).
        assert "--no-build-isolation" not in lines[i], (
            f"{path.name}: install without --no-build-isolation: {lines[i].strip()!r}")
    targets = re.findall(r"git\+(https://github\.com/[^\s@\"']+?)(?:\.git)?@([^\s\"'#]+)", first)
    assert targets, f"{path.name}: the set-up cell must install from the repository (git+URL@branch)"
    for target_url, ref in targets:
        assert (target_url, ref) == (url, branch), (
            f"{path.name}: installs from {target_url}@{ref}, _config.yml says {url}@{branch}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_cell_installs_torch(path):
    """Colab has its own torch; reinstalling it there breaks Colab's other packages."""
    nb = json.loads(path.read_text())
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        for line in source(cell).splitlines():
            if re.search(r"\b(pip|conda|mamba|uv)\b.*\binstall\b", line):
                rest = re.sub(r"tridiag[-_]tutorial", "", line)
                assert not re.search(r"\b(py)?torch\b", rest), (
                    f"{path.name}: cell {index} installs torch: {line.strip()!r}")


# ----------------------------------------------------------------------------------------------
# API reference covers the package
# ----------------------------------------------------------------------------------------------
def test_api_page_documents_every_module():
    api = (REPO / "book" / "api.md").read_text()
    documented = set(re.findall(r"\.\. (?:automodule|py:module):: ([\w.]+)", api))
    modules = {"tridiag_tutorial"} | {f"tridiag_tutorial.{p.stem}"
                                      for p in (REPO / "tridiag_tutorial").glob("*.py")
                                      if not p.stem.startswith("_")}
    missing = sorted(modules - documented)
    assert not missing, f"book/api.md documents no `.. automodule::` for {missing}"


def test_every_reference_sits_in_one_group_of_the_bibliography():
    """book/bibliography.md lists the sources by subject (one `{bibliography}` block per
    `keywords` value of book/references.bib): an entry without a listed group would vanish."""
    bib = (REPO / "book" / "references.bib").read_text()
    page = (REPO / "book" / "bibliography.md").read_text()
    groups = set(re.findall(r':filter: keywords % "\^?([\w-]+)\$?"', page))
    entries = re.findall(r"^@\w+\{([^,]+),\s*keywords\s*=\s*\{([^}]*)\}", bib, re.M)
    assert len(entries) == len(re.findall(r"^@\w+\{", bib, re.M)), "an entry has no keywords line"
    stray = [(key, group) for key, group in entries if group not in groups]
    assert not stray, f"entries whose group book/bibliography.md does not list: {stray}"
