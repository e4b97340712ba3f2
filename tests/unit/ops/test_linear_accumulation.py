"""precision.accumulation: resolved once into the spec, read by each of a linear's FP8 GEMMs."""

from __future__ import annotations

import pickle

import pytest
import torch

import readback.numerics.gemm as gemm
from readback.config import from_saved, validate
from readback.errors import ConfigError
from readback.numerics import CurrentScaling
from readback.numerics.precision_settings import resolve_accumulation
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from readback.ops.linear import linear
from readback.train.settings import plain_config
from specs import make_spec
from toys import compose


def numerics_of(cfg):
    return Numerics(numerics_spec(cfg.numerics), seed=cfg.seed)


@pytest.mark.parametrize(
    "name, gemms, resolved",
    [
        ("native", None, ("native", "native", "native")),
        ("ieee", None, ("ieee", "ieee", "ieee")),
        ("hopper", None, ("fast", "split", "split")),
        ("hopper", {"dgrad": "fast"}, ("fast", "fast", "split")),
        ("native", {"wgrad": "ieee", "fprop": "split"}, ("split", "native", "ieee")),
    ],
)
def test_a_name_and_its_overrides_resolve_to_fprop_dgrad_wgrad(name, gemms, resolved):
    assert resolve_accumulation(name, gemms) == resolved
    spec = make_spec("fp8", CurrentScaling(), accumulation=name, accumulation_gemms=gemms)
    assert spec.accumulation == resolved and pickle.loads(pickle.dumps(spec)) == spec
    assert [spec.linear_accumulation(g) for g in ("fprop", "dgrad", "wgrad")] == list(resolved)


@pytest.mark.parametrize("name, gemms", [("fast", None), ("hopper", {"dgrad": "hopper"}), ("ieee", {"attn": "fast"})])
def test_other_names_are_refused(name, gemms):
    with pytest.raises(ValueError, match="accumulation"):
        resolve_accumulation(name, gemms)


def run_linear(accumulation: str, monkeypatch) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The accumulations a linear's GEMMs ran with, its output and its weight's gradient."""
    calls: list[str] = []
    fp8_mm = gemm.fp8_mm

    def recording(a, b, accumulation="ieee", bf16_gemm="fp32"):
        calls.append(accumulation)
        return fp8_mm(a, b, accumulation, bf16_gemm)

    monkeypatch.setattr(gemm, "fp8_mm", recording)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 64, generator=g) * torch.logspace(-4, 2, 64)).requires_grad_()
    weight = torch.randn(32, 64, generator=g).requires_grad_()
    numerics = Numerics(make_spec("fp8", CurrentScaling(), "reuse_rounded", accumulation=accumulation))
    y = linear(x, weight, numerics, "fc")
    y.backward(torch.randn(64, 32, generator=g))
    return calls, y.detach(), weight.grad


def test_a_linear_runs_fprop_fast_and_its_backward_split_under_hopper(monkeypatch):
    calls, y, dw = run_linear("hopper", monkeypatch)
    assert calls == ["fast", "split", "split"]
    ieee_calls, y_ieee, dw_ieee = run_linear("ieee", monkeypatch)
    assert ieee_calls == ["ieee"] * 3
    # the truncations are seen: operands spanning six decades lose products below the alignment
    assert not torch.equal(y, y_ieee) and not torch.equal(dw, dw_ieee)


def test_native_is_ieee_on_the_cpu(monkeypatch):
    calls, y, _ = run_linear("native", monkeypatch)
    assert calls == ["ieee"] * 3
    assert torch.equal(y, run_linear("ieee", monkeypatch)[1])


def test_the_config_key_and_its_overrides_reach_the_spec():
    cfg = validate(compose("precision.accumulation=hopper", "precision.accumulation_gemms={wgrad: fast}"))
    assert numerics_of(cfg).spec.accumulation == ("fast", "split", "fast")
    assert numerics_of(validate(compose())).spec.accumulation == ("native",) * 3


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["precision.accumulation=fast"], "precision.accumulation"),
        (["precision.accumulation_gemms={dgrad: hopper}"], "precision.accumulation_gemms"),
        (["precision.accumulation_gemms=[fast]"], "precision.accumulation_gemms"),
        (["backend=te", "precision.accumulation=hopper"], "precision.accumulation"),
    ],
)
def test_validate_names_a_bad_accumulation(overrides, key):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert error.value.key == key


def test_a_config_saved_before_the_key_existed_accumulates_natively():
    saved = plain_config(validate(compose()))
    for key in ("accumulation", "accumulation_gemms"):
        del saved["precision"][key]
    assert numerics_of(from_saved(saved)).spec.accumulation == ("native",) * 3
