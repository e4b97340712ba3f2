"""readback's FP8 attention core against torch's FP32 ``scaled_dot_product_attention`` on the CPU.

    python benchmarks/attention.py                                  # T 1,024-8,192, one thread
    python benchmarks/attention.py --seqs 4096 --rounds 5 --variants reuse_rounded/fp8 sdpa
    python benchmarks/attention.py --stack                          # + the 390M-shaped training step

One attention layer of the 390M's shape (batch 1, 8 heads over 4 KV groups, head dim 128),
causal, at each sequence length: torch's SDPA in FP32 (``is_causal=True``, ``enable_gqa``) and
readback's op (``readback.ops.attention``) per variant ``<policy>/<backward>``: ``fp8`` is the
FP8 backward, ``bf16-te`` the BF16 backward that reads what Transformer Engine's does
(``attention.bwd_reads=te``), ``fp32`` the FP32 backward; ``@current`` takes current scaling
instead of delayed scaling (whose scales come from a step before the timed ones). Forward and
backward are timed apart, the variants interleaved, one of each per round, so a busy machine
slows them alike; the table gives medians, and each variant's forward + backward time as a
fraction of SDPA's speed (``x sdpa``: SDPA's seconds over the variant's). Memory is each
variant's peak RSS during a forward and backward, in its own process, as its rise over the RSS
before the forward (inputs made), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that the RSS follows
the live tensors; ``/ sdpa`` is its ratio to SDPA's. ``--stack`` adds a training step (forward,
backward, no optimizer) of a 16-layer FOG of the 390M's width and attention (d_model 1,024,
vocabulary 32,768) at T 4,096 and batch 2, reuse_rounded with the FP8 attention backward, its
seconds and peak RSS rise. The first line names the CPU and its vector extensions
(``benchmarks/step.py``'s ``cpu_description``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from readback.numerics import CurrentScaling, DelayedScaling
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from readback.stopping import ends_on_ctrl_c
from specs import make_spec
from step import cpu_description

HEADS, GROUPS, DIM = 8, 4, 128
SDPA = "sdpa"
VARIANTS = (SDPA, "reuse_rounded/fp8", "reuse_rounded/bf16-te", "no_saved_copy/fp8", "reuse_rounded/fp8@current")
BACKWARDS = {
    "fp8": ("fp8", "forward"),
    "bf16-te": ("bf16", "te"),
    "bf16": ("bf16", "forward"),
    "fp32": ("fp32", "forward"),
}


def inputs(seq: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, HEADS, seq, DIM, generator=g)
    k, v = (torch.randn(batch, GROUPS, seq, DIM, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, seq, HEADS * DIM, generator=g)


def build(variant: str, seq: int):
    """``(forward, backward)`` of one variant: ``forward()`` runs the op on fresh leaves and
    returns what ``backward(out)`` differentiates."""
    q0, k0, v0, d_out = inputs(seq)
    if variant == SDPA:

        def forward_sdpa():
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        heads_d_out = d_out.reshape(1, seq, HEADS, DIM).transpose(1, 2)
        return forward_sdpa, lambda o: o.backward(heads_d_out)
    spec, _, recipe = variant.partition("@")
    policy, backward = spec.split("/")
    bwd, bwd_reads = BACKWARDS[backward]
    scaling = CurrentScaling() if recipe == "current" else DelayedScaling()
    numerics = Numerics(make_spec("fp8", scaling, policy, attention=dict(bwd_precision=bwd, bwd_reads=bwd_reads)))

    def forward():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        return attention(q, k, v, numerics, "attn", DIM**-0.5)[0]

    def backward(o):
        o.backward(d_out)
        numerics.end_step()

    backward(forward())  # a first step: delayed scales from its amaxes
    return forward, backward


def time_table(seq: int, variants: list[str], rounds: int) -> dict:
    built = {v: build(v, seq) for v in variants}
    times: dict[str, dict[str, list[float]]] = {v: {"forward": [], "backward": []} for v in variants}
    for _ in range(rounds):
        for v, (forward, backward) in built.items():
            start = time.perf_counter()
            out = forward()
            middle = time.perf_counter()
            backward(out)
            times[v]["forward"].append(middle - start)
            times[v]["backward"].append(time.perf_counter() - middle)
            del out
    return {v: {part: statistics.median(t) for part, t in parts.items()} for v, parts in times.items()}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rise(run) -> float:
    """The peak RSS (MiB) while ``run()`` runs, above the RSS before it: Linux's peak (VmHWM)
    is reset first (``/proc/self/clear_refs``), so what came before does not count."""
    start = rss_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return peak / 2**10 - start


def peak_memory(variant: str, seq: int) -> float:
    """Peak RSS rise (MiB) over one forward and backward, after a first step (in this process)."""
    forward, backward = build(variant, seq)
    return peak_rise(lambda: backward(forward()))


def stack_step() -> dict:
    """One forward and backward of the 390M-shaped stack at T 4,096, batch 2."""
    from readback.model.fog import FOG, FOGConfig

    cfg = FOGConfig(
        n_layers=16, d_model=1024, n_heads=HEADS, n_kv_groups=GROUPS, ffn_dim=6144, vocab_size=32768, seq_len=4096
    )
    model = FOG(cfg, Numerics(make_spec("fp8", DelayedScaling(), "reuse_rounded", attention=dict(bwd_precision="fp8"))))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    rise = peak_rise(lambda: model(x, x.roll(-1, 1)).backward())
    return {"seconds": time.perf_counter() - start, "rise_mib": rise}


def in_process(args: list[str]) -> dict:
    """The JSON line a ``--memory-of`` or ``--stack-only`` run of this script prints."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


@ends_on_ctrl_c("benchmarks/attention.py")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--stack", action="store_true", help="also the 390M-shaped training step")
    parser.add_argument("--memory-of", nargs=2, metavar=("VARIANT", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--stack-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps({"rise_mib": peak_memory(args.memory_of[0], int(args.memory_of[1]))}))
        return
    if args.stack_only:
        print(json.dumps(stack_step()))
        return
    cpu = cpu_description()
    print(f"CPU: {cpu}; {args.threads} thread(s), {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
    results: dict = {"cpu": cpu, "threads": args.threads}
    print(f"  {'T':>5} {'variant':<27}{'fwd s':>8}{'bwd s':>8}{'x sdpa':>8}{'rise MiB':>10}{'/ sdpa':>8}")
    for seq in args.seqs:
        rows = time_table(seq, args.variants, args.rounds)
        memory = {} if args.no_memory else {v: in_process(["--memory-of", v, str(seq)])["rise_mib"] for v in rows}
        peer = rows.get(SDPA)
        for v, r in rows.items():
            speed = (peer["forward"] + peer["backward"]) / (r["forward"] + r["backward"]) if peer else float("nan")
            rise = memory.get(v, float("nan"))
            ratio = rise / memory[SDPA] if SDPA in memory else float("nan")
            print(f"  {seq:>5} {v:<27}{r['forward']:8.2f}{r['backward']:8.2f}{speed:8.2f}{rise:10.0f}{ratio:8.2f}")
            results[f"{seq}/{v}"] = {**r, "x_sdpa": speed, "rise_mib": rise}
    if args.stack:
        stack = in_process(["--stack-only", "--threads", str(args.threads)])
        seconds, rise = stack["seconds"], stack["rise_mib"]
        print(f"  390M-shaped stack, T 4096, batch 2: step {seconds:.1f} s, peak RSS rise {rise:.0f} MiB")
        results["stack"] = stack
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
