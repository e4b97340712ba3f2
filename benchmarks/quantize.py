"""Time rounding to FP8: torch's plain cast against ``quantize`` (nearest and stochastic).

    python benchmarks/quantize.py --size 4096 --repeats 10

Prints the median time over ``--repeats`` runs (after one warm-up run) of each, and its ratio
to the plain cast of an FP32 ``size x size`` tensor to ``float8_e4m3fn``.
"""

from __future__ import annotations

import argparse

import torch

from readback.numerics import E4M3, quantize
from readback.stopping import ends_on_ctrl_c
from timing import median_ms


@ends_on_ctrl_c("benchmarks/quantize.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the tensor is size x size FP32")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per case (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(args.seed))
    scale = torch.tensor(E4M3.max / 4.0)  # amax of a normal sample is about 4-5 sigma: some saturate
    generator = torch.Generator().manual_seed(args.seed + 1)

    cases = {
        "torch cast x.to(float8_e4m3fn)": lambda: x.to(torch.float8_e4m3fn),
        "quantize(..., 'nearest')": lambda: quantize(x, E4M3, scale, "nearest"),
        "quantize(..., 'stochastic', generator)": lambda: quantize(x, E4M3, scale, "stochastic", generator),
    }
    print(
        f"{args.size}x{args.size} fp32 -> E4M3, median of {args.repeats} after a warm-up, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    baseline = None
    for name, fn in cases.items():
        ms = median_ms(fn, args.repeats)
        baseline = baseline or ms
        print(f"  {name:<42} {ms:9.2f} ms   {ms / baseline:6.2f}x cast")


if __name__ == "__main__":
    main()
