"""``python -m readback.bias CHECKPOINT_OR_RUN_DIR [--batches N] [--out DIR] [--dtype fp64|fp32]``

Loads a training checkpoint (its directory, or a run directory's newest), and runs the bias meter at its
weights and FP8 scales on the run's first N validation batches; writes ``bias.json``,
``bias.md`` and ``bias.png`` to DIR (default ``<run dir>/bias/step<step>``) and prints the
table's total rows. Exit code 2, one line on stderr, when there is no checkpoint to read.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def load_run(path: Path):
    """``(model, stream, step, run_dir)`` from a checkpoint or a run directory's newest one."""
    from readback.backends import build_model
    from readback.data import build_data
    from readback.train.checkpoint import checkpoint_dir, is_checkpoint, list_checkpoints, load_checkpoint

    if not is_checkpoint(path):
        found = list_checkpoints(checkpoint_dir(path)) or list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"no checkpoint in {path} (nor in {checkpoint_dir(path)})")
        path = found[-1][1]
    state = load_checkpoint(path)
    cfg = OmegaConf.create(state["config"])
    stream = build_data(
        cfg.data,
        seq_len=int(cfg.model.seq_len),
        micro_batch=int(cfg.trainer.micro_batch),
        seed=int(cfg.seed),
        rank=0,
        world_size=1,
    )
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    model.numerics.load_state_dict(state["ranks"][0]["numerics"])
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return model, stream, int(state["step"]), run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.bias", description=__doc__.split("\n\n")[1])
    parser.add_argument("path", type=Path, metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("--batches", type=int, default=8, help="validation batches to average over (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp64", help="precision of the reference replay")
    parser.add_argument(
        "--show",
        default="total,*.attn.qkv",
        help="comma-separated globs of the groups printed (the files have all; default total,*.attn.qkv)",
    )
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.exit(2, f"{parser.prog}: error: --batches must be >= 1, got {args.batches}\n")
    os.environ.setdefault("MPLBACKEND", "Agg")
    from readback.bias import measure_bias
    from readback.bias.report import to_markdown, write

    try:
        model, stream, step, run_dir = load_run(args.path)
    except (FileNotFoundError, IsADirectoryError, RuntimeError, KeyError) as error:
        parser.exit(2, f"{parser.prog}: error: cannot read a checkpoint at {args.path}: {error}\n")
    start = time.perf_counter()
    result = measure_bias(model, list(stream.val_batches(args.batches)), dtype=DTYPES[args.dtype])
    result.info = {"checkpoint_step": step, "run_dir": str(run_dir)}
    paths = write(result, args.out or run_dir / "bias" / f"step{step}")
    shown = [g for g in result.groups if any(fnmatch.fnmatchcase(g, pattern) for pattern in args.show.split(","))]
    print(to_markdown(result, groups=shown or ["total"]))
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
