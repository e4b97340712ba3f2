"""A refactor changes nothing a user sees: the same short runs on two commits, compared key by key.

Each case trains the tiny FOG for 20 steps on the embedded text (probe and bias meter on where
they apply) once with the code of ``--base`` and once with ``--head`` (default: the working
tree), and compares every key of ``metrics.jsonl``, ``summary.json`` and, where the case writes
one, ``bias.json``, except wall-clock measurements. Compiled cases also compare how often torch
recompiled. Keys that only the head writes are counted as added, not as differences (a change
that adds statistics shows that it left the old ones alone). Exit status 1 when a value differs
or a key is gone.

    python scripts/refactor_check.py --base 63eb0bb            # head: the working tree
    python scripts/refactor_check.py --base A --head B --cases reuse_rounded,resumed

``--overrides`` adds settings to every case on both sides (e.g. ``precision.bf16_layers=[]``);
``--head-overrides`` to the head's runs only, for a key the base does not know (e.g. the head's
``precision.bf16_gemm=native``, to show that the old behaviour is still there under a new default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

REPO = Path(__file__).resolve().parents[1]
# Wall-clock measurements, the run's own folder (each side runs in its own) and the code version that
# wrote a record (each side's commit, none for the base's exported tree) are not results.
UNCOMPARED = {
    "tokens_per_s",
    "mfu",
    "mem_gib",
    "wall_time_s",
    "seconds_per_batch",
    "steps_per_batch",
    "run_dir",
    "code",
}
RUN = (
    "model=tiny",
    "data=shakespeare",
    "seed=3",
    "model.global_batch=8",
    "trainer.micro_batch=4",
    "trainer.steps=20",
    "trainer.log_every=5",
    "trainer.eval_every=10",
    "trainer.eval_batches=2",
    "trainer.ckpt_every=10",
    "trainer.optim.warmup_steps=5",
    "trainer.progress=false",
    "logger=none",
)
PROBE = ("probe.every=5", "probe.repeats=2")
BIAS = ("probe.bias_every=10", "probe.bias_batches=2")
FP8 = (*PROBE, *BIAS)


@dataclass(frozen=True)
class Case:
    """One run: its overrides, how it is launched (``plain``, ``resumed``: SIGKILLed after its
    first checkpoint and resumed, ``gloo``: two processes), and whether the bias CLI runs on it."""

    name: str
    overrides: tuple[str, ...]
    launch: str = "plain"
    bias_cli: bool = False
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("reuse_rounded", ("+experiment=reuse_rounded", *FP8), bias_cli=True),
    Case("fresh_reround", ("+experiment=fresh_reround", *FP8)),
    Case("no_saved_copy", ("+experiment=no_saved_copy", *FP8)),
    Case("reuse_rounded_bf16_bwd", ("+experiment=reuse_rounded_bf16_bwd", *FP8)),
    Case("bf16_baseline", ("+experiment=bf16_baseline", *PROBE)),
    Case("current", ("+experiment=reuse_rounded", "precision.recipe=current", *FP8)),
    Case("mxfp8", ("+experiment=reuse_rounded", "precision.recipe=mxfp8", *FP8)),
    Case("nvfp4", ("+experiment=reuse_rounded", "precision.recipe=nvfp4", *FP8)),
    Case("stochastic", ("+experiment=fresh_reround", "precision.rounding=stochastic", *FP8)),
    Case("site_margin", ("+experiment=reuse_rounded", "precision.site_margin={attn.core.output:10}", *FP8)),
    Case("bf16_layers", ("+experiment=reuse_rounded", "precision.bf16_layers=[lm_head,layers.0.mlp]", *FP8)),
    Case("bwd_fp32", ("+experiment=reuse_rounded", "attention.bwd_precision=fp32", *FP8)),
    Case("hf", ("+experiment=reuse_rounded", "model=hf", *PROBE)),
    Case("resumed", ("+experiment=fresh_reround", "precision.rounding=stochastic", *FP8), launch="resumed"),
    Case("gloo", ("+experiment=reuse_rounded", *PROBE), launch="gloo"),
    Case("compiled", ("+experiment=fresh_reround", "trainer.compile=true"), env={"TORCH_LOGS": "recompiles"}),
]


def export(rev: str, into: Path) -> Path:
    """The tree of commit ``rev`` in ``into`` (``git archive``: no worktree left behind)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _env(tree: Path, case: Case) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1", WANDB_MODE="disabled", **case.env)
    for key in ("WORLD_SIZE", "RANK", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        env.pop(key, None)
    return env


def run_case(tree: Path, case: Case, run_dir: Path, extra: tuple[str, ...] = ()) -> str:
    """Train ``case`` with the code in ``tree`` into ``run_dir``, ``extra`` overrides added;
    returns the logs."""
    args = [*RUN, *case.overrides, *extra, f"hydra.run.dir={run_dir}"]
    python = [sys.executable]
    if case.launch == "gloo":
        python += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*python, str(tree / "train.py"), *args]
    env, logs = _env(tree, case), ""
    if case.launch == "resumed":
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None and not list((run_dir / "checkpoints").glob("step_*")):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        logs += proc.communicate()[0]
        cmd.append("trainer.resume=true")
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    logs += done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{case.name} in {tree} failed ({done.returncode}):\n{logs[-3000:]}")
    if case.bias_cli:
        # the bias meter's command: readback.bias in a tree from before readback.cli
        meter = "readback.cli.bias" if (tree / "src/readback/cli/bias.py").exists() else "readback.bias"
        bias = [sys.executable, "-m", meter, str(run_dir), "--batches", "2", "--out", str(run_dir / "bias")]
        done = subprocess.run(bias, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"bias meter on {case.name} in {tree} failed:\n{done.stderr[-3000:]}")
    return logs


