"""``trainer.dry_run=true``: the model built on the meta device, its size, no weights allocated."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from readback.train.contract import Builders
from readback.train.summary import write_summary


def dry_run(cfg: DictConfig, run_dir: Path, experiment: str, builders: Builders, *, rank: int,
            world_size: int) -> dict[str, Any]:
    """Print the model's size and write ``status: dry_run`` (rank 0); reads data only for a
    vocabulary the config leaves unset."""
    from readback.train.trainer import build_stream

    t0 = time.time()
    if OmegaConf.select(cfg, "model.vocab_size", default=None) is None:
        build_stream(cfg, builders, rank=0, world_size=1)
    torch.manual_seed(int(cfg.seed))
    model = builders.model(cfg, "meta")
    n_params, fpt = int(model.n_params()), float(model.flops_per_token())
    summary = {
        "status": "dry_run",
        "experiment": experiment,
        "n_params": n_params,
        "flops_per_token": fpt,
        "final_loss": None,
        "val_loss": None,
        "steps": 0,
        "tokens": 0,
        "diverged_at_step": None,
        "wall_time_s": time.time() - t0,
    }
    if rank == 0:
        print(f"{experiment}: {n_params:,} parameters, {fpt:.4g} FLOPs per token (dry run, no weights allocated)")
        write_summary(run_dir, summary)
    return summary
