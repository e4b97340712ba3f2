"""The gradient-error probe: the reference is the gradient of the executed forward."""

import dataclasses
import json

import pytest
import torch

import toys
from readback.audit_model.examples import TINY_FOG
from readback.backends import build_model
from readback.errors import ConfigError
from readback.probe import check_params, compare, train_taped
from toys import config

FP32_BACKWARD = ["attention.bwd_precision=fp32", "precision.override_linear_precision=[false,true,true]"]


def _cfg(*overrides):
    return config("data=synthetic", "data.vocab_size=128", "model.vocab_size=128", *overrides)


def _trained_model(*overrides, steps=3):
    """A tiny FOG after a few steps, so delayed scales are no longer 1."""
    torch.manual_seed(0)
    model = build_model(_cfg(*overrides))
    idx = torch.randint(0, 128, (4, 32))
    toys.train_on_one_batch(model, idx, steps)
    return model, idx, idx.roll(-1, 1)


def test_exact_policy_with_fp32_backward_is_the_reference_to_round_off():
    model, x, y = _trained_model("+experiment=no_saved_copy", "policy=exact", *FP32_BACKWARD)
    stats = toys.probe(every=1).measure(model, x, y)
    assert stats["grad_error/rel_err/total"] < 1e-5
    assert stats["grad_error/cosine/total"] > 1 - 1e-9
    assert stats["grad_error/rel_err/layers.1.attn.core.dq"] < 1e-5


def test_the_forward_gemms_accumulation_is_part_of_the_executed_forward():
    """Hopper's fast accumulation in the forward GEMMs changes the executed forward, and the
    reference follows it (the replay pins each GEMM's output): the error stays round-off."""
    fast = ("precision.accumulation=hopper",)  # fast fprop; dgrad and wgrad run in FP32 here
    model, x, y = _trained_model("+experiment=no_saved_copy", "policy=exact", *FP32_BACKWARD, *fast)
    ieee, _, _ = _trained_model("+experiment=no_saved_copy", "policy=exact", *FP32_BACKWARD)
    ieee.load_state_dict(model.state_dict())
    ieee.numerics.load_state_dict(model.numerics.state_dict())
    assert not torch.equal(model(x, y), ieee(x, y))  # the forward's sums are truncated
    stats = toys.probe(every=1).measure(model, x, y)
    assert stats["grad_error/rel_err/total"] < 1e-5
    assert stats["grad_error/rel_err/layers.0.attn.qkv.weight"] < 1e-5


@pytest.mark.parametrize("kernel", ["fp32", "native"])
def test_the_bf16_gemm_kernel_is_part_of_the_executed_forward(kernel):
    """The LM head's BF16 GEMM, whichever kernel runs it, is what the reference replays (its
    output is pinned): the error stays round-off."""
    model, x, y = _trained_model(
        "+experiment=no_saved_copy", "policy=exact", *FP32_BACKWARD, f"precision.bf16_gemm={kernel}"
    )
    stats = toys.probe(every=1).measure(model, x, y)
    assert stats["grad_error/rel_err/total"] < 1e-5
    assert stats["grad_error/rel_err/embedding"] < 1e-5


def test_reuse_rounded_error_is_orders_larger_and_starts_at_attention():
    exact = toys.probe(every=1).measure(*_trained_model("+experiment=no_saved_copy", "policy=exact", *FP32_BACKWARD))
    model, x, y = _trained_model("+experiment=reuse_rounded", *FP32_BACKWARD)
    reuse = toys.probe(every=1).measure(model, x, y)
    assert reuse["grad_error/rel_err/total"] > 1000 * exact["grad_error/rel_err/total"]
    # The backward reaches the last block's MLP before any attention: its gradients are still exact.
    assert reuse["grad_error/rel_err/layers.1.mlp.down.weight"] < 1e-5
    assert reuse["grad_error/rel_err/layers.1.mlp_norm.gain"] < 1e-5
    # The error appears at the last attention core's inputs and flows upstream from there.
    assert reuse["grad_error/rel_err/layers.1.attn.core.dq"] > 1e-3
    assert reuse["grad_error/rel_err/layers.1.attn.core.dv"] < 1e-5  # dV = P8^T dO needs no D-term
    assert reuse["grad_error/rel_err/layers.0.attn.qkv.weight"] > 1e-4


