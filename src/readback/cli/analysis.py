"""``python -m readback.cli.analysis SWEEP_DIR [SWEEP_DIR ...] | --wandb ENTITY/PROJECT [--out DIR] [--html]
[--control EXP] [--pair-axis KEY=BASE] [--metric KEY ...] [--page PATH] [--x tokens|step]``

Loads every run under the sweep directories (or of a wandb project), groups them by
experiment and every override that varies except the seed, and writes to ``DIR`` (default
``<first SWEEP_DIR>/analysis``, or ``analysis/<project>`` for wandb alone) every plot as PNG,
``final_loss.md`` (and ``.csv``), ``paired.csv``, ``paired_curve.csv`` and ``paired_gap.png`` (the
paired gap at every evaluation), ``runs.csv``, ``report.md`` and, with
``--html``, the self-contained ``report.html``. Prints the keys it grouped by and the final-loss
table, with paired-seed differences from ``--control`` (default ``no_saved_copy`` when loaded).
``--pair-axis KEY=BASE`` also compares, seed by seed, each group whose override ``KEY`` is not
``BASE`` with its twin at ``BASE`` (mean, SE, 90 % t interval: ``paired_axis.md`` and ``.csv``).
Exit code 2, with one line on stderr, when a directory is missing or holds no runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

DEFAULT_CONTROL = "no_saved_copy"


@ends_on_ctrl_c("python -m readback.cli.analysis")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.cli.analysis", description=__doc__.split("\n\n")[1])
    parser.add_argument("sweep_dirs", nargs="*", metavar="SWEEP_DIR", help="a sweep (or run) directory")
    parser.add_argument("--wandb", default=None, metavar="ENTITY/PROJECT", help="also load the runs of a wandb project")
    parser.add_argument("--out", default=None, help="output directory (default: SWEEP_DIR/analysis)")
    parser.add_argument("--x", choices=("tokens", "step"), default="tokens", help="x axis of the curves")
    parser.add_argument(
        "--band", choices=("minmax", "std", "none"), default="minmax", help="band over seeds around the mean"
    )
    parser.add_argument(
        "--control",
        default=None,
        help=f"experiment the others are compared with by seed pairs (default {DEFAULT_CONTROL} if loaded; "
        "'none' for no comparison)",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="KEY",
        help="a logged key or glob (fp8_saturation/*, grad_norm): its last value per group and its curves; repeatable",
    )
    parser.add_argument(
        "--pair-axis",
        default=None,
        metavar="KEY=BASE",
        help="compare each group with its twin whose override KEY is BASE, by seed pairs (paired_axis.md)",
    )
    parser.add_argument("--html", action="store_true", help="also write the self-contained report.html")
    parser.add_argument("--page", default=None, help="write the Markdown page here instead of DIR/report.md")
    parser.add_argument("--title", default=None, help="title of the pages (default: the sweep names)")
    args = parser.parse_args(argv)
    if bool(args.sweep_dirs) == bool(args.wandb):
        print("error: give SWEEP_DIRs or --wandb ENTITY/PROJECT (one of the two)", file=sys.stderr)
        return 2
    if args.pair_axis is not None and "=" not in args.pair_axis:
        print(f"error: --pair-axis {args.pair_axis!r}: give KEY=BASE, e.g. precision.bf16_gemm=native", file=sys.stderr)
        return 2

    os.environ.setdefault("MPLBACKEND", "Agg")
    from readback.analysis import (
        final_loss_table,
        format_final_loss_table,
        format_metric_table,
        load_runs,
        load_wandb,
        metric_table,
        paired_table,
    )
    from readback.analysis.paired import axis_table
    from readback.analysis.render import cell_text, markdown_table
    from readback.analysis.report import this_command, write_report

    for d in args.sweep_dirs:
        if not Path(d).is_dir():
            print(f"error: no such sweep directory: {d}", file=sys.stderr)
            return 2
    if args.wandb:
        entity, _, project = args.wandb.rpartition("/")
        try:
            runs = load_wandb(project, entity or None)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        runs = load_runs(*args.sweep_dirs)
    if not len(runs):
        where = ", ".join(args.sweep_dirs + ([f"wandb {args.wandb}"] if args.wandb else []))
        print(f"error: no runs (directories with summary.json or metrics.jsonl) under {where}", file=sys.stderr)
        return 2
    control = args.control or (DEFAULT_CONTROL if DEFAULT_CONTROL in runs.experiments else None)
    if control == "none":
        control = None
    elif control is not None and control not in runs.experiments:
        print(
            f"error: --control {control!r} is not a loaded experiment; choose from {', '.join(runs.experiments)}",
            file=sys.stderr,
        )
        return 2
    default_out = (
        Path(args.sweep_dirs[0]) / "analysis" if args.sweep_dirs else Path("analysis") / args.wandb.replace("/", "_")
    )
    out = Path(args.out) if args.out else default_out
    names = [Path(d).name for d in args.sweep_dirs] + ([args.wandb] if args.wandb else [])
    paths = write_report(
        runs,
        out,
        x=args.x,
        band=None if args.band == "none" else args.band,
        control=control,
        metrics=args.metric,
        with_html=args.html,
        page=args.page,
        title=args.title or f"readback: {', '.join(names)}",
        command=this_command(argv),
    )
    print(f"grouped by: experiment{''.join(', ' + k for k in runs.group_keys)} (seeds pooled)")
    paired = paired_table(runs, control) if control else None
    print(format_final_loss_table(final_loss_table(runs), paired=paired))
    for pattern in args.metric:
        print(format_metric_table(metric_table(runs, pattern)))
    if args.pair_axis:
        key, base = args.pair_axis.split("=", 1)
        table = axis_table(runs, key, base)
        table.to_csv(out / "paired_axis.csv", index=False)
        cells = [[cell_text(v) for v in row] for row in table.itertuples(index=False)]
        text = markdown_table(list(table.columns), cells)
        (out / "paired_axis.md").write_text(text + "\n")
        print(text)
    print(f"{len(runs)} runs; wrote {', '.join(sorted(p.name for p in paths.values()))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
