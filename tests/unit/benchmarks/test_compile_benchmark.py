"""benchmarks/compile.py's arithmetic: the break-even from a compile's cost and the steps' times,
and the report of one size (its measuring takes minutes of compiling: run by hand)."""

from __future__ import annotations

import math

import pytest

import compile as compile_benchmark


def test_the_break_even_counts_only_the_compiled_steps_of_an_optimizer_step():
    # 90 s repaid by 4 micro-steps of 0.1 s saved, in 9 optimizer steps of 10: 250 steps
    assert compile_benchmark.break_even(90.0, 0.3, 0.2, accum=4, log_every=10) == pytest.approx(250)
    assert compile_benchmark.break_even(90.0, 0.2, 0.2, accum=1, log_every=10) == math.inf  # never pays


def test_the_report_gives_each_caches_cost_and_break_even(capsys):
    result = {
        "costs": {"cold": [120.0, 80.0, 100.0], "warm": [10.0, 30.0, 20.0]},
        "times": {"eager": [0.3, 0.4, 0.2], "compiled": [0.1, 0.2, 0.3]},
    }
    figures = compile_benchmark.report("tiny", "reuse_rounded", 3, result, log_every=10)
    assert figures["cold_s"] == 100.0 and figures["warm_s"] == 20.0
    assert figures["cold_break_even_steps"] == pytest.approx(100.0 / (0.1 * 0.9))
    out = capsys.readouterr().out
    assert "compiled / eager 0.67" in out and "cache warm: 20.0 s (rounds 10.0, 30.0, 20.0)" in out
