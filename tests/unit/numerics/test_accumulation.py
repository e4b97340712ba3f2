"""Hopper's FP8 accumulation (readback.numerics.accumulation) against mmaemu's bits: the committed
fixtures (scripts/make_accumulation_fixtures.py), mmaemu itself where it is installed, and cases
worked out by hand from the model."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from readback.numerics import E4M3, E5M2, QTensor, fp8_mm
from readback.numerics.accumulation import accumulate, epilogue, min_exponent
from readback.numerics.gemm import _decoded_product

FIXTURES = Path(__file__).parents[2] / "fixtures" / "accumulation" / "hopper.npz"
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUTS = {"bf16": (torch.bfloat16, torch.int16), "fp32": (torch.float32, torch.int32)}
SCALES = ("pow2", "odd", "tiny")  # the rows of the fixtures' "scales"


@pytest.fixture(scope="module")
def fixtures():
    with np.load(FIXTURES) as data:
        return {key: torch.from_numpy(data[key]) for key in data.files}


def cases(fixtures) -> list[str]:
    return sorted(key.removesuffix("_a") for key in fixtures if key.endswith("_a"))


def operands(fixtures, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    fa, fb = case.split("_")[0].split("x")
    return fixtures[f"{case}_a"].view(DTYPES[fa]), fixtures[f"{case}_b"].view(DTYPES[fb])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_the_fixtures_cover_the_grid(fixtures):
    assert len(cases(fixtures)) == 3 * 9
    assert {c.split("_")[0] for c in cases(fixtures)} == {"e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"}
    assert {int(c.split("_k")[1]) for c in cases(fixtures)} == {16, 32, 48, 64, 128, 130, 256, 1024, 4096}


@pytest.mark.parametrize("mode", ["fast", "split"])
def test_every_fixture_output_is_bit_identical(fixtures, mode):
    checked = 0
    for case in cases(fixtures):
        a, b = operands(fixtures, case)
        acc = accumulate(a, b, mode)
        assert torch.equal(bits(acc), fixtures[f"{case}_{mode}_acc"]), f"{case} {mode}: accumulator"
        for row, scale in enumerate(SCALES):
            scale_a, scale_b = fixtures["scales"][row]
            for out, (dtype, _) in OUTS.items():
                y = epilogue(acc, scale_a, scale_b, dtype)
                assert torch.equal(bits(y), fixtures[f"{case}_{mode}_{scale}_{out}"]), f"{case} {mode} {scale} {out}"
                checked += y.numel()
    assert checked == 27 * 3 * 2 * 16 * 16


@pytest.mark.parametrize("mode", ["fast", "split"])
def test_fp8_mm_gives_the_fixtures_bf16_outputs(fixtures, mode):
    formats = {"e4m3": E4M3, "e5m2": E5M2}
    for case in cases(fixtures):
        a, b = operands(fixtures, case)
        fa, fb = (formats[f] for f in case.split("_")[0].split("x"))
        scale_a, scale_b = fixtures["scales"][0]  # powers of two: QTensor's reciprocal is exact
        y = fp8_mm(QTensor(a, 1 / scale_a, fa), QTensor(b, 1 / scale_b, fb), accumulation=mode)
        expected = fixtures[f"{case}_{mode}_pow2_bf16"].view(torch.bfloat16).float()
        assert torch.equal(bits(y), bits(expected)), case


def test_decoded_operands_give_the_codes_bits(fixtures):
    case = "e5m2xe4m3_k1024"
    a, b = operands(fixtures, case)
    acc = accumulate(a.float(), b.float(), "split", (min_exponent(a.dtype), min_exponent(b.dtype)))
    assert torch.equal(bits(acc), fixtures[f"{case}_split_acc"])


def test_ieee_is_the_fp32_gemm_of_the_decoded_values():
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(2, 24, 96, generator=g) * 30).to(torch.float8_e4m3fn)
    b = (torch.randn(2, 96, 40, generator=g) * 3000).to(torch.float8_e5m2)
    qa, qb = QTensor(a, torch.tensor(3.0), E4M3), QTensor(b, torch.tensor(0.7), E5M2)
    scale = qa.scale_inv * qb.scale_inv
    expected = torch.matmul(a.float(), b.float()).mul_(scale).to(torch.bfloat16).float()
    for y in (fp8_mm(qa, qb), fp8_mm(qa, qb, accumulation="ieee"), _decoded_product(a, b, scale)):
        assert torch.equal(bits(y), bits(expected))
    assert torch.equal(bits(accumulate(a, b, "ieee")), bits(torch.matmul(a.float(), b.float())))


def one_row(values: list[float], dtype: torch.dtype = torch.float8_e4m3fn, k: int = 32) -> torch.Tensor:
    row = torch.zeros(1, k)
    row[0, : len(values)] = torch.tensor(values)
    assert torch.equal(row.to(dtype).float(), row), "not values of the format"
    return row.to(dtype)


def dot(a_values: list[float], b_values: list[float], mode: str, k: int = 32, b_dtype=torch.float8_e4m3fn) -> float:
    a, b = one_row(a_values, k=k), one_row(b_values, b_dtype, k).mT
    return accumulate(a, b, mode).item()


def test_products_below_the_alignment_are_truncated_not_rounded():
    # E = 8 + 0: the unit is 2**-5, and 3 * 2**-7 is 0.75 of it: truncated to 0 (rounding gives 1)
    assert dot([256.0, 0.09375], [1.0, 0.25], "fast") == 256.0
    assert dot([256.0, 0.09375], [1.0, 0.25], "ieee") == 256.0 + 3 * 2**-7


def test_the_block_result_keeps_13_fraction_bits_of_its_own_exponent():
    # 256 + 256 + 3 * 2**-5 is exact in the block's unit 2**-5, but the sum's exponent is 9:
    # truncated to 2**-4 it is 512.0625 (rounding to nearest would give 512.125)
    assert dot([256.0, 256.0, 0.09375], [1.0, 1.0, 1.0], "fast") == 512.0625
    assert dot([256.0, 256.0, 0.09375], [1.0, 1.0, 1.0], "ieee") == 512.09375


def test_split_restarts_the_chain_every_128_elements_and_adds_in_fp32():
    a = [0.0] * 256
    a[0], a[128] = 256.0, 3 * 2**-8
    b = [1.0] * 256
    # fast: the running sum 256 sets the unit 2**-5, below which 3 * 2**-8 vanishes
    assert dot(a, b, "fast", k=256) == 256.0
    # split: the second chunk's chain keeps it, and FP32 adds it to 256 exactly
    assert dot(a, b, "split", k=256) == 256.0 + 3 * 2**-8


def test_subnormal_inputs_align_at_the_clamped_exponent():
    # 2**-9 (E4M3 subnormal) counts as exponent -6: E = -6, unit 2**-19, so 1.5 * 2**-19 loses its half
    # (with its own exponent -9 the block's E would be -8 and nothing would be lost)
    value = dot([2.0**-9, 1.0, 0.046875], [1.0, 2.0**-8, 2.0**-14], "fast", b_dtype=torch.float8_e5m2)
    assert value == 2.0**-9 + 2.0**-8 + 2.0**-19


def test_a_zero_result_is_plus_zero():
    for a, b in (([-0.0, -0.0], [1.0, 1.0]), ([2.0, -2.0], [3.0, 3.0]), ([-1.0], [0.0])):
        for mode in ("fast", "split"):
            assert bits(torch.tensor(dot(a, b, mode))).item() == 0, (a, b, mode)


def test_batched_and_broadcast_operands_are_each_matrix_product():
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(3, 7, 4, 200, generator=g) * 20).to(torch.float8_e4m3fn)
    b = (torch.randn(7, 200, 9, generator=g) * 20).to(torch.float8_e5m2)
    for mode in ("fast", "split"):
        acc = accumulate(a, b, mode)
        assert acc.shape == (3, 7, 4, 9)
        for i in range(3):
            for j in range(7):
                assert torch.equal(bits(acc[i, j]), bits(accumulate(a[i, j], b[j], mode)))


def test_a_non_finite_input_gives_the_fp32_gemm_in_its_row_only():
    a = (torch.randn(4, 64) * 10).to(torch.float8_e4m3fn)
    b = (torch.randn(64, 5) * 10).to(torch.float8_e4m3fn)
    a[1, 3] = float("nan")
    acc, finite = accumulate(a, b, "fast"), accumulate(a[[0, 2, 3]], b, "fast")
    assert acc[1].isnan().all()
    assert torch.equal(bits(acc[[0, 2, 3]]), bits(finite))


@pytest.mark.parametrize("shapes", [((0, 32), (32, 5)), ((3, 0), (0, 4)), ((3, 32), (32, 0)), ((0, 2, 8), (8, 3))])
def test_an_empty_product_is_plus_zero(shapes):
    a, b = (torch.ones(shape).to(torch.float8_e4m3fn) for shape in shapes)
    for mode in ("fast", "split"):
        acc = accumulate(a, b, mode)
        assert acc.shape == torch.matmul(a.float(), b.float()).shape and not bits(acc).any()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown accumulation"):
        accumulate(torch.zeros(2, 2), torch.zeros(2, 2), "hopper")


@pytest.mark.parametrize("formats", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_fresh_random_operands_match_mmaemu(formats):
    mmaemu = pytest.importorskip("mmaemu")
    from mmaemu.model import epilogue as mmaemu_epilogue

    g = torch.Generator().manual_seed(sum(map(ord, "".join(formats))))
    fa, fb = (DTYPES[f] for f in formats)
    for m, k, n in ((9, 200, 16), (33, 64, 7), (2, 1000, 3)):
        x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-10, 10, (m, k), generator=g)
        w = torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-10, 10, (n, k), generator=g)
        x = x.masked_fill(torch.rand(m, k, generator=g) < 0.1, 0).clamp(-448, 448).to(fa)
        w = w.clamp(-448, 448).to(fb)
        scale_a, scale_b = torch.rand(2, generator=g) + 0.01
        for mode in ("fast", "split"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # mmaemu's notes on an explicit split decision
                expected = mmaemu.accumulate(x, w, use_fast_accum=mode == "fast", splitk=1)
            acc = accumulate(x, w.t(), mode)
            assert torch.equal(bits(acc), bits(expected)), (formats, m, k, n, mode)
            y = epilogue(acc, scale_a, scale_b, torch.bfloat16)
            theirs = mmaemu_epilogue.apply(expected, scale_a, scale_b, out_dtype=torch.bfloat16)
            assert torch.equal(bits(y), bits(theirs))


@pytest.mark.parametrize("mode, kernel", [("fast", True), ("split", False), ("ieee", None)])
def test_where_the_fp8_kernel_runs_fast_is_its_fast_accumulation_and_ieee_does_not_call_it(mode, kernel, monkeypatch):
    import readback.numerics.gemm as gemm

    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
        calls.append(use_fast_accum)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(gemm, "use_scaled_mm", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    a = QTensor(torch.ones(16, 32).to(torch.float8_e4m3fn), torch.tensor(1.0), E4M3)
    b = QTensor(torch.ones(32, 16).to(torch.float8_e4m3fn), torch.tensor(1.0), E4M3)
    y = fp8_mm(a, b, accumulation=mode)
    assert calls == ([] if kernel is None else [kernel])
    assert (y == (32.0 if kernel is None else 0.0)).all()  # ieee: the FP32 product of the decoded values
    assert gemm.native_accumulation(a, b) == "split"
