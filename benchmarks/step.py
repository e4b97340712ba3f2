"""Training-step speed and memory on the CPU: every experiment of readback, and a plain GPT.

    python benchmarks/step.py                       # tiny and small, 1 and 2 threads
    python benchmarks/step.py --sizes small --threads 1 --rounds 9
    python benchmarks/step.py --overrides precision.bf16_gemm=native   # readback's variants changed
    python benchmarks/step.py --variants reuse_rounded reuse_rounded@mxfp8 reuse_rounded@blockwise plain_fp32
    python benchmarks/step.py --variants reuse_rounded reuse_rounded@precision.bf16_gemm=native plain_fog

It first prints the CPU's model, its vector extensions that torch's kernels can use (AVX2,
AVX512, AVX512-BF16, AMX) and the level torch dispatches to: figures from different CPUs are not
comparable (a CPU without BF16 instructions runs torch's BF16 GEMM about 20x slower than FP32).
Each table gives every variant's GFLOP/s as a fraction of the plain GPT's in FP32 (``/ fp32``).

A step is forward + backward (+ ``numerics.end_step()`` for readback), gradients cleared after.
The variants run interleaved, one step each per round, so a busy machine slows them alike; the
table gives the median, min and max over the rounds. GFLOP/s use one formula for every variant
(``FOG.flops_per_token``: 6 per GEMM weight plus the causal attention products), so they compare
like tokens/s. The plain GPT has FOG's dimensions (width, depth, heads, KV groups, FFN width,
sequence, tied vocabulary) and none of its numerics: pre-norm LayerNorm, GELU MLP, torch's
``scaled_dot_product_attention``, learned positions; it runs in FP32 and under BF16 autocast.
``plain_fog`` is FOG itself in FP32 without readback's numerics (``peers.plain_fog``): against it,
what the emulation costs; against the GPT, what FOG's own blocks cost.
``probe`` is a reuse_rounded training step with the gradient probe (one repeat) as the trainer
runs it in one process: the step's taped backward is the probe's repeat 0, and the probe adds
the reference (plain autograd over the replayed forward) and the comparison. ``--compile`` adds
each variant's ``torch.compile`` twin (``<variant>+compile``, readback's through
``readback.ops.compiled``, after one eager step that creates the sites); its compilation is
done in the warm-up, outside the timed rounds. The timed variants share one process with the
trainer's malloc settings (``readback.train.launch.keep_freed_memory``). Memory is each
variant's peak RSS over a few steps, measured in its own process, as its rise over the RSS
after building the model: once with glibc's default malloc (whose heap keeps freed blocks, so
the figure includes fragmentation) and once with ``MALLOC_MMAP_THRESHOLD_=65536`` (large
tensors are mapped and unmapped, so the RSS follows the live tensors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from peers import PlainGPT, plain_fog
from readback.backends import build_model
from readback.config import CONF_DIR, typed
from readback.ops.compiled import compiled
from readback.probe import GradientProbe, train_taped
from readback.stopping import ends_on_ctrl_c
from readback.train.launch import keep_freed_memory
from readback.train.records.identity import cpu_model

VOCAB = 2048
READBACK = ("bf16_baseline", "reuse_rounded", "fresh_reround", "no_saved_copy", "reuse_rounded_bf16_bwd")
PLAIN = ("plain_fp32", "plain_bf16")  # the GPT peer
PLAIN_FOG = "plain_fog"  # FOG in FP32 without readback's numerics (peers.plain_fog)
PEER = "plain_fp32"  # what every variant's GFLOP/s is a fraction of
# the settings that keep torch, oneDNN (its BF16 GEMM) and MKL (its FP32 GEMM) below the CPU's own ISA
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``<model>, <the vector extensions torch can use>, torch dispatches <level>``."""
    flags: set[str] = set()
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    isa = [name for flag, name in ISA_FLAGS.items() if flag in flags] or ["none of AVX2, AVX512, AVX512-BF16, AMX"]
    limits = [f"{key}={os.environ[key]}" for key in ISA_LIMITS if key in os.environ]
    dispatch = f"torch {torch.__version__} dispatches {torch.backends.cpu.get_cpu_capability()}"
    return f"{cpu_model(Path(cpuinfo))}, {' '.join(isa)}; {dispatch}" + (
        f" (limited by {' '.join(limits)})" if limits else ""
    )


