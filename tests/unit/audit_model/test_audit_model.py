"""audit_model: every saved tensor of a step, what storing it in FP8 costs, on readback's FOG
(agreeing with the READS tables, and finding a planted wrong read), plain PyTorch modules, a
Hugging Face model from a tiny config and torchao's float8 training."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from readback.audit_model import audit_saved, stored, to_markdown, write
from readback.audit_model.examples import fog_example
from readback.audit_model.fog_reads import compare_reads
from toys import PLANTED_READS


@pytest.fixture(scope="module")
def fog_rows():
    model, loss_fn = fog_example("exact", 0, "model.n_layers=1", "model.seq_len=8")
    return audit_saved(model, loss_fn, storages=("e4m3", "original"))


def test_fog_verdicts_agree_with_the_reads_tables(fog_rows):
    compared = compare_reads(fog_rows, "exact")
    matched = {(c["op"], c["gradient"]) for c in compared}
    assert matched == {
        ("linear", "wgrad"),
        ("linear", "dgrad"),
        ("rms_norm", "gain"),
        *(("attention", g) for g in ("dQ", "dK", "dV", "dP", "dS")),
    }
    assert all(c["agrees"] for c in compared), [c for c in compared if not c["agrees"]]
    assert all(r.verdicts["original"] == "free" for r in fog_rows)  # the control changes nothing


def test_a_planted_wrong_read_is_found(fog_rows):
    """A test-only policy declaring that the softmax backward reads the FP8 copy of P: the audit
    shows that storing P rounded moves the gradient, so the declaration is wrong."""
    wrong = [c for c in compare_reads(fog_rows, reads=PLANTED_READS) if not c["agrees"]]
    assert [(c["op"], c["gradient"]) for c in wrong] == [("attention", "dS")]
    assert wrong[0]["saved"].endswith("SoftmaxBackward0.result")


def test_plain_modules_by_hand(tmp_path):
    """Linear -> tanh -> Linear: the first weight's gradient reads the input, tanh's gradient reads
    its saved output; an input already on the E4M3 grid is free to store rounded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False))
    x = stored(torch.randn(32, 8), "e4m3")  # already an FP8 value
    rows = audit_saved(model, lambda: model(x).square().mean())
    by_name = {r.name: r for r in rows}
    first = by_name["0/MmBackward0.self"]  # the input x, read by the first weight's gradient only
    assert first.verdicts["e4m3"] == "free" and first.hurts() == ["0"]  # E5M2 and fresh move it
    assert first.errors["e5m2"]["0"] > 1e-3 and first.errors["e5m2"]["2"] == 0.0
    tanh = by_name["1/TanhBackward0.result"]
    assert tanh.hurts() == ["0"] and tanh.errors["e4m3"]["2"] == 0.0
    assert tanh.fp8_bytes_saved == 32 * 16 * 3
    paths = write(rows, tmp_path, "plain")
    assert "TanhBackward0.result" in paths["markdown"].read_text() and paths["plot"].stat().st_size > 0


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers not installed (pip install 'readback[audit]')",
)
def test_hugging_face_llama_from_a_tiny_config():
    from readback.audit_model.examples import hf_example

    model, loss_fn = hf_example()
    rows = audit_saved(model, loss_fn, storages=("e4m3", "original"))
    names = [r.name for r in rows]
    assert any(n.startswith("model.layers.0.self_attn/SoftmaxBackward0.result") for n in names)
    softmax = next(r for r in rows if "SoftmaxBackward0.result" in r.name)
    assert softmax.verdicts["e4m3"] != "free" and "model.layers.0.self_attn.q_proj" in softmax.hurts(top=10)
    assert all(r.verdicts["original"] == "free" for r in rows)
    assert "| saved tensor" in to_markdown(rows)


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed (pip install 'readback[audit]')"
)
def test_torchao_float8_linear_reads_a_recast_of_its_saved_input():
    """torchao saves the high-precision input and casts it to E4M3 (current scaling) in backward:
    storing that input as its E4M3 rounding changes no gradient, E5M2 does."""
    from readback.audit_model.examples import torchao_example

    model, loss_fn = torchao_example()
    rows = audit_saved(model, loss_fn)
    saved_inputs = [r for r in rows if "matmul_with_hp_or_float8_args" in r.name and r.name.endswith("[0]")]
    assert len(saved_inputs) == 2
    for row in saved_inputs:
        assert row.dtype == "float32" and row.verdicts["e4m3"] == "free" and row.verdicts["e5m2"] != "free"
