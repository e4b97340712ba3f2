"""notebooks/study.ipynb: committed without outputs, and executes under papermill (python3 kernel
of this interpreter) with SWEEP_DIRS and OUT_DIR injected, on the real tiny sweep of
sweeps.make_sweep and from a directory without any multirun/, writing every PNG and final_loss.md
with the paired-seed columns."""

from __future__ import annotations

import nbformat
import pytest

from sweeps import EXPERIMENTS
from toys import REPO

NOTEBOOK = REPO / "notebooks" / "study.ipynb"
FIGURES = ("loss.png", "grad_error.png", "kurtosis.png", "attn_rowsum.png")


def test_notebook_is_committed_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SWEEP_DIRS = None" in params[0].source and "OUT_DIR = None" in params[0].source
    assert "os.environ" not in params[0].source  # defaults only: injected parameters must win
    assert nb.metadata["kernelspec"]["name"] == "python3"


def _python3_kernel(tmp_path, monkeypatch) -> None:
    """Make sure a ``python3`` kernelspec exists; else install ipykernel's into a temporary
    prefix and put it on JUPYTER_PATH. jupyter_client starts a spec whose argv[0] is
    ``python`` with this interpreter (``sys.executable``)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    prefix = tmp_path / "jupyter-prefix"
    install(prefix=str(prefix), kernel_name="python3")
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    KernelSpecManager().get_kernel_spec("python3")


@pytest.mark.slow
def test_notebook_runs_under_papermill(real_sweep, tmp_path, monkeypatch):
    import papermill

    sweep = real_sweep.dir
    out = tmp_path / "figures"
    monkeypatch.delenv("READBACK_SWEEP_DIRS", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    _python3_kernel(tmp_path, monkeypatch)
    cwd = tmp_path / "elsewhere"  # no multirun/ and no train.py here or above
    cwd.mkdir()
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(executed),
        kernel_name="python3",
        cwd=str(cwd),
        parameters={"SWEEP_DIRS": [str(sweep)], "OUT_DIR": str(out)},
        progress_bar=False,
    )

    nb = nbformat.read(executed, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)
    for name in FIGURES:
        p = out / name
        assert p.is_file() and p.read_bytes()[:4] == b"\x89PNG", name
    md = (out / "final_loss.md").read_text()
    assert all(f"| {exp} " in md for exp in EXPERIMENTS) and "Δ final, paired" in md
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    assert sum("image/png" in o.get("data", {}) for o in shown) == len(FIGURES)
    assert any("Δ final, paired" in o.get("data", {}).get("text/markdown", "") for o in shown)
    assert any("paired_mean" in o.get("data", {}).get("text/html", "") for o in shown)  # the paired table
    assert not (sweep / "analysis").exists()  # OUT_DIR was honoured
