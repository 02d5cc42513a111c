"""notebooks/explore.ipynb: it runs headless from top to bottom (nbclient), and
it is committed without outputs.

The execution test needs the SmolLM2 GGUF and the notebook tooling (nbformat,
nbclient, ipykernel, matplotlib); it skips, saying why, when either is
missing. The notebook runs in a temporary working directory and is never
written back.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore.ipynb"
CELL_TIMEOUT_S = 300  # per cell; the whole notebook takes about 40 s on 2 CPU cores
STRIP_HINT = "strip them: jupyter nbconvert --clear-output --inplace notebooks/explore.ipynb"


def _load_json() -> dict:
    with open(NOTEBOOK, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------ committed form (no kernel)
def test_committed_notebook_has_no_outputs():
    nb = _load_json()
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "the notebook has no code cells"
    with_outputs = [c.get("id") for c in code if c.get("outputs")]
    counted = [c.get("id") for c in code if c.get("execution_count") is not None]
    assert not with_outputs, f"code cells {with_outputs} were committed with outputs: {STRIP_HINT}"
    assert not counted, f"code cells {counted} were committed with execution counts: {STRIP_HINT}"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"


def test_notebook_code_cells_compile():
    for cell in _load_json()["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            compile(src, f"<notebook cell {cell.get('id')}>", "exec")


# ---------------------------------------------------------------- execution
def _model_present() -> bool:
    from mlx_tracer.loading.store import is_valid_model_file, resolve_model

    try:
        return is_valid_model_file(resolve_model())
    except FileNotFoundError:
        return False


def _text(cell) -> str:
    """Stream text and text/plain results of one executed cell."""
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def _images(cell) -> int:
    return sum(1 for o in cell.get("outputs", []) if "image/png" in o.get("data", {}))


@pytest.mark.model
@pytest.mark.slow
def test_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install ipykernel)")
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install matplotlib)")
    if not _model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class NativeKernelManager(AsyncKernelManager):
        """Only the native python3 kernel of this interpreter's ipykernel (its
        spec runs sys.executable), whatever kernel specs are registered elsewhere."""

        @default("kernel_spec_manager")
        def _native_only(self):
            return KernelSpecManager(kernel_dirs=[], parent=self)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # First cell (in memory only): which Python the kernel runs.
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.prefix)", id="test-probe"))
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=NativeKernelManager,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the figures
        t0 = time.perf_counter()
        client.execute()  # raises CellExecutionError (with the cell's traceback) on any error
        elapsed = time.perf_counter() - t0
    print(f"notebook executed in {elapsed:.0f} s")

    cells = {c.get("id"): c for c in nb.cells if c.cell_type == "code"}
    errors = [i for i, c in cells.items() if any(o["output_type"] == "error" for o in c.outputs)]
    assert not errors, f"cells with errors: {errors}"
    assert os.path.realpath(_text(cells["test-probe"]).strip()) == os.path.realpath(sys.prefix), (
        "the kernel ran another Python than the test's"
    )

    # 1. load + generate
    assert "Paris" in _text(cells["generate"]), _text(cells["generate"])
    assert "decode:" in _text(cells["generate"])
    # 2. the trace table: decode rows of buckets 1, 2 and 4, and no trace added by more decoding
    table = _text(cells["traces"])
    decode_rows = [line.split() for line in table.splitlines() if line.strip().startswith("decode")]
    assert sorted(int(r[1]) for r in decode_rows) == [1, 2, 4], table
    assert "(no new traces)" in _text(cells["no-new-traces"])
    # 3. the decode graph: op count and the bar chart
    assert "ops of" in _text(cells["graph"]) and _images(cells["graph"]) >= 1
    # 4. the ring cache masks, checked against temporal_view inside the cell
    assert "matches temporal_view" in _text(cells["ring"]) and _images(cells["ring"]) == 1
    # 5. tokens/s per bucket
    bench = _text(cells["bench"])
    assert all(re.search(rf"\(random\)\s+{b}\s+\d", bench) for b in (1, 2, 4)) and "SmolLM2" in bench, bench
    assert _images(cells["bench"]) == 1
    # Nothing was written next to the committed notebook.
    assert all(c.outputs == [] for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
