"""Every notebook runs top to bottom (a broken notebook fails CI) and is committed without outputs.
The notebooks pick their own device (the default, "auto"). nbformat, nbclient and ipykernel are the
notebooks extra: without them these tests skip."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat (the notebooks extra) is not installed")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    nbclient = pytest.importorskip("nbclient", reason="nbclient (the notebooks extra) is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel (the notebooks extra) is not installed")

    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
