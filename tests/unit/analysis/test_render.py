"""One cell formatter for the Markdown tables and the HTML report: the same value reads the same on
both pages, a missing value is always ``-`` and a number always a number."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pandas as pd

from readback.analysis import final_loss_table, format_final_loss_table, runs_from_records
from readback.analysis.render import difference_cell, html_table, markdown_table, plus_minus, se_digits
from readback.analysis.report import Section, render_html
from readback.analysis.tables import final_loss_cells
from sweeps import config, records, summary

# value -> what both renderers write for it
CELLS = [
    (math.nan, "-"),
    (np.float32("nan"), "-"),
    (None, "-"),
    (pd.NA, "-"),
    (pd.NaT, "-"),
    (3, "3"),
    (np.int64(3), "3"),
    (True, "True"),
    (0.123456, "0.1235"),
    (np.float64(2.5), "2.5"),
    (math.inf, "inf"),
    (-math.inf, "-inf"),
    ("a|b", "a|b"),
    ("`train.py seed=1`", "`train.py seed=1`"),
    (plus_minus(7.31415, 0.0123, 3), "7.314 ± 0.012"),
    (plus_minus(7.3, math.nan, 3), "7.300"),
    (plus_minus(math.nan, 0.1, 3), "-"),
    (plus_minus(math.inf, 0.1, 3), "inf ± 0.100"),
    (difference_cell(0.015, 0.002, 3, n=3), "+0.015 ± 0.002 (n=3, 7.5 SE)"),
    (difference_cell(0.015, None, 3, n=1), "+0.015 (n=1)"),
    (difference_cell(None, 0.002, 3), "-"),
]


def markdown_cells(text: str) -> list[list[str]]:
    """The cells of a Markdown table's body, unescaped and unpadded."""
    rows = []
    for line in text.splitlines()[2:]:
        cells = re.split(r"(?<!\\) \| ", line[2:-2])
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def html_cells(text: str) -> list[list[str]]:
    """The cells of an HTML table's body as text, `code` spans written back as Markdown."""
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", text.split("<tbody>", 1)[1]):
        cells = re.findall(r"<td>(.*?)</td>", row)
        rows.append([html.unescape(re.sub(r"<code>(.*?)</code>", r"`\1`", c)) for c in cells])
    return rows


def test_markdown_and_html_write_every_cell_value_the_same():
    values = [v for v, _ in CELLS]
    rows = [values[i : i + 3] + [None] * (3 - len(values[i : i + 3])) for i in range(0, len(values), 3)]
    headers = ["a", "b", "c"]
    md, page = markdown_cells(markdown_table(headers, rows)), html_cells(html_table(headers, rows))
    assert md == page
    written = [c for row in md for c in row][: len(CELLS)]
    assert written == [text for _, text in CELLS]


def test_the_final_loss_table_reads_the_same_in_final_loss_md_and_the_html_report():
    def run(exp, seed, final, val):
        return {
            "run_id": f"{exp}/{seed}",
            "config": config(exp, seed),
            "records": records([5.0, final]),
            "summary": summary("completed", final, val, 20, exp),
        }

    # one seed of no_saved_copy: no std; no val loss for reuse_rounded: a missing cell
    runs = runs_from_records(
        [run("reuse_rounded", 0, 4.1, None), run("reuse_rounded", 1, 4.3, None), run("no_saved_copy", 0, 4.0, 3.9)]
    )
    table = final_loss_table(runs)
    headers, rows, _ = final_loss_cells(table)
    md = markdown_cells(format_final_loss_table(table).split("\n\n")[0])
    page = html_cells(render_html([Section("Final loss", headers, rows)], "t"))
    assert md == page
    assert md[0][:4] == ["reuse_rounded", "2", "4.200 ± 0.141", "-"]
    assert md[1][:4] == ["no_saved_copy", "1", "4.000", "3.900"]


def test_an_se_is_shown_to_two_significant_digits_and_its_estimate_to_the_same_place():
    assert [se_digits(se) for se in (0.0023, 2.5e-5, 0.074, 1.0, 35.0)] == [4, 6, 3, 1, 0]
    n = se_digits(2.46e-5)
    assert f"{8.59e-5:.{n}f} ± {2.46e-5:.{n}f}" == "0.000086 ± 0.000025"  # never 0.0001 ± 0.0000
    assert se_digits(0.0) == se_digits(float("nan")) == se_digits(None) == 4  # no SE to size by
