"""The one page to look at: every table and plot of a sweep, what made it and where.

:func:`write_report` writes into ``out_dir`` every plot as PNG, ``final_loss.md``/``.csv``,
``paired.csv``, ``runs.csv``, with a control ``paired_curve.csv`` and ``paired_gap.png`` (the
paired gap of the validation loss at every evaluation), and ``report.md`` (a Markdown page linking the PNGs); with
``with_html=True`` also ``report.html``, one self-contained file (the PNGs embedded as base64 data
URIs, no script, no external resource) that any browser opens from disk or a mail attachment.
``page=PATH`` writes the Markdown page to PATH instead, its image links relative to it (how
``docs/results/*.md`` are made).

Both pages hold: the final-loss table with the paired-seed differences from the control, the
paired table, one table per ``--metric``, every plot, the runs table (group, seed, status,
losses, steps, overrides), the commands that made the runs, the machines they ran on, the
command that made the report and the machine it ran on.
"""

from __future__ import annotations

import base64
import html
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from readback.analysis.load import Runs
from readback.analysis.paired import paired_curve, paired_table
from readback.analysis.plots import plot_metric, plot_paired_gap, save_all
from readback.analysis.render import cell_text, html_inline, html_table, markdown_table
from readback.analysis.tables import (
    METRIC_HEADERS,
    final_loss_cells,
    final_loss_table,
    format_final_loss_table,
    metric_cells,
    metric_table,
)

RUN_COLUMNS = (
    "group",
    "seed",
    "status",
    "final_loss",
    "val_loss",
    "steps",
    "diverged_at_step",
    "wall_time_s",
    "overrides",
)


@dataclass
class Section:
    """One titled block of the page: a table (headers, rows of cell values, notes) or an image;
    both pages write the cells with :mod:`readback.analysis.render`."""

    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    image: Path | None = None