def test_fresh_reround_bias_is_within_its_noise_and_reuse_has_no_noise():
    model, x, y = _trained_model("+experiment=fresh_reround", *FP32_BACKWARD)
    fresh = toys.probe(every=1, repeats=8).measure(model, x, y)
    assert fresh["grad_error/noise/total"] > 0
    assert fresh["grad_error/bias/total"] < 3 * fresh["grad_error_se/bias/total"]

    model, x, y = _trained_model("+experiment=reuse_rounded", *FP32_BACKWARD)
    reuse = toys.probe(every=1, repeats=3).measure(model, x, y)
    assert reuse["grad_error/noise/total"] == 0  # nearest forward rounding: every repeat is the same
    assert reuse["grad_error/bias/total"] == pytest.approx(reuse["grad_error/rel_err/total"])


def test_probe_leaves_model_grads_and_numerics_untouched():
    model, x, y = _trained_model("+experiment=fresh_reround", "precision.rounding=stochastic")
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = model.numerics.state_dict()
    before_sites = set(model.numerics.sites)
    toys.probe(every=1, repeats=2).measure(model, x, y)
    assert all(torch.equal(a, p) for a, p in zip(before_params, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert set(model.numerics.sites) == before_sites
    after = model.numerics.state_dict()
    for name, saved in before_state["sites"].items():
        for key, value in saved["state"].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["sites"][name]["state"][key])), (name, key)
    # The step's own random streams are the ones training will use next.
    loss_after_probe = model(x, y).item()
    model2, _, _ = _trained_model("+experiment=fresh_reround", "precision.rounding=stochastic")
    assert model2(x, y).item() == loss_after_probe


def test_the_training_backward_as_repeat_0_gives_the_probe_s_own_result():
    """The trainer hands its taped first micro-batch to the probe (``train_taped``): the same
    statistics as the probe executing the batch itself, and the step's gradients are kept."""
    model, x, y = _trained_model("+experiment=fresh_reround", "precision.rounding=stochastic")
    probe = toys.probe(every=1, repeats=2)
    own = probe.measure(model, x, y)
    _, trained = train_taped(model, x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reused = probe.measure(model, x, y, trained)
    assert reused == own
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)


def test_compare_statistics_by_hand():
    ref = [{"w": torch.tensor([1.0, 0.0], dtype=torch.float64)}] * 2
    err = [{"w": torch.tensor([0.1, 0.0], dtype=torch.float64)}, {"w": torch.tensor([0.3, 0.0], dtype=torch.float64)}]
    stats = compare(err, ref)
    assert stats["grad_error/rel_err/w"] == pytest.approx(0.2)
    assert stats["grad_error/bias/w"] == pytest.approx(0.2)  # |mean error| / |mean reference|
    assert stats["grad_error/noise/w"] == pytest.approx((2 * 0.1**2 / 1) ** 0.5)  # sample std over repeats
    assert stats["grad_error_se/bias/w"] == pytest.approx(stats["grad_error/noise/w"] / 2**0.5)
    assert stats["grad_error/rel_err/total"] == pytest.approx(0.2)


def _concatenated(errors, references):
    """The statistics of ``total`` from the concatenated vectors, as their definitions read."""
    e = torch.stack([torch.cat([t.flatten() for t in x.values()]) for x in errors])
    r = torch.stack([torch.cat([t.flatten() for t in x.values()]) for x in references])
    k, mean_e = len(e), e.mean(0)
    noise = ((e - mean_e).pow(2).sum() / (k - 1)).sqrt() / r.mean(0).norm()
    return {
        "rel_err": (e.norm(dim=1) / r.norm(dim=1)).mean(),
        "cosine": torch.nn.functional.cosine_similarity(e + r, r, dim=1).mean(),
        "bias": mean_e.norm() / r.mean(0).norm(),
        "noise": noise,
    }


