"""benchmarks/step.py runs (a smoke test: one round, a few variants) and says what it ran on."""

from __future__ import annotations

import sys

import pytest
import torch

import peers
import step
from readback.train.launch import keep_freed_memory


def test_one_round_prints_the_cpu_and_every_variant_against_the_fp32_peer(monkeypatch, capsys):
    argv = ["step.py", "--sizes", "tiny", "--threads", "1", "--rounds", "1", "--no-memory"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--variants", "bf16_baseline", "reuse_rounded@mxfp8", "plain_fog", "plain_fp32"]
    )
    step.main()
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "dispatches" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert {"bf16_baseline", "reuse_rounded@mxfp8", "plain_fog", "plain_fp32"} <= set(rows)
    assert rows["plain_fp32"][6] == "1.00"  # the peer against itself; the header's 7th column is "/ fp32"


@pytest.mark.parametrize(
    ("variant", "recipe", "bf16_gemm"),
    [("reuse_rounded@mxfp8", "mxfp8", "fp32"), ("reuse_rounded@precision.bf16_gemm=native", "delayed", "native")],
)
def test_a_variant_after_at_takes_a_recipe_or_one_override(variant, recipe, bf16_gemm):
    _, fog = step.build(variant, "tiny", 2)
    assert (fog.numerics.spec.precision.recipe, fog.numerics.spec.bf16_gemm) == (recipe, bf16_gemm)


def test_a_compiled_variant_lifts_dynamos_limit_of_graphs_per_function(monkeypatch):
    """Past the limit a compiled variant would run eager under its compiled name, silently."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    step.build("reuse_rounded", "tiny", 2)
    assert torch._dynamo.config.recompile_limit == 8
    step.build("reuse_rounded+compile", "tiny", 2)
    assert torch._dynamo.config.recompile_limit == step.RECOMPILE_LIMIT


def test_the_cpu_description_names_the_isa_and_its_limits(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu sse avx avx2 fma\n")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    text = step.cpu_description(str(cpuinfo))
    assert text.startswith("Some CPU, AVX2;") and text.endswith("(limited by ONEDNN_MAX_CPU_ISA=AVX2)")


def test_glibc_keeps_freed_memory():
    assert keep_freed_memory()  # both mallopt settings accepted (this runs on glibc)


def test_the_plain_fog_is_fog_without_readbacks_numerics():
    """The same architecture: FOG's parameters by name and shape, and a finite loss that trains."""
    _, fog = step.build("reuse_rounded", "tiny", 2)
    plain = peers.plain_fog(fog.cfg, fog.numerics)
    shapes = {n: p.shape for n, p in plain.named_parameters()}
    assert shapes == {n: p.shape for n, p in fog.named_parameters()}
    x = torch.randint(0, fog.cfg.vocab_size, (2, fog.cfg.seq_len))
    loss = plain(x, x.roll(-1, 1))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in plain.parameters())
