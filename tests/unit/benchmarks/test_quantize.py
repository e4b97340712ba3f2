"""benchmarks/quantize.py end to end on a small tensor (a smoke test): every case it prints is a
finite time and ratio to torch's cast, so a broken call into ``quantize`` fails here."""

from __future__ import annotations

import math
import re

import quantize

ROW = re.compile(r"^  (.+?)\s+(\S+) ms\s+(\S+)x cast$")


def test_every_rounding_is_timed_against_torchs_cast(capsys):
    quantize.main(["--size", "128", "--repeats", "2"])
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("128x128 fp32 -> E4M3, median of 2 after a warm-up")
    rows = {m[1]: (float(m[2]), float(m[3])) for m in map(ROW.match, lines) if m}
    assert list(rows) == [
        "torch cast x.to(float8_e4m3fn)",
        "quantize(..., 'nearest')",
        "quantize(..., 'stochastic', generator)",
    ], lines
    assert rows["torch cast x.to(float8_e4m3fn)"][1] == 1.0
    for label, (ms, ratio) in rows.items():
        assert math.isfinite(ms) and ms >= 0 and math.isfinite(ratio) and ratio > 0, label
