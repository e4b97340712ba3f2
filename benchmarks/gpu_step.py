"""Training-step throughput of FOG on one GPU: tokens/s, MFU against the dense BF16 peak, and
peak memory, for the TE backend (BF16, and FP8 delayed scaling with FP8 attention) and for the
emulated backend under every policy (FP8, real FP8 GEMMs through ``torch._scaled_mm``).

    python benchmarks/gpu_step.py                                  # fog_390m, seq 1024, micro-batch 8
    python benchmarks/gpu_step.py --cases te_fp8 emulated_no_saved_copy --steps 100
    python benchmarks/gpu_step.py --model tiny --seq 128 --micro-batch 4 --json out.json

Tokens are synthetic (uniform over the vocabulary); each step is forward, backward, AdamW and
``numerics.end_step()``. Every case runs in its own process: Transformer Engine reads some
switches when it is imported, and each case gets a clean memory peak. A case runs ``--steps``
timed steps or until ``--max-seconds`` have passed, whichever comes first. On a machine without
CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Dense BF16 tensor-core peak FLOP/s, by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

# case -> (experiment overlay, backend, extra overrides)
CASES = {
    "te_bf16": ("bf16_baseline", "te", ()),
    "te_fp8": ("reuse_rounded", "te", ()),  # DelayedScaling(fp8_dpa=True): TE's FP8 attention
    **{
        f"emulated_{policy}": ("reuse_rounded", "emulated", (f"policy={policy}",))
        for policy in ("reuse_rounded", "fresh_reround", "no_saved_copy", "original", "exact")
    },
}
DESCRIPTIONS = {
    "te_bf16": "TE modules, no FP8",
    "te_fp8": "TE delayed scaling, fp8_dpa",
}


def _peak(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), None)


def _compose(case: str, args) -> object:
    from hydra import compose, initialize_config_dir

    from readback.config import CONF_DIR  # registers the schema conf/train.yaml names

    experiment, backend, extra = CASES[case]
    overrides = [
        f"+experiment={experiment}",
        f"backend={backend}",
        f"model={args.model}",
        f"model.seq_len={args.seq}",
        f"seed={args.seed}",
        *extra,
    ]
    if args.vocab:
        overrides.append(f"model.vocab_size={args.vocab}")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    if cfg.model.vocab_size is None:
        raise SystemExit(f"model={args.model} takes its vocabulary from the data: pass --vocab")
    return cfg


def run_case(case: str, args) -> dict:
    """One case in this process: build, warm up, time; a dict of results (or of the error)."""
    import torch

    from readback.backends import build_model
    from readback.errors import ConfigError

    result = {"case": case, "steps": 0}
    try:
        cfg = _compose(case, args)
        torch.manual_seed(args.seed)
        model = build_model(cfg, args.device)
    except ConfigError as error:
        return {**result, "error": str(error)}
    sites = None
    try:
        from readback.backends import site_implementations

        sites = site_implementations(cfg)
    except Exception:  # the summary is a courtesy here
        pass
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = args.device == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    vocab, batch, seq = int(cfg.model.vocab_size), args.micro_batch, args.seq
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
        **result,
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
        "sites": sites,
    }


def _table(results: list[dict]) -> str:
    header = f"{'case':<24} {'steps':>5} {'tokens/s':>10} {'ms/step':>8} {'MFU':>6} {'peak GiB':>8} {'loss':>7}  notes"
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:<24} {'-':>5} {'-':>10} {'-':>8} {'-':>6} {'-':>8} {'-':>7}  {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        note = DESCRIPTIONS.get(r["case"], "emulated FP8, policy " + r["case"].removeprefix("emulated_"))
        lines.append(
            f"{r['case']:<24} {r['steps']:>5} {r['tokens_per_s']:>10.0f} {r['step_ms']:>8.1f} {mfu:>6} "
            f"{r['peak_mem_gib']:>8.1f} {r['final_loss']:>7.3f}  {note}"
        )
    return "\n".join(lines)


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
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size for models that take it from data")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per case, at most")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="timed seconds per case, at most")
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds before a case's process is stopped")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak, if the device is not known")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke tests of the worker
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device on this machine; this benchmark measures GPU training steps. Nothing to do.")
        return 0
    if args.worker:
        print("RESULT " + json.dumps(run_case(args.worker, args)), flush=True)
        return 0

    forwarded = list(argv if argv is not None else sys.argv[1:])
    results = []
    print(
        f"gpu_step: model={args.model} seq={args.seq} micro_batch={args.micro_batch} on {torch.cuda.get_device_name()}",
        flush=True,
    )
    for case in args.cases:
        command = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--worker", case]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout, cwd=ROOT)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is not None:
                result = json.loads(line.removeprefix("RESULT "))
            else:
                tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
                result = {"case": case, "error": f"exit {done.returncode}: {tail[-300:]}"}
        except subprocess.TimeoutExpired:
            result = {"case": case, "error": f"timed out after {args.case_timeout:.0f} s"}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "sites"}), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
    print()
    print(_table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
