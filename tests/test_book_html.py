"""Build the book once per session and check what a reader gets.

The build runs `jupyter-book build . -W -n --keep-going` (the command of `make book`) into a
temporary directory (`--path-output`), so it neither needs nor touches the repository's _build.
The browser test opens the pages in headless Chromium (tests/browser_check.py) and saves a
screenshot of the first chapter to _build/screenshot-chapter.png. The browser is installed by the
set-up step `make browser-setup`, never by the tests: without one they are skipped with the
reason, except in CI (`CI=true`), where they fail.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from bs4 import BeautifulSoup

sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser_check  # noqa: E402  (a helper module next to this file)

pytestmark = pytest.mark.book

REPO = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((REPO / "_config.yml").read_text())
ROOT, PAGES, CHAPTERS = browser_check.toc_pages(REPO / "_toc.yml")
SCREENSHOT = REPO / "_build" / "screenshot-chapter.png"
# Rendered as an image unless the output also has one of these (MyST-NB's priority for HTML).
ABOVE_PNG = ("application/vnd.jupyter.widget-view+json", "application/javascript", "text/html",
             "image/svg+xml")


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """``(html_dir, log, seconds)`` of one build of the book."""
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb) if jb.exists() else "jupyter-book", "build", str(REPO), "--path-output",
           str(out), "-W", "-n", "--keep-going"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    log = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, f"jupyter-book build failed ({done.returncode}):\n{log[-6000:]}"
    return out / "_build" / "html", log, seconds


def soup(html_dir: Path, docname: str) -> BeautifulSoup:
    return BeautifulSoup((html_dir / f"{docname}.html").read_text(), "html.parser")


def notebook(docname: str) -> dict:
    return json.loads((REPO / f"{docname}.ipynb").read_text())


# ----------------------------------------------------------------------------------------------
def test_build_has_no_warnings(build):
    _, log, seconds = build
    problems = [line for line in log.splitlines()
                if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)]
    assert not problems, "\n".join(problems)


def test_every_toc_page_has_html(build):
    html_dir, _, _ = build
    missing = [d for d in PAGES if not (html_dir / f"{d}.html").is_file()]
    assert not missing, missing
    assert CHAPTERS, "no chapter notebook in _toc.yml"
    index = (html_dir / "index.html").read_text()
    assert f"{ROOT}.html" in index, "index.html should redirect to the root page"


@pytest.mark.parametrize("docname", CHAPTERS)
def test_chapter_shows_its_plots(build, docname):
    """Each image/png output of the notebook is an <img> on the page, and its file exists."""
    html_dir, _, _ = build
    page = soup(html_dir, docname)
    shown = {Path(img["src"]).name for img in page.select("article img")
             if (html_dir / docname).parent.joinpath(img["src"]).resolve().is_file()}
    expected = []
    for index, cell in enumerate(notebook(docname)["cells"]):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or {"remove-output", "remove-cell"} & set(tags):
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data and not any(m in data for m in ABOVE_PNG):
                png = data["image/png"]
                png = "".join(png) if isinstance(png, list) else png
                digest = hashlib.sha256(base64.b64decode(png)).hexdigest()
                expected.append((index, f"{digest}.png"))
    missing = [(i, name) for i, name in expected if name not in shown]
    assert not missing, f"{docname}: plots of cells {[i for i, _ in missing]} are not on the page"
    for _, name in expected:
        assert (html_dir / "_images" / name).is_file()


@pytest.mark.parametrize("k, docname", list(enumerate(CHAPTERS, start=1)))
def test_chapter_number_title_and_navigation(build, k, docname):
    """Chapter k is notebooks/0k_*.ipynb, titled "k. ...", and listed so in the navigation."""
    html_dir, _, _ = build
    assert Path(docname).name.startswith(f"{k:02d}_"), f"chapter {k} is {docname}"
    page = soup(html_dir, docname)
    h1 = page.select_one("article h1").get_text(" ", strip=True).rstrip("#").strip()
    assert re.match(rf"{k}\. \S", h1), f"{docname}: title {h1!r} should start with '{k}. '"
    nav = [a.get_text(" ", strip=True) for a in page.select("nav.bd-docs-nav a.reference")]
    assert h1 in nav, f"{docname}: the navigation should list {h1!r}, has {nav}"
    assert not page.select("article h1 .section-number"), "automatic numbering doubles the number"


@pytest.mark.parametrize("docname", PAGES)
def test_colab_links_open_this_notebook(build, docname):
    """Chapter pages launch Colab on their own .ipynb; Markdown pages have no launch button."""
    html_dir, _, _ = build
    org_repo = CONFIG["repository"]["url"].split("github.com/")[1]
    branch = CONFIG["repository"]["branch"]
    page = soup(html_dir, docname)
    launch = [a["href"] for a in page.select("a[href]")
              if a["href"].startswith("https://colab.research.google.com/github/")]
    if docname in CHAPTERS:
        expected = (f"https://colab.research.google.com/github/{org_repo}/blob/{branch}/"
                    f"{docname}.ipynb")
        assert launch and set(launch) == {expected}, (docname, launch)
        header = page.select(".dropdown-launch-buttons a[href*='colab.research.google.com']")
        assert [a["href"] for a in header] == [expected], "the rocket menu's Colab link"
    else:
        assert not launch, f"{docname} is a Markdown page, Colab cannot open it: {launch}"
        assert not page.select(".dropdown-launch-buttons"), f"{docname}: launch buttons on a .md page"


@pytest.mark.parametrize("docname", PAGES)
def test_mathjax_is_local(build, docname):
    html_dir, _, _ = build
    page = soup(html_dir, docname)
    scripts = [s["src"] for s in page.select("script[src]") if "mathjax" in s["src"].lower()]
    if page.select("article .math"):
        assert scripts, f"{docname} has maths but loads no MathJax"
    for src in scripts:
        assert "://" not in src and not src.startswith("//"), f"{docname}: MathJax from {src}"
        assert (html_dir / docname).parent.joinpath(src.split("?")[0]).resolve().is_file(), src


def test_mathjax_bundle_is_copied(build):
    html_dir, _, _ = build
    bundle = html_dir / "_static" / "mathjax"
    assert (bundle / "tex-chtml.js").is_file()
    assert any((bundle / "output" / "chtml" / "fonts").rglob("*.woff")), "MathJax fonts missing"


def test_repository_and_issue_buttons(build):
    html_dir, _, _ = build
    url = CONFIG["repository"]["url"]
    hrefs = [a["href"] for a in soup(html_dir, ROOT).select("a[href]")]
    assert url in hrefs, "repository button"
    assert any(h.startswith(f"{url}/issues/new") for h in hrefs), "issues button"


def test_bibliography_and_citations(build):
    html_dir, _, _ = build
    bib = soup(html_dir, "book/bibliography")
    entries = bib.select("div.citation, dl.citation > dt")
    assert len(entries) >= 8, f"bibliography has {len(entries)} entries"
    intro_cites = soup(html_dir, ROOT).select("a[href*='bibliography.html#']")
    assert intro_cites, "the introduction cites nothing"


def test_api_reference_documents_the_public_functions(build):
    html_dir, _, _ = build
    ids = {tag.get("id") for tag in soup(html_dir, "book/api").select("dt[id]")}
    import tridiag_tutorial

    missing = [f"tridiag_tutorial.{name}" for name in tridiag_tutorial.__all__
               if f"tridiag_tutorial.{name}" not in ids]
    assert not missing, missing


def test_no_duplicate_inline_scripts(build):
    """Guards book/_ext/dedupe_scripts.py: a duplicated `const` is a SyntaxError on every page."""
    html_dir, _, _ = build
    for docname in PAGES:
        bodies = [s.string for s in soup(html_dir, docname).select("script:not([src])")
                  if s.string and s.string.strip().startswith(("const ", "let "))]
        assert len(bodies) == len(set(bodies)), f"{docname}: duplicated inline scripts"


# ----------------------------------------------------------------------------------------------
# In a browser
# ----------------------------------------------------------------------------------------------
def browser_or_skip() -> str:
    """The browser's path. Nothing is installed here (that is `make browser-setup`): without a
    browser or Playwright the browser tests are skipped with the reason, or fail in CI
    (``CI=true``), where a skip would hide that the book was never opened in a browser."""
    path = browser_check.find_chromium()
    reason = "" if path else browser_check.missing_browser_reason()
    reason = reason or browser_check.playwright_missing()
    if reason:
        if browser_check.in_ci():
            pytest.fail(f"browser check cannot run in CI (CI=true): {reason}", pytrace=False)
        pytest.skip(f"browser check skipped: {reason}")
    return path


@pytest.fixture(scope="session")
def chromium():
    return browser_or_skip()


@pytest.mark.parametrize("ci", ["true", ""])
def test_missing_browser_skips_outside_ci_and_fails_in_ci(monkeypatch, tmp_path, ci):
    """A missing browser is never installed by the tests: a skip saying what to run, a CI failure."""
    monkeypatch.setenv("CHROMIUM", str(tmp_path / "no-such-browser"))
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected) as info:
        browser_or_skip()
    assert "no-such-browser" in str(info.value)
    monkeypatch.delenv("CHROMIUM")
    monkeypatch.setenv("PATH", str(tmp_path))  # no browser on PATH
    with pytest.raises(expected) as info:
        browser_or_skip()
    assert "make browser-setup" in str(info.value)


def test_pages_render_in_a_browser(chromium, build):
    """MathJax typeset everything, images load, no console errors, nothing external but badges.
    (``chromium`` first: without a browser the test is skipped before the book is built.)"""
    html_dir, _, _ = build
    reports = browser_check.check_pages(html_dir, PAGES, chromium=chromium,
                                        screenshot=(CHAPTERS[0], SCREENSHOT))
    problems = [f"{r.page}: {p}" for r in reports for p in r.problems]
    assert not problems, "\n".join(problems)
    by_page = {r.page: r for r in reports}
    assert by_page[ROOT].typeset > 0, "the introduction's maths was not typeset"
    for docname in CHAPTERS:
        assert by_page[docname].images > 0, f"{docname}: no image on the page"
    assert SCREENSHOT.is_file()


def test_browser_check_catches_problems(tmp_path, chromium):
    """The browser check itself fails a page with raw TeX, a broken image and a console error."""
    (tmp_path / "bad.html").write_text(
        "<!DOCTYPE html><html><head><title>bad</title></head><body><article>"
        "<p>Raw maths: $$x^2$$ and \\begin{aligned} a \\end{aligned} and $y$.</p>"
        "<span class='math notranslate nohighlight'>\\(z\\)</span>"
        "<img src='missing.png'>"
        "<img src='https://example.org/tracker.png'>"
        "<script>console.error('boom')</script>"
        "</article></body></html>")
    (report,) = browser_check.check_pages(tmp_path, ["bad"], chromium=chromium)
    text = "\n".join(report.problems)
    for expected in ("raw TeX '$$'", "raw TeX '\\\\begin{'", "raw $...$", "maths not typeset",
                     "page has maths but no MathJax script", "image did not load: missing.png",
                     "console error: boom", "fetches an external resource: https://example.org"):
        assert expected in text, f"browser check missed {expected!r}:\n{text}"