COMPILED = "+compile"
# ``<experiment>@<recipe>``: the experiment under ``precision.recipe=<recipe>`` (e.g. reuse_rounded@mxfp8);
# ``<experiment>@<key>=<value>``: under that one override (e.g. reuse_rounded@precision.bf16_gemm=native), so that
# two settings of one experiment interleave in one run
SETTING = "@"
RECOMPILE_LIMIT = 64  # graphs of one function dynamo compiles in a process (its default: 8)


def build(variant: str, size: str, batch: int, overrides: tuple[str, ...] = ()):
    """``(step function, FOG for the FLOP formula)`` of one variant, on fixed random tokens;
    ``overrides`` change readback's configuration."""
    variant, compile_it = variant.removesuffix(COMPILED), variant.endswith(COMPILED)
    variant, _, setting = variant.partition(SETTING)
    experiment = variant if variant in READBACK else "reuse_rounded"
    overrides = (*overrides, *([setting if "=" in setting else f"precision.recipe={setting}"] if setting else []))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        settings = [f"model={size}", f"+experiment={experiment}", f"model.vocab_size={VOCAB}", *overrides]
        cfg = typed(compose("train", overrides=settings))
    torch.manual_seed(0)
    fog = build_model(cfg)
    x = torch.randint(0, VOCAB, (batch, cfg.model.seq_len))
    y = x.roll(-1, 1)
    model = PlainGPT(fog.cfg) if variant in PLAIN else plain_fog(fog.cfg, fog.numerics) if variant == PLAIN_FOG else fog
    autocast = torch.autocast("cpu", torch.bfloat16) if variant == "plain_bf16" else nullcontext()

    forward = model

    def step():
        with autocast:
            loss = forward(x, y)
        loss.backward()
        if model is fog:
            fog.numerics.end_step()
        model.zero_grad(set_to_none=True)

    if compile_it:
        step()  # eager: creates every rounding site before the compiled graph is traced
        # each compiled variant and size is one more graph of FOG.forward: past dynamo's limit of 8
        # the next variant would run eager under its compiled name
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        forward = compiled(model)
    if variant == "probe":
        probe = GradientProbe(dataclasses.replace(cfg.probe, every=1, repeats=1))

        def probed_step():
            _, trained = train_taped(fog, x, y)
            probe.measure(fog, x, y, trained)
            fog.numerics.end_step()
            fog.zero_grad(set_to_none=True)

        return probed_step, fog
    return step, fog


def peak_memory(variant: str, size: str, batch: int, overrides: tuple[str, ...] = (), steps: int = 3) -> dict:
    """Peak RSS (MiB) of ``steps`` steps in this process, and its rise over the RSS after building."""
    step, _ = build(variant, size, batch, overrides)
    with open("/proc/self/statm") as f:
        built = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    for _ in range(steps):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return {"peak_mib": peak, "rise_mib": peak - built}


def time_table(
    size: str, threads: int, batch: int, rounds: int, variants: list[str], overrides: tuple[str, ...] = ()
) -> dict:
    torch.set_num_threads(threads)
    keep_freed_memory()
    built = {v: build(v, size, batch, overrides) for v in variants}
    fog = next(iter(built.values()))[1]
    tokens = batch * fog.cfg.seq_len
    flops = fog.flops_per_token() * tokens
    times = {v: [] for v in variants}
    for fn, _ in built.values():
        fn()  # warm-up
    for _ in range(rounds):
        for v, (fn, _) in built.items():
            start = time.perf_counter()
            fn()
            times[v].append(time.perf_counter() - start)
    return {
        v: {
            "median_ms": 1e3 * statistics.median(t),
            "min_ms": 1e3 * min(t),
            "max_ms": 1e3 * max(t),
            "tokens_per_s": tokens / statistics.median(t),
            "gflops": flops / statistics.median(t) / 1e9,
        }
        for v, t in times.items()
    }


