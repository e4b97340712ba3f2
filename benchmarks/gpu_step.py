"""Training-step throughput of FOG on one GPU: tokens/s, MFU against the dense BF16 peak, and
peak memory, for the emulated backend in BF16 and under every policy (FP8, real FP8 GEMMs through
``torch._scaled_mm``) and for the TE backend (BF16, and FP8 delayed scaling with FP8 attention),
at one or more sequence lengths.

    python benchmarks/gpu_step.py                                  # fog_390m, seq 1024, micro-batch 8
    python benchmarks/gpu_step.py --cases emulated_bf16 emulated_reuse_rounded --seq 1024 4096 --micro-batch 8 2
    python benchmarks/gpu_step.py --model tiny --seq 128 --micro-batch 4 --vocab 256 --json out.json

Tokens are synthetic (uniform over the vocabulary); each step is forward, backward, AdamW and
``numerics.end_step()``. Every case and sequence length runs in its own process: Transformer
Engine reads some switches when it is imported, and each gets a clean memory peak. A case runs
``--steps`` timed steps or until ``--max-seconds`` have passed, whichever comes first; one that
runs out of memory or past ``--case-timeout`` is a result that says so. The emulated attention
runs in blocks of query rows and saves nothing T x T, so its memory grows linearly with the
sequence: ``--seq 1024 4096`` with micro-batches of the same tokens (``--micro-batch 8 2``)
shows it. Needs a CUDA device: on a machine without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

ROOT = Path(__file__).resolve().parents[1]

POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy", "original", "exact")
# case -> (experiment overlay, backend, extra overrides)
CASES = {
    "te_bf16": ("bf16_baseline", "te", ()),
    "te_fp8": ("reuse_rounded", "te", ()),  # DelayedScaling(fp8_dpa=True): TE's FP8 attention
    "emulated_bf16": ("bf16_baseline", "emulated", ()),
    **{f"emulated_{policy}": ("reuse_rounded", "emulated", (f"policy={policy}",)) for policy in POLICIES},
    # the emulated cases' attention runs on the Triton kernel on CUDA (attention.kernel=auto); this on the ops
    "emulated_reuse_rounded_ops": ("reuse_rounded", "emulated", ("attention.kernel=ops",)),
}
DESCRIPTIONS = {
    "te_bf16": "TE modules, no FP8",
    "te_fp8": "TE delayed scaling, fp8_dpa",
    "emulated_bf16": "readback's ops, no FP8",
    "emulated_reuse_rounded_ops": "reuse_rounded, attention on readback's ops",
}
# FP8 case -> the BF16 case of its backend, which its speed and memory are compared with
BASELINES = {
    "te_fp8": "te_bf16",
    **{f"emulated_{policy}": "emulated_bf16" for policy in POLICIES},
    "emulated_reuse_rounded_ops": "emulated_bf16",
}


def _peak(device_name: str, override_tflops: float | None) -> float | None:
    from readback.train.records.metrics import peak_bf16_flops

    return override_tflops * 1e12 if override_tflops else peak_bf16_flops(device_name)


def _compose(case: str, seq: int, args) -> object:
    from hydra import compose, initialize_config_dir

    from readback.config import CONF_DIR, typed  # registers the schema conf/train.yaml names

    experiment, backend, extra = CASES[case]
    overrides = [
        f"+experiment={experiment}",
        f"backend={backend}",
        f"model={args.model}",
        f"model.seq_len={seq}",
        f"seed={args.seed}",
        *extra,
    ]
    if args.vocab:  # the steps read random tokens: a data group of that vocabulary, never read
        overrides += [f"model.vocab_size={args.vocab}", "data=synthetic", f"data.vocab_size={args.vocab}"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = typed(compose("train", overrides=overrides))
    if cfg.model.vocab_size is None:
        raise SystemExit(f"model={args.model} takes its vocabulary from the data: pass --vocab")
    return cfg


def run_case(case: str, seq: int, batch: int, args) -> dict:
    """One case at one sequence length in this process: build, warm up, time; a dict of results
    (or of the error: a refused configuration, or the memory peak where memory ran out)."""
    import torch

    from readback.backends import build_model, site_implementations
    from readback.errors import ConfigError

    result = {"case": case, "seq": seq, "micro_batch": batch, "steps": 0}
    cuda = args.device == "cuda"
    try:
        cfg = _compose(case, seq, args)
        torch.manual_seed(args.seed)
        model = build_model(cfg, args.device)
        result["sites"] = site_implementations(cfg)
        return {**result, **_timed_steps(model, int(cfg.model.vocab_size), seq, batch, args)}
    except ConfigError as error:
        return {**result, "error": str(error)}
    except torch.cuda.OutOfMemoryError as error:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
        first_line = str(error).split("\n")[0][:160]
        return {**result, "error": f"out of memory: {first_line}", "oom": True, "peak_mem_gib": peak}


def _timed_steps(model, vocab: int, seq: int, batch: int, args) -> dict:
    """Warm-up steps, then timed ones: speed, MFU, and the memory peak from the warm-up on (weights,
    AdamW states and activations)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    cuda = args.device == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> torch.Tensor:
        idx = torch.randint(0, vocab, (batch, seq + 1), device=args.device, generator=generator)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.numerics.end_step()
        return loss.detach()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    sync()
    losses, start = [], time.perf_counter()
    while len(losses) < args.steps and time.perf_counter() - start < args.max_seconds:
        losses.append(step())
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_s = len(losses) * batch * seq / elapsed
    flops_per_token = float(model.flops_per_token())
    device_name = torch.cuda.get_device_name() if cuda else args.device
    peak = _peak(device_name, args.peak_tflops)
    final = torch.stack(losses).float()[-1].item() if losses else math.nan
    return {
        "steps": len(losses),
        "seconds": elapsed,
        "tokens_per_s": tokens_per_s,
        "step_ms": 1e3 * elapsed / max(len(losses), 1),
        "mfu": flops_per_token * tokens_per_s / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan,
        "final_loss": final,
        "loss_finite": math.isfinite(final),
        "n_params": int(model.n_params()),
        "flops_per_token": flops_per_token,
        "device": device_name,
    }


