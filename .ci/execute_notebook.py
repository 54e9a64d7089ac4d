"""Execute notebooks in place on a fresh kernel, top to bottom, as nbval will.

Usage: python .ci/execute_notebook.py notebooks/01_finite_differences.ipynb [...]

Cells tagged ``raises-exception`` may raise; any other error stops with a non-zero exit.
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths):
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        client = NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        client.execute()
        nbformat.write(nb, path)
        print(f"executed {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
