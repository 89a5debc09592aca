"""The quickstart notebook runs end to end (nbclient, a real kernel on this venv's Python)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


def test_quickstart_notebook_executes_without_a_cell_error(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from jupyter_client.kernelspec import KernelSpecManager

    # The kernel must be this interpreter (the venv): "python3" is ipykernel's own spec, whose
    # "python" jupyter_client replaces with sys.executable.
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] in ("python", "python3", sys.executable), spec.argv
    monkeypatch.setenv("QUICKSTART_MESSAGES", "60")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"a notebook cell failed:\n{str(exc)[-4000:]}")
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "published 120 messages" in text
    assert "each once" in text and "every origin verified" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
    assert not any(o.get("output_type") == "error" for o in outputs)
