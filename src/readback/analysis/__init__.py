"""Analysis of readback sweeps: load runs, tabulate final losses, plot curves.

    from readback.analysis import load_runs, final_loss_table, format_final_loss_table, plot_loss
    runs = load_runs("multirun/2026-01-01_12-00-00")
    print(format_final_loss_table(final_loss_table(runs)))
    plot_loss(runs, path="loss.png")

``python -m readback.cli.analysis SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--html] [--control EXP]``
writes every plot as PNG, the final-loss table with paired-seed differences from the control,
``report.md`` and, with ``--html``, one self-contained ``report.html`` (default
``DIR = SWEEP_DIR/analysis``; :mod:`readback.analysis.report`). See :mod:`readback.analysis.load`
for the two tables of :class:`Runs`, :mod:`readback.analysis.groups` for what a group is and
:mod:`readback.analysis.paired` for the paired comparison.
"""

from readback.analysis.drawing import aggregate
from readback.analysis.files import find_run_dirs, load_runs
from readback.analysis.load import Runs, natural_key
from readback.analysis.paired import paired_table
from readback.analysis.plots import (
    PLOTS,
    plot_attn_rowsum,
    plot_grad_error,
    plot_kurtosis,
    plot_loss,
    plot_metric,
    save_all,
)
from readback.analysis.records import runs_from_records
from readback.analysis.remote import load_wandb
from readback.analysis.render import markdown_table
from readback.analysis.report import write_report
from readback.analysis.tables import (
    final_loss_table,
    format_final_loss_table,
    format_metric_table,
    metric_table,
)

__all__ = [
    "PLOTS",
    "Runs",
    "aggregate",
    "final_loss_table",
    "find_run_dirs",
    "format_final_loss_table",
    "format_metric_table",
    "load_runs",
    "load_wandb",
    "markdown_table",
    "metric_table",
    "natural_key",
    "paired_table",
    "plot_attn_rowsum",
    "plot_grad_error",
    "plot_kurtosis",
    "plot_loss",
    "plot_metric",
    "runs_from_records",
    "save_all",
    "write_report",
]