def _table(results: list[dict]) -> str:
    header = (
        f"{'case':<24} {'seq':>5} {'batch':>5} {'steps':>5} {'tokens/s':>10} {'ms/step':>8} {'MFU':>6} "
        f"{'peak GiB':>8} {'loss':>7}  notes"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        shape = f"{r['case']:<24} {r['seq']:>5} {r['micro_batch']:>5}"
        if "error" in r:
            peak = f"{r['peak_mem_gib']:>8.1f}" if "peak_mem_gib" in r else f"{'-':>8}"
            lines.append(f"{shape} {'-':>5} {'-':>10} {'-':>8} {'-':>6} {peak} {'-':>7}  {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        note = DESCRIPTIONS.get(r["case"], "emulated FP8, policy " + r["case"].removeprefix("emulated_"))
        lines.append(
            f"{shape} {r['steps']:>5} {r['tokens_per_s']:>10.0f} {r['step_ms']:>8.1f} {mfu:>6} "
            f"{r['peak_mem_gib']:>8.1f} {r['final_loss']:>7.3f}  {note}"
        )
    return "\n".join(lines)


def fp8_against_bf16(results: list[dict]) -> list[str]:
    """One line per FP8 case whose BF16 baseline ran at the same sequence length: the ratios of
    their tokens/s and of their memory peaks."""
    done = {(r["case"], r["seq"]): r for r in results if "error" not in r}
    lines = []
    for (case, seq), fp8 in done.items():
        baseline = done.get((BASELINES.get(case), seq))
        if baseline is None:
            continue
        speed = fp8["tokens_per_s"] / baseline["tokens_per_s"]
        memory = fp8["peak_mem_gib"] / baseline["peak_mem_gib"]
        lines.append(f"{case} / {baseline['case']} at seq {seq}: tokens/s x{speed:.2f}, peak memory x{memory:.2f}")
    return lines


def _parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(CASES),
        choices=list(CASES),
        metavar="CASE",
        help=f"cases to run (default: all of {', '.join(CASES)})",
    )
    parser.add_argument("--model", default="fog_390m")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024], help="sequence lengths (default 1024)")
    parser.add_argument(
        "--micro-batch", type=int, nargs="+", default=[8], help="sequences per step: one for all, or one per --seq"
    )
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size for models that take it from data")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per case, at most")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="timed seconds per case, at most")
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds before a case's process is stopped")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak, if the device is not known")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: tests of the worker
    args = parser.parse_args(argv)
    if len(args.micro_batch) not in (1, len(args.seq)):
        parser.error(f"--micro-batch takes one value, or one per --seq ({len(args.seq)})")
    return args


def shapes(args) -> list[tuple[int, int]]:
    """(sequence length, micro-batch) pairs, in the order they run."""
    batches = args.micro_batch * len(args.seq) if len(args.micro_batch) == 1 else args.micro_batch
    return list(zip(args.seq, batches))


def worker_command(args, case: str, seq: int, batch: int) -> list[str]:
    """This script, run for one case at one shape (its result: the line ``RESULT <json>``)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--model", args.model]
    command += ["--seq", str(seq), "--micro-batch", str(batch), "--steps", str(args.steps), "--seed", str(args.seed)]
    command += ["--warmup", str(args.warmup), "--max-seconds", str(args.max_seconds), "--device", args.device]
    command += ["--vocab", str(args.vocab)] if args.vocab else []
    return command + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])


def run_worker(command: list[str], case: str, seq: int, batch: int, timeout: float) -> dict:
    """The worker's result, or one that says why there is none (its exit, or the time limit)."""
    failed = {"case": case, "seq": seq, "micro_batch": batch}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line.removeprefix("RESULT "))
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    return {**failed, "error": f"exit {done.returncode}: {tail[-300:]}"}


@ends_on_ctrl_c("benchmarks/gpu_step.py")
def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_step: needs a CUDA device; torch {torch.__version__} sees none: nothing measured", file=sys.stderr)
        return 2
    if args.worker:
        result = run_case(args.worker, args.seq[0], args.micro_batch[0], args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"gpu_step: model={args.model} {shapes(args)} (seq, micro-batch) on {device}", flush=True)
    results = []
    for seq, batch in shapes(args):
        for case in args.cases:
            command = worker_command(args, case, seq, batch)
            results.append(run_worker(command, case, seq, batch, args.case_timeout))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "sites"}), flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2))
    print()
    print(_table(results))
    print("\n".join(fp8_against_bf16(results)))
    return 1 if failures(results) else 0


def failures(results: list[dict]) -> list[dict]:
    """The results without a measurement: running out of memory is a measurement, not a failure."""
    return [r for r in results if "error" in r and not r.get("oom")]


if __name__ == "__main__":
    sys.exit(main())
