"""The attention core's forward and backward on one GPU at fog_390m's shape (8 query heads over 4
key-value groups, head dim 128): readback's FP8 core on the Triton kernel and on the ops, against
torch's SDPA in BF16 (its flash kernel), in milliseconds per forward + backward and peak memory.

    python benchmarks/attention_kernel.py                       # T 4,096, batch 1
    python benchmarks/attention_kernel.py --seq 1024 4096 --json out.json

The FP8 cores run as a training step runs them (``reuse_rounded``, delayed scaling): the sites
round Q, K, V, O and dO, and the step's scales are updated after each backward. The goal of the
Triton core on an H100 is at least half SDPA BF16's speed at T 4,096. Where Transformer Engine
imports, its fused FP8 attention (``te.DotProductAttention`` under ``DelayedScaling(fp8_dpa=True)``,
BF16 in and out, the cuDNN kernel ``reuse_rounded`` runs under ``backend=te``) is timed beside them;
elsewhere that case is left out and the output says so. Needs a CUDA device and triton: without them
it says so and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable

import torch

HEADS, GROUPS, HEAD_DIM = 8, 4, 128
NAME = "layers.0.attn.core"


def _sdpa(batch: int, seq: int) -> Callable[[], None]:
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(batch, GROUPS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(grad)

    return step


def _readback(kernel: str, batch: int, seq: int) -> Callable[[], None]:
    from readback.numerics import DelayedScaling
    from readback.numerics.state import Numerics
    from readback.ops.attention import attention
    from specs import make_spec

    numerics = Numerics(make_spec("fp8", DelayedScaling(), "reuse_rounded", attention=dict(kernel=kernel)))
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", requires_grad=True)
    k, v = (torch.randn(batch, GROUPS, seq, HEAD_DIM, device="cuda", requires_grad=True) for _ in range(2))
    grad = torch.randn(batch, seq, HEADS * HEAD_DIM, device="cuda")

    def step() -> None:
        o, _ = attention(q, k, v, numerics, NAME, HEAD_DIM**-0.5)
        o.backward(grad)
        numerics.end_step()

    return step


def _te_fp8(batch: int, seq: int) -> Callable[[], None]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    from readback.backends.te.parts import fp8_autocast

    core = te.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, attn_mask_type="causal", qkv_format="bshd")
    q = torch.randn(batch, seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(batch, seq, GROUPS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn(batch, seq, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, fp8_dpa=True)

    def step() -> None:
        with fp8_autocast(enabled=True, recipe=recipe):
            o = core(q, k, v)
        o.backward(grad)

    return step


CASES: dict[str, Callable[[int, int], Callable[[], None]]] = {
    "sdpa_bf16": _sdpa,
    "readback_fp8_triton": lambda batch, seq: _readback("triton", batch, seq),
    "readback_fp8_ops": lambda batch, seq: _readback("ops", batch, seq),
    "te_fp8": _te_fp8,
}


def measure(case: str, batch: int, seq: int, repeats: int) -> dict[str, float]:
    """Milliseconds per forward + backward (the median of ``repeats``, after two to warm up) and
    the peak memory allocated (MiB)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = CASES[case](batch, seq)
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": sorted(times)[len(times) // 2], "peak_mib": torch.cuda.max_memory_allocated() / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_kernel: needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("attention_kernel: needs triton (pip install triton)", file=sys.stderr)
        return 2
    cases = args.cases
    if "te_fp8" in cases and importlib.util.find_spec("transformer_engine") is None:
        print("attention_kernel: te_fp8 left out: transformer_engine is not installed", file=sys.stderr)
        cases = [case for case in cases if case != "te_fp8"]
    results = []
    for seq in args.seq:
        by_case = {case: measure(case, args.batch, seq, args.repeats) for case in cases}
        base = by_case.get("sdpa_bf16")
        for case, figures in by_case.items():
            speed = f", {base['ms'] / figures['ms']:.2f}x sdpa_bf16's speed" if base else ""
            timing = f"{figures['ms']:.2f} ms fwd+bwd, peak {figures['peak_mib']:.0f} MiB"
            print(f"attention at seq {seq}: {case} {timing}{speed}")
            results.append({"case": case, "seq": seq, "batch": args.batch, **figures})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
