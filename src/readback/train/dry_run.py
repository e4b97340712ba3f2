"""``trainer.dry_run=true``: the model built on the meta device, its size and its per-GPU memory
under DDP and FSDP, no weights allocated, and under ``backend=te`` the Transformer Engine plan
(for this machine's TE and GPU, or the assumed ones it names: :mod:`~readback.backends.te.dry_run`);
and the same memory check before a real run on GPUs allocates anything.

The memory estimate: parameters, gradients, AdamW states and the activations of one micro-batch,
under DDP (everything replicated) and FSDP2 (sharded).

Bytes are counted in GB (10^9 bytes), as ``trainer.gpu_memory_gb``. Parameters, gradients and
both Adam moments are FP32 (4 bytes each: 16 bytes a parameter replicated). Under FSDP a rank
holds ``1 / world_size`` of each, plus the blocks unsharded at a time: the running block and the
prefetched next one (FP32 parameters: the FP8 sites scale from the master weights), and one
block's unsharded gradient before its reduce-scatter.

Activations (the tensors saved for backward, no recomputation) follow Korthikanti et al. 2022
("Reducing activation recomputation"), with 2-byte activations and no dropout: per layer
``b s (14 d + 4 f)`` bytes (no ``s^2`` term: neither the emulated attention, which recomputes
its probabilities block by block, nor fused attention, ``backend=te``, keeps them), plus the
FP32 logits and their gradient, ``8 b s V``. FP8 copies (1 byte) replace BF16 ones under
``precision=fp8`` on the GPU, so the estimate is an upper bound there. Allocator fragmentation
and workspaces are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from readback.errors import ConfigError
from readback.train.contract import Builders, TrainableModule, check_model, with_vocabulary
from readback.train.records.summary import write_summary
from readback.train.settings import PARALLEL, Config

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    parallel: str
    world_size: int
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def activation_bytes(cfg: Config) -> float:
    """Saved-for-backward bytes of one micro-batch (see the module docstring)."""
    m, b = cfg.model, cfg.trainer.micro_batch
    s, d, f, v = m.seq_len, m.d_model, m.ffn_dim, m.vocab_size
    assert v is not None, "train.contract.with_vocabulary resolves it before the model is sized"
    return m.n_layers * b * s * (14 * d + 4 * f) + 8 * b * s * v


def estimate(model: TrainableModule, cfg: Config, parallel: str, world_size: int) -> MemoryEstimate:
    """Per-GPU bytes of ``model`` (built on ``meta``) trained under ``parallel`` on ``world_size`` GPUs."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if parallel == "fsdp":
        block = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers), default=0)
        shard = n / world_size
        params, grads, optimizer = 4 * (shard + 2 * block), 4 * (shard + block), 8 * shard
    else:
        params, grads, optimizer = 4 * n, 4 * n, 8 * n
    return MemoryEstimate(parallel, world_size, params, grads, optimizer, activation_bytes(cfg))


def table(estimates: list[MemoryEstimate]) -> str:
    """A text table, one row per estimate, in GB per GPU."""
    rows = [
        f"{'parallel':>8} {'world':>5} {'params':>8} {'grads':>8} {'adam':>8} {'activ.':>8} {'total':>8}  (GB per GPU)"
    ]
    for e in estimates:
        cells = (e.params, e.grads, e.optimizer, e.activations, e.total)
        rows.append(f"{e.parallel:>8} {e.world_size:>5} " + " ".join(f"{c / GB:8.2f}" for c in cells))
    return "\n".join(rows)


def refuse_unless_fits(e: MemoryEstimate, gpu_memory_gb: int | float) -> None:
    """A one-line ``ConfigError`` when ``e`` exceeds ``trainer.gpu_memory_gb``."""
    if e.total > gpu_memory_gb * GB:
        hint = (
            "trainer.parallel=fsdp (or more GPUs)"
            if e.parallel == "ddp"
            else "more GPUs, or a smaller trainer.micro_batch"
        )
        raise ConfigError(
            "trainer.gpu_memory_gb",
            gpu_memory_gb,
            f"at least the estimated {e.total / GB:.1f} GB per GPU of trainer.parallel={e.parallel} on "
            f"{e.world_size} GPU(s) ({e.params / GB:.1f} params, {e.grads / GB:.1f} grads, "
            f"{e.optimizer / GB:.1f} AdamW, {e.activations / GB:.1f} activations); try {hint}",
        )


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
        from readback.backends.te.dry_run import dry_run_plan

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
