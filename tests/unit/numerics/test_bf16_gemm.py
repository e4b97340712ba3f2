"""The BF16 GEMM (``gemm.bf16_mm``): exact products, FP32 sums, one rounding to BF16, whichever
kernel runs it; and the choice reaching every BF16 GEMM of a run (``precision.bf16_gemm``)."""

from __future__ import annotations

import pytest
import torch

from readback.numerics import fp8_mm, matmul, round_bf16
from readback.numerics.gemm import BF16_GEMMS, bf16_mm
from specs import make_spec
from toys import config


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 units in the last place between same-signed BF16 values (bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("kernel", BF16_GEMMS)
def test_exact_sums_give_the_exact_product_rounded_once(kernel):
    """Integers below 256 are BF16 values and K * 255**2 < 2**24, so every FP32 sum is exact:
    both kernels must return the float64 product rounded once to BF16, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-255, 256, (3, 40, 200), generator=gen).to(torch.bfloat16)
    b = torch.randint(-255, 256, (3, 200, 24), generator=gen).to(torch.bfloat16)
    exact = a.double() @ b.double()
    assert exact.abs().max() < 2**24  # exact in FP32 too
    got = bf16_mm(a, b, kernel)
    assert got.dtype == torch.float32
    assert torch.equal(got, exact.to(torch.bfloat16).float())
    assert not torch.equal(got, exact.float())  # the output was rounded (most products need > 8 bits)


def test_fp32_kernel_is_an_fp32_gemm_of_the_bf16_values_rounded_once():
    """General operands: the FP32 kernel is within half a BF16 ulp of the FP32 GEMM's sum, and
    that sum within FP32 accumulation round-off of the float64 product."""
    a, b = _bf16(64, 512, seed=1), _bf16(512, 48, seed=2)
    got = bf16_mm(a, b, "fp32")
    fp32 = a.float() @ b.float()
    exact = a.double() @ b.double()
    assert ((got.double() - fp32.double()).abs() <= 2.0**-8 * fp32.abs().double()).all()  # half a BF16 ulp
    assert ((fp32.double() - exact).abs() <= 512 * 2.0**-24 * (a.double().abs() @ b.double().abs())).all()
    assert torch.equal(got, fp32.to(torch.bfloat16).float())


def test_native_kernel_is_torchs_bf16_gemm_and_agrees_with_fp32_up_to_the_sums_order():
    """``native`` is torch's BF16 GEMM itself. Against the FP32 kernel the two differ only where
    their FP32 sums, added in another order, fall on either side of a BF16 rounding boundary:
    the share of identical outputs and the largest difference (BF16 ulps) are printed."""
    a, b = _bf16(256, 1024, seed=4), _bf16(1024, 256, seed=5)
    native, fp32 = bf16_mm(a, b, "native"), bf16_mm(a, b, "fp32")
    assert torch.equal(native, torch.matmul(a, b).float())
    n, f = native.to(torch.bfloat16), fp32.to(torch.bfloat16)
    same_sign = (n.float() * f.float() > 0) | (n.float() == f.float())
    ulps = _ulps(n[same_sign], f[same_sign])
    identical = float((n.float() == f.float()).double().mean())
    print(f"\nnative vs fp32 BF16 GEMM, K 1024: {identical:.2%} identical, largest difference {int(ulps.max())} ulp")
    assert identical > 0.9 and int(ulps.max()) <= 2


def test_every_bf16_gemm_takes_the_chosen_kernel(monkeypatch):
    """The BF16 operands of ``fp8_mm`` (BF16 sites) and ``matmul``'s ``bf16`` precision (a BF16
    attention backward) both run ``bf16_mm`` with the kernel asked for."""
    seen = []
    real = bf16_mm
    monkeypatch.setattr("readback.numerics.gemm.bf16_mm", lambda a, b, k: seen.append(k) or real(a, b, k))
    qa, qb = round_bf16(torch.randn(4, 8)), round_bf16(torch.randn(8, 3))
    for kernel in BF16_GEMMS:
        fp8_mm(qa, qb, bf16_gemm=kernel)
        matmul(torch.randn(4, 8), torch.randn(8, 3), "bf16", bf16_gemm=kernel)
        matmul(qa, qb, "fp8", bf16_gemm=kernel)
    assert seen == [k for k in BF16_GEMMS for _ in range(3)]


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="bf16_gemm"):
        bf16_mm(_bf16(2, 2, seed=0), _bf16(2, 2, seed=1), "amx")
    with pytest.raises(ValueError, match="bf16_gemm"):
        make_spec("bf16", bf16_gemm="amx")


@pytest.mark.parametrize("experiment", ["reuse_rounded", "bf16_baseline"])
def test_the_config_key_reaches_the_spec(experiment):
    from readback.backends import build_model

    vocab = ("data=synthetic", "data.vocab_size=128", "model.vocab_size=128")
    default = build_model(config(f"+experiment={experiment}", *vocab))
    native = build_model(config(f"+experiment={experiment}", *vocab, "precision.bf16_gemm=native"))
    assert default.numerics.spec.bf16_gemm == "fp32" and native.numerics.spec.bf16_gemm == "native"
