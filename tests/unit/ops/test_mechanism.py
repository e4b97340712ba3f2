"""Mechanism statistics of attention: hand-made cases for the logit, entropy, D-term cosine and
O's rounding figures, their keys from a FOG step on a log step, and the analysis plot."""

from __future__ import annotations

import math

import pytest
import torch

from readback.analysis import runs_from_records
from readback.analysis.plots import plot_mechanism
from readback.backends import build_model
from readback.numerics import E4M3, CurrentScaling, QTensor, quantize
from readback.numerics.site import rounding_figures
from readback.numerics.state import Numerics
from readback.ops import attention as attention_op
from readback.ops import attention_parts, mechanism
from specs import make_spec
from toys import config


def test_logits_and_entropy_by_hand():
    numerics = Numerics(make_spec(precision="off"))
    scores = torch.tensor([[[[1.0, 9.0], [2.0, 4.0]]]])
    probs = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    mechanism.observe_logits(numerics, "a", scores, probs)
    stats = numerics.pop_observations()
    assert stats["attn_logit/max/a"] == 4.0  # 9.0 is masked
    assert stats["attn_logit/mean/a"] == pytest.approx(7 / 3)
    assert stats["attn_entropy/mean/a"] == pytest.approx(math.log(2) / 2)


def test_rounding_figures_by_hand():
    """E4M3 at scale 1 holds 1 and 0.001953125 (its smallest subnormal) exactly and rounds 1.03125
    to 1 (3 mantissa bits): the error is 0.03125 of a vector whose norm and rms are known."""
    x = torch.tensor([1.0, 1.03125, 0.001953125, 0.0])
    q = quantize(x, E4M3, torch.tensor(1.0))
    rel_err, amax_to_rms, log2_rms_scaled, history_amax_to_rms = rounding_figures(x, q)
    assert history_amax_to_rms is None  # no history given
    norm = math.sqrt(1 + 1.03125**2 + 0.001953125**2)
    assert float(rel_err) == pytest.approx(0.03125 / norm, rel=1e-12)
    assert float(amax_to_rms) == pytest.approx(1.03125 / (norm / 2), rel=1e-12)
    assert float(log2_rms_scaled) == pytest.approx(math.log2(norm / 2), rel=1e-12)
    scaled = rounding_figures(x, quantize(x, E4M3, torch.tensor(2.0**-7)))  # rms lands 7 binades lower
    assert float(scaled.log2_rms_scaled) == pytest.approx(math.log2(norm / 2) - 7, rel=1e-12)
    assert float(rounding_figures(x, QTensor(x, torch.tensor(1.0), None)).rel_err) == 0.0
    held = rounding_figures(x, q, history_amax=torch.tensor(2.0**10))  # a spike held in the history
    assert float(held.history_amax_to_rms) == pytest.approx(2.0**10 / (norm / 2), rel=1e-12)


def test_dterm_cosine_is_minus_one_for_a_one_signed_d_and_small_for_a_signless_one():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 2, 64, 64, generator=g), -1)
    keys = torch.randn(2, 2, 64, 8, generator=g)
    numerics = Numerics(make_spec(precision="off"))
    d_term = mechanism.DTermCosine(keys)
    d_term.add(probs, torch.full((2, 2, 64, 1), 0.3))
    d_term.observe(numerics, "a")
    assert numerics.pop_observations()["attn_dq_dterm_cos/mean/a"] == pytest.approx(-1.0)
    signs = torch.randint(0, 2, (2, 2, 64, 1), generator=g) * 2.0 - 1
    d_term = mechanism.DTermCosine(keys)
    d_term.add(probs, signs)
    d_term.observe(numerics, "a")
    assert abs(numerics.pop_observations()["attn_dq_dterm_cos/mean/a"]) < 0.2


def test_dterm_cosine_over_row_blocks_is_that_of_the_whole_layer():
    """The backward adds it block by block of query rows; the sums must give the whole-layer cosine."""
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(2, 2, 100, 100, generator=g), -1)
    keys, row_term = torch.randn(2, 2, 100, 8, generator=g), torch.randn(2, 2, 100, 1, generator=g) + 0.2
    whole, blocked = Numerics(make_spec(precision="off")), Numerics(make_spec(precision="off"))
    d_term = mechanism.DTermCosine(keys)
    d_term.add(probs, row_term)
    d_term.observe(whole, "a")
    d_term = mechanism.DTermCosine(keys)
    for rows in (slice(0, 64), slice(64, 100)):
        d_term.add(probs[:, :, rows], row_term[:, :, rows])
    d_term.observe(blocked, "a")
    mean_key = probs @ keys
    expected = torch.nn.functional.cosine_similarity((-row_term * mean_key).flatten(), mean_key.flatten(), dim=0)
    key = "attn_dq_dterm_cos/mean/a"
    assert (
        blocked.pop_observations()[key]
        == pytest.approx(whole.pop_observations()[key])
        == pytest.approx(float(expected))
    )


