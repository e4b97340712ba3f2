"""benchmarks/threads.py end to end (a smoke test: one short round): a row for each thread count
quiet and beside the busy process, each a finite speed, the quiet rows the anchor of their count."""

from __future__ import annotations

import math

import threads


def test_each_thread_count_is_timed_quiet_and_beside_a_busy_process(capsys):
    threads.main(["--threads", "1", "--rounds", "1", "--seconds", "0.05", "--batch", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ") and lines[1].startswith("tiny reuse_rounded, batch 2 x 128")
    rows = {tuple(line.split()[:2]): [float(x) for x in line.split()[2:]] for line in lines[3:-1]}
    assert list(rows) == [("1", "quiet"), ("1", "busy")]
    assert rows["1", "quiet"][3:] == [1.0, 1.0]
    for speed, low, high, *ratios in rows.values():
        assert 0 < low <= speed <= high and all(math.isfinite(r) and r > 0 for r in ratios)
