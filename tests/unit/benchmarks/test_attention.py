"""benchmarks/attention.py runs (a smoke test: one round at a short sequence) and says what it ran on."""

from __future__ import annotations

import sys

import torch

import attention as bench


def test_one_round_prints_the_cpu_and_each_variant_against_sdpa(monkeypatch, capsys):
    argv = ["attention.py", "--seqs", "128", "--rounds", "1", "--no-memory"]
    monkeypatch.setattr(sys, "argv", [*argv, "--variants", "sdpa", "reuse_rounded/fp8", "reuse_rounded/bf16-te"])
    bench.main()
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "dispatches" in out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("    128 ")}
    assert set(rows) == {"sdpa", "reuse_rounded/fp8", "reuse_rounded/bf16-te"}
    assert rows["sdpa"][4] == "1.00"  # SDPA against itself


def test_the_peak_rise_counts_what_the_run_holds_at_once():
    def hold():
        t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        del t

    assert bench.peak_rise(hold) > 48
