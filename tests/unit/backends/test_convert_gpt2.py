"""``readback.convert`` on a tiny transformers GPT-2, whose linears are ``Conv1D`` (weight of shape
``(in, out)``, ``y = x @ W + b``): every one converted to readback's FP8 linear with its
Parameters, shapes and ``state_dict`` kept; outputs within FP8 tolerance of the unconverted model;
its GEMMs rounded at their sites; gradients that read what the linear's READS declare; and under
``backend="te"`` each ``Conv1D`` left, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import readback
from readback.audit.core import audit
from readback.backends import convert as convert_module
from readback.backends.converted import ConvertedConv1D
from readback.ops import linear as linear_op

transformers = pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
from transformers.pytorch_utils import Conv1D  # noqa: E402  (after the skip)

VOCAB = 128
# FP8 forward, FP32 backward GEMMs: what a gradient read is then told apart from GEMM round-off.
FP32_BACKWARD = {"recipe": "current", "override_linear_precision": [False, True, True]}


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def conv1d_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Conv1D)]


def tokens(seed: int = 0, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_every_conv1d_is_converted_keeping_parameters_and_state_dict():
    model = gpt2()
    names = conv1d_names(model)
    assert len(names) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per layer
    params = dict(model.named_parameters())
    state = {k: (tuple(v.shape), v.stride()) for k, v in model.state_dict().items()}
    report = readback.convert(model, policy="reuse_rounded")
    for name in names:
        assert report.swapped[name].startswith("Conv1D -> readback.ops.linear"), name
        assert isinstance(model.get_submodule(name), ConvertedConv1D)
    assert not [n for n in report.left if n in names]
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(p is params[n] for n, p in now.items())  # the very Parameters
    assert {k: (tuple(v.shape), v.stride()) for k, v in model.state_dict().items()} == state
    model.load_state_dict(gpt2(seed=1).state_dict())  # a GPT-2 checkpoint loads as it is


def test_outputs_match_the_unconverted_model():
    reference = gpt2()
    off, fp8 = copy.deepcopy(reference), copy.deepcopy(reference)
    readback.convert(off, precision="off")
    report = readback.convert(fp8)
    ids = tokens()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        exact, rounded = off(input_ids=ids).logits, fp8(input_ids=ids).logits
    assert torch.allclose(exact, want, rtol=1e-4, atol=1e-5)
    rel = ((rounded - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1, rel  # FP8 (E4M3) GEMMs: a few per cent, and not zero
    assert report.attention == {"transformer.h.0.attn": 1, "transformer.h.1.attn": 1}


def test_the_conv1d_gemms_run_in_fp8_at_their_sites():
    model = gpt2()
    readback.convert(model)
    out = model(input_ids=tokens(), labels=tokens())
    out.loss.backward()
    sites = model.numerics.sites
    for name in conv1d_names(gpt2()):
        for tensor in ("weight", "grad_output"):
            site = sites[f"{name}.{tensor}"]
            assert site.fmt is not None and int(site.nonzero) > 0, (name, tensor)  # rounded, counted
    # the input of the linear after each norm is the norm's rounded copy; the others round their own
    assert "transformer.h.0.attn.c_attn.input" not in sites and "transformer.h.0.ln_1.output" in sites
    assert "transformer.h.0.mlp.c_proj.input" in sites


@pytest.mark.parametrize("name", ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_proj"])
def test_conv1d_gradients_read_what_the_linear_rules_declare(name):
    """Weight gradient ``X8^T dY`` in Conv1D's ``(in, out)`` layout, input gradient ``dY W8^T``:
    the forward's rounded copies, as ``linear.READS`` says (classified by the audit)."""
    model = gpt2()
    readback.convert(model, precision=FP32_BACKWARD, policy="exact")
    seen: dict[str, torch.Tensor] = {}

    def keep(module, inputs, output):
        seen["x"], seen["y"] = inputs[0], output
        for t in (inputs[0], output):
            t.retain_grad()

    model.get_submodule(name).register_forward_hook(keep)
    with model.numerics.taping() as tape:
        model(input_ids=tokens(3), labels=tokens(4)).loss.backward()
    record = dict(tape)[name]
    weight = model.get_submodule(name).weight
    d_y = seen["y"].grad.reshape(-1, weight.shape[1]).double()
    x = seen["x"].detach().reshape(-1, weight.shape[0]).double()
    x8, w8 = record["input"].dequantize(torch.float64), record["weight"].dequantize(torch.float64)
    assert w8.shape == weight.shape[::-1]  # the op multiplies W^T, (out, in)
    wgrad = {"rounded": x8.mT @ d_y, "original": x.mT @ d_y}
    dgrad = {"rounded": d_y @ w8, "original": d_y @ weight.detach().double().mT}
    declared = linear_op.READS["exact"]
    dx = seen["x"].grad.reshape(-1, weight.shape[0])
    rows = [
        *audit("Conv1D", "wgrad", weight.grad, wgrad["rounded"], wgrad, declared=declared),
        *audit("Conv1D", "dgrad", dx, dgrad["rounded"], dgrad, declared=declared),
    ]
    assert [(r.reads, r.declared, r.ok) for r in rows] == [("rounded", "rounded", True)] * 2


class StandInTE:
    """``convert_te.TEConverter``'s interface on a CPU (nn.Linear and nn.LayerNorm copies)."""

    def __init__(self, numerics, device):
        pass

    def linear_from(self, module, name):
        return copy.deepcopy(module)

    def norm_from(self, module, name, center):
        return copy.deepcopy(module)

    def describe(self, kind):
        return {"linear": "te.Linear", "layer_norm": "te.LayerNorm", "rms_norm": "te.RMSNorm"}[kind]


def test_under_backend_te_each_conv1d_is_left_with_the_transposed_weight_reason(monkeypatch):
    from readback.backends.te import convert as convert_te

    monkeypatch.setattr(convert_te, "TEConverter", StandInTE)  # no CUDA, no TE here
    model = gpt2()
    report = readback.convert(model, backend="te")
    names = conv1d_names(gpt2())
    assert {n: report.left[n] for n in names} == dict.fromkeys(names, convert_module.TE_CONV1D)
    assert "transposed copy" in convert_module.TE_CONV1D
    assert all(type(model.get_submodule(n)) is Conv1D for n in names)
    assert report.swapped["lm_head"] == "Linear -> te.Linear"
    assert "Conv1D" in str(report) and "transposed copy" in str(report)