@pytest.mark.parametrize("k", [1, 3])
def test_compare_total_is_the_concatenated_vector(k):
    """``total`` adds the names' sums of squares and products: the statistics of the vectors
    concatenated, by their definitions."""
    g = torch.Generator().manual_seed(4)
    shapes = {"a": (7, 5), "b": (11,), "c": (3, 2, 4)}
    references = [{n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()} for _ in range(k)]
    errors = [
        {n: 0.1 * torch.randn(s, generator=g, dtype=torch.float64) + 0.05 for n, s in shapes.items()} for _ in range(k)
    ]
    stats = compare(errors, references)
    want = _concatenated(errors, references)
    for key in ("rel_err", "cosine", *(("bias", "noise") if k > 1 else ())):
        assert stats[f"grad_error/{key}/total"] == pytest.approx(float(want[key]), rel=1e-12), key
    one = _concatenated([{"b": e["b"]} for e in errors], [{"b": r["b"]} for r in references])
    assert stats["grad_error/cosine/b"] == pytest.approx(float(one["cosine"]), rel=1e-12)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("micro_batch", [2, 4], ids=["accum2", "accum1"])
def test_probe_does_not_change_the_training_trajectory(tmp_path, micro_batch):
    """Same losses and statistics with and without the probe; with one micro-batch the probe
    takes the step's own (last, statistics-measuring) backward and its passes measure nothing."""
    from readback.train import run

    common = [
        "+experiment=fresh_reround",
        "precision.rounding=stochastic",
        "data=synthetic",
        "data.vocab_size=128",
        "logger=none",
        "trainer.steps=6",
        "trainer.log_every=1",
        "trainer.eval_every=6",
        "trainer.progress=false",
        "model.d_model=32",
        "model.n_heads=2",  # head dim 16, as FP8 asks
        "model.ffn_dim=64",
        "model.global_batch=4",
        f"trainer.micro_batch={micro_batch}",
        "model.seq_len=32",
    ]
    run(_cfg(*common), tmp_path / "plain")
    run(_cfg(*common, "probe.every=2", "probe.repeats=2"), tmp_path / "probed")
    plain, probed = _losses(tmp_path / "plain"), _losses(tmp_path / "probed")
    assert plain == probed
    records = [json.loads(line) for line in (tmp_path / "probed" / "metrics.jsonl").read_text().splitlines()]
    measured = ("kurtosis/", "attn_rowsum/", "fp8_underflow/", "fp8_saturation/")
    for p, q in zip(map(json.loads, (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()), records):
        assert {k: v for k, v in p.items() if k.startswith(measured)} == {
            k: v for k, v in q.items() if k.startswith(measured)
        }, p["step"]
    probed_steps = [r["step"] for r in records if "grad_error/rel_err/total" in r]
    assert probed_steps == [2, 4, 6]
    assert all("grad_error/bias/total" in r for r in records if r["step"] in probed_steps)


@pytest.mark.parametrize(
    "pattern", ["*", "embedding", "layers.*.mlp.up.weight", "*.attn.core.*", "layers.0.attn.core.dv"]
)
def test_probe_patterns_naming_a_parameter_or_watched_gradient_are_kept(pattern):
    cfg = config(*TINY_FOG)
    check_params(dataclasses.replace(cfg.probe, params=[pattern]), build_model(cfg))


@pytest.mark.parametrize("pattern", ["mlp.up.weight", "*.atn.*", "layers.0.attn.core.dx"])  # whole names, globs
def test_a_probe_pattern_naming_nothing_is_refused_listing_the_parameters(pattern):
    cfg = config(*TINY_FOG)
    with pytest.raises(ConfigError) as error:
        check_params(dataclasses.replace(cfg.probe, params=["*", pattern]), build_model(cfg))
    line = str(error.value)
    assert (error.value.key, error.value.value) == ("probe.params", pattern) and "\n" not in line
    assert "e.g. embedding, layers.*.attn.qkv.weight," in line
