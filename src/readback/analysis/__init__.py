"""Analysis of readback sweeps: load runs, tabulate final losses, plot curves.

    from readback.analysis import load_runs, final_loss_table, format_final_loss_table, plot_loss
    runs = load_runs("multirun/2026-01-01_12-00-00")
    print(format_final_loss_table(final_loss_table(runs)))
    plot_loss(runs, path="loss.png")

``python -m readback.analysis SWEEP_DIR [SWEEP_DIR ...] [--out DIR]`` writes every plot as PNG
and ``final_loss.md`` (default ``DIR = SWEEP_DIR/analysis``). See :mod:`readback.analysis.load`
for the two tables of :class:`Runs`.
"""

from readback.analysis.load import Runs, find_run_dirs, load_runs, load_wandb, natural_key, runs_from_records
from readback.analysis.plots import (
    PLOTS,
    aggregate,
    plot_attn_rowsum,
    plot_grad_error,
    plot_kurtosis,
    plot_loss,
    save_all,
)
from readback.analysis.tables import final_loss_table, format_final_loss_table, markdown_table

__all__ = [
    "PLOTS",
    "Runs",
    "aggregate",
    "final_loss_table",
    "find_run_dirs",
    "format_final_loss_table",
    "load_runs",
    "load_wandb",
    "markdown_table",
    "natural_key",
    "plot_attn_rowsum",
    "plot_grad_error",
    "plot_kurtosis",
    "plot_loss",
    "runs_from_records",
    "save_all",
    "write_report",
]


def write_report(runs: Runs, out_dir, *, x: str = "tokens", band: str | None = "minmax") -> dict:
    """Every plot as ``out_dir/<name>.png``, ``final_loss.md``, ``final_loss.csv`` and
    ``runs.csv`` (the per-run summary); returns name -> path."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(save_all(runs, out, x=x, band=band))
    table = final_loss_table(runs)
    md = out / "final_loss.md"
    md.write_text(format_final_loss_table(table), encoding="utf-8")
    paths["final_loss.md"] = md
    table.to_csv(out / "final_loss.csv", index=False)
    paths["final_loss.csv"] = out / "final_loss.csv"
    runs.summary.to_csv(out / "runs.csv")
    paths["runs.csv"] = out / "runs.csv"
    return paths