def print_table(size: str, threads: int, batch: int, rounds: int, rows: dict, memory: dict) -> None:
    print(f"\n{size}, batch {batch}, {threads} thread(s), {rounds} interleaved rounds")
    width = max(29, *(len(v) + 2 for v in rows))
    print(
        f"  {'variant':<{width}}{'median ms':>10}{'min':>9}{'max':>9}{'tok/s':>9}{'GFLOP/s':>9}"
        f"{'/ fp32':>8}{'rise MiB':>10}{'live MiB':>10}"
    )
    peer = rows[PEER]["gflops"] if PEER in rows else float("nan")
    for v, r in rows.items():
        mem = memory.get(v, {})
        print(
            f"  {v:<{width}}{r['median_ms']:10.1f}{r['min_ms']:9.1f}{r['max_ms']:9.1f}{r['tokens_per_s']:9.0f}"
            f"{r['gflops']:9.2f}{r['gflops'] / peer:8.2f}"
            f"{mem.get('rise_mib', float('nan')):10.0f}{mem.get('live_rise_mib', float('nan')):10.0f}"
        )
    for v in rows:
        if v.endswith(COMPILED) and v.removesuffix(COMPILED) in rows:
            eager = rows[v.removesuffix(COMPILED)]["median_ms"]
            print(f"  {v} / eager step: {rows[v]['median_ms'] / eager:.2f}")
    if "probe" in rows:
        ratio = rows["probe"]["median_ms"] / rows["reuse_rounded"]["median_ms"]
        print(f"  probed step (1 repeat) / reuse_rounded step: {ratio:.2f} (the probe adds {ratio - 1:.2f} of a step)")


@ends_on_ctrl_c("benchmarks/step.py")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 4], help="micro-batch per size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=[*READBACK, *PLAIN, PLAIN_FOG, "probe"])
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides of readback's variants")
    parser.add_argument("--compile", action="store_true", help="also time each variant compiled (not the probe)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--memory-of", nargs=3, metavar=("VARIANT", "SIZE", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.memory_of:
        torch.set_num_threads(1)
        variant, size, batch = args.memory_of
        print(json.dumps(peak_memory(variant, size, int(batch), tuple(args.overrides))))
        return
    if args.compile:
        args.variants += [v + COMPILED for v in args.variants if v != "probe"]
    cpu = cpu_description()
    print(f"CPU: {cpu}" + (f"; readback with {' '.join(args.overrides)}" if args.overrides else ""))
    results: dict = {"cpu": cpu, "overrides": args.overrides}
    for size, batch in zip(args.sizes, args.batch * len(args.sizes)):
        memory = {}
        if not args.no_memory:
            for v in (v for v in args.variants if not v.endswith(COMPILED)):  # (the compiler's own memory would count)
                memory[v] = {}
                for prefix, malloc in (("", {}), ("live_", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
                    out = subprocess.run(
                        [sys.executable, __file__, "--memory-of", v, size, str(batch), "--overrides", *args.overrides],
                        check=True,
                        capture_output=True,
                        text=True,
                        env={**os.environ, **malloc},
                    ).stdout
                    memory[v].update({prefix + k: n for k, n in json.loads(out.splitlines()[-1]).items()})
        for threads in args.threads:
            rows = time_table(size, threads, batch, args.rounds, args.variants, tuple(args.overrides))
            print_table(size, threads, batch, args.rounds, rows, memory)
            results[f"{size}/{threads}"] = {"rows": rows, "memory": memory}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
