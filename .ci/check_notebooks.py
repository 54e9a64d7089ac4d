"""Fail when a committed notebook holds an error that is not expected.

The book renders committed outputs (nbval proves they are current), so an error output would
otherwise reach readers silently. Cells tagged ``raises-exception`` are allowed to show one.
"""
import json
import sys
from pathlib import Path


def problems(folder):
    for path in sorted(Path(folder).glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for index, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            tags = cell.get("metadata", {}).get("tags", [])
            if cell.get("execution_count") is None:
                yield f"{path}: code cell {index} was never executed"
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error" and "raises-exception" not in tags:
                    yield f"{path}: code cell {index} raised {output.get('ename')}: {output.get('evalue')}"


if __name__ == "__main__":
    found = list(problems(sys.argv[1] if len(sys.argv) > 1 else "notebooks"))
    print("\n".join(found) or "notebooks: no unexpected errors")
    sys.exit(1 if found else 0)
