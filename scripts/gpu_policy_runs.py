"""Every policy, and the BF16 baseline, trained for 20 steps through train.py: a FOG of head dim
128 (fog_390m's) and two layers, on synthetic data, no logger. Each run must complete with every
logged loss finite; one line per run says so (final loss, validation loss, seconds).

    python scripts/gpu_policy_runs.py --out DIR                           # on CUDA (gpu_check.sh)
    python scripts/gpu_policy_runs.py --out DIR --device cpu --steps 2    # the same runs on a CPU
    python scripts/gpu_policy_runs.py --out DIR --steps 3 --runs reuse_rounded   # gpu_check.sh's first steps

The FP8 policies run as one Hydra multirun (one process, one run directory per policy), the
baseline as one run. Exits 1 when a run failed or logged a non-finite loss.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy", "original", "exact")
BASELINE = "bf16_baseline"
RUNS = (*POLICIES, BASELINE)  # the run directories under --out
HEAD_DIM_128 = ("model=tiny", "model.d_model=256", "model.n_heads=2", "model.n_kv_groups=1", "model.ffn_dim=384")


def run_overrides(device: str, steps: int) -> list[str]:
    """The overrides every run shares: the model, the data, a loss logged at every step."""
    return [
        *HEAD_DIM_128,
        "data=synthetic",
        "data.n_tokens=131072",
        "logger=none",
        f"trainer.device={device}",
        f"trainer.steps={steps}",
        "trainer.log_every=1",
        f"trainer.eval_every={steps}",
        "trainer.eval_batches=1",
        "trainer.progress=false",
    ]


def train_commands(
    out: Path, device: str, steps: int, runs: tuple[str, ...] = RUNS, python: str = sys.executable
) -> list[list[str]]:
    """The multirun of the FP8 policies among ``runs`` (``out/<policy>``) and, if asked for, the
    baseline's run (``out/bf16_baseline``)."""
    train, shared = str(ROOT / "train.py"), run_overrides(device, steps)
    swept = [p for p in POLICIES if p in runs]
    commands = []
    if swept:
        policies = [python, train, "-m", "+experiment=reuse_rounded", f"policy={','.join(swept)}", *shared]
        commands.append([*policies, f"hydra.sweep.dir={out}", "hydra.sweep.subdir=${policy}"])
    if BASELINE in runs:
        commands.append([python, train, f"+experiment={BASELINE}", *shared, f"hydra.run.dir={out / BASELINE}"])
    return commands


def check_run(run_dir: Path, steps: int) -> str | None:
    """What is wrong with the run in ``run_dir``, in a few words; None: it completed ``steps``
    steps with a finite loss at every logged step and a finite validation loss."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return "no summary.json"
    summary = json.loads(summary_file.read_text())
    if summary["status"] != "completed" or summary["steps"] != steps:
        return f"status {summary['status']} after {summary['steps']} of {steps} steps"
    metrics = run_dir / "metrics.jsonl"
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    if len(losses) != steps:
        return f"{len(losses)} losses logged for {steps} steps"
    finals = (summary["final_loss"], summary["val_loss"])
    if not all(x is not None and math.isfinite(x) for x in (*losses, *finals)):
        return "a non-finite loss"
    return None


def report(out: Path, steps: int, runs: tuple[str, ...] = RUNS) -> tuple[list[str], int]:
    """One line per run and the number of runs that failed."""
    lines, failed = [], 0
    for name in runs:
        problem = check_run(out / name, steps)
        if problem is None:
            summary = json.loads((out / name / "summary.json").read_text())
            lines.append(
                f"{name:<16} ok: final loss {summary['final_loss']:.4f}, val loss {summary['val_loss']:.4f}, "
                f"{summary['wall_time_s']:.1f} s"
            )
        else:
            failed += 1
            lines.append(f"{name:<16} FAILED: {problem}")
    return lines, failed


@ends_on_ctrl_c("scripts/gpu_policy_runs.py")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run directories go here")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="default: every run")
    args = parser.parse_args(argv)
    runs = tuple(args.runs)
    for command in train_commands(args.out.resolve(), args.device, args.steps, runs):
        print("$ " + " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT)  # a failed run is reported below, with the others
    lines, failed = report(args.out, args.steps, runs)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
