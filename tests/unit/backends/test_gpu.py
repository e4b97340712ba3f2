"""The emulated backend's GPU path: ``fp8_mm`` through ``torch._scaled_mm`` (a real FP8 GEMM)
against the emulation (FP32 GEMM of the decoded codes, scaled, one BF16 rounding), and a tiny FOG
training step on CUDA against the CPU."""

from __future__ import annotations

import math
import os

import pytest
import torch

from readback.numerics import E4M3, E5M2, compute_scale, fp8_mm, gemm, quantize
from toys import compose

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA device with FP8 (sm_89+)")]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of BF16 numbers at ``|x|`` (8 significant bits)."""
    _, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def _emulated_mm(a, b) -> torch.Tensor:
    """``fp8_mm``'s emulation (what it runs on the CPU): the FP32 GEMM of the decoded codes,
    scaled, rounded once to BF16."""
    return gemm._decoded_product(a.data, b.data, a.scale_inv * b.scale_inv)


def _quantized(shape, fmt, std, generator):
    x = torch.randn(shape, device="cuda", generator=generator) * std
    return quantize(x, fmt, compute_scale(x.abs().amax(), fmt))


@pytest.mark.parametrize(
    "fmt_a, fmt_b", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2"]
)
@pytest.mark.parametrize("m, k, n", [(64, 256, 128), (256, 1024, 512)])
def test_scaled_mm_agrees_with_bf16_emulation(fmt_a, fmt_b, m, k, n):
    generator = torch.Generator(device="cuda").manual_seed(m + k + n)
    a, b = _quantized((m, k), fmt_a, 3.0, generator), _quantized((k, n), fmt_b, 0.05, generator)
    assert gemm.use_scaled_mm(a, b), "these shapes must take the real FP8 kernel"
    real, emulated = fp8_mm(a, b), _emulated_mm(a, b)
    # Both apply the scales to an FP32 accumulation of the exact products and round once to
    # BF16 (error <= 1/2 ulp each); only the accumulation order differs, so 1.5 BF16 ulp bounds
    # them with room. The floor covers sums that cancel to near zero (FP32 partial sums).
    magnitude = a.dequantize().abs() @ b.dequantize().abs()
    tolerance = 1.5 * _bf16_ulp(torch.maximum(real.abs(), emulated.abs())) + 2.0**-14 * magnitude
    excess = ((real - emulated).abs() - tolerance).max().item()
    assert excess <= 0, f"FP8 kernel and emulation differ by more than 1.5 BF16 ulp (excess {excess:.3g})"
    assert (real - emulated).norm() < 2.0**-7 * emulated.norm()  # about half a BF16 ulp on average


# torch._scaled_mm's accumulation modes with an emulation in readback: mode -> (the kernel's call,
# readback's emulation of it, on the CPU). "fp32" is the call ``native`` makes (no use_fast_accum:
# partial sums promoted to FP32) against the IEEE FP32 emulation; "fast" and "split" are Hopper's
# accumulations (use_fast_accum True and False) against ``numerics.accumulation``'s model of them,
# which was fitted to an H100: this is where it is checked on the machine at hand.
def _on_cpu(q):
    return type(q)(q.data.cpu(), q.scale.cpu(), q.fmt)


ACCUMULATIONS = {
    "fp32": (fp8_mm, _emulated_mm),
    "fast": (lambda a, b: fp8_mm(a, b, "fast"), lambda a, b: fp8_mm(_on_cpu(a), _on_cpu(b), "fast")),
    "split": (lambda a, b: fp8_mm(a, b, "split"), lambda a, b: fp8_mm(_on_cpu(a), _on_cpu(b), "split")),
}
SHAPES = [(64, 16, 256), (64, 256, 256), (64, 1024, 256), (64, 4096, 256), (1024, 4096, 1024)]


@pytest.mark.parametrize("mode", sorted(ACCUMULATIONS))
@pytest.mark.parametrize("fmt_a, fmt_b", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3-e4m3", "e5m2-e4m3"])
def test_scaled_mm_bit_identical_fraction_per_accumulation_mode(mode, fmt_a, fmt_b):
    """The share of BF16 outputs in which the FP8 kernel and its emulation agree bit for bit, per
    K, printed for the GPU check's summary (which also runs it with CUBLASLT_WORKSPACE_SIZE=0, so
    that cuBLAS cannot split K, which neither emulation models). For fp32 the summation order
    differs, which changes the BF16 result only where the two sums straddle a rounding boundary;
    for fast and split the model claims every bit. 90 % is a floor, the printed share the
    measurement."""
    real_mm, emulated_mm = ACCUMULATIONS[mode]
    generator = torch.Generator(device="cuda").manual_seed(1)
    shares = {}
    for m, k, n in SHAPES:
        a, b = _quantized((m, k), fmt_a, 3.0, generator), _quantized((k, n), fmt_b, 0.05, generator)
        assert gemm.use_scaled_mm(a, b), "these shapes must take the real FP8 kernel"
        real, emulated = real_mm(a, b).to(torch.bfloat16).cpu(), emulated_mm(a, b).to(torch.bfloat16).cpu()
        shares[f"{m}x{k}x{n}"] = (real.view(torch.int16) == emulated.view(torch.int16)).double().mean().item()
    workspace = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "default")
    print(
        f"scaled_mm bit-identical [{mode} accumulation, {fmt_a}x{fmt_b}, CUBLASLT_WORKSPACE_SIZE={workspace}]: "
        + ", ".join(f"{s} {v:.4%}" for s, v in shares.items())
    )
    assert min(shares.values()) >= 0.9, shares


# Head dim 128, as fog_390m's and as Transformer Engine's FP8 attention needs on sm90.
HEAD_DIM_128 = ("model.d_model=256", "model.n_heads=2", "model.n_kv_groups=1", "model.ffn_dim=384")


def _config(experiment: str, *overrides: str):
    return compose(f"+experiment={experiment}", *overrides)


@pytest.mark.parametrize("experiment", ["reuse_rounded", "fresh_reround", "no_saved_copy", "bf16_baseline"])
def test_tiny_fog_step_on_cuda_matches_cpu(monkeypatch, experiment):
    from readback.backends import build_model

    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    cfg = _config(experiment, "model.vocab_size=256", *HEAD_DIM_128)
    assert cfg.model.d_model // cfg.model.n_heads == 128
    torch.manual_seed(0)
    cpu = build_model(cfg, "cpu")
    model = build_model(cfg, "cuda")
    model.load_state_dict(cpu.state_dict())
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (2, int(cfg.model.seq_len)), generator=generator)
    targets = idx.roll(-1, 1)
    with torch.no_grad():
        cpu_loss = cpu(idx, targets).item()

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        loss = model(idx.cuda(), targets.cuda())
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.numerics.end_step()
        losses.append(loss.item())
    assert abs(losses[0] - cpu_loss) < 1e-2 * cpu_loss, (losses[0], cpu_loss)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    if experiment != "bf16_baseline":
        assert calls, "the FP8 linears must run torch._scaled_mm on an FP8 GPU"
