"""Marked excerpts of the package's own source, for the chapters that show it.

A chapter that shows a piece of the package asks for it by a tag, never by the name of a private
function: ``excerpt("solve-routing")``. In the source, a comment line marks the piece:

- ``# [book: TAG]`` (``// [book: TAG]`` in C++) on the line before a ``def`` or ``class``, its
  decorators included: the excerpt is that definition;
- the same line and, further down, ``# [/book: TAG]``: the excerpt is every line between the two.

A renamed function keeps its marker, so the chapter that shows it goes on working; a marker that
is missing, or written twice, raises ``KeyError`` naming the tag and the tags that exist.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

__all__ = ["excerpt", "tags"]

_PACKAGE = Path(__file__).resolve().parent.parent
_MARK = re.compile(r"^\s*(?:#|//) \[(/?)book: ([\w.-]+)\]\s*$")


@functools.cache
def _marks() -> dict[str, list[tuple[Path, int, str]]]:
    """Every mark in the package: tag -> [(file, line index, "begin" or "end")]."""
    found: dict[str, list[tuple[Path, int, str]]] = {}
    for path in sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.glob("csrc/*.cpp"),
                        *_PACKAGE.glob("csrc/*.h")]):
        for index, line in enumerate(path.read_text().splitlines()):
            match = _MARK.match(line)
            if match:
                kind = "end" if match[1] else "begin"
                found.setdefault(match[2], []).append((path, index, kind))
    return found


def tags() -> list[str]:
    """The tags marked in the package's source, sorted."""
    return sorted(_marks())


def excerpt(tag: str) -> str:
    """The source that ``tag`` marks, without the marks and without a trailing newline."""
    marks = _marks().get(tag, [])
    begins = [m for m in marks if m[2] == "begin"]
    ends = [m for m in marks if m[2] == "end"]
    if len(begins) != 1 or len(ends) > 1:
        raise KeyError(f"excerpt: the tag {tag!r} is marked {len(begins)} times where it must be "
                       f"marked once; the marked tags are {', '.join(tags())}")
    path, start, _ = begins[0]
    lines = path.read_text().splitlines(keepends=True)
    if ends:
        end_path, end, _ = ends[0]
        if end_path != path or end < start:
            raise KeyError(f"excerpt: the end of {tag!r} is not below its start in {path.name}")
        piece = lines[start + 1:end]
    else:
        piece = inspect.getblock(lines[start + 1:])
    return "".join(piece).rstrip()