def results(run_dir: Path, logs: str) -> dict[str, object]:
    """Everything a user sees of a run, ``UNCOMPARED`` keys left out."""

    def kept(record: dict) -> dict:
        return {k: v for k, v in record.items() if k not in UNCOMPARED}

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, object] = {
        "metrics.jsonl": [kept(row) for row in rows],
        "summary.json": kept(json.loads((run_dir / "summary.json").read_text())),
        "recompiles": logs.count("Recompiling function"),
    }
    if (run_dir / "bias" / "bias.json").exists():
        out["bias.json"] = kept(json.loads((run_dir / "bias" / "bias.json").read_text()))
    return out


def differences(base: object, head: object, where: str = "") -> list[str]:
    """The paths at which ``head`` differs from ``base`` (dicts by key, lists by index; floats
    bit for bit, as JSON wrote them)."""
    if isinstance(base, dict) and isinstance(head, dict):
        found = [f"{where}.{k}: only in {'base' if k in base else 'head'}" for k in sorted(set(base) ^ set(head))]
        for key in sorted(set(base) & set(head)):
            found += differences(base[key], head[key], f"{where}.{key}")
        return found
    if isinstance(base, list) and isinstance(head, list):
        found = [f"{where}: {len(base)} entries in base, {len(head)} in head"] if len(base) != len(head) else []
        for i, (b, h) in enumerate(zip(base, head)):
            found += differences(b, h, f"{where}[{i}]")
        return found
    return [] if base == head or (base != base and head != head) else [f"{where}: {base!r} -> {head!r}"]  # NaN == NaN


@ends_on_ctrl_c("scripts/refactor_check.py")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", help="the commit after it (default: the working tree)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)", default="")
    parser.add_argument("--keep", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--overrides", nargs="*", default=[], help="added to every run on both sides")
    parser.add_argument("--head-overrides", nargs="*", default=[], help="added to the head's runs only")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if not args.cases or c.name in args.cases.split(",")]
    work = args.keep or Path(tempfile.mkdtemp(prefix="refactor_check_"))
    trees = {"base": export(args.base, work / "base_tree")}
    trees["head"] = export(args.head, work / "head_tree") if args.head else REPO
    extra = {"base": tuple(args.overrides), "head": (*args.overrides, *args.head_overrides)}
    failed = 0
    for case in chosen:
        seen = {}
        for side, tree in trees.items():
            run_dir = work / side / case.name
            seen[side] = results(run_dir, run_case(tree, case, run_dir, extra[side]))
        found = differences(seen["base"], seen["head"])
        added = [line for line in found if line.endswith("only in head")]  # new keys: a feature, not a change
        changed = [line for line in found if line not in added]
        rows = len(seen["head"]["metrics.jsonl"])  # type: ignore[arg-type]
        files = ", ".join(k for k in seen["head"] if k != "recompiles")
        verdict = "identical" if not changed else f"{len(changed)} values differ"
        print(
            f"{case.name}: {verdict}{f', {len(added)} keys added' if added else ''} ({rows} records; {files}; "
            f"{seen['head']['recompiles']} recompiles)",
            flush=True,
        )
        for line in changed[:20]:
            print(f"    {line}")
        failed += bool(changed)
    if not args.keep:
        shutil.rmtree(work)
    print(f"{len(chosen) - failed} of {len(chosen)} cases identical in every key both write")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
