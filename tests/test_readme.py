"""The README's example runs as written (it is the first thing an engineer copies)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["diag"].grad.shape == (1000,)
    assert namespace["x"].shape == (1000, 8)
    assert len(blocks[0].strip().splitlines()) <= 12


def test_readme_names_the_make_targets():
    text = README.read_text()
    assert "make test" in text and "make book" in text
