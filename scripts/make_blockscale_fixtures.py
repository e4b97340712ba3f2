"""Write tests/fixtures/blockscale/mxfp8.npz: a grid of BF16 tensors and torchao's MXFP8 bits for them.

    python scripts/make_blockscale_fixtures.py   # with a torchao whose eager to_mx RCEIL is TE's rule

torchao's ``to_mx`` with ``ScaleCalculationMode.RCEIL`` is the independent reference that
tests/unit/numerics/test_blockscale.py checks readback's MXFP8 quantiser against without torchao
installed. Its eager code computes Transformer Engine's rule (amax times fp32(1 / max) in FP32,
rounded up to a power of two from its bits) from torchao commit 5d73a0c on ("Refine MXFP8 CUDA
quantization semantics"); torchao 0.18.0's eager RCEIL divides by the max, takes the ceil of an
FP32 log2 and multiplies the blocks whose scale is 2**-127 by 1, so the script refuses it. The
committed file was made with torchao main at 36027d8 (0.19.0 dev, run from its source tree).

The grid (``grid``): 128 x 128 BF16 tensors, one per case: ``random`` (normal values, a random
power of two per row), ``zeros`` (+0 above, -0 below), ``negzero`` (-0 among normal values),
``subnormal`` (BF16 subnormals above, values over 24 binades below), ``top`` (block maxima at and
around E4M3's or E5M2's max times a power of two), ``equal`` (constant 32x32 tiles above, constant rows
below) and ``wide`` (a huge and a tiny value in every 32 elements of a row). For each case and
element format (E4M3, E5M2): the rowwise copy, ``to_mx(x)``, and the columnwise copy,
``to_mx(x.T).T``: FP8 codes and E8M0 scale codes, both uint8.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "blockscale" / "mxfp8.npz"
SHAPE = (128, 128)
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def grid(seed: int) -> dict[str, torch.Tensor]:
    """The cases, BF16, each ``SHAPE``; a case's values depend only on the seed."""
    g = torch.Generator().manual_seed(seed)
    m, k = SHAPE

    def signs(*shape: int) -> torch.Tensor:
        return torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)

    def pow2(low: int, high: int, *shape: int) -> torch.Tensor:
        return 2.0 ** torch.randint(low, high, shape, generator=g).double()

    cases = {"random": torch.randn(m, k, generator=g) * pow2(-20, 20, m, 1)}
    zeros = torch.zeros(m, k)
    zeros[m // 2 :] = -0.0
    cases["zeros"] = zeros
    negzero = torch.randn(m, k, generator=g)
    cases["negzero"] = negzero.masked_fill(torch.rand(m, k, generator=g) < 0.4, -0.0)
    subnormal = torch.randint(1, 128, (m, k), generator=g) * 2.0**-133 * signs(m, k)  # BF16 subnormals
    subnormal[m // 2 :] = torch.randn(m // 2, k, generator=g) * pow2(-24, 1, m // 2, k)
    cases["subnormal"] = subnormal
    # each row's maximum, once in every 32 elements: at, above and below E4M3's and E5M2's max
    near = torch.tensor([448.0, 450.0, 446.0, 440.0, 416.0, 480.0, 512.0, 57344.0, 61440.0, 57088.0])
    row_max = near[torch.randint(len(near), (m, 1), generator=g)] * pow2(-30, 30, m, 1)
    top = torch.rand(m, k, generator=g) * row_max * signs(m, k)
    columns = torch.arange(0, k, 32) + torch.randint(0, 32, (m, k // 32), generator=g)
    cases["top"] = top.scatter_(1, columns, row_max.expand(m, k // 32) * signs(m, k // 32))
    equal = (torch.randn(m // 32, k // 32, generator=g) * pow2(-40, 40, m // 32, k // 32)).float()
    equal = equal.repeat_interleave(32, 0).repeat_interleave(32, 1)
    equal[m // 2 :] = (torch.randn(m // 2, 1, generator=g) * pow2(-40, 40, m // 2, 1)).float()
    cases["equal"] = equal
    wide = torch.randn(m, k, generator=g)
    columns = torch.arange(0, k, 32) + torch.randint(0, 16, (m, k // 32), generator=g)
    wide.scatter_(1, columns, pow2(60, 120, m, k // 32).float() * signs(m, k // 32))
    wide.scatter_(1, columns + 16, pow2(-120, -60, m, k // 32).float() * signs(m, k // 32))
    cases["wide"] = wide
    return {name: x.to(torch.bfloat16) for name, x in cases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--torchao-label", help="what to record as torchao's version (default: its __version__)")
    args = parser.parse_args()

    import torchao
    from torchao.prototype.mx_formats import mx_tensor
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    if not hasattr(mx_tensor, "_f32_to_e8m0_rceil"):
        raise SystemExit(f"torchao {torchao.__version__}: its eager RCEIL is not Transformer Engine's rule (see above)")
    label = args.torchao_label or torchao.__version__
    arrays: dict[str, np.ndarray] = {"torchao": np.array(label)}
    for case, x in grid(args.seed).items():
        arrays[f"{case}_x"] = x.view(torch.int16).numpy()
        for fmt, dtype in FORMATS.items():
            for direction, source in (("rowwise", x), ("columnwise", x.T.contiguous())):
                scale, data = mx_tensor.to_mx(source, dtype, 32, ScaleCalculationMode.RCEIL)
                scale, data = scale.view(torch.uint8), data.view(torch.uint8)
                if direction == "columnwise":
                    scale, data = scale.T.contiguous(), data.T.contiguous()
                arrays[f"{case}_{fmt}_{direction}_data"] = data.numpy()
                arrays[f"{case}_{fmt}_{direction}_scale"] = scale.numpy()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: {len(arrays)} arrays, {args.out.stat().st_size / 2**10:.0f} KiB, torchao {label}")


if __name__ == "__main__":
    main()
