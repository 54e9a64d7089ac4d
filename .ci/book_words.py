"""Words of prose in the chapters: what a reader reads, outside code and maths.

A chapter's *main* prose is its Markdown outside collapsed blocks (``:::{dropdown} ...`` fences: the
exercises' solutions and the "Going further" details); its *total* counts those blocks as well.
Code cells, fenced code, maths, HTML comments and link targets are not prose. A word is a
whitespace-separated token with a letter or a digit in it.

    python .ci/book_words.py                 # every chapter, then the book
    python .ci/book_words.py notebooks/06_compile.ipynb

tests/test_book_length.py holds the limits: 4,000 words of main prose a chapter, 50,000 in all.
"""

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(`{3,}|~{3,})(?!\{dropdown\}).*?^\1\s*$", re.S | re.M)
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$|\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"\]\([^)]*\)|<https?://[^>]*>")
WORD = re.compile(r"[A-Za-z0-9]")


def words(text: str) -> int:
    text = COMMENT.sub(" ", text)
    text = FENCE.sub(" ", text)
    text = MATH.sub(" ", text)
    text = LINK.sub("]", text)
    lines = [line for line in text.splitlines()
             if not re.match(r"\s*(:{3,}|`{3,})", line) and not re.match(r"\s*:\w[\w-]*:\s", line)]
    return sum(1 for token in " ".join(lines).split() if WORD.search(token))


def split_dropdowns(markdown: str) -> tuple[str, str]:
    """``(main, collapsed)``: the text outside and inside ``{dropdown}`` fences."""
    main, collapsed, depth, fence = [], [], 0, None
    for line in markdown.splitlines():
        opening = re.match(r"\s*(:{3,}|`{3,})\{dropdown\}", line)
        if depth == 0 and opening:
            depth, fence = 1, opening.group(1)
            collapsed.append(line)
            continue
        if depth:
            if re.match(rf"\s*{re.escape(fence)}\{{", line):
                depth += 1
            elif line.strip() == fence:
                depth -= 1
            collapsed.append(line)
        else:
            main.append(line)
    return "\n".join(main), "\n".join(collapsed)


def chapter_words(path: Path) -> tuple[int, int]:
    """``(main, total)`` words of prose in one notebook."""
    cells = json.loads(path.read_text())["cells"]
    main = total = 0
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        outside, inside = split_dropdowns(source)
        main += words(outside)
        total += words(outside) + words(inside)
    return main, total


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    all_main = all_total = 0
    for path in paths:
        m, t = chapter_words(path)
        all_main, all_total = all_main + m, all_total + t
        print(f"{path.name:40s} main {m:6d}  total {t:6d}")
    print(f"{'book':40s} main {all_main:6d}  total {all_total:6d}")


if __name__ == "__main__":
    main(sys.argv[1:])
