"""Open the built book in headless Chromium and report what a reader would see go wrong.

For each page: MathJax typeset every formula (no raw TeX left in the visible text, no MathJax
error boxes), every image loaded, the console shows no errors, and nothing was fetched from
outside the book except the allowed badge images. The book is served from a loopback HTTP
server; requests to any other host are answered locally (never sent) and recorded.

Usage, after `make book` (or through `make book-check`):

    .venv/bin/python tests/browser_check.py [_build/html] [--screenshot _build/screenshot-chapter.png]

Chromium is Debian's `chromium` package (or a Chrome/Chromium found on PATH, or $CHROMIUM),
driven by Playwright for Python. Playwright's own browser download is never used. Nothing here
installs anything while checking: the set-up step `make browser-setup` (this script with
`--install`) installs Debian's chromium with apt-get when none is found and it runs as root.
tests/test_book_html.py imports this module; without a browser its browser tests are skipped with
the reason, except in CI (`CI=true`), where a missing browser fails them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# External resources a page may reference: fetched by a reader's browser, stubbed here.
ALLOWED_EXTERNAL = {
    "https://colab.research.google.com/assets/colab-badge.svg",
}
# A 1x1 SVG returned for allowed external images, so that they count as loaded.
STUB_SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>'

# Text that must not be visible once MathJax has run (outside code blocks and outputs).
RAW_TEX_MARKERS = ("$$", "\\begin{", "\\end{", "\\[", "\\]", "\\(", "\\)", "\\frac", "\\mathsf")


# ----------------------------------------------------------------------------------------------
# Finding Chromium (installing it only in the set-up step, `make browser-setup`)
# ----------------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    """Path of a Chromium-family browser: $CHROMIUM, else the first of CHROMIUM_NAMES on PATH."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def in_ci() -> bool:
    """True in CI (``CI=true``, as GitHub Actions sets it): a missing browser is then a failure."""
    return os.environ.get("CI", "").lower() == "true"


def missing_browser_reason() -> str:
    """Why no browser check can run here, with what to do about it."""
    if os.environ.get("CHROMIUM"):
        return (f"$CHROMIUM is set to {os.environ['CHROMIUM']!r}, which does not exist; "
                "unset it or point it at a Chrome/Chromium binary")
    return ("no Chromium found (looked for $CHROMIUM and " + ", ".join(CHROMIUM_NAMES) + "): "
            "run `make browser-setup` (installs Debian's `chromium` as root), or install a "
            "Chrome/Chromium and put it on PATH or in $CHROMIUM")


def install_chromium() -> tuple[str | None, str]:
    """The set-up step (``make browser-setup``): return ``(path, "")`` of the browser, installing
    Debian's ``chromium`` with apt-get (``apt-get update`` first) when none is found and we are
    root; ``(None, reason)`` when there is none and it cannot be installed."""
    path = find_chromium()
    if path:
        return path, ""
    if os.environ.get("CHROMIUM"):
        return None, missing_browser_reason()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None, ("no Chromium found and not root, so it cannot be installed here: "
                      "install Debian's `chromium` package (apt-get install chromium) "
                      "or set $CHROMIUM to a Chrome/Chromium binary")
    if shutil.which("apt-get") is None:
        return None, "no Chromium found and no apt-get to install Debian's `chromium` package"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return None, f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-2000:]}"
    path = find_chromium()
    return (path, "") if path else (None, "apt-get installed chromium, yet no binary was found")


def playwright_missing() -> str:
    """``""`` when Playwright for Python imports, else why not (it is in requirements-pinned.txt)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        return f"Playwright for Python is not installed ({err}): it is pinned in requirements-pinned.txt"
    return ""


# ----------------------------------------------------------------------------------------------
# Serving the book
# ----------------------------------------------------------------------------------------------
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@contextlib.contextmanager
def serve(directory: Path):
    """Serve ``directory`` on 127.0.0.1 at a free port, in a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ----------------------------------------------------------------------------------------------
