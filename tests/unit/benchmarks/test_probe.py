"""benchmarks/probe.py end to end on the tiny FOG (a smoke test: one timed step per row): every row
it prints is a finite time and ratio, so a broken call into the probe fails here."""

from __future__ import annotations

import math
import re

import probe

ROW = re.compile(r"^  (.+?)\s+(\S+) ms\s+(\S+)x$")


def test_every_probe_row_is_a_finite_time_against_the_plain_step(capsys):
    probe.main(["--repeats", "1", "2", "--steps", "1", "--batch", "2"])
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("tiny reuse_rounded, batch 2 x ")
    rows = {m[1]: (float(m[2]), float(m[3])) for m in map(ROW.match, lines) if m}
    assert list(rows) == [
        "plain step (forward + backward)",
        "probe, repeats=1",
        "probed step, repeats=1",
        "probe, repeats=2",
        "probed step, repeats=2",
    ], lines
    assert rows["plain step (forward + backward)"][1] == 1.0
    for label, (ms, ratio) in rows.items():
        assert math.isfinite(ms) and ms > 0 and math.isfinite(ratio) and ratio > 0, label
