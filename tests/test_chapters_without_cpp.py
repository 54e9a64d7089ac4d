"""The chapters still run where the C++ kernel was not built (a reader in Colab whose build failed).

Each chapter of CHAPTERS is executed top to bottom with nbclient in a fresh kernel whose
environment has ``TRIDIAG_TUTORIAL_NO_CPP=1``, so that the package runs as if the kernel had not
been built (every CPU solve on LAPACK). The test checks that no cell raises (except those tagged
``raises-exception``, which show an error on purpose), that the kernel really was off there (a
cell put first prints ``tridiag_tutorial.cpp_available()``), and that the cells which need the
kernel said so with a line starting ``skipped:`` instead of stopping the chapter. The chapters run
from a copy of the notebooks folder (data included, the same working directory as nbval's), so
that nothing they write lands in the repository."""

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # seconds to minutes a chapter

nbformat = pytest.importorskip("nbformat", reason="executing the chapters needs nbformat")
nbclient = pytest.importorskip("nbclient", reason="executing the chapters needs nbclient")
pytest.importorskip("ipykernel", reason="executing the chapters needs an IPython kernel (ipykernel)")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# The chapters that call the C++ kernel somewhere; chapters 3, 9 and 12, whose timings run on
# whichever kernel the automatic choice picks; and chapter 17, whose FSDP2 training runs on LAPACK
# without the kernel. Each must run to the end without it.
CHAPTERS = [
    "03_adjoint.ipynb",
    "07_torch_func.ipynb",
    "09_application.ipynb",
    "12_performance.ipynb",
    "13_production_op.ipynb",
    "14_cpp_operator.ipynb",
    "15_cpu_kernels.ipynb",
    "16_other_devices.ipynb",
    "17_distributed.ipynb",
]
# no cell needs the kernel: no "skipped:" line to expect
NO_GUARD = {"03_adjoint.ipynb", "09_application.ipynb", "12_performance.ipynb", "13_production_op.ipynb",
            "17_distributed.ipynb"}
CELL_TIMEOUT_S = 600
CHECK = "C++ kernel available in this run:"
CHECK_CELL = f"import tridiag_tutorial\nprint({CHECK!r}, tridiag_tutorial.cpp_available())"


def printed_lines(cell):
    """The lines that a code cell printed to stdout."""
    return [line for output in cell.get("outputs", [])
            if output.get("output_type") == "stream" and output.get("name") == "stdout"
            for line in output.get("text", "").splitlines()]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[name.removesuffix(".ipynb") for name in CHAPTERS])
def test_chapter_runs_without_the_cpp_kernel(chapter, tmp_path, monkeypatch):
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    nb = nbformat.read(folder / chapter, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(CHECK_CELL))
    monkeypatch.setenv("TRIDIAG_TUTORIAL_NO_CPP", "1")  # before the kernel starts: it inherits it
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{chapter} stops without the C++ kernel:\n{error}", pytrace=False)

    assert printed_lines(nb.cells[0]) == [f"{CHECK} False"], "the C++ kernel was not switched off"
    skipped = [line for cell in nb.cells[1:] if cell.cell_type == "code"
               for line in printed_lines(cell) if line.startswith("skipped:")]
    if chapter in NO_GUARD:
        assert not skipped, f"{chapter} skips cells; move it out of NO_GUARD: {skipped}"
    else:
        assert skipped, f"{chapter} printed no 'skipped:' line: did any guard run?"