# The pages of the book
# ----------------------------------------------------------------------------------------------
def toc_pages(toc_path: Path = REPO / "_toc.yml") -> tuple[str, list[str], list[str]]:
    """``(root, all docnames in order, chapter docnames)`` from a jb-book ``_toc.yml``."""
    toc = yaml.safe_load(toc_path.read_text())
    root = toc["root"]
    pages, chapters = [root], []
    for part in toc.get("parts", []):
        for entry in part.get("chapters", []):
            docname = str(Path(entry["file"]).with_suffix("")) if Path(entry["file"]).suffix in (
                ".md", ".ipynb") else entry["file"]
            pages.append(docname)
            if docname.startswith("notebooks/"):
                chapters.append(docname)
    return root, pages, chapters


@dataclass
class PageReport:
    page: str
    problems: list[str] = field(default_factory=list)
    math_elements: int = 0
    typeset: int = 0
    images: int = 0
    external_requests: list[str] = field(default_factory=list)


_PAGE_STATE_JS = r"""
async (markers) => {
  // Images: make lazy ones eager and wait (at most 10 s) for every one to settle.
  const imgs = Array.from(document.images);
  imgs.forEach(img => { img.loading = "eager"; });
  await Promise.race([
    Promise.all(imgs.map(img => img.complete ? null :
      new Promise(resolve => { img.addEventListener("load", resolve); img.addEventListener("error", resolve); }))),
    new Promise(resolve => setTimeout(resolve, 10000)),
  ]);
  const broken = imgs.filter(img => !(img.complete && img.naturalWidth > 0))
                     .map(img => img.getAttribute("src"));

  // Maths: every Sphinx math element should hold a MathJax container, and none an error.
  const article = document.querySelector("article") || document.body;
  const maths = Array.from(article.querySelectorAll(".math"));
  const untypeset = maths.filter(el => !el.querySelector("mjx-container"))
                         .map(el => el.textContent.trim().slice(0, 80));
  const mathErrors = Array.from(document.querySelectorAll("mjx-merror, [data-mjx-error]"))
                          .map(el => (el.getAttribute("data-mjx-error") || el.textContent).slice(0, 80));

  // Raw TeX in the visible text, leaving out code, outputs and typeset maths.
  const clone = article.cloneNode(true);
  clone.querySelectorAll("pre, code, .highlight, .output, .cell_output, mjx-container, script, style")
       .forEach(el => el.remove());
  const text = clone.innerText || clone.textContent || "";
  const rawTex = markers.filter(m => text.includes(m));
  const dollarPairs = (text.match(/\$[^$\n]{1,200}\$/g) || []).slice(0, 5);

  return {
    images: imgs.length, broken,
    mathCount: maths.length,
    typeset: document.querySelectorAll("mjx-container").length,
    untypeset, mathErrors, rawTex, dollarPairs,
    hasMathJaxScript: !!document.querySelector('script[src*="mathjax"]'),
    mathJaxSrc: (document.querySelector('script[src*="mathjax"]') || {}).src || null,
  };
}
"""


def _router(origin: str, report: PageReport):
    """Route handler: the book's own server is reached; any other host is stubbed and recorded."""
    def on_route(route):
        url = route.request.url
        if urlsplit(url).netloc == origin or url.startswith(("data:", "blob:")):
            route.continue_()
            return
        report.external_requests.append(url)
        if url in ALLOWED_EXTERNAL:
            route.fulfill(status=200, content_type="image/svg+xml", body=STUB_SVG)
        else:
            route.fulfill(status=204, body=b"")
    return on_route


