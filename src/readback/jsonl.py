"""JSON Lines records as every reader of them takes them: one object a line, a torn line (a run
killed mid-write) counted and skipped, not raised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl_counted(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a ``.jsonl`` file and how many lines could not be read (a run killed
    mid-write leaves a torn last line); no file: no records."""
    records, bad = [], 0
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (crash mid-write) is ignored."""
    return read_jsonl_counted(path)[0]