@pytest.mark.parametrize("policy", ["reuse_rounded", "no_saved_copy"])
def test_the_row_blocked_backward_logs_the_cosine_one_block_would(monkeypatch, policy):
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 4, 100, 16, generator=g),
        torch.randn(1, 2, 100, 16, generator=g),
        torch.randn(1, 2, 100, 16, generator=g),
    )
    d_o = torch.randn(1, 100, 64, generator=g)

    def cosine(row_block: int) -> float:
        monkeypatch.setattr(attention_parts, "BLOCK_ELEMENTS", 0)
        monkeypatch.setattr(attention_parts, "MIN_ROWS", row_block)
        numerics = Numerics(make_spec(recipe=CurrentScaling(), policy=policy))
        with numerics.measuring():
            o, _ = attention_op.attention(*(t.clone().requires_grad_() for t in (q, k, v)), numerics, "a")
            o.backward(d_o)
        return numerics.pop_observations()["attn_dq_dterm_cos/mean/a"]

    blocked = cosine(16)  # 7 blocks, the last partial
    assert blocked != 0
    assert blocked == pytest.approx(cosine(128), rel=1e-5, abs=1e-7)


def test_a_logged_fog_step_records_them_and_the_analysis_plots_them(tmp_path):
    cfg = config(
        "data=synthetic", "data.vocab_size=64", "model.vocab_size=64", "model.seq_len=16", "policy=reuse_rounded"
    )
    model = build_model(cfg)
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx).backward()  # not a log step: nothing measured
    assert not any(k.startswith("attn_logit") for k in model.numerics.pop_observations())
    with model.numerics.measuring():  # as the trainer's log steps do
        model(idx, idx).backward()
    stats = model.numerics.pop_observations()
    for key in ("attn_logit/max/", "attn_logit/mean/", "attn_entropy/mean/", "attn_dq_dterm_cos/mean/"):
        assert key + "layers.1.attn.core" in stats
    assert -1 <= stats["attn_dq_dterm_cos/mean/layers.0.attn.core"] <= 1
    assert "attn_dq_dterm_cos/z/layers.0.attn.core" not in stats  # one value per layer and step: no spread
    assert "attn_entropy/z/layers.0.attn.core" in stats  # one value per row
    # O's rounding: what the bias meter reads from the same forward (readback.bias.output_rounding)
    with model.numerics.measuring(), model.numerics.taping() as tape:
        model(idx, idx)
    again = model.numerics.pop_observations()
    o = dict(tape)["layers.0.attn.core"]
    figures = rounding_figures(o["out"], o["output"])
    assert again["attn_out_rel_err/mean/layers.0.attn.core"] == float(figures.rel_err) > 0
    assert again["attn_out_amax_to_rms/mean/layers.0.attn.core"] == float(figures.amax_to_rms) > 1
    assert again["attn_out_log2_rms_scaled/mean/layers.0.attn.core"] == float(figures.log2_rms_scaled)
    assert "attn_out_history_amax_to_rms/mean/layers.0.attn.core" not in again  # no history entry yet: scale 1
    # after a step the scale comes from the amax history: its ratio to O's rms sets where O lands
    model.numerics.end_step()
    with model.numerics.measuring(), model.numerics.taping() as tape:
        model(idx, idx)
    held = model.numerics.pop_observations()
    o = dict(tape)["layers.0.attn.core"]
    history_amax = model.numerics.site("layers.0.attn.core.output").history_amax
    figures = rounding_figures(o["out"], o["output"], history_amax)
    ratio = held["attn_out_history_amax_to_rms/mean/layers.0.attn.core"]
    assert ratio == float(figures.history_amax_to_rms) > 1
    # scale = 448 / history amax (margin 0): log2(rms * scale) = log2(448) - log2(history amax / rms)
    assert held["attn_out_log2_rms_scaled/mean/layers.0.attn.core"] == pytest.approx(
        math.log2(E4M3.max) - math.log2(ratio),
        abs=1e-6,  # the scale is an FP32 number
    )
    records = [
        {"step": s, "tokens": s, "loss": 1.0, **stats, **held, "fp8_underflow/layers.0.attn.core.output": 0.5}
        for s in (1, 2)
    ]
    runs = runs_from_records(
        [{"run_id": "r", "config": {"experiment": "reuse_rounded", "seed": 0}, "summary": None, "records": records}]
    )
    fig = plot_mechanism(runs, x="step", path=tmp_path / "mechanism.png")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 2 * 8 + 1 and (tmp_path / "mechanism.png").stat().st_size > 0  # 8 panels a layer, kurtosis
    history = next(ax for ax in shown if ax.get_title().startswith("history amax / rms(O)"))
    assert history.get_lines()  # drawn, not an empty panel
    grid = next(ax for ax in shown if ax.get_title().startswith("log2(rms(O) * scale)"))
    assert any(list(line.get_ydata()) == [-6, -6] for line in grid.get_lines())  # E4M3's smallest normal
