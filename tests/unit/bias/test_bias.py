"""The bias meter: its zero is the reference, it finds a planted wrong read, it separates the
D-term read from the backward's gradient roundings, and it leaves the run as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from readback.backends import build_model
from readback.bias import measure_bias, temporary_policy, variants
from readback.bias.__main__ import main as bias_main
from readback.config import CONF_DIR
from readback.policy import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def _model(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "model.vocab_size=64",
                "model.seq_len=16",
                "model.d_model=32",
                "model.n_heads=2",
                "model.n_kv_groups=1",
                "model.ffn_dim=48",
                "precision.recipe=current",
                *overrides,
            ],
        )
    torch.manual_seed(0)
    return build_model(cfg)


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(n)]


def test_everything_exact_is_the_reference_and_the_run_is_untouched():
    model = _model("policy=reuse_rounded")
    before = model.numerics.state_dict()
    result = measure_bias(model, _batches())
    assert result.stats["all_exact"]["total"]["rel_err"] < 1e-6
    assert result.stats["reuse_rounded"]["total"]["rel_err"] > 1e-3  # FP8 backward: a visible error
    assert all(p.grad is None for p in model.parameters())
    after = model.numerics.state_dict()
    assert after["step"] == before["step"] and set(after["sites"]) == set(before["sites"])
    assert result.steps_per_batch > 1 and set(result.metrics()) >= {
        "grad_bias/reuse_rounded/total",
        "grad_bias_cos/all_exact/total",
    }


def test_a_planted_wrong_read_is_found_where_it_acts():
    """A test-only policy whose softmax backward reads the FP8 copy P8 instead of the original
    P: the meter lists that read, and switching it back to exact moves the gradients of the
    attention inputs (QKV and everything before it), never the projection or MLP after it."""
    model = _model("policy=exact")
    with temporary_policy("planted", base="exact", reads={"attention": {"dS": "rounded"}}):
        model.numerics.policy = "planted"
        names = [v.name for v in variants(model.numerics)]
        assert "exact_read.attention.dS" in names and "planted" in names
        result = measure_bias(model, _batches())
    assert "planted" not in POLICIES  # the test-only policy is gone after its block
    contribution = result.stats["contrib.exact_read.attention.dS"]
    for group in ("layers.1.attn.qkv", "layers.0.attn.qkv", "layers.0.mlp.up", "embedding"):
        assert contribution[group]["rel_err"] > 1e-3, group
    for group in ("layers.1.attn.proj", "layers.1.attn_norm", "layers.1.mlp.up", "layers.1.mlp.act"):
        assert contribution[group]["rel_err"] == 0.0, group
    assert result.stats["contrib.exact_read.attention.dS"]["total"] == result.stats["contrib.planted"]["total"]


def test_the_d_term_read_is_its_own_contribution():
    """Under a stressed reuse_rounded the D-term read moves the attention inputs' gradients of its
    layer (and everything before), never the projection or MLP after it; the attention
    backward's E5M2 roundings are a separate entry."""
    model = _model("policy=reuse_rounded", "precision.site_margin={attn.core.output:10}")
    result = measure_bias(model, _batches())
    d_term = result.stats["contrib.exact_read.attention.D"]
    assert d_term["layers.1.attn.qkv"]["rel_err"] > 1e-3
    for group in ("layers.1.attn.proj", "layers.1.mlp.up", "layers.1.mlp.down", "layers.1.attn_norm"):
        assert d_term[group]["rel_err"] == 0.0, group
    assert result.stats["contrib.fresh_reround"]["layers.1.attn.qkv"]["rel_err"] > 0
    assert result.stats["contrib.no_saved_copy"]["total"]["rel_err"] == 0.0  # no_saved_copy reads like exact
    assert "contrib.exact_bwd.attention" in result.stats


@pytest.mark.slow
def test_bias_in_training_and_from_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    tiny = [
        "data=synthetic",
        "logger=none",
        "trainer.progress=false",
        "model.n_layers=1",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_kv_groups=1",
        "model.ffn_dim=64",
        "model.seq_len=32",
        "model.global_batch=4",
        "trainer.micro_batch=2",
        "trainer.steps=2",
        "trainer.log_every=1",
        "trainer.eval_every=2",
        "trainer.eval_batches=1",
        "trainer.ckpt_every=2",
        "+experiment=reuse_rounded",
        "precision.site_margin={attn.core.output:12}",
        "probe.bias_every=2",
        "probe.bias_batches=1",
    ]
    subprocess.run(
        [sys.executable, "train.py", *tiny, f"hydra.run.dir={run}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "grad_bias/reuse_rounded/layers.0.attn.qkv" in records[-1]
    assert "grad_bias/contrib.exact_read.attention.D/total" in records[-1]
    assert "fp8_underflow/layers.0.attn.core.output" in records[-1]
    assert bias_main([str(run), "--batches", "2", "--out", str(tmp_path / "bias")]) == 0
    written = json.loads((tmp_path / "bias" / "bias.json").read_text())
    assert written["checkpoint_step"] == 2 and written["batches"] == 2
    assert (tmp_path / "bias" / "bias.png").stat().st_size > 0
    assert "| contrib.exact_read.attention.D | total |" in (tmp_path / "bias" / "bias.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        bias_main([str(tmp_path / "nothing_here")])
    assert exit_.value.code == 2
