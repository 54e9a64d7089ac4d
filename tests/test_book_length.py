"""One idea per chapter: at most 4,000 words of main prose in a chapter (outside the collapsed
"Going further" blocks and the exercises' solutions) and 50,000 words in the whole book, collapsed
blocks included (.ci/book_words.py counts them; `python .ci/book_words.py` prints the table). And
every "section k.m" / "chapter k" the prose names exists."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("book_words", REPO / ".ci" / "book_words.py")
book_words = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book_words)
CHAPTERS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHAPTER_WORDS = 4_000
BOOK_WORDS = 50_000


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_is_one_idea(path):
    main, _ = book_words.chapter_words(path)
    assert main <= CHAPTER_WORDS, (
        f"{path.name}: {main} words of main prose; move detail into a collapsed "
        f"'Going further' block or split the chapter")


def test_the_book_reads_in_fewer_than_50000_words():
    total = sum(book_words.chapter_words(path)[1] for path in CHAPTERS)
    assert total <= BOOK_WORDS, f"{total} words of prose in the chapters"


def test_the_counter_counts_prose_only():
    markdown = ("Two words.\n\n```python\nx = 1 + 2\n```\n\n$$a + b$$ and $c$\n\n"
                ":::{dropdown} Going further: more\nthree more words\n:::\n")
    main, collapsed = book_words.split_dropdowns(markdown)
    assert book_words.words(main) == 3  # "Two", "words.", "and"
    assert book_words.words(collapsed) == 3  # the block's title line is not counted


def headings():
    """``{chapter: {section numbers}}`` from the chapters' "## k.m" headings."""
    found = {}
    for path in CHAPTERS:
        k = int(path.name[:2])
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        found[k] = set(re.findall(rf"^#{{2,4}} ({k}\.\d+)\b", text, re.M))
    return found


def test_every_section_the_prose_names_exists():
    sections = headings()
    known = {s for found in sections.values() for s in found}
    sources = [(p.name, "\n".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"]
                                   if c["cell_type"] == "markdown")) for p in CHAPTERS]
    sources += [(p.name, p.read_text()) for p in (REPO / "book").glob("*.md")]
    sources.append(("README.md", (REPO / "README.md").read_text()))
    missing = []
    for name, text in sources:
        for match in re.finditer(r"\b[Ss]ections?[ \n]+((?:\d+\.\d+(?:,[ \n]*|[ \n]+and[ \n]+|"
                                 r"[ \n]*[–-][ \n]*)?)+)", text):
            for section in re.findall(r"\d+\.\d+", match.group(1)):
                if section not in known:
                    missing.append(f"{name}: section {section}")
        for match in re.finditer(r"\b[Cc]hapters?[ \n]+((?:\d+(?:,[ \n]*|[ \n]+and[ \n]+|"
                                 r"[ \n]*[–-][ \n]*)?)+)", text):
            for chapter in re.findall(r"\d+", match.group(1)):
                if int(chapter) not in sections:
                    missing.append(f"{name}: chapter {chapter}")
    assert not missing, missing
