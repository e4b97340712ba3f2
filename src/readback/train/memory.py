"""Per-GPU memory of a training run before it starts: parameters, gradients, AdamW states and an
activation estimate for one micro-batch, under DDP (everything replicated) and FSDP2 (sharded).

Bytes are counted in GB (10^9 bytes), as ``trainer.gpu_memory_gb``. Parameters, gradients and
both Adam moments are FP32 (4 bytes each: 16 bytes a parameter replicated). Under FSDP a rank
holds ``1 / world_size`` of each, plus the blocks unsharded at a time: the running block and the
prefetched next one (FP32 parameters: the FP8 sites scale from the master weights), and one
block's unsharded gradient before its reduce-scatter.

Activations (the tensors saved for backward, no recomputation) follow Korthikanti et al. 2022
("Reducing activation recomputation"), with 2-byte activations and no dropout: per layer
``b s (14 d + 4 f)`` bytes, plus ``b h s^2`` for the FP8 copy of the attention probabilities
the emulated attention keeps for its backward (fused attention, ``backend=te``, keeps none), plus
the FP32 logits and their gradient, ``8 b s V``. FP8 copies (1 byte) replace BF16 ones under
``precision=fp8`` on the GPU, so the estimate is an upper bound there. Allocator fragmentation
and workspaces are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from readback.errors import ConfigError
from readback.train.contract import TrainableModule
from readback.train.settings import Config

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
    s, d, f, h, v = m.seq_len, m.d_model, m.ffn_dim, m.n_heads, m.vocab_size
    assert v is not None, "train.contract.with_vocabulary resolves it before the model is sized"
    fused = cfg.backend.name == "te"
    scores = 0 if fused else b * h * s * s
    return m.n_layers * (b * s * (14 * d + 4 * f) + scores) + 8 * b * s * v


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
