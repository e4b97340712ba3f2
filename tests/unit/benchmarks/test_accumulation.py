"""benchmarks/accumulation.py without timing anything that matters: the GEMM shapes of a step, the
operands' formats, the interleaving, and the step totals."""

from __future__ import annotations

import pytest
import torch

import accumulation

TINY = accumulation.gemm_shapes("tiny", tokens=2048, vocab=2048)


def test_the_tiny_fogs_gemms_are_fprop_dgrad_and_wgrad_of_each_linear():
    shapes = {(name, gemm): (m, k, n) for name, gemm, m, k, n in TINY}
    assert len(TINY) == 5 * 3
    # d_model 64, 4 heads of 16, 2 KV groups, FFN 192 (conf/model/tiny.yaml)
    assert shapes["qkv", "fprop"] == (2048, 64, 128)
    assert shapes["qkv", "dgrad"] == (2048, 128, 64)
    assert shapes["qkv", "wgrad"] == (128, 2048, 64)
    assert shapes["down", "fprop"] == (2048, 192, 64)
    assert shapes["lm_head", "fprop"] == (2048, 64, 2048)
    assert shapes["lm_head", "wgrad"] == (2048, 2048, 64)


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_gradients_are_the_left_e5m2_operand_of_the_backward_gemms(gemm):
    a, b = accumulation.operands(gemm, 4, 32, 8, torch.Generator().manual_seed(0))
    assert a.data.shape == (4, 32) and b.data.shape == (32, 8)
    assert a.data.dtype == (torch.float8_e4m3fn if gemm == "fprop" else torch.float8_e5m2)
    assert b.data.dtype == torch.float8_e4m3fn


def test_the_cases_alternate_within_each_round():
    calls = []
    medians = accumulation.interleaved_ms({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, rounds=3)
    assert calls == ["x", "y"] * 4  # one warm-up each, then three rounds
    assert set(medians) == {"x", "y"}


def test_a_steps_totals_count_the_blocks_linears_per_layer():
    rows = [
        dict(linear="qkv", gemm="fprop", ieee=1.0, fast=10.0, split=20.0),
        dict(linear="qkv", gemm="wgrad", ieee=2.0, fast=30.0, split=40.0),
        dict(linear="lm_head", gemm="dgrad", ieee=5.0, fast=50.0, split=60.0),
    ]
    totals = accumulation.step_totals(rows, n_layers=2, head=True)
    assert totals == {"ieee": 2 * 3.0 + 5.0, "fast": 2 * 40.0 + 50.0, "split": 2 * 60.0 + 60.0, "hopper": 2 * 50.0 + 60}
    # the study's LM head is BF16: its GEMMs are not FP8 ones
    assert accumulation.step_totals(rows, n_layers=2) == {"ieee": 6.0, "fast": 80.0, "split": 120.0, "hopper": 100.0}


def test_it_measures_every_mode_of_a_small_model(capsys, monkeypatch):
    shapes = accumulation.gemm_shapes
    monkeypatch.setattr(accumulation, "gemm_shapes", lambda model, tokens, vocab: shapes(model, tokens, vocab)[:3])
    accumulation.main(["--micro-batch", "1", "--rounds", "1", "--step"])
    out = capsys.readouterr().out
    assert "qkv fprop" in out and "128x64x128" in out and "qkv wgrad" in out and "hopper / ieee" in out
    assert "training step (reuse_rounded): ieee" in out