def check_pages(html_dir: Path, pages: list[str], *, chromium: str,
                screenshot: tuple[str, Path] | None = None, timeout_ms: int = 60000
                ) -> list[PageReport]:
    """Open each ``pages`` docname (``book/intro``, ...) from ``html_dir`` and report problems.

    ``screenshot=(docname, path)`` saves a viewport screenshot of that page, scrolled to its
    first figure when it has one.
    """
    from playwright.sync_api import sync_playwright

    reports = []
    with serve(html_dir) as base, sync_playwright() as pw:
        origin = urlsplit(base).netloc
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900},
                                          service_workers="block")
            for docname in pages:
                report = PageReport(docname)
                page = context.new_page()
                page.set_default_timeout(timeout_ms)

                page.route("**/*", _router(origin, report))
                page.on("console", lambda msg, r=report: msg.type == "error"
                        and "favicon.ico" not in (msg.location or {}).get("url", "")
                        and r.problems.append(f"console error: {msg.text}"))
                page.on("pageerror", lambda exc, r=report: r.problems.append(f"page error: {exc}"))
                page.on("response", lambda resp, r=report: resp.status >= 400
                        and not resp.url.endswith("/favicon.ico")  # the browser's own guess
                        and r.problems.append(f"HTTP {resp.status} for {resp.url}"))

                response = page.goto(base + docname + ".html", wait_until="load")
                if response is None or response.status != 200:
                    report.problems.append(f"page did not load: {response and response.status}")
                    reports.append(report)
                    page.close()
                    continue
                # MathJax is loaded (deferred) only on pages with maths: wait for it to finish.
                page.evaluate("""async () => {
                    if (!document.querySelector('script[src*="mathjax"]')) return;
                    const t0 = Date.now();
                    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) {
                        if (Date.now() - t0 > 30000) throw new Error("MathJax never started");
                        await new Promise(r => setTimeout(r, 50));
                    }
                    await MathJax.startup.promise;
                }""")
                state = page.evaluate(_PAGE_STATE_JS, list(RAW_TEX_MARKERS))
                report.math_elements, report.typeset = state["mathCount"], state["typeset"]
                report.images = state["images"]
                for src in state["broken"]:
                    report.problems.append(f"image did not load: {src}")
                if state["mathCount"]:
                    if not state["hasMathJaxScript"]:
                        report.problems.append("page has maths but no MathJax script")
                    elif urlsplit(state["mathJaxSrc"]).netloc != origin:
                        report.problems.append(f"MathJax is not local: {state['mathJaxSrc']}")
                for tex in state["untypeset"]:
                    report.problems.append(f"maths not typeset: {tex!r}")
                for err in state["mathErrors"]:
                    report.problems.append(f"MathJax error: {err!r}")
                for marker in state["rawTex"]:
                    report.problems.append(f"raw TeX {marker!r} left in the visible text")
                for pair in state["dollarPairs"]:
                    report.problems.append(f"raw $...$ left in the visible text: {pair!r}")
                for url in report.external_requests:
                    if url not in ALLOWED_EXTERNAL:
                        report.problems.append(f"fetches an external resource: {url}")

                if screenshot and screenshot[0] == docname:
                    figure = page.locator("article img[src*='_images/']").first
                    if figure.count():
                        figure.scroll_into_view_if_needed()
                        page.evaluate("window.scrollBy(0, -120)")
                    screenshot[1].parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(screenshot[1]))
                page.close()
                reports.append(report)
        finally:
            browser.close()
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", nargs="?", default=str(REPO / "_build" / "html"))
    parser.add_argument("--screenshot", default=str(REPO / "_build" / "screenshot-chapter.png"))
    parser.add_argument("--install", action="store_true",
                        help="set-up step only: find Chromium, apt-get install it when missing "
                             "(as root), check that Playwright imports, and exit; without a "
                             "browser this fails only in CI (CI=true)")
    args = parser.parse_args(argv)

    if args.install:
        chromium, reason = install_chromium()
        reason = reason or playwright_missing()
        if not reason:
            print(f"browser for the book check: {chromium}")
            return 0
        if in_ci():  # CI must open the book in a browser: its browser tests would fail anyway
            print(f"browser set-up failed: {reason}", file=sys.stderr)
            return 2
        print(f"no browser for the book check ({reason}); the browser tests will be skipped",
              file=sys.stderr)
        return 0

    html_dir = Path(args.html_dir)
    if not (html_dir / "index.html").exists():
        print(f"{html_dir} holds no built book: run `make book` first", file=sys.stderr)
        return 2
    chromium = find_chromium()
    reason = "" if chromium else missing_browser_reason()
    reason = reason or playwright_missing()
    if reason:
        print(f"browser check not run: {reason}", file=sys.stderr)
        return 2
    _, pages, chapters = toc_pages()
    shot = (chapters[0], Path(args.screenshot)) if chapters else None
    reports = check_pages(html_dir, pages, chromium=chromium, screenshot=shot)
    failed = 0
    for r in reports:
        status = "FAIL" if r.problems else "ok"
        print(f"{status:4} {r.page}: {r.math_elements} maths ({r.typeset} typeset), "
              f"{r.images} images, {len(r.external_requests)} external requests stubbed")
        for p in r.problems:
            print(f"       - {p}")
        failed += bool(r.problems)
    if shot:
        print(f"screenshot of {shot[0]}: {shot[1]}")
    print(f"{len(reports) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
