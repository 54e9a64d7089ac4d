"""The chapters show the package's source through marked excerpts and call it through public
names: a private function renamed in the library breaks no chapter."""

import json
import re
from pathlib import Path

import pytest

import tridiag_tutorial
from tridiag_tutorial.book.source import excerpt, tags

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
PACKAGE = Path(tridiag_tutorial.__file__).parent


def code_cells():
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield f"{path.name} cell {index}", "".join(cell["source"])


def test_every_excerpt_a_chapter_asks_for_is_marked_once():
    asked = {tag for _, source in code_cells() for tag in re.findall(r'excerpt\("([\w.-]+)"\)', source)}
    assert asked, "no chapter shows an excerpt: the scan is broken"
    assert asked <= set(tags()), f"asked for but not marked: {sorted(asked - set(tags()))}"
    for tag in asked:
        assert excerpt(tag).strip()


def test_an_excerpt_is_the_marked_definition_without_its_marks():
    shown = excerpt("solve-routing")
    assert shown.startswith("def _solve(") and "[book:" not in shown
    assert shown.splitlines()[-1] == "    return _apply(*args, trans, driver)"
    region = excerpt("registrations")
    assert region.startswith("for _key in _KERNEL_KEYS:")
    assert region.rstrip().endswith('lib=_LIB)') and "[/book:" not in region


def test_an_unknown_tag_names_the_tags_that_exist():
    with pytest.raises(KeyError, match="'no-such-tag' is marked 0 times.*solve-routing"):
        excerpt("no-such-tag")


def test_a_tag_marked_twice_is_refused(tmp_path, monkeypatch):
    from tridiag_tutorial.book import source

    (tmp_path / "a.py").write_text("# [book: twice]\ndef f():\n    pass\n# [book: twice]\ndef g():\n    pass\n")
    monkeypatch.setattr(source, "_PACKAGE", tmp_path)
    source._marks.cache_clear()
    try:
        with pytest.raises(KeyError, match="'twice' is marked 2 times"):
            source.excerpt("twice")
    finally:
        source._marks.cache_clear()


# A name with a leading underscore reached through one of the package's modules, or a private
# module of the package imported by a chapter. The extension module tridiag_tutorial._C is the
# compiled library's name, which chapter 14 reads as a file, not a Python name it calls.
PRIVATE = re.compile(r"\b(?:tridiag_tutorial|tt|api|functions|registration|kernels|lapack|compiled|"
                     r"partitioned|sequential|internals|distributed|solve|sharding|benchmarks|"
                     r"accuracy)\.(_(?!C\b|_)\w+)"
                     r"|from tridiag_tutorial(?:\.\w+)* import [^\n]*\b(_(?!C\b)\w+)"
                     r"|from tridiag_tutorial\.(_\w+)")


def test_no_chapter_calls_a_private_name_of_the_package():
    found = [(where, m.group(0)) for where, source in code_cells() for m in PRIVATE.finditer(source)]
    assert not found, found