def this_machine() -> str:
    """The machine the report is made on, in one line."""
    import torch

    return (
        f"{platform.node()}: {os.cpu_count()} CPUs; {platform.platform()}; torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def this_command(argv: Sequence[str] | None = None) -> str:
    return "python -m readback.cli.analysis " + shlex.join(list(sys.argv[1:] if argv is None else argv))


def _sections(
    runs: Runs, images: dict[str, Path], *, control: str | None, metrics: Sequence[str], command: str
) -> tuple[list[Section], pd.DataFrame]:
    paired = paired_table(runs, control) if control else pd.DataFrame()
    headers, rows, notes = final_loss_cells(final_loss_table(runs), paired=paired if len(paired) else None)
    keys = ", ".join(runs.group_keys) or "none (one group per experiment)"
    out = [Section("Final loss", headers, rows, [f"Grouped by experiment and: {keys}; seeds pooled.", *notes])]
    if len(paired):
        out.append(
            Section(
                f"Paired by seed against {control}",
                ["group", "control", "metric", "pairs", "paired Δ", "SE", "z", "unpaired Δ", "SE", "z"],
                [
                    [
                        r["group"],
                        r["control"],
                        r["metric"],
                        str(r["n_pairs"]),
                        cell_text(r["paired_mean"], "+.4g"),
                        cell_text(r["paired_se"], ".2g"),
                        cell_text(r["paired_z"], "+.1f"),
                        cell_text(r["unpaired_mean"], "+.4g"),
                        cell_text(r["unpaired_se"], ".2g"),
                        cell_text(r["unpaired_z"], "+.1f"),
                    ]
                    for _, r in paired.iterrows()
                ],
                ["Δ = group minus control; z = Δ / SE."],
            )
        )
    for pattern in metrics:
        out.append(Section(f"Last value of {pattern}", METRIC_HEADERS, metric_cells(metric_table(runs, pattern))))
    out += [Section(name.replace("_", " "), image=path) for name, path in images.items()]
    s = runs.summary
    out.append(Section("Runs", ["run", *RUN_COLUMNS], [[i, *(s.at[i, c] for c in RUN_COLUMNS)] for i in s.index]))
    made = [f"`{c}`" for c in dict.fromkeys(s["command"].dropna())] or ["(not recorded)"]
    where = list(dict.fromkeys(s["machine"].dropna())) or ["(not recorded)"]
    code = list(dict.fromkeys(s["code"].dropna())) or ["(not recorded)"]
    out.append(
        Section(
            "How it was made",
            ["what", "value"],
            [
                *(["runs: command", c] for c in made),
                *(["runs: machine", m] for m in where),
                *(["runs: code", f"`{c}`"] for c in code),
                ["report: command", f"`{command}`"],
                ["report: machine", this_machine()],
            ],
        )
    )
    return out, paired


def render_markdown(sections: list[Section], title: str, page: Path) -> str:
    parts = [f"# {title}\n"]
    for sec in sections:
        parts.append(f"## {sec.title}\n")
        if sec.image is not None:
            parts.append(f"![{sec.title}]({Path(os.path.relpath(sec.image, page.parent)).as_posix()})\n")
        if sec.headers:
            parts.append(markdown_table(sec.headers, sec.rows, align=["l"] * len(sec.headers)) + "\n")
        parts += [f"{n}\n" for n in sec.notes]
    return "\n".join(parts)


def render_html(sections: list[Section], title: str) -> str:
    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>"]
    for sec in sections:
        anchor = esc(sec.title.lower().replace(" ", "-"))
        body.append(f'<section id="{anchor}"><h2>{esc(sec.title)}</h2>')
        if sec.image is not None:
            data = base64.b64encode(sec.image.read_bytes()).decode("ascii")
            body.append(f'<img alt="{esc(sec.title)}" src="data:image/png;base64,{data}">')
        if sec.headers:
            body.append(html_table(sec.headers, sec.rows))
        body += [f"<p>{html_inline(n)}</p>" for n in sec.notes]
        body.append("</section>")
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child,th:first-child"
        "{text-align:left}img{max-width:100%}code{background:#f4f4f4;white-space:pre-wrap}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(
    runs: Runs,
    out_dir: str | os.PathLike,
    *,
    x: str = "tokens",
    band: str | None = "minmax",
    control: str | None = None,
    metrics: Sequence[str] = (),
    with_html: bool = False,
    page: str | os.PathLike | None = None,
    title: str = "readback sweep report",
    command: str | None = None,
) -> dict[str, Path]:
    """Write the report files (module docstring) to ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = dict(save_all(runs, out, x=x, band=band))
    for pattern in metrics:
        name = "metric_" + "".join(c if c.isalnum() or c in "-_." else "_" for c in pattern)
        plot_metric(runs, pattern, x=x, band=band, path=out / f"{name}.png")
        images[name] = out / f"{name}.png"
    if control:  # the gap over training, beside its final value, on both pages
        gap = paired_curve(runs, control)
        gap.to_csv(out / "paired_curve.csv", index=False)
        plot_paired_gap(gap, out / "paired_gap.png")
        images["paired_gap"] = out / "paired_gap.png"
    sections, paired = _sections(runs, images, control=control, metrics=metrics, command=command or this_command())
    paths = dict(images)
    table = final_loss_table(runs)
    (out / "final_loss.md").write_text(
        format_final_loss_table(table, paired=paired if len(paired) else None), encoding="utf-8"
    )
    table.to_csv(out / "final_loss.csv", index=False)
    paired.to_csv(out / "paired.csv", index=False)
    runs.summary.to_csv(out / "runs.csv")
    for name in (
        "final_loss.md",
        "final_loss.csv",
        "paired.csv",
        "runs.csv",
        *(("paired_curve.csv",) if control else ()),
    ):
        paths[name] = out / name
    page_path = Path(page) if page is not None else out / "report.md"
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(render_markdown(sections, title, page_path), encoding="utf-8")
    paths["report.md"] = page_path
    if with_html:
        (out / "report.html").write_text(render_html(sections, title), encoding="utf-8")
        paths["report.html"] = out / "report.html"
    return paths
