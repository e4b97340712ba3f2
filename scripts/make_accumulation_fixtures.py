"""Write tests/fixtures/accumulation/hopper.npz: FP8 GEMMs and the bits mmaemu gives for them.

    pip install -e '.[fidelity]'   # mmaemu, the bit-exact model of an H100's FP8 GEMMs
    python scripts/make_accumulation_fixtures.py

mmaemu (profile ``hopper``: ``torch._scaled_mm`` on an H100 PCIe, cuBLASLt 12.8.3.14) is the
independent source that tests/unit/numerics/test_accumulation.py checks readback's emulation
against, without mmaemu installed. The grid: each pair of input formats (E4M3 x E4M3, E5M2 x E4M3,
E4M3 x E5M2) and each K in ``KS``, one pair of operands (``M x K`` and ``K x N`` codes), whose
rows mix random codes over every finite value (zeros, -0, subnormals, the largest values),
normal-looking values, a row of zeros, a row of subnormals and a row whose products cancel in
pairs; for each operand pair, both accumulations (``fast``: ``use_fast_accum=True``; ``split``:
``False``, unsplit, ``splitk=1``), the FP32 accumulator (``mmaemu.accumulate``) and, for each pair
of scales in ``SCALES`` and each output dtype (BF16, FP32), the output bits of
``mmaemu.scaled_mm``. K = 130, which ``torch._scaled_mm`` refuses (K % 16), takes the accumulator
through mmaemu's own epilogue (``mmaemu.model.epilogue.apply``) instead.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "accumulation" / "hopper.npz"
M, N = 16, 16
KS = (16, 32, 48, 64, 128, 130, 256, 1024, 4096)
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PAIRS = (("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2"))
# (scale_a, scale_b): powers of two; ordinary non-powers of two; a product below FP32's normal range
SCALES = {"pow2": (2.0**-3, 2.0**5), "odd": (0.0123, 3.7), "tiny": (1.3e-20, 7.1e-21)}
OUTS = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = {"fast": True, "split": False}


def finite_codes(fmt: str) -> torch.Tensor:
    """Every code of ``fmt`` whose value is finite, as uint8."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes[torch.isfinite(codes.view(FORMATS[fmt]).float())]


def operand(fmt: str, rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``rows x k`` uint8 codes: random finite codes in even rows, rounded normal values times a
    random power of two in odd rows, then a row of zeros (+0 and -0), one of subnormals, and one
    whose odd elements are the negated even ones."""
    codes = finite_codes(fmt)
    out = codes[torch.randint(len(codes), (rows, k), generator=generator)]
    normal = torch.randn(rows, k, generator=generator) * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=generator)
    limit = torch.finfo(FORMATS[fmt]).max
    out[1::2] = normal[1::2].clamp(-limit, limit).to(FORMATS[fmt]).view(torch.uint8)
    out[2] = torch.where(torch.rand(k, generator=generator) < 0.5, 0x00, 0x80)
    mantissa = 3 if fmt == "e4m3" else 2
    subnormal = torch.randint(1, 1 << mantissa, (k,), generator=generator)
    out[3] = subnormal | (torch.rand(k, generator=generator) < 0.5) * 0x80
    out[4, 1::2] = out[4, 0::2] ^ 0x80  # x, -x
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=21)
    args = parser.parse_args()

    import mmaemu
    from mmaemu.model import epilogue

    warnings.simplefilter("ignore")  # mmaemu's notes on explicit split decisions
    generator = torch.Generator().manual_seed(args.seed)
    arrays: dict[str, np.ndarray] = {"scales": np.array([SCALES[s] for s in SCALES], dtype=np.float32)}
    for fa, fb in PAIRS:
        for k in KS:
            a = operand(fa, M, k, generator)
            bt = operand(fb, N, k, generator)  # b's columns, K last
            bt[: N // 2, 1::2] = bt[: N // 2, 0::2]  # equal pairs, so that row 4 cancels against them
            case = f"{fa}x{fb}_k{k}"
            arrays[f"{case}_a"], arrays[f"{case}_b"] = a.numpy(), bt.t().contiguous().numpy()
            x, w = a.view(FORMATS[fa]), bt.view(FORMATS[fb])
            for mode, fast in MODES.items():
                acc = mmaemu.accumulate(x, w, use_fast_accum=fast, splitk=1)
                arrays[f"{case}_{mode}_acc"] = acc.view(torch.int32).numpy()
                for scale, (sa, sb) in SCALES.items():
                    scale_a, scale_b = torch.tensor(sa), torch.tensor(sb)
                    for out, dtype in OUTS.items():
                        if k % 16:
                            y = epilogue.apply(acc, scale_a, scale_b, out_dtype=dtype)
                        else:
                            y = mmaemu.scaled_mm(
                                x, w.t(), scale_a, scale_b, out_dtype=dtype, use_fast_accum=fast, splitk=1
                            )
                        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                        arrays[f"{case}_{mode}_{scale}_{out}"] = y.view(bits).numpy()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: {len(arrays)} arrays, {args.out.stat().st_size / 2**10:.0f} KiB, mmaemu {mmaemu.__version__}")


if __name__ == "__main__":
    main()
