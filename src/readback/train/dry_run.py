"""``trainer.dry_run=true``: the model built on the meta device, its size and its per-GPU memory
under DDP and FSDP (:mod:`~readback.train.memory`), no weights allocated, and under ``backend=te``
the Transformer Engine plan (for this machine's TE and GPU, or the assumed ones it names:
:mod:`~readback.backends.te_dry_run`); and the same memory check before a real run on GPUs
allocates anything."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from readback.train.contract import Builders, TrainableModule, check_model, with_vocabulary
from readback.train.memory import GB, estimate, refuse_unless_fits, table
from readback.train.settings import PARALLEL, Config
from readback.train.summary import write_summary


def _meta_model(cfg: Config, builders: Builders) -> TrainableModule:
    torch.manual_seed(cfg.seed)
    return check_model(builders.model(cfg, "meta"))


def check_memory(cfg: Config, builders: Builders, world_size: int) -> None:
    """Refuse (one-line ``ConfigError``) a run whose per-GPU estimate exceeds ``trainer.gpu_memory_gb``."""
    e = estimate(_meta_model(cfg, builders), cfg, cfg.trainer.parallel, world_size)
    refuse_unless_fits(e, cfg.trainer.gpu_memory_gb)


def dry_run(
    cfg: Config, run_dir: Path, experiment: str, builders: Builders, *, rank: int, world_size: int
) -> dict[str, Any]:
    """Print the model's size and memory table, refuse it if it does not fit, else write
    ``status: dry_run`` (rank 0); reads data only for a vocabulary the config leaves unset."""
    t0 = time.time()
    if cfg.model.vocab_size is None:
        cfg = with_vocabulary(cfg, builders.stream(cfg, rank=0, world_size=1))
    model = _meta_model(cfg, builders)
    n_params, fpt = int(model.n_params()), float(model.flops_per_token())
    estimates = {p: estimate(model, cfg, p, world_size) for p in PARALLEL}
    chosen = estimates[cfg.trainer.parallel]
    if rank == 0:
        print(f"{experiment}: {n_params:,} parameters, {fpt:.4g} FLOPs per token (dry run, no weights allocated)")
        print(table(list(estimates.values())))
    te_plan = None
    # The plan is printed before the memory check: a job that does not fit is planned too.
    if cfg.backend.name == "te":
        from readback.backends.te_dry_run import dry_run_plan

        lines, te_plan = dry_run_plan(cfg)
        if rank == 0:
            print("\n".join(lines))
    refuse_unless_fits(chosen, cfg.trainer.gpu_memory_gb)
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
        "memory_gb": {
            p: {
                **{k: getattr(e, k) / GB for k in ("params", "grads", "optimizer", "activations")},
                "total": e.total / GB,
                "world_size": e.world_size,
            }
            for p, e in estimates.items()
        },
        **({"te_plan": te_plan} if te_plan is not None else {}),
    }
    if rank == 0:
        write_summary(run_dir, summary)
    return summary
