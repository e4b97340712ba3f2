"""One way to write a table cell, shared by the Markdown tables (``final_loss.md``, ``report.md``)
and the HTML report, so that a number reads the same on every page.

A cell without a value (``None``, NaN, pandas' ``NA`` or ``NaT``) is written ``-``; any other
number is written as a number, ``inf`` included (an overflow is a value, not a gap); floats by a
format spec (``.4g`` unless the column asks for another), everything else by ``str``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

MISSING = "-"


def is_missing(value: Any) -> bool:
    """Whether a cell has no value to show: ``None``, NaN of any float type, ``pd.NA``, ``pd.NaT``."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def cell_text(value: Any, spec: str = ".4g") -> str:
    """The text of one cell: ``-`` without a value, a float by ``spec``, anything else by ``str``."""
    if is_missing(value):
        return MISSING
    if isinstance(value, (float, np.floating)):
        return format(value, spec)
    return str(value)


def plus_minus(mean: float, spread: float, digits: int) -> str:
    """``mean ± spread`` with ``digits`` decimals; the mean alone without a spread, ``-`` without
    a mean."""
    if is_missing(mean):
        return MISSING
    text = f"{mean:.{digits}f}"
    return text if is_missing(spread) else f"{text} ± {spread:.{digits}f}"


def se_digits(se: float, significant: int = 2) -> int:
    """The decimals that show ``se`` to ``significant`` digits, so that an estimate beside it is
    written to the precision its SE needs (never ``0.0001 ± 0.0000``); 4 without a positive SE."""
    if is_missing(se) or not math.isfinite(se) or se <= 0:
        return 4
    return max(0, significant - 1 - math.floor(math.log10(se)))


def difference_cell(mean: float, se: float, digits: int = 3, n: int | None = None) -> str:
    """``+0.015 ± 0.002 (n=3, 7.5 SE)``; ``-`` without a value."""
    if is_missing(mean):
        return MISSING
    text, extra = f"{mean:+.{digits}f}", [] if n is None else [f"n={n}"]
    if not is_missing(se):
        text += f" ± {se:.{digits}f}"
        if se > 0:
            extra.append(f"{abs(mean) / se:.1f} SE")
    return text + (f" ({', '.join(extra)})" if extra else "")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured Markdown table (no third-party formatter). ``align``: ``l``/``r``/``c``
    per column. Cells are written by :func:`cell_text`; ``|`` in them is escaped."""
    cells = [[_markdown_cell(h) for h in headers]] + [[_markdown_cell(c) for c in row] for row in rows]
    n = len(headers)
    if any(len(r) != n for r in cells):
        raise ValueError("every row needs one cell per header")
    align = list(align or ["l"] * n)
    width = [max(3, *(len(r[i]) for r in cells)) for i in range(n)]
    rule = {
        "l": lambda w: ":" + "-" * (w - 1),
        "r": lambda w: "-" * (w - 1) + ":",
        "c": lambda w: ":" + "-" * (w - 2) + ":",
    }

    def line(r: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(width[i]) if align[i] == "r" else c.ljust(width[i]) for i, c in enumerate(r))
            + " |"
        )

    out = [line(cells[0]), "| " + " | ".join(rule[a](width[i]) for i, a in enumerate(align)) + " |"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _markdown_cell(value: Any) -> str:
    return cell_text(value).replace("|", "\\|").replace("\n", " ")


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table in HTML: cells written by :func:`cell_text`, Markdown's `code` spans kept."""
    head = "".join(f"<th>{html.escape(cell_text(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html_inline(cell_text(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_inline(text: str) -> str:
    """Escaped text with Markdown's `code` spans kept as <code>."""
    pieces = str(text).split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(pieces))
